"""`data` mode: delegates to `tools/bench_data.py` (the data reader / prepare benchmark) when it exists."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Sequence
from pathlib import Path


def run_data_benchmark(script: str | Path, argv: Sequence[str]) -> int:
    """Runs `script`'s main (tools/bench_data.py, another module's benchmark) with `argv`; 1 if it is missing."""
    script = Path(script)
    if not script.is_file():
        print(f"data benchmark: {script} is missing (the data-reader / prepare benchmark is not written yet); "
              "nothing was measured")  # fmt: skip
        return 1
    spec = importlib.util.spec_from_file_location("bench_data", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    main = getattr(module, "main", None)
    if not callable(main):
        print(f"data benchmark: {script} has no main(); expected main(argv: list[str] | None) -> int | None")
        return 1
    if inspect.signature(main).parameters:
        rc = main(list(argv))
    else:  # an argparse main() reading sys.argv
        saved = sys.argv
        sys.argv = [str(script), *argv]
        try:
            rc = main()
        finally:
            sys.argv = saved
    return int(rc or 0)

"""Several real trainings one after another in one process: a lone process, or one rank of a launch.

Each case is what `tapetrain train CONFIG KEY=VALUE ...` runs (tapetrain.train.run.train_from_args: config, process
group, DeepSpeed engine, data, checkpoints, metrics.jsonl); running them in one process pays the imports and the
launch once instead of once per case.

    python run_cases_worker.py CASES.json                          # one rank
    deepspeed --num_gpus 2 run_cases_worker.py CASES.json          # two ranks (the launcher adds --local_rank)

CASES.json: a list of {"config": path, "overrides": ["key=value", ...]}. Exits with the first failing case's code.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    from tapetrain.train.run import train_from_args

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = [a for a in argv if not a.startswith("--local_rank") and not a.startswith("--local-rank")]
    cases = json.loads(Path(args[0]).read_text())
    for case in cases:
        started = time.perf_counter()
        code = train_from_args(case["config"], case["overrides"])
        logging.getLogger("run_cases").warning("case %s: exit %d in %.1f s", " ".join(case["overrides"]), code,
                                               time.perf_counter() - started)
        if code:
            return code
    return 0


if __name__ == "__main__":
    from tapetrain.distributed import end_rank_process

    end_rank_process(main(sys.argv[1:]))

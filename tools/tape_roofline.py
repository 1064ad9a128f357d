"""The bytes TAPE's own operations move per layer (rotation by E, the head mix, the MLP-side update, [V ‖ E]),
forward and backward, as eager PyTorch runs them (measured on the meta device) and as one fused kernel per op would,
with the step time that traffic takes at H100 and H200 bandwidth (tapetrain/bench/roofline.py).

    python tools/tape_roofline.py [--out docs/benchmarks/tape-roofline.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tapetrain.bench.roofline import BANDWIDTH_TBPS, roofline

CASES = (("llama-1b", 8, 2048), ("llama2-7b", 1, 8192))  # the train benchmark's and the 8K recipe's shapes


def table(result: dict) -> str:
    e = result["e_bytes"]
    lines = [f"{result['preset']} {result['batch']} × {result['seq_len']} ({result['dtype']}), "
             f"{result['layers_with_state']} layers with E; bytes per layer in units of E ({e / 1e6:.1f} MB)",
             f"{'op':<11} {'eager fwd':>10} {'eager bwd':>10} {'fused fwd':>10} {'fused bwd':>10}"]
    for op in result["ops"]:
        lines.append(f"{op['op']:<11} " + " ".join(f"{op[k] / e:>10.1f}" for k in
                     ("eager_fwd_bytes", "eager_bwd_bytes", "fused_fwd_bytes", "fused_bwd_bytes")))  # fmt: skip
    step = result["step_bytes"]
    lines.append(f"per step: eager {step['eager'] / 1e9:.1f} GB, fused {step['fused'] / 1e9:.1f} GB; " + "; ".join(
        f"{name}: {ms['eager']:.1f} -> {ms['fused']:.1f} ms" for name, ms in result["step_ms"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the JSON here")
    args = parser.parse_args(argv)
    results = [roofline(*case) for case in CASES]
    print("\n\n".join(table(r) for r in results))
    if args.out:
        from tapetrain.bench.report import write_json_atomic

        write_json_atomic(args.out, {"bandwidth_tbps": BANDWIDTH_TBPS, "results": results})
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python
"""Where a training step's time goes, TAPE next to its RoPE twin (torch.profiler).

  python tools/profile_step.py --preset paper-155m --seq-len 1024 --batch 16 [--pe-list tape,rope] --out R.json
  python tools/profile_step.py --device cpu --preset tiny --seq-len 128 --batch 4     # CPU operators, fp32

Runs warm-up steps, then profiles a few optimizer steps of the plain bf16 loop that `tools/benchmark.py train`
times, and sums device time per category of kernel: attention (fused/flash kernels), matmul (GEMMs), loss
(softmax / cross-entropy), optimizer (AdamW, clipping, master-weight copies), elementwise (the rest: norms,
rotations, SiLU, TAPE's state updates, copies). The JSON holds every category per PE, their difference and the
top kernels; a Chrome trace per PE is written next to it with --trace. Each kernel is counted once (its self
time; user annotations such as torch.optim's `Optimizer.step#AdamW.step` range are not kernels): see
tapetrain/bench/profile.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from tapetrain import bench
from tapetrain.bench.profile import by_category, category, profile_steps


def profile_pe(pe: str, args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = bench.build_model(args.preset, pe, args.seq_len, backend=args.backend,
                              overrides=bench.parse_overrides(args.set), seed=0)  # fmt: skip
    model.to(device=device, dtype=dtype).train()
    opt = bench.PlainOptimizer(model)
    batches = bench.random_batches(model.cfg.vocab_size, args.batch, args.seq_len, device, 2, 1)
    step = bench.plain_step(model, opt)
    for i in range(args.warmup):
        step(batches[i % 2])
    if device.type == "cuda":
        torch.cuda.synchronize()
    feed = itertools.cycle(batches[:2])
    wall_ms, per_kernel, prof = profile_steps(lambda: step(next(feed)), args.steps, device)
    if args.trace:
        prof.export_chrome_trace(str(args.trace.with_name(f"{args.trace.stem}-{pe}.json")))
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top]
    del model, opt, batches
    bench.release_memory(device)
    return {
        "step_ms": wall_ms,
        "device_ms": sum(per_kernel.values()),
        "categories_ms": by_category(per_kernel),
        "top_kernels_ms": [{"kernel": k[:160], "ms": v, "category": category(k)} for k, v in top],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="paper-155m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--pe-list", default="tape,rope")
    p.add_argument("--backend", default="auto")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="model config override")
    p.add_argument("--trace", type=Path, help="write Chrome traces as TRACE-<pe>.json")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda: bf16 kernels' device time; cpu: fp32 operators' self time (default: cuda if present)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here (use --device cpu)")
    name = torch.cuda.get_device_name() if args.device == "cuda" else bench.device_name(torch.device("cpu"))
    result = {"device": name, "preset": args.preset, "seq_len": args.seq_len, "batch": args.batch,
              "dtype": "bf16" if args.device == "cuda" else "fp32", "overrides": args.set,
              "attribution": "self time of each kernel/operator once; user annotations excluded",
              "pes": {}}  # fmt: skip
    for pe in args.pe_list.split(","):
        result["pes"][pe] = profile_pe(pe, args)
    pes = result["pes"]
    cats = sorted({c for r in pes.values() for c in r["categories_ms"]})
    print(f"profile: {args.preset} T={args.seq_len} B={args.batch} {result['dtype']} on {result['device']} "
          "(ms per step)")
    print(f"{'category':12s}" + "".join(f"{pe:>10s}" for pe in pes))
    for c in cats:
        print(f"{c:12s}" + "".join(f"{r['categories_ms'].get(c, 0.0):10.2f}" for r in pes.values()))
    print(f"{'device sum':12s}" + "".join(f"{r['device_ms']:10.2f}" for r in pes.values()))
    print(f"{'step (wall)':12s}" + "".join(f"{r['step_ms']:10.2f}" for r in pes.values()))
    for pe, r in pes.items():
        print(f"top kernels, {pe}:")
        for k in r["top_kernels_ms"][:15]:
            print(f"  {k['ms']:8.2f} ms  {k['category']:11s} {k['kernel'][:110]}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out} and {plot_profile(result, args.out.with_suffix('.png'))}")
    return 0


def plot_profile(result: dict, path: Path) -> Path:
    """Stacked bars: device time per category for each PE (ms per step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pes = list(result["pes"])
    cats = sorted({c for r in result["pes"].values() for c in r["categories_ms"]},
                  key=lambda c: -result["pes"][pes[0]]["categories_ms"].get(c, 0.0))  # fmt: skip
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    bottom = [0.0] * len(pes)
    for i, cat in enumerate(cats):
        values = [result["pes"][pe]["categories_ms"].get(cat, 0.0) for pe in pes]
        ax.bar(pes, values, bottom=bottom, label=cat, color=f"C{i}")
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, pe in enumerate(pes):
        ax.text(x, bottom[x], f"{result['pes'][pe]['step_ms']:.0f} ms", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("device time per step (ms)")
    ax.set_title(f"{result['preset']}, {result['batch']}×{result['seq_len']}, {result['device']}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
    return path


if __name__ == "__main__":
    sys.exit(main())

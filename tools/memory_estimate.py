"""Per-GPU memory for a model/context/ZeRO setting (tapetrain.train.memory), e.g. Llama-2-7B TAPE at 8192 on
8×A100-80GB. Prints a table; --out writes JSON. The logits column is the fused loss (model.loss_backend
auto/chunked/liger, the default); --loss plain gives the materialised (B, T, V) logits instead.

    python tools/memory_estimate.py --preset llama2-7b --pe tape --seq-len 8192 --world-size 8 [--loss plain]

--measure-saved runs one fp32 training forward on this machine (the preset cut to --layers layers) with the plain
and the fused loss and prints the bytes autograd saves for backward (measure_saved_activation_bytes):

    python tools/memory_estimate.py --measure-saved --preset paper-155m --layers 2 --seq-len 1024 --micro-batch 4

--sequence-parallel N: each GPU holds seq-len / N tokens of every sequence (DeepSpeed-Ulysses); --tiled-mlp
CHUNKS|auto: model.tiled_mlp; --attention: model.attn_backend on the GPU (auto: cuDNN's SDPA for TAPE on Hopper and
newer, the larger estimate; triton: the Triton kernel auto takes before Hopper, 2·H·D fewer values per token).
--longest-context prints, per sequence-parallel degree 1, 2, 4, 8 (up to the world size), the longest context (a
multiple of 1024) whose estimate fits 90% of --gpu-gb, for the 8K TAPE recipe's setting
(configs/llama2-7b-8k-tape.yaml: ZeRO-2, TAPE + embeddings + norms trained, activation checkpointing, micro batch 1),
without and with the tiled MLP:

    python tools/memory_estimate.py --longest-context --gpu-gb 80 --world-size 8 --out docs/benchmarks/x.json

--ring-table prints, for 128K, 512K and 1M tokens on 8, 32 and 64 GPUs, which context parallelism R (ring) ×
sequence parallelism U (Ulysses, at most 8: one node), ZeRO stage and activation checkpointing fit 90% of --gpu-gb
(full training, micro batch 1, tiled MLP auto): the fitting setting with the fewest ranks per sequence (the most data
parallelism), else the smallest estimate:

    python tools/memory_estimate.py --ring-table --preset llama2-7b --pe tape --gpu-gb 80
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from tapetrain.model import preset_config
from tapetrain.train.memory import (
    ZeroBuffers,
    as_row,
    attention_path,
    estimate_memory,
    measure_loss_saved_bytes,
    parameter_counts,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama2-7b")
    parser.add_argument("--pe", default="tape")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--gpu-gb", type=float, default=80.0, help="memory per GPU, to flag settings that do not fit")
    parser.add_argument("--loss", choices=("fused", "plain"), default="fused", help="loss term of the estimate")
    parser.add_argument("--measure-saved", action="store_true", help="measure saved bytes, plain vs fused loss")
    parser.add_argument("--layers", type=int, help="--measure-saved: cut the preset to this many layers")
    parser.add_argument("--sequence-parallel", type=int, default=1, help="SP degree N (seq-len / N tokens per GPU)")
    parser.add_argument("--tiled-mlp", default="0", help="model.tiled_mlp: chunks (0 = off) or auto")
    parser.add_argument("--longest-context", action="store_true", help="longest fitting context per SP degree")
    parser.add_argument("--ring-table", action="store_true",
                        help="which context parallel R x sequence parallel U fits 128K-1M tokens on 8-64 GPUs")
    parser.add_argument("--attention", choices=("auto", "sdpa", "triton", "flash"), default="auto",
                        help="model.attn_backend on the GPU: the saved tensors depend on the kernel")
    parser.add_argument("--overlap-comm", action="store_true", default=None,
                        help="deepspeed.overlap_comm (two gradient buckets; default: DeepSpeed's, on for stage 3 only)")
    parser.add_argument("--out", help="write the rows as JSON")
    args = parser.parse_args()
    args.tiled_mlp = args.tiled_mlp if args.tiled_mlp == "auto" else int(args.tiled_mlp)
    args.attention = attention_path(args.attention)  # the path layer_activation_bytes models
    if args.measure_saved:
        return measure(args)
    if args.longest_context:
        return longest_context(args)
    if args.ring_table:
        return ring_table(args)

    cfg = preset_config(args.preset, pe=args.pe, max_seq_len=args.seq_len)
    modes = ["all"] + (["tape+embed+norm"] if args.pe == "tape" else [])
    counts = {mode: parameter_counts(cfg, mode) for mode in modes}
    total = counts["all"].total
    buffers = ZeroBuffers(overlap_comm=args.overlap_comm)
    rows = []
    for mode, count in counts.items():
        for stage, offload_opt, offload_params in [(2, False, False), (3, False, False), (2, True, False),
                                                   (3, True, True)]:
            for ckpt in (True, False):
                est = estimate_memory(
                    cfg, seq_len=args.seq_len, micro_batch=args.micro_batch, world_size=args.world_size,
                    zero_stage=stage, trainable_params=count.trainable, total_params=count.total,
                    activation_checkpointing=ckpt, offload_optimizer=offload_opt, offload_params=offload_params,
                    fused_loss=args.loss == "fused", lm_head_trainable=count.head_trainable,
                    sequence_parallel=args.sequence_parallel, tiled_mlp=args.tiled_mlp, buffers=buffers,
                    largest_trainable=count.largest_trainable, attention=args.attention,
                )
                name = (f"train={mode} ZeRO-{stage}{' +offload-opt' if offload_opt else ''}"
                        f"{' +offload-params' if offload_params else ''} ckpt={'on' if ckpt else 'off'}")
                row = as_row(name, est)
                row["fits"] = est.total_gpu_gb <= args.gpu_gb * 0.9  # leave ~10% for allocator fragmentation
                rows.append(row)
    print(f"{args.preset} pe={args.pe}: {total / 1e9:.2f}B parameters; seq {args.seq_len}, micro batch "
          f"{args.micro_batch}, {args.world_size} GPUs of {args.gpu_gb:.0f} GB, {args.loss} loss, sequence parallel "
          f"{args.sequence_parallel}, tiled MLP {args.tiled_mlp}, attention {args.attention} (GiB per GPU below)")
    header = ["setting", "weights_gb", "grads_gb", "optimizer_gb", "buffers_gb", "activations_gb", "logits_gb",
              "context_gb", "total_gpu_gb", "host_offload_gb", "fits"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(row[h]) for h in header) + " |")
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"preset": args.preset, "pe": args.pe, "seq_len": args.seq_len, "loss": args.loss,
                       "attention": args.attention, "rows": rows}, f, indent=2)
        os.replace(tmp, args.out)
    return 0


RECIPE_BUFFERS = ZeroBuffers(overlap_comm=True)  # configs/llama2-7b-8k-tape.yaml's deepspeed: section


def fits(cfg, counts, seq_len: int, n: int, tiled, args) -> float | None:
    """The estimate's GiB per GPU at seq_len for the 8K recipe's setting, or None if it does not fit."""
    est = estimate_memory(
        cfg, seq_len=seq_len, micro_batch=args.micro_batch, world_size=args.world_size, zero_stage=2,
        trainable_params=counts.trainable, total_params=counts.total, activation_checkpointing=True,
        lm_head_trainable=counts.head_trainable, sequence_parallel=n, tiled_mlp=tiled, buffers=RECIPE_BUFFERS,
        largest_trainable=counts.largest_trainable, attention=args.attention,
    )
    return est.total_gpu_gb if est.total_gpu_gb <= args.gpu_gb * 0.9 else None


def longest(cfg, counts, n: int, tiled, args) -> tuple[int, float]:
    """The longest multiple of 1024 (and of N) that fits: doubling, then bisection between the last two."""
    step = 1024 * n // math.gcd(1024, n)
    low, high = 0, step
    while fits(cfg, counts, high, n, tiled, args) is not None and high < 2**24:
        low, high = high, 2 * high
    while high - low > step:
        mid = (low + high) // 2 // step * step
        low, high = (mid, high) if fits(cfg, counts, mid, n, tiled, args) is not None else (low, mid)
    return low, (fits(cfg, counts, low, n, tiled, args) or 0.0) if low else 0.0


def longest_context(args) -> int:
    cfg = preset_config(args.preset, pe=args.pe)
    counts = parameter_counts(cfg, "tape+embed+norm")
    tiled = args.tiled_mlp if args.tiled_mlp else "auto"
    rows = []
    for n in (1, 2, 4, 8):
        if n > args.world_size or args.world_size % n or cfg.n_heads % n:
            continue
        plain, plain_gb = longest(cfg, counts, n, 0, args)
        tile, tile_gb = longest(cfg, counts, n, tiled, args)
        rows.append({"sequence_parallel": n, "longest_context": plain, "gib_per_gpu": round(plain_gb, 2),
                     "longest_context_tiled_mlp": tile, "gib_per_gpu_tiled_mlp": round(tile_gb, 2)})
    print(f"{args.preset} pe={args.pe} on {args.world_size} GPUs of {args.gpu_gb:.0f} GB (fits: estimate <= 90%): "
          f"ZeRO-2, train tape+embed+norm, activation checkpointing, micro batch {args.micro_batch}, fused loss; "
          f"tiled MLP {tiled}; attention {args.attention}")
    print("| sequence parallel | longest context | GiB per GPU | with tiled MLP | GiB per GPU |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sequence_parallel']} | {r['longest_context']} | {r['gib_per_gpu']} | "
              f"{r['longest_context_tiled_mlp']} | {r['gib_per_gpu_tiled_mlp']} |")
    result = {"preset": args.preset, "pe": args.pe, "world_size": args.world_size, "gpu_gb": args.gpu_gb,
              "zero_stage": 2, "trainable": "tape+embed+norm", "activation_checkpointing": True,
              "micro_batch": args.micro_batch, "tiled_mlp": tiled, "attention": args.attention, "fit_fraction": 0.9,
              "rows": rows}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


def ring_settings(world: int, n_heads: int):
    """(R, U) with U ≤ 8 dividing the heads and R × U dividing the world, fewest ranks per sequence first."""
    found = [(r, u) for u in (1, 2, 4, 8) for r in range(1, world + 1)
             if n_heads % u == 0 and world % (r * u) == 0]
    return sorted(found, key=lambda ru: (ru[0] * ru[1], ru[0]))


def ring_table(args) -> int:
    cfg = preset_config(args.preset, pe=args.pe)
    counts = parameter_counts(cfg, "all")
    rows = []
    for seq_len in (131072, 524288, 1048576):
        for world in (8, 32, 64):
            best = None
            for (r, u) in ring_settings(world, cfg.n_heads):
                if seq_len % (2 * r * u):
                    continue
                for stage, ckpt in ((2, True), (3, True), (3, False)):
                    est = estimate_memory(
                        cfg, seq_len=seq_len, micro_batch=1, world_size=world, zero_stage=stage,
                        trainable_params=counts.trainable, total_params=counts.total, activation_checkpointing=ckpt,
                        lm_head_trainable=counts.head_trainable, sequence_parallel=u, context_parallel=r,
                        tiled_mlp="auto", buffers=RECIPE_BUFFERS, largest_trainable=counts.largest_trainable,
                        attention=args.attention,
                    )
                    row = {"seq_len": seq_len, "gpus": world, "context_parallel": r, "sequence_parallel": u,
                           "zero_stage": stage, "activation_checkpointing": ckpt,
                           "gib_per_gpu": round(est.total_gpu_gb, 1), "activations_gib": round(est.activations_gb, 1),
                           "fits": est.total_gpu_gb <= args.gpu_gb * 0.9}
                    if best is None or (row["fits"] and not best["fits"]) or (
                            not best["fits"] and row["gib_per_gpu"] < best["gib_per_gpu"]):
                        best = row
                if best is not None and best["fits"]:
                    break
            rows.append(best)
    print(f"{args.preset} pe={args.pe}, full training, micro batch 1, tiled MLP auto, attention {args.attention}, "
          f"GPUs of {args.gpu_gb:.0f} GB (fits: estimate <= 90%)")
    print("| tokens | GPUs | R (ring) | U (Ulysses) | ZeRO | checkpointing | GiB per GPU | activations GiB | fits |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seq_len'] // 1024}K | {r['gpus']} | {r['context_parallel']} | {r['sequence_parallel']} | "
              f"{r['zero_stage']} | {'on' if r['activation_checkpointing'] else 'off'} | {r['gib_per_gpu']} | "
              f"{r['activations_gib']} | {'yes' if r['fits'] else 'no'} |")
    return 0


def measure(args) -> int:
    overrides = {"n_layers": args.layers} if args.layers else {}
    cfg = preset_config(args.preset, pe=args.pe, max_seq_len=args.seq_len, attn_backend="sdpa", **overrides)
    result = measure_loss_saved_bytes(cfg, args.micro_batch, args.seq_len)
    mib = {k: v / 2**20 for k, v in result.items()}
    print(f"{args.preset} pe={args.pe} layers={cfg.n_layers} V={cfg.vocab_size} C={cfg.d_model}, micro batch "
          f"{args.micro_batch} x seq {args.seq_len}, fp32: bytes autograd saves for backward (MiB)")
    print("| plain loss | fused loss | drop | predicted drop |\n|---|---|---|---|")
    print(f"| {mib['plain_bytes']:.2f} | {mib['fused_bytes']:.2f} | {mib['drop_bytes']:.2f} | "
          f"{mib['predicted_drop_bytes']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"preset": args.preset, "pe": args.pe, "n_layers": cfg.n_layers, "seq_len": args.seq_len,
                       "micro_batch": args.micro_batch, **result}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

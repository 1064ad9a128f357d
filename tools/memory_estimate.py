"""Per-GPU memory for a model/context/ZeRO setting (tapetrain.train.memory), e.g. Llama-2-7B TAPE at 8192 on
8×A100-80GB. Prints a table; --out writes JSON. The logits column is the fused loss (model.loss_backend
auto/chunked/liger, the default); --loss plain gives the materialised (B, T, V) logits instead.

    python tools/memory_estimate.py --preset llama2-7b --pe tape --seq-len 8192 --world-size 8 [--loss plain]

--measure-saved runs one fp32 training forward on this machine (the preset cut to --layers layers) with the plain
and the fused loss and prints the bytes autograd saves for backward (measure_saved_activation_bytes):

    python tools/memory_estimate.py --measure-saved --preset paper-155m --layers 2 --seq-len 1024 --micro-batch 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from tapetrain.model import Transformer, preset_config
from tapetrain.train.memory import as_row, estimate_memory, measure_loss_saved_bytes
from tapetrain.train.optim import is_trainable


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
    parser.add_argument("--out", help="write the rows as JSON")
    args = parser.parse_args()
    if args.measure_saved:
        return measure(args)

    cfg = preset_config(args.preset, pe=args.pe, max_seq_len=args.seq_len)
    with torch.device("meta"):
        model = Transformer(cfg)
    names = dict(model.named_parameters())
    total = model.num_params()
    trainable = {
        mode: sum(p.numel() for n, p in names.items() if is_trainable(n, mode))
        for mode in ("all", "tape+embed+norm")
        if mode == "all" or args.pe == "tape"
    }
    rows = []
    for mode, count in trainable.items():
        for stage, offload_opt, offload_params in [(2, False, False), (3, False, False), (2, True, False),
                                                   (3, True, True)]:
            for ckpt in (True, False):
                est = estimate_memory(
                    cfg, seq_len=args.seq_len, micro_batch=args.micro_batch, world_size=args.world_size,
                    zero_stage=stage, trainable_params=count, total_params=total, activation_checkpointing=ckpt,
                    offload_optimizer=offload_opt, offload_params=offload_params, fused_loss=args.loss == "fused",
                    lm_head_trainable=is_trainable("embed.weight" if cfg.tie_embeddings else "lm_head.weight", mode),
                )
                name = (f"train={mode} ZeRO-{stage}{' +offload-opt' if offload_opt else ''}"
                        f"{' +offload-params' if offload_params else ''} ckpt={'on' if ckpt else 'off'}")
                row = as_row(name, est)
                row["fits"] = est.total_gpu_gb <= args.gpu_gb * 0.9  # leave ~10% for allocator fragmentation
                rows.append(row)
    print(f"{args.preset} pe={args.pe}: {total / 1e9:.2f}B parameters; seq {args.seq_len}, micro batch "
          f"{args.micro_batch}, {args.world_size} GPUs of {args.gpu_gb:.0f} GB, {args.loss} loss (GiB per GPU below)")
    header = ["setting", "weights_gb", "grads_gb", "optimizer_gb", "activations_gb", "logits_gb", "total_gpu_gb",
              "host_offload_gb", "fits"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(row[h]) for h in header) + " |")
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"preset": args.preset, "pe": args.pe, "seq_len": args.seq_len, "loss": args.loss, "rows": rows},
                      f, indent=2)
        os.replace(tmp, args.out)
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

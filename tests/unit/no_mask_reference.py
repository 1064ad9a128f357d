"""Digests of the model's training step without a document mask, to pin it bit for bit across code changes.

Self-contained (imports only tapetrain.model) so that it runs unchanged on the code before document masking:
tests/fixtures/no_mask_reference.json was written by running it on the first parent of the issue-26 merge
(661e90c^1) with

    git archive 661e90c^1 | tar -x -C /tmp/base
    cd /tmp/base && PYTHONPATH=/tmp/base python /path/to/tests/unit/no_mask_reference.py --write out.json

For every encoding and the eager and sdpa backends it records sha256 digests of the logits, the loss and every
gradient of one training forward/backward (fp32, one thread, fixed seeds; RandPE draws from the seeded global RNG).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch

PES = ["tape", "rope", "nope", "alibi", "xpos", "fire", "randpe"]
BACKENDS = ["eager", "sdpa"]
# RandPE twice: its default draws per layer, the other mode once for all layers.
CASES = [(pe, b, {}) for pe in PES for b in BACKENDS] + [("randpe", b, {"randpe_per_layer": False}) for b in BACKENDS]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


def build(pe: str, backend: str, extra: dict) -> torch.nn.Module:
    from tapetrain.model import Transformer, preset_config

    overrides = {"init_std": 0.15, "attn_backend": backend, "loss_backend": "plain", **extra}
    if pe == "xpos":
        overrides["xpos_scale_base"] = 8.0  # several xPos query blocks per row
    torch.manual_seed(0)
    model = Transformer(preset_config("tiny", pe=pe, **overrides))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero TAPE and FIRE parameters, so that every part of them is exercised
        for name, param in model.named_parameters():
            if "tape" in name or "fire" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.2)
    return model.train()


def case_name(pe: str, backend: str, extra: dict) -> str:
    return "/".join([pe, backend, *(f"{k}={v}" for k, v in sorted(extra.items()))])


def one_case(pe: str, backend: str, extra: dict) -> dict[str, str]:
    model = build(pe, backend, extra)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 512, (2, 24), generator=gen)
    labels = torch.randint(0, 512, (2, 24), generator=gen)
    torch.manual_seed(3)  # RandPE's draws
    out = model(ids, labels=labels)
    out.loss.backward()
    result = {"logits": digest(out.logits), "loss": digest(out.loss)}
    result.update({f"grad:{n}": digest(p.grad) for n, p in model.named_parameters() if p.grad is not None})
    return result


def reference_digests() -> dict:
    """{"torch", "cpu", "cases": {name: {tensor: sha256}}}; one thread so that the reductions' order is fixed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cases = {case_name(*c): one_case(*c) for c in CASES}
    finally:
        torch.set_num_threads(threads)
    return {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(), "cases": cases}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", required=True, help="JSON file to write the digests to")
    args = parser.parse_args(argv)
    with open(args.write, "w") as f:
        json.dump(reference_digests(), f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])

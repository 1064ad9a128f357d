"""The model's training step without a document mask, summarised to pin it across code changes on any CPU.

For every encoding and the eager and sdpa backends, one training forward/backward (fp32, one thread, fixed seeds;
RandPE draws from the seeded global RNG) is summarised per tensor (the logits, the loss, every gradient) by its
norm and its dot products with 4 fixed Gaussian vectors (numpy's PCG64, seeded by the tensor's name; float64). Two
runs of the same computation agree in these to float32 rounding, whatever the CPU's kernels; any change of meaning
moves them by far more (tests/unit/test_no_mask_reference.py says how far each may move).

tests/fixtures/no_mask_reference.json holds them for the code before document masking (661e90c^1, the first parent
of the issue-26 merge), written with

    PYTHONPATH=. python tests/unit/no_mask_reference.py --write tests/fixtures/no_mask_reference.json

at e486ddd on the AMD AVX512 machine where that code's sha256 digests of every tensor (the fixture's earlier form,
written on 661e90c^1 itself) were still matched bit for bit: the same numbers as the base commit's. Self-contained
(imports only tapetrain.model), so it runs unchanged on older code.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib

import numpy as np
import torch

PES = ["tape", "rope", "nope", "alibi", "xpos", "fire", "randpe"]
BACKENDS = ["eager", "sdpa"]
# RandPE twice: its default draws per layer, the other mode once for all layers.
CASES = [(pe, b, {}) for pe in PES for b in BACKENDS] + [("randpe", b, {"randpe_per_layer": False}) for b in BACKENDS]


PROJECTIONS = 4


def summary(name: str, t: torch.Tensor) -> dict:
    """{"norm": ||t||, "proj": [t . g_i for 4 Gaussian g_i seeded by the name]}, in float64."""
    flat = t.detach().double().cpu().numpy().ravel()
    gauss = np.random.default_rng(zlib.crc32(name.encode())).standard_normal((PROJECTIONS, flat.size))
    return {"norm": float(np.linalg.norm(flat)), "proj": [float(x) for x in gauss @ flat]}


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


def one_case(pe: str, backend: str, extra: dict, change_input: bool = False) -> dict[str, dict]:
    model = build(pe, backend, extra)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 512, (2, 24), generator=gen)
    labels = torch.randint(0, 512, (2, 24), generator=gen)
    if change_input:  # one token of one row (the test shows the comparison notices)
        ids[1, 20] = (ids[1, 20] + 1) % 512
    torch.manual_seed(3)  # RandPE's draws
    out = model(ids, labels=labels)
    out.loss.backward()
    result = {"logits": summary("logits", out.logits), "loss": summary("loss", out.loss)}
    result.update({f"grad:{n}": summary(f"grad:{n}", p.grad) for n, p in model.named_parameters()
                   if p.grad is not None})
    return result


def one_thread(fn, *args, **kwargs):
    """fn(...) on one thread (a fixed order of reductions; the tolerance does not rely on it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


def reference_summaries() -> dict:
    """{"torch", "cpu" (where they were written, for the record), "cases": {name: {tensor: summary}}}."""
    cases = one_thread(lambda: {case_name(*c): one_case(*c) for c in CASES})
    return {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(), "cases": cases}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", required=True, help="JSON file to write the summaries to")
    args = parser.parse_args(argv)
    with open(args.write, "w") as f:
        json.dump(reference_summaries(), f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])

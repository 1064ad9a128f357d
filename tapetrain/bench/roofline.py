"""Bytes TAPE's own operations move per layer, forward and backward, as eager PyTorch runs them today and as a fused
kernel would, and the time that traffic takes at a GPU's memory bandwidth (a roofline: these ops do almost no
arithmetic, so bytes are their cost).

"Today" is measured, not modelled: each op's module runs forward and backward on the meta device (no memory, no
arithmetic) under a dispatch mode that adds up, for every aten call, the bytes of the tensors it reads and writes
(views move nothing and are not counted). "Fused" is the compulsory traffic of one kernel per op: its forward reads
each input once and writes each output once; its backward reads the output gradient and the inputs it recomputes
from, and writes each input gradient once (weights are a few hundred values and are left out).

The ops, per layer that carries TAPE's state E (B, T, M, D), value bytes p:
- rotation: q̃ = Eᵀq and k̃ = Eᵀk (keys expanded to the query heads first under GQA);
- head mix: E ← E + (A·E) ×_heads W_A, from A·E (B, T, M, D);
- MLP update: E ← E + W_down · (SiLU(W_x m) ⊙ (W_up · E)) with I = 4·M channels: eager writes (B, T, I, D) twice;
- values: [V ‖ E] for attention as one value tensor (SDPA's path concatenates them; a fused attention reads both).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tapetrain.model import ModelConfig, preset_config
from tapetrain.model.tape import TapeHeadMix, TapeMlpUpdate, rotate_by_state

BANDWIDTH_TBPS = {"H100 SXM (3.35 TB/s)": 3.35, "H200 (4.8 TB/s)": 4.8}
VIEW_OPS = {"view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "slice", "select", "unsqueeze",
            "squeeze", "alias", "as_strided", "detach", "split", "unbind", "split_with_sizes", "chunk", "narrow",
            "_reshape_alias", "lift_fresh"}  # fmt: skip


class ByteCounter(TorchDispatchMode):
    """Sum of the bytes of every tensor argument and result of the aten calls made inside (views excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.read = 0
        self.written = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] not in VIEW_OPS:
            self.read += sum(_bytes(x) for x in tree_flatten((args, kwargs or {}))[0])
            self.written += sum(_bytes(x) for x in tree_flatten(out)[0])
        return out


def _bytes(x: Any) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


@dataclass
class OpTraffic:
    name: str
    eager_fwd: int
    eager_bwd: int
    fused_fwd: int
    fused_bwd: int

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.name, "eager_fwd_bytes": self.eager_fwd, "eager_bwd_bytes": self.eager_bwd,
                "fused_fwd_bytes": self.fused_fwd, "fused_bwd_bytes": self.fused_bwd}  # fmt: skip


def _measure(run: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[int, int]:
    """(forward bytes, backward bytes) of `run` (which builds its inputs with requires_grad) on the meta device.
    The output gradients are made outside the counters: they are the next op's work."""
    with ByteCounter() as fwd:
        outs = run()
    grads = [torch.ones_like(o) for o in outs]
    with ByteCounter() as bwd:
        torch.autograd.backward(outs, grads)
    return fwd.read + fwd.written, bwd.read + bwd.written


def layer_traffic(cfg: ModelConfig, batch: int, seq: int, dtype: torch.dtype = torch.bfloat16) -> list[OpTraffic]:
    """Per-op traffic of one TAPE layer that carries E (model `cfg`, `batch` × `seq` tokens)."""
    b, t, m, hk, d, c = batch, seq, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_model
    p = torch.empty((), dtype=dtype).element_size()
    e_size = b * t * m * d * p  # one E-sized tensor (= one q)
    kv_size = b * t * hk * d * p

    def leaf(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=True)

    def rotation() -> tuple[torch.Tensor, ...]:
        q, k, e = leaf(b, t, m, d), leaf(b, t, hk, d), leaf(b, t, m, d)
        k_full = k.repeat_interleave(m // hk, dim=2) if m > hk else k
        return rotate_by_state(q, e), rotate_by_state(k_full, e)

    mix = TapeHeadMix(m, cfg.tape_head_mix).to(device="meta", dtype=dtype)
    mlp = TapeMlpUpdate(c, m, cfg.tape_dim).to(device="meta", dtype=dtype)

    def head_mix() -> tuple[torch.Tensor, ...]:
        return (mix(leaf(b, t, m, d), leaf(b, t, m, d)),)

    def mlp_update() -> tuple[torch.Tensor, ...]:
        return (mlp(leaf(b, t, m, d), leaf(b, t, c)),)

    def values() -> tuple[torch.Tensor, ...]:
        v, e = leaf(b, hk, t, d), leaf(b, m, t, d)
        return (torch.cat([v.repeat_interleave(m // hk, dim=1) if m > hk else v, e], dim=-1),)

    m_size = b * t * c * p  # the MLP block's output m (B, T, C): the gate SiLU(W_x m) is recomputed from it
    fused = {
        # fwd: read q, k, E; write q̃, k̃. bwd: read dq̃, dk̃, q, k, E; write dq, dk (summed over the group), dE.
        "rotation": (3 * e_size + kv_size + e_size, 5 * e_size + 2 * kv_size + e_size),
        # fwd: read E, A·E; write E'. bwd: read dE' and A·E (W_A's gradient); write d(A·E) (dE is dE': residual).
        "head_mix": (3 * e_size, 3 * e_size),
        # fwd: read E, m; write E'. bwd: read dE', E, m; write dE, dm.
        "mlp_update": (2 * e_size + m_size, 3 * e_size + 2 * m_size),
        # A fused attention reads V and E where they are: nothing is concatenated.
        "values": (0, 0),
    }
    ops = []
    for name, run in (("rotation", rotation), ("head_mix", head_mix), ("mlp_update", mlp_update),
                      ("values", values)):  # fmt: skip
        fwd, bwd = _measure(run)
        ops.append(OpTraffic(name, fwd, bwd, *fused[name]))
    return ops


def roofline(preset: str, batch: int, seq: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Per-op and per-step traffic of a preset's TAPE layers, and the time it takes at each bandwidth."""
    cfg = preset_config(preset, pe="tape", max_seq_len=seq)
    layers = sum(cfg.updates_tape_state(i) for i in range(cfg.n_layers))
    ops = layer_traffic(cfg, batch, seq, dtype)
    per_layer = {k: sum(getattr(o, k) for o in ops) for k in ("eager_fwd", "eager_bwd", "fused_fwd", "fused_bwd")}
    step = {k: v * layers for k, v in per_layer.items()}
    eager, fused = step["eager_fwd"] + step["eager_bwd"], step["fused_fwd"] + step["fused_bwd"]
    return {
        "preset": preset, "batch": batch, "seq_len": seq, "dtype": str(dtype).removeprefix("torch."),
        "layers_with_state": layers, "e_bytes": batch * seq * cfg.n_heads * cfg.head_dim * dtype.itemsize,
        "ops": [o.as_dict() for o in ops],
        "step_bytes": {"eager": eager, "fused": fused},
        "step_ms": {name: {"eager": eager / (tb * 1e12) * 1e3, "fused": fused / (tb * 1e12) * 1e3}
                    for name, tb in BANDWIDTH_TBPS.items()},
    }  # fmt: skip

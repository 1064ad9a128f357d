"""FlexAttention (torch.nn.attention.flex_attention) with a document BlockMask: the "flex" attention backend.

Values may be wider than q/k, so TAPE's [V ‖ E] (B, H, S, Dv + De) goes through one softmax, as with SDPA. The
BlockMask marks (128 × 128) tiles with no same-document, causal pair as empty; compiled, flex skips them. No
additive bias (ALiBi/FIRE go to SDPA). Compiled once per process (torch.compile of flex_attention, no recompile
for new document layouts of one shape). On CPU (torch 2.13) FlexAttention has no backward: there it serves
forwards without gradients (evaluation), where it measured 2-4.5x faster than SDPA's boolean mask
(tools/bench_document_mask.py, docs/document-masking.md); training on CPU uses SDPA.
"""

from __future__ import annotations

import functools
import math

import torch

from tapetrain.model.documents import DocumentMask


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


compile_failed = False  # set by the attention dispatch after a CompileError: it then uses SDPA


class CompileError(RuntimeError):
    """torch.compile of flex_attention failed (e.g. no C++ compiler for CPU code)."""


def _compile_failures() -> tuple[type[BaseException], ...]:
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InductorError

    return BackendCompilerFailed, InductorError


@functools.cache
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def document_block_mask(docs: DocumentMask, causal: bool, block: int = 128):
    """A BlockMask of (B, 1, T, S): same document and (if causal) key <= query, bottom-right aligned; built once
    per DocumentMask (every layer of a forward shares it)."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = ("flex", causal, block)
    if key in docs.cache:
        return docs.cache[key]

    q_ids, k_ids = docs.q_ids, docs.k_ids
    t, s = q_ids.shape[1], k_ids.shape[1]
    off = s - t

    def mask_mod(b, h, q_idx, kv_idx):
        same = q_ids[b, q_idx] == k_ids[b, kv_idx]
        return same & (kv_idx <= q_idx + off) if causal else same

    docs.cache[key] = create_block_mask(mask_mod, q_ids.shape[0], None, t, s, device=q_ids.device, BLOCK_SIZE=block)
    return docs.cache[key]


def flex_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e: torch.Tensor | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    docs: DocumentMask | None = None,
    compiled: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (B, H, T, D), k (B, Hk, S, D), v (B, Hv, S, Dv), e (B, H, S, De) or None -> (A·V, A·E or None)."""
    from torch.nn.attention.flex_attention import flex_attention

    if docs is None:
        raise ValueError("the flex backend serves document masks; without one use sdpa")
    n_heads = q.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    dv = v.shape[-1]
    if e is not None:  # E has a head per query head: expand k/v to H heads and widen the values to [V ‖ E]
        k = k.repeat_interleave(n_heads // k.shape[1], dim=1) if k.shape[1] != n_heads else k
        v = v.repeat_interleave(n_heads // v.shape[1], dim=1) if v.shape[1] != n_heads else v
        v = torch.cat([v, e], dim=-1)
    elif k.shape[1] != v.shape[1]:
        k = k.repeat_interleave(n_heads // k.shape[1], dim=1)
        v = v.repeat_interleave(n_heads // v.shape[1], dim=1)
    mask = document_block_mask(docs, causal)
    gqa = k.shape[1] != n_heads
    if compiled and not torch.compiler.is_compiling():
        failures = _compile_failures()
        try:
            out = _compiled()(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
        except failures as err:
            raise CompileError(str(err).splitlines()[0] if str(err) else type(err).__name__) from err
    else:
        out = flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    if e is None:
        return out, None
    return out[..., :dv], out[..., dv:]

"""Cross-entropy of the LM head without materialising the (N, V) logits (N = B·T tokens, V the vocabulary).

    loss = Σ_{t: label_t != -100} logsumexp(h_t Wᵀ) − (h_t Wᵀ)[label_t]        reduction "sum"
           that sum / #(label != -100)                                       reduction "mean" (= F.cross_entropy)

Backends (`model.loss_backend`):
  plain    logits = h Wᵀ, then F.cross_entropy: autograd keeps (N, V) fp32 tensors for backward (the reference).
  chunked  plain torch, every device: walks the tokens in chunks; per chunk the fp32 logits (n, V), their loss and
           the gradients dh (n, C) and dW += dlogitsᵀ h are computed in the forward, so only dh (N, C) and dW (V, C)
           are kept for backward, which scales them by the incoming gradient.
  liger    liger-kernel's fused linear cross-entropy (Triton, CUDA only; `pip install "tapetrain[liger]"`): the
           same scheme in fused kernels.
  auto     liger on CUDA when liger-kernel is installed (bf16/fp32), else chunked.

Under ZeRO-3 these must run inside the forward of the module that owns W (DeepSpeed gathers a partitioned
parameter only there): see `LMHead`.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import torch
import torch.nn.functional as F
from torch import nn

from tapetrain.model import kernel_record
from tapetrain.model.config import LOSS_BACKENDS

IGNORE_INDEX = -100
REDUCTIONS = ("mean", "sum")


def upcast(logits: torch.Tensor) -> torch.Tensor:
    """Logits in at least fp32 for the softmax (16-bit -> fp32; fp64 stays fp64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def chunk_tokens_for(vocab_size: int, chunk_mib: float) -> int:
    """Tokens per chunk so that one chunk's fp32 logits (tokens × V × 4 bytes) take at most `chunk_mib` MiB."""
    if not chunk_mib > 0:
        raise ValueError(f"model.loss_chunk_mib must be > 0, got {chunk_mib}; use e.g. 256 (MiB of fp32 logits)")
    return max(1, int(chunk_mib * 2**20) // (4 * vocab_size))


@functools.cache
def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def resolve_loss_backend(requested: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """'auto' -> liger (CUDA with liger-kernel installed, not fp16) or chunked; explicit choices are checked.
    fp16 stays on chunked, whose unnormalised fp16 gradients and fp32 rescaling are tested against loss scaling."""
    if requested not in LOSS_BACKENDS:
        raise ValueError(f"model.loss_backend={requested!r} is unknown; choose one of {', '.join(LOSS_BACKENDS)}")
    cuda_liger = device.type == "cuda" and liger_available()
    if requested == "auto":  # liger only where its GPU tests passed on this capability (model/kernel_record.py)
        return "liger" if cuda_liger and dtype != torch.float16 and kernel_record.is_verified(
            _liger_path(device, dtype)) else "chunked"
    if requested == "liger" and not cuda_liger:
        raise RuntimeError(
            f"model.loss_backend=liger needs CUDA and liger-kernel (device {device.type}, liger-kernel "
            f"{'installed' if liger_available() else 'not installed'}); pip install 'tapetrain[liger]' on a GPU "
            "machine, or set model.loss_backend=auto (or chunked)"
        )
    if requested == "liger" and not torch.compiler.is_compiling():
        kernel_record.warn_if_unverified(_liger_path(device, dtype))
    return requested


def _liger_path(device: torch.device, dtype: torch.dtype) -> kernel_record.KernelKey:
    capability = kernel_record.capability_of(device)
    return kernel_record.KernelKey("loss", "liger", capability, kernel_record.dtype_name(dtype))


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """scale · Σ_t CE(h_t Wᵀ, label_t) with gradients computed chunk by chunk in the forward.

    hidden (N, C), weight (V, C), labels (N,) int64 (-100 = ignore), scale () -> loss (), both fp32 (fp64 for
    fp64 inputs).
    Logits are upcast to fp32 for the softmax (`upcast`, as the plain path); dlogits are cast back to the hidden
    dtype for the two gradient matmuls, as autograd does through the upcast.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, scale, chunk_tokens: int):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n_tokens = hidden.shape[0]
        loss = torch.zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        # dW: accumulated in fp32 over several chunks of 16-bit weights (one rounding at the end, as the plain
        # path's single matmul) and kept in fp32 for fp16, whose range the unscaled sums could exceed; directly in
        # place otherwise.
        fp16 = weight.dtype == torch.float16
        direct = weight.dtype.itemsize >= 4 or (n_tokens <= chunk_tokens and not fp16)
        grad_w = torch.zeros(weight.shape, dtype=weight.dtype if direct else torch.float32,
                             device=weight.device) if need_w else None  # fmt: skip
        for start in range(0, n_tokens, chunk_tokens):
            h = hidden[start : start + chunk_tokens]  # (n, C)
            y = labels[start : start + chunk_tokens]  # (n,)
            keep = y != IGNORE_INDEX
            target = torch.where(keep, y, 0)[:, None]  # (n, 1)
            logits = upcast(h @ weight.t())  # (n, V) fp32 (fp64 stays); every step below is in place
            logits.sub_(logits.amax(dim=-1, keepdim=True))  # shifted: x - max
            picked = logits.gather(1, target).squeeze(1)  # (n,)
            probs = logits.exp_()
            total = probs.sum(dim=-1)  # (n,)
            loss += torch.where(keep, total.log() - picked, 0.0).sum()
            if grad_h is None and grad_w is None:
                continue
            probs.div_(total[:, None])  # softmax
            probs.scatter_add_(1, target, probs.new_full(target.shape, -1.0))  # softmax - onehot
            dlogits = probs.mul_((keep * scale)[:, None]).to(hidden.dtype)  # (n, V): d(scale·Σ CE)/dlogits
            if grad_h is not None:
                torch.mm(dlogits, weight, out=grad_h[start : start + chunk_tokens])  # (n, C)
            if grad_w is not None and direct:
                grad_w.addmm_(dlogits.t(), h)  # (V, C)
            elif grad_w is not None:  # 16-bit product added into fp32, in row blocks no larger than the logits
                rows = max(1, dlogits.numel() // h.shape[1])
                for r in range(0, grad_w.shape[0], rows):
                    grad_w[r : r + rows] += dlogits[:, r : r + rows].t() @ h  # (rows, C)
            del logits, probs, dlogits
        if grad_w is not None and not direct and not fp16:
            grad_w = grad_w.to(weight.dtype)
        # Saved through save_for_backward, so saved-tensor hooks (offloading, the memory probe) see them.
        ctx.save_for_backward(grad_h, grad_w)
        ctx.used = False
        return loss * scale

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.used:
            raise RuntimeError("the chunked cross-entropy's backward ran twice (retain_graph=True); it scales its "
                               "saved gradients in place, so use model.loss_backend=plain for double backward")
        ctx.used = True
        grad_h, grad_w = ctx.saved_tensors
        return _scale_(grad_h, grad_out), _scale_(grad_w, grad_out), None, None, None


def _scale_(grad: torch.Tensor | None, factor: torch.Tensor) -> torch.Tensor | None:
    """grad *= factor in place, multiplying in fp32 for 16-bit grads (an fp16 loss scale such as 65536 is not
    representable in fp16; the product usually is), in row blocks of at most 2**24 values."""
    if grad is None or grad.dtype.itemsize >= 4:
        return grad if grad is None else grad.mul_(factor.to(grad.dtype))
    rows = max(1, 2**24 // max(1, grad[0].numel()))
    for r in range(0, grad.shape[0], rows):
        grad[r : r + rows] = grad[r : r + rows].float().mul_(factor)
    return grad


def _chunked_sum_scaled(hidden, weight, labels, scale, chunk_tokens: int) -> torch.Tensor:
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return ChunkedLinearCrossEntropy.apply(hidden, weight, labels, scale, chunk_tokens)
    with torch.no_grad():  # evaluation: the same chunks, no gradient work
        return ChunkedLinearCrossEntropy.forward(_NoGradContext(), hidden, weight, labels, scale, chunk_tokens)


class _NoGradContext:
    needs_input_grad = (False, False, False, False, False)

    def save_for_backward(self, *tensors) -> None:
        pass


def _liger_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    import inspect

    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    extra = {}
    if "accum_dtype" in inspect.signature(liger_fused_linear_cross_entropy).parameters:
        extra["accum_dtype"] = torch.float32  # dW summed over chunks in fp32, as the chunked backend does
    loss = liger_fused_linear_cross_entropy(
        hidden.contiguous(), weight, labels.contiguous(), ignore_index=IGNORE_INDEX, reduction="sum", **extra
    )
    return upcast(loss)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    backend: str = "chunked",
    chunk_mib: float = 256.0,
    reduction: str = "mean",
    count: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight.T` against `labels` without the logits (except backend 'plain').

    hidden (..., C), weight (V, C), labels (...) int64 with -100 = ignore -> () fp32. 'mean' divides by the
    number of non-ignored labels (nan when there are none, as F.cross_entropy; the gradients are then zero);
    'sum' is the plain sum (0 when all are ignored); `count_targets` gives the count that goes with it.
    `count` () replaces the mean's divisor: for `labels` that are one part of the tokens, the count of all of them
    makes the mean this part's share of the whole mean.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}; choose 'mean' or 'sum'")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels {tuple(labels.shape)} do not match the hidden states {tuple(hidden.shape[:-1])}")
    if backend == "auto":  # a caller without an execution plan (the model's LMHead is handed the plan's choice)
        backend = resolve_loss_backend(backend, hidden.device, hidden.dtype)
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)  # (N, C), (N,)
    if backend == "plain" and reduction == "sum":
        return F.cross_entropy(upcast(hidden @ weight.t()), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    if backend == "plain":
        return cross_entropy(hidden @ weight.t(), labels, count)
    count = count_targets(labels) if count is None else count
    if backend == "liger" and torch.is_grad_enabled():
        total = _liger_sum(hidden, weight, labels)
        if reduction == "sum":
            return total
        return torch.where(count > 0, total / count.clamp(min=1), math.nan)
    # chunked (also liger's evaluation: the same numbers, no gradient buffers). The mean's 1/count goes into the
    # saved gradients, as in the plain path, except in fp16: there they stay sums, so that small probabilities
    # do not underflow before backward multiplies in the loss scale (with 1/count).
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    one = torch.ones((), dtype=dtype, device=hidden.device)
    inner = reduction == "mean" and hidden.dtype != torch.float16
    scale = one / count.clamp(min=1).to(dtype) if inner else one
    total = _chunked_sum_scaled(hidden, weight, labels, scale, chunk_tokens_for(weight.shape[0], chunk_mib))
    if reduction == "sum":
        return total
    return torch.where(count > 0, total if inner else total / count.clamp(min=1), math.nan)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, count: torch.Tensor | None = None) -> torch.Tensor:
    """The mean cross-entropy of logits (..., V) against labels (...) (-100 = ignore), in at least fp32 -> ().
    `count` () replaces the mean's divisor, as in `linear_cross_entropy`."""
    logits, labels = upcast(logits).flatten(0, -2), labels.flatten()  # (N, V), (N,)
    if count is None:
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
    total = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return torch.where(count > 0, total / count.clamp(min=1), math.nan)


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    """Number of labels that are not -100, as a device tensor (no host synchronisation)."""
    return (labels != IGNORE_INDEX).sum()


class LMHead(nn.Linear):
    """The output projection (state-dict key `lm_head.weight`, shape (V, C)) with the loss inside its forward.

    forward(hidden) -> logits (..., V), as nn.Linear; forward(hidden, labels) -> the mean cross-entropy, computed
    by `linear_cross_entropy` without the logits. Keeping the loss in this module's forward lets DeepSpeed
    ZeRO-3 gather the partitioned weight for it (and again for backward).
    """

    def __init__(self, d_model: int, vocab_size: int, *, loss_backend: str = "auto", chunk_mib: float = 256.0):
        super().__init__(d_model, vocab_size, bias=False)
        self.loss_backend = loss_backend
        self.chunk_mib = chunk_mib

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None,
                count: torch.Tensor | None = None) -> torch.Tensor:
        """`count`: the mean's divisor, as in `linear_cross_entropy`."""
        if labels is None:
            return super().forward(hidden)
        return linear_cross_entropy(hidden, self.weight, labels, backend=self.loss_backend, chunk_mib=self.chunk_mib,
                                    count=count)

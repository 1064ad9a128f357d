"""The execution plan: which attention kernel, which E-update path and which loss every layer runs, decided once.

`resolve_plan(cfg, device, dtype)` reads the settings (model.attn_backend, model.tape_fused_updates,
model.loss_backend), the device, the dtype and the kernel record (model/kernel_record.py) and returns plain names;
`Transformer.use_plan` hands them to the modules, which run what they were given and never decide again. Training
(train/build.py), evaluation, export, the benchmarks, `--print-config`, the start checks and the memory model all
read a plan from this one function. A model built without one (`Transformer(cfg)`) runs `portable_plan(cfg)`: what
`auto` means on a CPU, which every device can run.

What `auto` picks:
  * attention, CUDA: the fastest candidate the newest bake-off on this GPU capability found exact and timed for the
    layer's head dim, dtype and features (TAPE's E as extra values, document masks, GQA), among those installed and
    verified by their gpu-marked tests (kernel_record.fastest_attention: a committed table, no preference order
    written here); without such timings PyTorch's SDPA. CPU: SDPA, and for document masks without gradients
    (evaluation) compiled FlexAttention.
  * E updates: fused Triton kernels where their gpu-marked tests passed on this capability, else eager.
  * loss: liger where verified, else the chunked loss.
A backend named explicitly is checked here (installed, takes the call's bias and mask) and runs; on a GPU where it
is unverified, one warning says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tapetrain.errors import ConfigError
from tapetrain.model import attention as backends  # backends.backend_available: what is installed here
from tapetrain.model import kernel_record
from tapetrain.model.config import ATTN_BACKENDS, ModelConfig

if TYPE_CHECKING:
    from tapetrain.model.transformer import Transformer

log = logging.getLogger("tapetrain.model")

CPU = torch.device("cpu")
BIAS_PES = ("alibi", "fire")  # additive logit biases: only SDPA and eager take them


@dataclass(frozen=True)
class AttentionPlan:
    """The backends one layer's attention runs: without a document mask, with one while gradients flow (training),
    and with one without gradients (evaluation; on CPU compiled FlexAttention, which has no backward there)."""

    plain: str
    documents: str
    documents_no_grad: str

    def backend(self, has_docs: bool, grad: bool) -> str:
        if not has_docs:
            return self.plain
        return self.documents if grad else self.documents_no_grad


@dataclass(frozen=True)
class LayerPlan:
    carries_e: bool  # TAPE's E travels as extra value channels through this layer's attention (ModelConfig.carries_e)
    attention: AttentionPlan
    # TAPE's E updates as Triton kernels: the q/k rotation, the head mix, the MLP-side update (the non-equivariant
    # ablation's MLP update has no kernel and stays eager)
    fused_updates: bool


@dataclass(frozen=True)
class ExecutionPlan:
    device: str  # "cpu" | "cuda" | ...
    where: str  # the device's name, for messages ("NVIDIA H200", "cpu")
    dtype: torch.dtype
    settings: tuple[str, str, str]  # (model.attn_backend, model.tape_fused_updates, model.loss_backend) as written
    layers: tuple[LayerPlan, ...]
    loss: str  # "chunked" | "plain" | "liger"
    verdicts: tuple[tuple[str, str], ...] = ()  # (backend, "verified" / "fallback" / "UNVERIFIED ...") per choice
    pe: str = "rope"
    float8: str = "off"  # train.float8's recipe for the projections (a training run's plan; train/float8.py)

    @property
    def fused_updates(self) -> bool:
        return any(layer.fused_updates for layer in self.layers)

    def lines(self, documents: bool = False) -> list[str]:
        """--print-config's lines: one per kind of layer (with E / without E) and the E-update path."""
        verdicts = dict(self.verdicts)
        dtype = kernel_record.dtype_name(self.dtype)
        lines = [f"attention ({self.settings[0]!r} on {self.where}, {dtype}" + (", document mask" if documents
                                                                                else "") + "):"]
        groups: dict[tuple[bool, str], list[int]] = {}
        for i, layer in enumerate(self.layers):
            groups.setdefault((layer.carries_e, layer.attention.backend(documents, grad=True)), []).append(i)
        for (carries_e, backend), layers in sorted(groups.items(), key=lambda item: item[1][0]):
            what = "layers carrying TAPE's E" if carries_e else "layers without E"
            span = f"{layers[0]}" if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"
            lines.append(f"  {what} ({span}): {backend} ({verdicts.get(backend, self._default_verdict())})")
        if self.pe == "tape":
            lines.append(self.fused_line())
        return lines

    def fused_line(self) -> str:
        head = f"TAPE's E updates (model.tape_fused_updates={self.settings[1]} on {self.where}): "
        if not self.fused_updates:
            why = "asked for" if self.settings[1] == "false" else (
                "auto: not verified on this GPU" if self.device == "cuda" else f"auto: eager on {self.device}")
            return head + f"eager ({why})"
        if self.device != "cuda":
            return head + "fused Triton kernels (CPU interpreter: correctness checks only)"
        return head + f"fused Triton kernels ({dict(self.verdicts).get('tape_update', 'verified')})"

    def _default_verdict(self) -> str:
        return "CPU: PyTorch's own or the CPU-tested path" if self.device != "cuda" else \
            "PyTorch's own kernel (the fallback)"  # fmt: skip


def resolve_plan(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, *, documents: bool = False,
                 warn: bool = True) -> ExecutionPlan:
    """The plan for `cfg` on `device` in `dtype`. Raises ConfigError for a setting that cannot run here, naming the
    key and the fix. `documents`: whether the run's data carries document masks (only refusals depend on it: the
    plan always holds the document-mask backends too). `warn`: one warning per unverified GPU path named explicitly."""
    from tapetrain.model.loss import resolve_loss_backend
    from tapetrain.model.tape_fused import resolve_fused_updates

    gqa = cfg.kv_heads != cfg.n_heads
    verdicts: dict[str, str] = {}
    choices: dict[bool, AttentionPlan] = {}
    for carries_e in sorted({cfg.carries_e(i) for i in range(cfg.n_layers)}):
        plain = _attention(cfg, device, dtype, carries_e, docs=False, grad=True, gqa=gqa, warn=warn)
        with_docs = _attention(cfg, device, dtype, carries_e, docs=True, grad=True, gqa=gqa, warn=warn and documents,
                               refuse=documents)
        no_grad = _attention(cfg, device, dtype, carries_e, docs=True, grad=False, gqa=gqa, warn=False)
        choices[carries_e] = AttentionPlan(plain, with_docs, no_grad)
        for backend, docs in ((plain, False), (with_docs, True)):
            verdicts.setdefault(backend, _verdict(backend, device, dtype, carries_e, docs, gqa))
    fused = cfg.pe == "tape" and resolve_fused_updates(cfg.tape_fused_updates, device, dtype, warn=warn)
    if fused and device.type == "cuda":
        verified = kernel_record.is_verified(kernel_record.KernelKey("tape_update", "triton",
                                                                     kernel_record.capability_of(device),
                                                                     kernel_record.dtype_name(dtype)))
        verdicts["tape_update"] = "verified" if verified else f"UNVERIFIED on this GPU; {kernel_record.HOW_TO_VERIFY}"
    try:
        loss = resolve_loss_backend(cfg.loss_backend, device, dtype)
    except RuntimeError as err:
        raise ConfigError(str(err)) from err
    layers = tuple(LayerPlan(cfg.carries_e(i), choices[cfg.carries_e(i)], fused) for i in range(cfg.n_layers))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    settings = (cfg.attn_backend, str(cfg.tape_fused_updates).lower(), cfg.loss_backend)
    plan = ExecutionPlan(device.type, where, dtype, settings, layers, loss, tuple(verdicts.items()), cfg.pe)
    _log_once(plan)
    return plan


def portable_plan(cfg: ModelConfig) -> ExecutionPlan:
    """The plan a model is built with until it is given one for its device: `auto` as on a CPU (fp32), explicit
    names as written, nothing refused (a refusal belongs to the run that resolves the plan for its device)."""
    bias = cfg.pe in BIAS_PES
    if cfg.attn_backend == "auto":
        attention = AttentionPlan(*(_auto(CPU, torch.float32, bias, False, docs, grad, False)
                                    for docs, grad in ((False, True), (True, True), (True, False))))
    elif cfg.attn_backend == "flex":
        attention = AttentionPlan("sdpa", "flex", "flex")
    else:
        attention = AttentionPlan(cfg.attn_backend, cfg.attn_backend, cfg.attn_backend)
    fused = cfg.pe == "tape" and cfg.tape_fused_updates is True
    layers = tuple(LayerPlan(cfg.carries_e(i), attention, fused) for i in range(cfg.n_layers))
    loss = "chunked" if cfg.loss_backend == "auto" else cfg.loss_backend
    settings = (cfg.attn_backend, str(cfg.tape_fused_updates).lower(), cfg.loss_backend)
    return ExecutionPlan("cpu", "cpu", torch.float32, settings, layers, loss, (), cfg.pe)


# ---- attention -----------------------------------------------------------------------------------------------------


BACKEND_NEEDS = {"flash": "a CUDA GPU and flash-attn 2", "triton": "a CUDA GPU and triton (or TRITON_INTERPRET=1)",
                 "flex": "torch's FlexAttention", **{name: "a CUDA GPU and flash-attn-4 (pip install 'tapetrain[gpu]')"
                                                    for name in backends.FA4_BACKENDS}}


def attention_key(backend: str, device: torch.device, dtype: torch.dtype, *, carries_e: bool, docs: bool = False,
                  gqa: bool = False) -> kernel_record.KernelKey:
    """The kernel-record key of one attention path on a CUDA device."""
    return kernel_record.KernelKey("attention", backend, kernel_record.capability_of(device),
                                   kernel_record.dtype_name(dtype), e=carries_e, docs=docs, gqa=gqa)


def _attention(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, carries_e: bool, *, docs: bool,
               grad: bool, gqa: bool, warn: bool, refuse: bool = True) -> str:
    """The backend for one kind of call. `refuse`: raise for an explicit choice that cannot take the call (else
    fall back to SDPA: a document-mask call the run never makes)."""
    requested, bias = cfg.attn_backend, cfg.pe in BIAS_PES
    if requested == "auto":
        return _auto(device, dtype, bias, carries_e, docs, grad, gqa, cfg.head_dim)
    if requested not in ATTN_BACKENDS:
        raise ConfigError(f"model.attn_backend={requested!r} is not a backend; choose one of "
                          f"{', '.join(ATTN_BACKENDS)}")
    if not backends.backend_available(requested, device):
        raise ConfigError(f"model.attn_backend={requested} cannot run on this {device.type} machine (it needs "
                          f"{BACKEND_NEEDS.get(requested, requested)}); use model.attn_backend=auto (or sdpa), or "
                          "run on a machine that has it")
    if requested not in backends.FALLBACKS and bias:
        raise ConfigError(f"model.attn_backend={requested} does not take the additive bias of model.pe={cfg.pe}; "
                          "use model.attn_backend=sdpa (or auto)")
    if requested == "flex" and not docs:
        return "sdpa"  # FlexAttention is here for document masks only; plain causal attention is SDPA's
    if requested == "flex" and grad and device.type == "cpu":
        if refuse:
            raise ConfigError("model.attn_backend=flex has no backward on CPU (torch's FlexAttention) and "
                              "data.document_mask trains through it; set model.attn_backend=auto (SDPA trains on CPU)")
        return "sdpa"
    if warn and device.type == "cuda":
        kernel_record.warn_if_unverified(attention_key(requested, device, dtype, carries_e=carries_e, docs=docs,
                                                       gqa=gqa))
    return requested


def _auto(device: torch.device, dtype: torch.dtype, bias: bool, carries_e: bool, docs: bool, grad: bool,
          gqa: bool, head_dim: int = 0) -> str:
    if device.type != "cuda":  # CPU: SDPA; compiled FlexAttention for document masks without gradients (measured,
        # docs/document-masking.md: 2-4.5x SDPA's boolean mask forward; it has no CPU backward)
        return "flex" if docs and not grad and not bias and backends.backend_available("flex", device) else "sdpa"
    if bias or dtype not in (torch.float16, torch.bfloat16):
        return "sdpa"  # the fused kernels take no additive bias, and are 16-bit only
    # The GPU: the fastest candidate installed here that the newest bake-off on this capability found exact and
    # timed for this head dim, dtype and features, and whose gpu-marked tests passed (kernel_record.fastest_attention).
    # No preference order is written here: without such timings, PyTorch's own SDPA.
    candidates = [name for name in ATTN_BACKENDS if name not in ("auto", "eager") and (docs or name != "flex")
                  and backends.backend_available(name, device)]
    fastest = kernel_record.fastest_attention(kernel_record.capability_of(device), kernel_record.dtype_name(dtype),
                                              head_dim, carries_e, docs, gqa, candidates)
    return fastest or "sdpa"


def _verdict(backend: str, device: torch.device, dtype: torch.dtype, carries_e: bool, docs: bool, gqa: bool) -> str:
    if device.type != "cuda":
        return "CPU: PyTorch's own or the CPU-tested path"
    if backend in kernel_record.FALLBACKS["attention"]:
        return "PyTorch's own kernel (the fallback)"
    key = attention_key(backend, device, dtype, carries_e=carries_e, docs=docs, gqa=gqa)
    return "verified" if kernel_record.is_verified(key) else f"UNVERIFIED on this GPU; {kernel_record.HOW_TO_VERIFY}"


_logged: set[tuple] = set()


def _log_once(plan: ExecutionPlan) -> None:
    """One log line per distinct plan in a process (a run resolves one; evaluation may resolve a few)."""
    key = (plan.device, plan.dtype, plan.settings, plan.layers, plan.loss)
    if key in _logged:
        return
    _logged.add(key)
    for line in plan.lines():
        log.info("execution plan: %s", line.strip())


# ---- applying a plan -----------------------------------------------------------------------------------------------


def place_model(model: Transformer, device: torch.device, dtype: torch.dtype | None = None, *,
                documents: bool = False) -> Transformer:
    """Move (and cast) a model to `device` and give it the plan resolved there: what every caller that runs a model
    outside the training engine does (evaluation, benchmarks). Returns the model."""
    model.to(device=device, dtype=dtype)
    model.use_plan(resolve_plan(model.cfg, device, dtype or next(model.parameters()).dtype, documents=documents))
    return model


def paths_ran(plans: list[ExecutionPlan], documents: bool = False) -> dict[str, list[str]]:
    """What the models of `plans` run, for a benchmark's JSON: the attention backends of their training calls (with
    or without document masks) and whether TAPE's E updates are fused."""
    backends = {layer.attention.backend(documents, grad=True) for plan in plans for layer in plan.layers}
    updates = {"fused" if plan.fused_updates else "eager" for plan in plans if plan.pe == "tape"}
    return {"backends": sorted(backends), "tape_updates": sorted(updates)}

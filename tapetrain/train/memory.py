"""Per-GPU memory model for DeepSpeed ZeRO training of tapetrain decoders, and an exact activation probe.

Model states (bytes per GPU, N data-parallel ranks, P parameters, T trainable, 16-bit training):
    weights   2P            (ZeRO-3: 2P/N; offload_params: 0 on GPU)
    grads     2T            (ZeRO-2/3: 2T/N)
    optimizer 12T           fp32 master + Adam m, v (ZeRO-1/2/3: 12T/N; offload_optimizer: 0 on GPU, 12T on host)
Activations per GPU for micro batch b and sequence s, hidden C, L layers, F SwiGLU width, H heads, D head dim:
    checkpointed  L · b·s·C · 2           layer inputs kept between forward and backward (+ TAPE's state E:
                                          b·H·s·D · 2 per layer, the same size again for an MHA model)
    recompute     one layer's saved tensors while it is recomputed (see `layer_activation_bytes`)
    no checkpointing: L · one layer's saved tensors
    logits        b·s·V · (2 + 4 + 4)     16-bit logits, fp32 upcast for the loss and its gradient
Flash/fused attention never stores the s×s matrix; the eager path would add b·H·s²·2 per layer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from tapetrain.model.config import ModelConfig

GiB = 2**30


def layer_activation_bytes(
    cfg: ModelConfig, batch: int, seq: int, bytes_per_value: int = 2, updates_state: bool = True
) -> int:
    """Tensors one decoder layer saves for backward with a fused attention kernel (values × bytes).
    `updates_state`: TAPE layers other than the last also update E (the last one's E would be dropped)."""
    c, f, h, hk, d = cfg.d_model, cfg.ffn_dim, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    tokens = batch * seq
    values = 0
    values += 2 * c  # two RMSNorm inputs
    values += 2 * c  # normalised inputs to the q/k/v and MLP projections
    values += h * d + 2 * hk * d  # q, k, v
    values += h * d  # attention output (input of o_proj)
    values += 3 * f  # gate, up, and silu(gate)·up (input of down_proj)
    values += 2 * f  # silu input/output kept by autograd
    if cfg.pe == "tape":
        values += h * d * 2  # E (rotation blocks) and k expanded to query heads
        if updates_state and cfg.tape_attn_update:
            values += 2 * h * d  # A·E, and the head-mix contraction's permuted copy of it
        if updates_state and cfg.tape_mlp_update:
            i = cfg.tape_dim
            # W_up·E, gated product and its permuted copy for W_down, the gate, the MLP output m, E's copy for W_up
            values += 3 * i * d + i + c + h * d
    return tokens * values * bytes_per_value


@dataclass
class MemoryEstimate:
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    logits_gb: float
    total_gpu_gb: float
    host_offload_gb: float


def estimate_memory(
    cfg: ModelConfig,
    *,
    seq_len: int,
    micro_batch: int,
    world_size: int,
    zero_stage: int,
    trainable_params: int,
    total_params: int,
    activation_checkpointing: bool,
    offload_optimizer: bool = False,
    offload_params: bool = False,
) -> MemoryEstimate:
    n = world_size
    weights = 2 * total_params / (n if zero_stage == 3 else 1)
    if offload_params:
        weights = 0
    grads = 2 * trainable_params / (n if zero_stage >= 2 else 1)
    optimizer = 12 * trainable_params / (n if zero_stage >= 1 else 1)
    host = 0.0
    if offload_optimizer:
        host += optimizer * n / max(n, 1)  # each rank's partition lives in its host's memory
        optimizer = 0
    if offload_params:
        host += 2 * total_params / n
    tokens = micro_batch * seq_len
    layer = layer_activation_bytes(cfg, micro_batch, seq_len)
    if activation_checkpointing:
        state = cfg.n_heads * cfg.head_dim if cfg.pe == "tape" else 0
        activations = cfg.n_layers * tokens * (cfg.d_model + state) * 2 + layer
    else:
        last = layer_activation_bytes(cfg, micro_batch, seq_len, updates_state=False)
        activations = (cfg.n_layers - 1) * layer + last
    logits = tokens * cfg.vocab_size * (2 + 4 + 4)
    total = weights + grads + optimizer + activations + logits
    return MemoryEstimate(
        *(x / GiB for x in (weights, grads, optimizer, activations, logits, total, host))
    )


def measure_saved_activation_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Exact bytes of every tensor autograd saves for backward during one training forward (storage-deduplicated,
    parameters excluded): the quantity the activation term above models."""
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens[:, :-1], labels=tokens[:, 1:])
    out.loss.backward()
    return sum(seen.values())


def as_row(name: str, est: MemoryEstimate) -> dict:
    return {"setting": name, **{k: round(v, 2) for k, v in asdict(est).items()}}

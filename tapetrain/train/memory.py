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
    loss          fused (model.loss_backend chunked/liger, the default): dh b·s·C·2 kept for backward, one
                  chunk's logits and products n·V·(4 + 2·2), dW accumulated in fp32 V·C·4 if the head
                  is trained (`loss_bytes`)
                  plain: b·s·V · (2 + 4 + 4)  16-bit logits, fp32 upcast for the loss and its gradient
Flash/fused attention never stores the s×s matrix; the eager path would add b·H·s²·2 per layer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from tapetrain.model.config import ModelConfig
from tapetrain.model.loss import chunk_tokens_for

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


def loss_bytes(
    cfg: ModelConfig, batch: int, seq: int, bytes_per_value: int = 2, *, fused: bool = True, head_trainable: bool = True
) -> int:
    """Peak bytes the LM head's cross-entropy adds on top of the layers (the `logits` column), p = bytes_per_value.

    plain: N·V·(p + 4 + 4): the logits, the fp32 log-softmax autograd keeps, and its fp32 gradient in backward.
    fused: dh (N·C·p) kept for backward; one chunk's fp32 logits, n·V·4 (+ their p-byte copy with 16-bit
    weights); and, if the head is trained, dW (V·C·p; with 16-bit weights over several chunks accumulated in
    fp32, V·C·4, from product blocks of at most one chunk's logits, n·V·p; fp16 keeps that fp32 dW).
    liger-kernel picks its own chunks.
    """
    tokens, v, c, p = batch * seq, cfg.vocab_size, cfg.d_model, bytes_per_value
    if not fused:
        return tokens * v * (p + 4 + 4)
    chunk = min(tokens, chunk_tokens_for(v, cfg.loss_chunk_mib))
    cast = 0 if p >= 4 else p  # 16-bit: dlogits' copy in the weight dtype
    dh, logits = tokens * c * p, chunk * v * (4 + cast)
    if not head_trainable:
        return dh + logits
    if p >= 4 or tokens <= chunk:  # dW accumulated in place in the weight dtype
        return dh + v * c * p + logits
    return dh + v * c * 4 + max(logits + chunk * v * p, v * c * p)  # fp32 accumulator, then its cast


def head_saved_bytes(cfg: ModelConfig, batch: int, seq: int, bytes_per_value: int = 2, *, fused: bool = True) -> int:
    """Bytes autograd keeps for the backward of what follows the layers (as `measure_saved_activation_bytes` sees
    them): the final RMSNorm's input and output (2·N·C·p), then the loss: plain keeps the LM head's input h
    (N·C·p), the fp32 log-softmax (N·V·4) and the int64 labels (N·8); fused keeps dh (N·C·p) and dW (V·C·p)."""
    tokens, v, c, p = batch * seq, cfg.vocab_size, cfg.d_model, bytes_per_value
    loss = tokens * c * p + (v * c * p if fused else tokens * v * 4 + tokens * 8)
    return 2 * tokens * c * p + loss


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
    fused_loss: bool = True,
    lm_head_trainable: bool = True,
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
    logits = loss_bytes(cfg, micro_batch, seq_len, fused=fused_loss, head_trainable=lm_head_trainable)
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


def measure_loss_saved_bytes(cfg: ModelConfig, batch: int, seq: int, seed: int = 0) -> dict:
    """Saved bytes of one fp32 training forward with the plain and the fused (chunked) loss, same weights and
    tokens, next to `head_saved_bytes`' prediction of the difference (CPU-sized configs: it runs the model)."""
    import dataclasses

    from tapetrain.model.transformer import Transformer

    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    measured = {}
    for backend in ("plain", "chunked"):
        torch.manual_seed(seed)
        model = Transformer(dataclasses.replace(cfg, loss_backend=backend))
        measured[backend] = measure_saved_activation_bytes(model, tokens)
        del model
    predicted = head_saved_bytes(cfg, batch, seq, 4, fused=False) - head_saved_bytes(cfg, batch, seq, 4, fused=True)
    return {"plain_bytes": measured["plain"], "fused_bytes": measured["chunked"],
            "drop_bytes": measured["plain"] - measured["chunked"], "predicted_drop_bytes": predicted}  # fmt: skip


def as_row(name: str, est: MemoryEstimate) -> dict:
    return {"setting": name, **{k: round(v, 2) for k, v in asdict(est).items()}}

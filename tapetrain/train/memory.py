"""Per-GPU memory model for DeepSpeed ZeRO training of tapetrain decoders, and an exact activation probe.

Model states (bytes per GPU, N data-parallel ranks, P parameters, T trainable, p = 2 for bf16/fp16, 4 for fp32):
    weights   pP            (ZeRO-3: pP/N; offload_params: 0 on GPU)
    grads     pT            (ZeRO-1/2/3: the partition, pT/N, at the end of backward; 4T/N at the step)
    optimizer 12T           fp32 master + Adam m, v (DeepSpeed's ZeRO keeps the master in fp32 runs too; a ZeRO-0
                            fp32 run: 8T) (ZeRO-1/2/3: /N; offload_optimizer: 0 on GPU, on the host instead)
ZeRO buffers (`zero_buffer_bytes`, DeepSpeed 0.19.8): with contiguous_gradients, stages 1-2 keep one gradient
bucket of reduce_bucket_size elements in backward (two with overlap_comm), stage 3 one from start-up, whatever the
model's size; stage 3 also gathers the parameters at work: the largest of a layer and the embedding, plus
stage3_prefetch_bucket_size (at most stage3_max_live_parameters).
Stages 1-3 also see the largest trainable tensor's whole gradient (the embedding, the LM head) before it enters a
bucket (`largest_trainable` elements): last in backward, with the other gradients, when the activations are gone.
Peak: the larger of backward (weights, optimizer, ZeRO buffers, and the larger of activations + loss at its start
and the gradients at its end; ZeRO-3's gradient partition is there throughout) and the step (weights, optimizer,
the fp32 master partition's gradient 4T/N, plus ZeRO-3's persistent 16-bit partition pT/N). Checked against a
1-rank DeepSpeed 0.19.8 engine on CPU for stages 1-3, fp32 and bf16, with and without overlap_comm
(tests/unit/test_memory_model.py).
Context: CUDA_CONTEXT_GIB per GPU for the CUDA context, cuBLAS workspaces and NCCL buffers (not in
max_memory_allocated; an allowance, not measured here), 0 for a CPU estimate.
Activations per GPU for micro batch b and sequence s, hidden C, L layers, F SwiGLU width, H heads, D head dim,
sequence parallelism N (each GPU holds s/N tokens of every sequence; ZeRO still partitions over all ranks):
    checkpointed  L · b·(s/N)·C · 2       layer inputs kept between forward and backward (+ TAPE's state E:
                                          b·H·(s/N)·D · 2 per layer, the same size again for an MHA model)
    recompute     one layer's saved tensors while it is recomputed (see `layer_activation_bytes`), and in its
                  backward the gradients of its largest intermediates (`recompute_backward_bytes`)
    no checkpointing: every layer's saved tensors (TAPE's first keeps less: its E^(0) needs no gradient)
    per layer     exact against saved-tensor hooks, and per attention path (`attention_path`): cuDNN's SDPA
                  (auto for TAPE on Hopper+, what the estimate assumes) keeps [V ‖ E], [A·V ‖ A·E] and o_proj's
                  copy, 2·H·D values per token (MHA) more than the Triton kernel (auto before Hopper); 16-bit RMSNorms
                  keep their input in fp32
    tiled MLP     (model.tiled_mlp) the MLP intermediates are not kept (`mlp_intermediate_values`); one chunk's
                  recompute and its gradients are held in backward instead (`tiled_mlp_peak_bytes`)
    exchange      N > 1: one layer's all-to-all send and receive buffers of q, k and the values ([V ‖ E] for
                  TAPE) (`exchange_bytes`); attention itself runs on whole sequences of H/N heads, which hold as
                  many values as s/N tokens of H heads
    loss          on each rank's s/N tokens. fused (model.loss_backend chunked/liger, the default): dh b·s·C·2
                  kept for backward, one chunk's logits and products n·V·(4 + 2·2), dW accumulated in fp32
                  V·C·4 if the head is trained (`loss_bytes`)
                  plain: b·s·V · (2 + 4 + 4)  16-bit logits, fp32 upcast for the loss and its gradient
Fused attention never stores the s×s matrix; the math and eager paths add b·H·s²·4 per layer (fp32 softmax).
float8 (train.float8, torchao's Float8Linear): a converted projection saves its high-precision input and weight,
as nn.Linear does, and redoes the FP8 casts in backward: no term of its own (exact against saved-tensor hooks in
torchao's emulation, tests/unit/test_memory_model.py; a compiled layer's partitioner may keep FP8 copies instead).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from tapetrain.model.config import ModelConfig
from tapetrain.model.execution_plan import ExecutionPlan
from tapetrain.model.loss import chunk_tokens_for
from tapetrain.model.sequence_shard import SequenceShard
from tapetrain.model.tiling import tile_count

GiB = 2**30
CUDA_CONTEXT_GIB = 1.0  # per GPU: CUDA context, cuBLAS workspaces, NCCL buffers (outside the caching allocator)
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class ZeroBuffers:
    """The DeepSpeed settings that size ZeRO's own buffers (the `deepspeed:` section's defaults)."""

    reduce_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None  # None: DeepSpeed's default, on for stage 3 only
    contiguous_gradients: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_max_live_parameters: int = 1_000_000_000


def zero_buffer_bytes(stage: int, buffers: ZeroBuffers, bytes_per_value: int, total_params: int,
                      world_size: int = 1, layer_params: int | None = None) -> int:
    """Bytes ZeRO holds beyond the partitioned states during backward (module docstring): gradient buckets
    (stages 1-2: one, two with overlap_comm; stage 3: one, allocated at start-up) and stage 3's gathered
    parameters: the layer at work plus the prefetch (`layer_params` + prefetch elements, capped by max_live and
    the model), less this rank's own share of them."""
    if stage == 0 or not buffers.contiguous_gradients and stage < 3:
        return 0
    overlap = buffers.overlap_comm if buffers.overlap_comm is not None else stage == 3
    buckets = 1 if stage == 3 else (2 if overlap else 1)
    total = buckets * buffers.reduce_bucket_size * bytes_per_value if buffers.contiguous_gradients else 0
    if stage == 3:
        working = (layer_params if layer_params is not None else total_params) + buffers.stage3_prefetch_bucket_size
        gathered = min(buffers.stage3_max_live_parameters, working, total_params)
        total += int(gathered * bytes_per_value * (world_size - 1) / world_size)
    return total


def recompute_backward_bytes(cfg: ModelConfig, batch: int, seq: int, bytes_per_value: int = 2) -> int:
    """What the backward of one recomputed layer adds to its saved tensors: the gradients of the SwiGLU gate and
    up products (2F per token) and of the layer's input and output (2C per token)."""
    return batch * seq * (2 * cfg.ffn_dim + 2 * cfg.d_model) * bytes_per_value


def fused_updates_modelled(cfg: ModelConfig) -> bool:
    """Whether the estimate counts TAPE's fused E updates (model/tape_fused.py): only model.tape_fused_updates=true.
    `auto` resolves per GPU against the kernel record, so the estimate keeps eager's larger figure for it."""
    return cfg.pe == "tape" and cfg.tape_fused_updates is True


def mlp_intermediate_values(cfg: ModelConfig, updates_state: bool = True, fused_updates: bool | None = None) -> int:
    """Values per token that a layer's MLP work saves beyond its inputs: what `model.tiled_mlp` no longer keeps
    (it keeps the MLP's normalised input and E, and recomputes the rest chunk by chunk in backward)."""
    values = 4 * cfg.ffn_dim  # gate (for SiLU), SiLU(gate) and up (for their product), the product (for down_proj)
    if cfg.pe == "tape" and updates_state and cfg.tape_mlp_update:
        i = cfg.tape_dim
        fused = fused_updates_modelled(cfg) if fused_updates is None else fused_updates
        if fused and cfg.tape_equivariant:  # the kernel keeps W_x·m and recomputes W_up·E (and the gate) backward
            values += cfg.d_model + i  # m (for W_x), W_x·m
        else:  # m (for W_x), W_x·m (for SiLU), the gate, W_up·E and the gated product (for W_down)
            values += cfg.d_model + 2 * i + 2 * i * cfg.head_dim
    return values


ATTENTION_PATHS = ("sdpa", "sdpa_split", "math", "triton", "flash")


def attention_path(backend: str, device: str = "cuda", keys: int = 0, carries_e: bool = True) -> str:
    """What `layer_activation_bytes` models for the attention backend that runs (the execution plan's choice, or a
    model.attn_backend setting) on `device` ("cuda" or "cpu"), `keys` keys per sequence.

    "auto" on a GPU: TAPE's layers that carry E take cuDNN's SDPA on Hopper and newer, the Triton kernel before it;
    "sdpa" is the larger of the two (2·H·D more values per token with multi-head attention), so the estimate keeps
    it. CPU SDPA runs TAPE's [V ‖ E] (2D-wide values) through its math path, or from CPU_TWO_CALLS_FROM_KEYS keys on
    as two calls of its fused kernel (sdpa_value_calls); eager materialises the softmax as the math path does."""
    from tapetrain.model.attention import CPU_TWO_CALLS_FROM_KEYS

    if backend in ("triton", "flash"):
        return backend
    if backend == "eager":
        return "math"
    if device == "cpu" and carries_e:
        return "sdpa_split" if keys >= CPU_TWO_CALLS_FROM_KEYS else "math"
    return "sdpa"  # and "auto" (GPU), "flex" (document masks; a fused kernel keeping q, k, values, output, lse)


def _norm_bytes(c: int, p: int) -> int:
    """Bytes per token both RMSNorms keep: each its input upcast to fp32 (x.float(): a 16-bit model's copy, an
    fp32 model's input itself), the normalised x cast back and weighted (the projections' input), and rstd (fp32)."""
    return 2 * (4 * c + 2 * p * c + 4)


def _attention_bytes(cfg: ModelConfig, p: int, path: str, carries_e: bool, first_layer: bool, keys: int,
                     sequence_parallel: int, fused: bool = False) -> int:
    """Bytes per local token attention keeps for backward (see `layer_activation_bytes`)."""
    h, hk, d = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    tape, rotary = cfg.pe == "tape", cfg.pe in ("rope", "randpe", "xpos")
    # TAPE rotates by E, which needs a gradient after the first updating layer: the rotations keep E (B, T, H, D)
    # and q, k before rotation (eager: k expanded to H heads; the fused kernel: k as projected, Hkv heads); layer
    # 0's E^(0) is one (B, T, D) table, broadcast over heads
    e_grad = tape and not first_layer and (cfg.tape_attn_update or cfg.tape_mlp_update)
    rotation = 2 * h * d + (hk * d if fused else h * d)
    values = rotation if e_grad else d if tape or rotary else 0  # (rope: its cos, sin (B, 1, T, D/2))
    width = 2 * d if carries_e else d  # value width per head: [V ‖ E] or V
    lse = 4 * h  # a fused kernel's logsumexp (B, H, T) fp32
    if path in ("triton", "flash") and not (carries_e and sequence_parallel > 1):
        # V as given (Hkv heads; E is the state, kept above); A·V and A·E as two token-major tensors, which o_proj
        # and W_A read in place. (With a sequence shard and E, V and E are views of the exchanged [V ‖ E], and the
        # output comes back through the exchange, as SDPA's below.)
        values += h * d + (h if tape else hk) * d + hk * d + h * width  # q̃, k̃, V, A·V (‖ A·E)
        fp32 = lse * (2 if path == "flash" and carries_e else 1)  # flash-attn: V and E in two calls
        attended = 0  # W_A 'gain' keeps A·E: the kernel's output
    elif path == "math":  # fp32 (math upcasts 16-bit): q, k scaled, values, softmax weights (H/N heads, T keys)
        fp32 = 4 * (2 * h * d + h * width + h * keys)
        values += h * d  # o_proj's input: a copy of the (unsaved) heads-first output
        attended = h * width  # W_A 'gain' keeps A·E, a slice of that output
    else:  # sdpa_attention expands grouped k, v to the query heads; q̃, k̃ (B, H, T, D)
        values += 2 * h * d
        if path == "sdpa_split" and carries_e:  # V, then E (the state, kept above) in a second call
            values += h * d + 2 * h * d  # V; A·V, A·E, token-major as q̃
            fp32 = 2 * lse
        else:  # values [V ‖ E] (V expanded) and the output [A·V ‖ A·E], or V and A·V
            values += 2 * h * width
            fp32 = lse
        # the output's layout follows q̃'s: token-major for TAPE, heads-first after rotate_qk's cat; o_proj copies
        # a heads-first one (and A·V, a slice of the 2D-wide output). GPU flash / memory-efficient SDPA write
        # token-major whatever q̃'s layout, so rope layers there keep one copy fewer than counted.
        values += h * d if (carries_e and path == "sdpa") or rotary else 0
        attended = 0
    if carries_e:  # eager W_A's matmul copies A·E (B·T·D, M); 'gain' and the fused head mix keep A·E itself
        values += h * d if cfg.tape_head_mix == "full" and not fused else attended
    return values * p + fp32


def layer_activation_bytes(
    cfg: ModelConfig, batch: int, seq: int, bytes_per_value: int = 2, updates_state: bool = True,
    tiled_mlp: int = 1, sequence_parallel: int = 1, attention_matrix: bool = False, attention: str = "sdpa",
    first_layer: bool = False, fused_updates: bool | None = None,
) -> int:
    """Bytes one decoder layer saves for backward (values × bytes, plus the fp32 pieces), on one rank.

    `seq`: the whole sequence; each of the `sequence_parallel` ranks holds seq/N tokens of it, and attention saves
    the exchanged q, k and values (whole sequences of H/N heads: as many values as T/N tokens of H heads), which
    replace the local ones, so per token nothing changes (the all-to-all's buffers are transient: `exchange_bytes`).
    `updates_state`: TAPE layers other than the last also update E (the last one's E would be dropped).
    `tiled_mlp` > 1: the MLP intermediates (`mlp_intermediate_values`) are not kept (see `tiled_mlp_peak_bytes`).
    `attention`: the path attention takes (`attention_path`; ATTENTION_PATHS): "sdpa" a fused SDPA kernel (cuDNN,
    flash or memory-efficient on GPU) on values [V ‖ E]; "triton" the TAPE kernel, "flash" flash-attn; "math" CPU
    SDPA's math path (the softmax weights, B·(H/N)·T² per rank, instead of the output); "sdpa_split" CPU SDPA's two
    fused calls (V, E). `attention_matrix=True` is attention="math" (kept for callers).
    `first_layer`: TAPE's layer 0, whose E^(0) needs no gradient (its rotations keep neither q, k nor E).
    `fused_updates`: TAPE's E updates run as the fused kernels (None: `fused_updates_modelled(cfg)`); they keep k
    with its own heads, no copy of A·E, and neither W_up·E nor the gated product.
    Exact against saved-tensor hooks on CPU (tests/unit/test_memory_model.py: SDPA, math, and the Triton kernel in
    Triton's interpreter, fp32 and bf16) and on GPUs, bf16 (docs/benchmarks/gpu: an H100 at 8192 tokens, Triton;
    an H200 at 32768, cuDNN SDPA). Not measured: "flash", and "triton" with a sequence shard."""
    path = "math" if attention_matrix else attention
    if path not in ATTENTION_PATHS:
        raise ValueError(f"attention={path!r}: choose one of {', '.join(ATTENTION_PATHS)}")
    p, tokens = bytes_per_value, batch * (seq // sequence_parallel)
    carries_e = cfg.e_in_attention(updates_state)
    fused = fused_updates_modelled(cfg) if fused_updates is None else fused_updates and cfg.pe == "tape"
    per_token = _norm_bytes(cfg.d_model, p) + _attention_bytes(cfg, p, path, carries_e, first_layer, seq,
                                                               sequence_parallel, fused)
    if cfg.pe == "tape" and updates_state and cfg.tape_mlp_update:
        per_token += cfg.n_heads * cfg.head_dim * p  # E' for W_up (the tile's input when tiled)
    if tiled_mlp <= 1:
        per_token += mlp_intermediate_values(cfg, updates_state, fused) * p
    return tokens * per_token


def exchanged_widths(cfg: ModelConfig, n: int, updates_state: bool = True) -> tuple[int, int, int]:
    """Values per token of q, k and the values that go through the Ulysses all-to-all (`Attention._attend_sharded`):
    keys and values keep their Hkv heads when N divides them, else are expanded to H; TAPE's k is always expanded
    (E has a row per query head), and its values are [V ‖ E] (2D wide, H heads) in layers that update E."""
    h, hk, d = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    own = hk if hk % n == 0 else h
    k = h * d if cfg.pe == "tape" else own * d
    v = 2 * h * d if cfg.e_in_attention(updates_state) else own * d
    return h * d, k, v


def ring_block_bytes(cfg: ModelConfig, batch: int, seq: int, context_parallel: int, sequence_parallel: int = 1,
                     bytes_per_value: int = 2) -> int:
    """Ring attention's transient bytes per rank in one layer at a time (tapetrain.parallel.ring), 0 for R = 1.

    Per layer the ring rank's T/R tokens of H/U heads attend: one K/V block in flight (a send and a receive buffer
    of k and the values, (B, T/R, ·) each), in backward with its fp32 gradients travelling beside it; one query
    tile's scores (at most TILE_SCORES elements), of which the recompute under autograd keeps about five fp32
    copies (scores, masked, weights, their gradients). Besides the saved tensors the layer terms already count,
    the ring keeps its merged output in fp32 rather than the model's dtype: (4 − p) more bytes per value of it."""
    if context_parallel <= 1:
        return 0
    from tapetrain.parallel.ring import tile_rows

    _, k, v = exchanged_widths(cfg, sequence_parallel)  # per token, all heads: this rank's H/U heads of T/R tokens
    tokens = batch * (seq // context_parallel) // sequence_parallel
    block = (k + v) * tokens  # values per rank of one K/V block
    heads = cfg.n_heads // sequence_parallel
    queries = seq // context_parallel
    scores = batch * heads * tile_rows(batch, heads, queries, queries) * queries
    in_flight = max(2 * block * bytes_per_value, 2 * block * (bytes_per_value + 4))  # forward; backward with grads
    output = cfg.n_layers * batch * (seq // (context_parallel * sequence_parallel)) * v * (4 - bytes_per_value)
    return in_flight + 5 * 4 * scores + max(0, output)


def exchange_bytes(cfg: ModelConfig, batch: int, seq: int, n: int, bytes_per_value: int = 2) -> int:
    """The all-to-all's transient buffers in one layer at a time: a send and a receive buffer for each of q, k
    and the values, per rank (B, T/N, ·) each; 0 without sequence parallelism."""
    if n <= 1:
        return 0
    return 2 * batch * (seq // n) * sum(exchanged_widths(cfg, n)) * bytes_per_value


def tiled_mlp_peak_bytes(cfg: ModelConfig, batch: int, seq: int, chunks: int, bytes_per_value: int = 2) -> int:
    """What one chunk's recompute holds in backward on top of the layer: its intermediates and their gradients
    (about twice one chunk's `mlp_intermediate_values`); 0 without tiling."""
    if chunks <= 1:
        return 0
    tokens = batch * -(-seq // chunks)
    return 2 * tokens * mlp_intermediate_values(cfg) * bytes_per_value


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
    buffers_gb: float
    activations_gb: float
    logits_gb: float
    context_gb: float
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
    sequence_parallel: int = 1,
    tiled_mlp: int | str = 0,
    precision: str = "bf16",
    buffers: ZeroBuffers = ZeroBuffers(),
    largest_trainable: int = 0,
    context_gib: float = CUDA_CONTEXT_GIB,
    attention: str = "sdpa",
    fused_updates: bool | None = None,
    context_parallel: int = 1,
) -> MemoryEstimate:
    """Per-GPU bytes. ZeRO partitions over all `world_size` ranks (sequence parallel ones too); each rank holds
    seq_len / sequence_parallel tokens of every sequence, so activations and the loss scale with T/N. `attention`:
    the path attention takes on the GPU (`attention_path` of model.attn_backend; "sdpa" for auto)."""
    n = world_size
    p = PRECISION_BYTES[precision]
    weights = p * total_params / (n if zero_stage == 3 else 1)
    if offload_params:
        weights = 0
    grads = p * trainable_params / (n if zero_stage >= 1 else 1)  # at the end of backward (ZeRO-1 too, 0.19.8)
    # the step: 16-bit gradients are gone, the fp32 master partition's gradient exists (ZeRO-3 keeps its 16-bit
    # gradient partition as well); a ZeRO-0 engine steps on the gradients it has
    step_grads = 4 * trainable_params / n + (grads if zero_stage == 3 else 0) if zero_stage >= 1 else grads
    # fp32 master + Adam m, v; DeepSpeed's ZeRO optimizers keep the fp32 master copy in fp32 runs too, so only a
    # ZeRO-0 fp32 run updates its weights in place (Adam m, v: 8T)
    optimizer = (8 if p == 4 and zero_stage == 0 else 12) * trainable_params / (n if zero_stage >= 1 else 1)
    host = 0.0
    if offload_optimizer:
        host += optimizer
        optimizer = 0
    if offload_params:
        host += p * total_params / n
    embeddings = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
    layer_params = max(total_params - embeddings, 0) // cfg.n_layers  # ZeRO-3 gathers a layer at a time
    zero = zero_buffer_bytes(zero_stage, buffers, p, total_params, n, max(layer_params, cfg.vocab_size * cfg.d_model))
    # the largest trainable tensor's whole gradient (ZeRO 1-3, before it is bucketed) comes last in backward, when
    # the activations and the loss's buffers are gone: it competes with them for the peak rather than adding
    # (ZeRO-1 without overlap_comm reduces only after backward, from whole gradients: nothing extra)
    overlap = buffers.overlap_comm if buffers.overlap_comm is not None else zero_stage == 3
    late_gradient = largest_trainable * p if zero_stage >= 2 or zero_stage == 1 and overlap else 0
    # context parallelism R: each rank holds T/(R·U) tokens; the ring adds its block in flight (ring_block_bytes)
    ranks = sequence_parallel * context_parallel
    activations = activation_bytes(cfg, micro_batch, seq_len, activation_checkpointing, ranks, tiled_mlp,
                                   bytes_per_value=p, attention=attention, fused_updates=fused_updates)
    activations += ring_block_bytes(cfg, micro_batch, seq_len, context_parallel, sequence_parallel, p)
    local = seq_len // ranks
    logits = loss_bytes(cfg, micro_batch, local, p, fused=fused_loss, head_trainable=lm_head_trainable)
    context = context_gib * GiB
    # backward frees activations as it produces gradients: at its start all activations and no gradient, at its end
    # the reverse, so the peak is the larger of the two (ZeRO-3's gradient partition is allocated from the start)
    if zero_stage == 3:
        backward_peak = weights + optimizer + zero + grads + max(activations + logits, late_gradient)
    else:
        backward_peak = weights + optimizer + zero + max(activations + logits, grads + late_gradient)
    step_peak = weights + optimizer + step_grads
    total = max(backward_peak, step_peak) + context
    return MemoryEstimate(
        *(x / GiB for x in (weights, grads, optimizer, zero, activations, logits, context, total, host))
    )


@dataclass(frozen=True)
class ParameterCounts:
    total: int
    trainable: int
    largest_trainable: int  # elements of the largest trainable tensor (its whole gradient exists at once)
    head_trainable: bool  # the LM head's weight trains (the loss then keeps its gradient)


def parameter_counts(cfg: ModelConfig, trainable: str) -> ParameterCounts:
    """Counts for `train.trainable` mode `trainable`, on the meta device (no memory). LoRA modes count the base
    model as frozen (adapters are small next to what the estimate is for)."""
    from tapetrain.model.transformer import Transformer
    from tapetrain.train.optim import is_trainable

    with torch.device("meta"):
        model = Transformer(cfg)
    params = {id(p): (name, p) for name, p in model.named_parameters()}  # tied weights once
    chosen = [p.numel() for name, p in params.values() if not trainable.startswith("lora") and
              is_trainable(name, trainable)]
    head = "embed.weight" if cfg.tie_embeddings else "lm_head.weight"
    return ParameterCounts(total=sum(p.numel() for _, p in params.values()), trainable=sum(chosen),
                           largest_trainable=max(chosen, default=0),
                           head_trainable=not trainable.startswith("lora") and is_trainable(head, trainable))


def estimate_run_memory(run_cfg, model_cfg: ModelConfig, world_size: int, *, context_gib: float = CUDA_CONTEXT_GIB,
                        plan: ExecutionPlan | None = None) -> tuple[MemoryEstimate, ParameterCounts]:
    """The estimate for a resolved RunConfig on `world_size` ranks: what `--print-config` prints. `plan`: the run's
    execution plan on this machine; on a GPU its attention path and E-update path are what the estimate counts
    (elsewhere the GPU's is not known: the larger of cuDNN SDPA and Triton, eager updates unless set true)."""
    d = run_cfg.deepspeed
    attention, fused = attention_path(model_cfg.attn_backend), None
    if plan is not None and plan.device == "cuda":
        layer = next((layer for layer in plan.layers if layer.carries_e), plan.layers[0])
        backend = layer.attention.backend(run_cfg.data.document_mask, grad=True)
        attention = attention_path(backend, "cuda", run_cfg.data.seq_len, layer.carries_e)
        fused = plan.fused_updates
    counts = parameter_counts(model_cfg, run_cfg.train.trainable)
    est = estimate_memory(
        model_cfg, seq_len=run_cfg.data.seq_len, micro_batch=run_cfg.train.micro_batch_size, world_size=world_size,
        zero_stage=d.zero_stage, trainable_params=counts.trainable, total_params=counts.total,
        activation_checkpointing=model_cfg.activation_checkpointing, offload_optimizer=d.offload_optimizer,
        offload_params=d.offload_params, fused_loss=model_cfg.loss_backend != "plain",
        lm_head_trainable=counts.head_trainable, sequence_parallel=run_cfg.parallel.sequence_parallel,
        tiled_mlp=model_cfg.tiled_mlp, precision=d.precision, largest_trainable=counts.largest_trainable,
        buffers=ZeroBuffers(reduce_bucket_size=d.reduce_bucket_size, overlap_comm=d.overlap_comm,
                            contiguous_gradients=d.contiguous_gradients,
                            stage3_prefetch_bucket_size=d.stage3_prefetch_bucket_size,
                            stage3_max_live_parameters=d.stage3_max_live_parameters),
        context_gib=context_gib, attention=attention, fused_updates=fused,
        context_parallel=run_cfg.parallel.context_parallel,
    )  # fmt: skip
    return est, counts


def activation_bytes(cfg: ModelConfig, batch: int, seq: int, checkpointing: bool, sequence_parallel: int = 1,
                     tiled_mlp: int | str = 0, bytes_per_value: int = 2, attention: str = "sdpa",
                     fused_updates: bool | None = None) -> int:
    """Peak activation bytes per rank: what the layers keep for backward, plus one layer's transients (its
    recompute and that recompute's backward under checkpointing, one MLP chunk's recompute when tiled, the
    all-to-all buffers). `attention`: the path attention takes (`attention_path`)."""
    n, p = sequence_parallel, bytes_per_value
    local = seq // n
    chunks = tile_count(tiled_mlp, local, cfg.d_model)
    layers = [
        layer_activation_bytes(cfg, batch, seq, p, cfg.updates_tape_state(i), chunks, n, attention=attention,
                               first_layer=i == 0, fused_updates=fused_updates)
        for i in range(cfg.n_layers)
    ]
    transient = tiled_mlp_peak_bytes(cfg, batch, local, chunks, p) + exchange_bytes(cfg, batch, seq, n, p)
    if checkpointing:
        state = cfg.n_heads * cfg.head_dim if cfg.pe == "tape" else 0
        kept = cfg.n_layers * batch * local * (cfg.d_model + state) * p
        return kept + max(layers) + recompute_backward_bytes(cfg, batch, local, p) + transient
    return sum(layers) + transient


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


def measure_layer_saved_bytes(model: torch.nn.Module, input_ids: torch.Tensor, layer: int = 0,
                              shard: SequenceShard | None = None) -> int:
    """Exact bytes autograd saves for backward in one decoder layer's training forward, on this rank: input_ids
    (B, T), or with a sequence shard this rank's slice (B, T/N) of whole sequences of T·N tokens, as
    `Transformer.forward` runs them. Storage-deduplicated, parameters excluded (`layer_activation_bytes`
    models it). The layers before `layer` run first, unmeasured, so that its input and TAPE's E are what training
    gives it (E then needs a gradient; layer 0's E^(0) does not)."""
    model.train()
    sharded_before = model.sequence_shard
    model.shard_sequence(shard)
    try:
        x, ctx, state = model.layer_inputs(input_ids)  # as Transformer.forward computes them
    finally:
        model.shard_sequence(sharded_before)
    x = x.detach().requires_grad_()
    for earlier in model.layers[:layer]:
        x, state = earlier(x, ctx, state, model.pe)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers[layer](x, ctx, state, model.pe)
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

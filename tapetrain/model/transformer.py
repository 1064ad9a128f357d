"""A Llama-style decoder with a choice of positional encoding, TAPE included. Plain single-device PyTorch.

Each layer carries two streams: token features x (B, T, C) and, for TAPE, the positional state E (B, T, M, D),
token-major (M = n_heads; see model/tape.py).

    h  = x + Attn(RMSNorm(x); E)        logits from q̃ = E^T q, k̃ = E^T k; values [V ‖ E] share one softmax
    E  = E + (A·E) ×_heads W_A           attention-side update
    m  = SwiGLU(RMSNorm(h)); x' = h + m
    E' = E + W_down(SiLU(W_x m) ⊙ W_up E) MLP-side update; the final E is dropped

Sequence parallelism (`Transformer.shard_sequence`, model/sequence_shard.py): the input is one rank's contiguous
slice of T/N tokens of every sequence, at its global positions. Only attention crosses ranks: q̃, k̃ and [V ‖ E]
go through the Ulysses exchange, attention runs on whole sequences for H/N heads, and W_A and the MLP-side update
act on the returned tokens with all their heads. Without a shard the same forward runs on `WHOLE_SEQUENCE`, the
group of one rank that holds every token.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tapetrain.model.abacus import AbacusEmbedding, check_places, digit_places, offset_places
from tapetrain.model.attention import attention, shifted_sparse_attention
from tapetrain.model.cache import KVCache, LayerCache
from tapetrain.model.config import ModelConfig
from tapetrain.model.documents import DocumentMask
from tapetrain.model.execution_plan import AttentionPlan, ExecutionPlan, portable_plan
from tapetrain.model.fire import FireBias
from tapetrain.model.loss import LMHead, cross_entropy
from tapetrain.model.positions import PositionalEncoding, PositionContext
from tapetrain.model.sequence_shard import (
    WHOLE_SEQUENCE,
    AttentionInputs,
    LocalAttention,
    SequenceShard,
    head_split,
    kept_tokens,
    local_tokens,
    whole_sequence_mean,
)
from tapetrain.model.tape import (
    TapeHeadMix,
    TapeHeadMixWithKernels,
    TapeMlpUpdateNonEquivariant,
    TapeMlpUpdateWithKernels,
    rotate_qk_by_state,
)
from tapetrain.model.tiling import tile_count, tiled


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # (B, T, V); None when the loss was computed without them (training, see loss.py)
    loss: torch.Tensor | None = None  # mean cross-entropy over labels != -100


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, as Hugging Face Llama does (bit-compatible import).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=False)
        # Qwen3: every head's q and k are RMS-normalised (one gain of D per projection) before the rotation.
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.scale = cfg.attention_scale  # None = 1/√D; YaRN/LongRoPE's temperature, on the logits only
        self.tape_mix = TapeHeadMixWithKernels(cfg.n_heads, cfg.tape_head_mix) if cfg.carries_e(layer) else None
        # What the execution plan decided for this layer (Transformer.use_plan): plain names, never re-derived.
        self.backends = AttentionPlan("sdpa", "sdpa", "sdpa")
        self.fused_updates = False

    def forward(
        self,
        x: torch.Tensor,
        ctx: PositionContext,
        state: torch.Tensor | None,
        pe: PositionalEncoding,
        cache: LayerCache | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, C), TAPE's state E (B, T, M, D) or None -> attention output (B, T, C), E after the update."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)  # (B, T, H, D)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim)  # (B, T, Hkv, D)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D) view
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        e_values = None  # E as extra value channels (B, S, M, D), for layers that update it
        if state is not None:
            # Everything stays token-major (keys expanded to the query heads); the backends take heads-first views.
            q, k = rotate_qk_by_state(q, k, state, self.fused_updates)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            e_values = state if self.tape_mix is not None else None
        else:
            q, k = pe.rotate_qk(q.transpose(1, 2), k.transpose(1, 2), ctx)
        if cache is not None:
            k, v, e_values = cache.append(k, v, e_values)
        grad = torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (q, k, v, e_values, ctx.bias))
        backend = self.backends.backend(ctx.docs is not None, grad)
        if ctx.shard.size > 1:
            out, attended = self._attend_sharded(q, k, v, e_values, ctx, backend)
        elif self.cfg.s2_attn and self.training and cache is None and ctx.docs is None:
            group = max(2, int(t * self.cfg.s2_attn_group_fraction))
            out, attended = shifted_sparse_attention(q, k, v, group, backend, self.scale), None
        else:
            out, attended = attention(
                q, k, v, None if e_values is None else e_values.transpose(1, 2),  # E as (B, M, S, D) view
                causal=self.cfg.causal, scale=self.scale, bias=ctx.bias,
                backend=backend, decay=ctx.xpos, **_docs(ctx),
            )
        out = self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
        if attended is not None:
            state = self.tape_mix(state, attended.transpose(1, 2))  # A·E back to token-major (B, T, M, D)
        return out, state

    def _attend_sharded(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, e_values: torch.Tensor | None, ctx: PositionContext,
        backend: str,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of this rank's T/N tokens through the shard's exchange (Ulysses).

        q (B, H, T/N, D), k (B, Hk, T/N, D), v (B, Hkv, T/N, D) heads-first views, already rotated; e_values TAPE's
        E (B, T/N, M, D) or None -> (A·V (B, H, T/N, D), A·E (B, M, T/N, D) or None), heads-first views like
        `attention`'s. Keys and values go with their own heads when N divides their count; otherwise, and always
        for values that carry E (which has a row per query head), they are expanded to the query heads first.
        Inside, ctx.bias holds this rank's heads and ctx.xpos the whole sequence's positions.
        """
        shard, dv = ctx.shard, self.head_dim
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # token-major (B, T/N, ·, D) views
        split = head_split(shard)  # the ranks the heads are split over (a ring's are not)
        if k.shape[2] % split:
            k = k.repeat_interleave(self.n_heads // k.shape[2], dim=2)
        if e_values is not None or v.shape[2] % split:
            v = v.repeat_interleave(self.n_heads // v.shape[2], dim=2)
        values = v if e_values is None else torch.cat([v, e_values], dim=-1)  # (B, T/N, Hv, D [+ D])

        def local_attention(q_all: torch.Tensor, k_all: torch.Tensor, values_all: torch.Tensor) -> torch.Tensor:
            # whole sequences of this rank's heads, token-major (B, T, h, ·) -> [A·V ‖ A·E] (B, T, h, D [+ D])
            v_all, e_all = (values_all, None) if e_values is None else (values_all[..., :dv], values_all[..., dv:])
            out, out_e = attention(
                q_all.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2),
                None if e_all is None else e_all.transpose(1, 2),
                causal=self.cfg.causal, scale=self.scale, bias=ctx.bias, backend=backend,
                decay=ctx.xpos, **_docs(ctx),
            )
            out = out.transpose(1, 2)
            return out if out_e is None else torch.cat([out, out_e.transpose(1, 2)], dim=-1)

        inputs = AttentionInputs(self.cfg.causal, self.scale, ctx.bias, ctx.xpos, ctx.docs)  # for a ring's blocks
        out = shard.attend(LocalAttention(local_attention, inputs), q, k, values)  # (B, T/N, H, D [+ D]): all heads
        if e_values is None:
            return out.transpose(1, 2), None
        return out[..., :dv].transpose(1, 2), out[..., dv:].transpose(1, 2)


def _docs(ctx: PositionContext) -> dict:
    """The attention call's docs keyword, only with a document mask (calls without one stay as they were)."""
    return {} if ctx.docs is None else {"docs": ctx.docs}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        # The final E is dropped, so the last layer's E updates could never affect the output: not created
        # (dead parameters would only get None gradients). model.tape_layers limits the updates to some layers.
        updates_state = cfg.updates_tape_state(layer)
        self.tiled_mlp = cfg.tiled_mlp
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_dim)
        self.tape_mlp: nn.Module | None = None
        if updates_state and cfg.tape_mlp_update and cfg.tape_equivariant:
            self.tape_mlp = TapeMlpUpdateWithKernels(cfg.d_model, cfg.n_heads, cfg.tape_dim)
        elif updates_state and cfg.tape_mlp_update:  # the ablation without equivariance (no fused kernel)
            self.tape_mlp = TapeMlpUpdateNonEquivariant(cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.tape_dim)
        # FIRE, as the paper's baseline: one bias module per layer (model.fire_shared: one in PositionalEncoding).
        self.fire = FireBias(cfg.n_heads, cfg.fire_hidden, cfg.fire_init_c, cfg.fire_init_threshold) if (
            cfg.pe == "fire" and not cfg.fire_shared) else None

    def forward(
        self,
        x: torch.Tensor,
        ctx: PositionContext,
        state: torch.Tensor | None,
        pe: PositionalEncoding,
        cache: LayerCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, C), TAPE's state E (B, T, M, D) or None -> both after this layer."""
        if self.fire is not None:  # with N > 1 ranks: the whole sequence, this rank's heads
            bias = ctx.own_heads(self.fire(ctx.query_positions, ctx.key_positions))
            ctx = dataclasses.replace(ctx, bias=bias.to(x.dtype))
        attn_out, state = self.attn(self.attn_norm(x), ctx, state, pe, cache)
        x = x + attn_out
        chunks = tile_count(self.tiled_mlp, x.shape[1], x.shape[2])  # model.tiled_mlp (model/tiling.py)
        if self.tape_mlp is None:
            (mlp_out,) = tiled(self._mlp, (self.mlp_norm(x),), chunks)
        else:
            mlp_out, state = tiled(self._mlp_and_tape, (self.mlp_norm(x), state), chunks)
        return x + mlp_out, state

    def _mlp(self, h: torch.Tensor) -> tuple[torch.Tensor]:
        """Normalised h (B, t, C) -> (m (B, t, C),): the MLP of a chunk of t tokens."""
        return (self.mlp(h),)

    def _mlp_and_tape(self, h: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised h (B, t, C), E (B, t, M, D) -> m (B, t, C), E' (B, t, M, D): MLP and TAPE's update, per token."""
        mlp_out = self.mlp(h)
        return mlp_out, self.tape_mlp(state, mlp_out)  # conditioned on the MLP output m, not its input


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: ExecutionPlan | None = None):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.abacus = AbacusEmbedding(cfg.abacus_max_places, cfg.d_model) if cfg.abacus else None  # model.abacus
        self.pe = PositionalEncoding(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size, loss_backend=cfg.loss_backend, chunk_mib=cfg.loss_chunk_mib)
        self.sequence_shard: SequenceShard | None = None  # set by shard_sequence
        self.plan = portable_plan(cfg)
        self.use_plan(plan or self.plan)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        if cfg.compile:
            self.compile_layers()

    def use_plan(self, plan: ExecutionPlan) -> None:
        """Run what `plan` decided (model/execution_plan.py): each layer's attention backends and E-update path,
        and the loss. Plain values, set once; nothing in a forward decides again. Callers resolve the plan for
        their device and dtype (`resolve_plan`) after building the model; until then it runs `portable_plan`."""
        if len(plan.layers) != len(self.layers):
            raise ValueError(f"the plan has {len(plan.layers)} layers, the model {len(self.layers)}")
        self.plan = plan
        for layer, decided in zip(self.layers, plan.layers, strict=True):
            layer.attn.backends = decided.attention
            layer.attn.fused_updates = decided.fused_updates
            for module in (layer.attn.tape_mix, layer.tape_mlp):
                if isinstance(module, (TapeHeadMixWithKernels, TapeMlpUpdateWithKernels)):
                    module.fused = decided.fused_updates
        if isinstance(self.lm_head, LMHead):
            self.lm_head.loss_backend = plan.loss

    def shard_sequence(self, shard: SequenceShard | None) -> None:
        """Sequence parallelism from now on (None: off). Every forward then takes this rank's contiguous slice of
        T/N tokens of each sequence (input_ids and labels (B, T/N), labels shifted before slicing), computes at
        their global positions, returns logits for its slice, and a loss that is the mean over the whole sequences
        (see `forward`). Training and evaluation alike; no KV cache (sharded generation recomputes every step,
        tapetrain.eval.sequence_parallel)."""
        self.sequence_shard = shard

    def compile_layers(self) -> None:
        """torch.compile every decoder layer in place (parameter names unchanged). Layers are where the
        elementwise work is (norms, rotations, SwiGLU, TAPE's updates); the attention kernels stay opaque ops."""
        for layer in self.layers:
            layer.compile()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) for projections and embeddings; TAPE's W_A and W_down at zero (RoPE twin at init)."""
        for module in self.modules():
            self.init_module(module)

    def init_module(self, module: nn.Module) -> None:
        """Initialise one module's own parameters (not its children's). Callers that shard parameters (ZeRO-3)
        gather one module at a time and call this, so the model never has to exist whole on one rank."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.cfg.init_std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, TapeHeadMix):
            nn.init.zeros_(module.weight)
        elif isinstance(module, FireBias):
            module.reset_scalars()
        if isinstance(module, nn.Linear) and getattr(module, "zero_init", False):
            nn.init.zeros_(module.weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        position_offset: int = 0,
        cache: KVCache | None = None,
        tape_state: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        doc_ids: torch.Tensor | None = None,
        abacus_offsets: torch.Tensor | None = None,
    ) -> ModelOutput:
        """input_ids (B, T); labels (B, T) aligned with the inputs (already shifted; -100 = ignore). With labels the
        loss is computed by model.loss_backend and logits are None (except the plain backend).

        positions (B, T) or (T,) overrides the default positions (past + arange(T) + position_offset);
        tape_state (B, T, M, D) overrides TAPE's E^(0) (tests of the O(2) property use it).
        logits_to_keep > 0 computes the logits of the last that many positions only, (B, keep, V): a long prompt's
        prefill needs one row, not T rows of V.
        doc_ids (B, T) int (data.document_mask): packed documents, contiguous runs of equal ids; positions restart
        at 0 (+ position_offset) at every document start and attention stays inside each document, so every
        document computes what it would alone (RandPE: one draw per document). Not with a cache or explicit positions.
        abacus_offsets (B,) int (model.abacus): the training offsets of the digits' places (the trainer passes
        `abacus_offsets` of the samples' slots); None = drawn from torch's RNG while training, none in eval mode.

        One forward for every layout: without a shard (`shard_sequence`) the model is the one rank of
        `WHOLE_SEQUENCE`. With a shard of N ranks input_ids and labels are this rank's slice (B, T/N); positions and
        doc_ids, if given, stay the whole sequences' (B, T). The loss's value is then the mean over the whole
        sequences' labels (the same on every rank of the group) and its gradient this slice's share of it
        (`whole_sequence_mean`). logits_to_keep keeps this rank's part of the whole sequences' last that many
        positions (B, k, V), k = 0 on ranks that hold none of them.
        """
        shard = WHOLE_SEQUENCE if self.sequence_shard is None else self.sequence_shard
        b, t = input_ids.shape
        x, ctx, state = self.layer_inputs(input_ids, positions=positions, position_offset=position_offset, cache=cache,
                                          tape_state=tape_state, doc_ids=doc_ids, abacus_offsets=abacus_offsets)
        hidden = self._decode(x, ctx, state, cache)  # (B, T/N, C)
        if labels is None:
            return ModelOutput(logits=self.lm_head(hidden[:, kept_tokens(shard, t, logits_to_keep)]))
        if isinstance(self.lm_head, LMHead) and self.lm_head.loss_backend != "plain":
            # Fused loss inside lm_head's forward (ZeRO-3 gathers its weight there); no (B, T, V) logits.
            # (A LoRA-wrapped lm_head is no LMHead and takes the plain path.)
            loss = whole_sequence_mean(shard, labels, lambda count: self.lm_head(hidden, labels, count=count))
            return ModelOutput(logits=None, loss=loss)
        logits = self.lm_head(hidden)
        return ModelOutput(logits=logits, loss=whole_sequence_mean(
            shard, labels, lambda count: cross_entropy(logits, labels, count)))

    def layer_inputs(
        self, input_ids: torch.Tensor, *, positions: torch.Tensor | None = None, position_offset: int = 0,
        cache: KVCache | None = None, tape_state: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
        abacus_offsets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, PositionContext, torch.Tensor | None]:
        """What the first decoder layer takes, as `forward` computes it (arguments as there): the embeddings
        x (B, T/N, C), the positional context and TAPE's E^(0) (B, T/N, M, D) or None. The memory model measures one
        layer on exactly these."""
        shard = WHOLE_SEQUENCE if self.sequence_shard is None else self.sequence_shard
        b, t = input_ids.shape
        self._check_inputs(input_ids, shard, positions, cache, tape_state, doc_ids)
        whole, docs, sample = self._positions(b, t * shard.size, positions, position_offset, cache, doc_ids, shard,
                                              input_ids.device)  # (B, T) float64: the whole sequences'
        key_positions = cache.extend_positions(whole) if cache is not None else whole  # (B, S)
        x = self.embed(input_ids)  # (B, T/N, C)
        if self.abacus is not None:
            x = x + self._abacus_embedding(input_ids, cache, abacus_offsets, shard)
        ctx = self.pe.context(whole[:, local_tokens(shard, whole.shape[1])], key_positions, x.dtype, sample, shard,
                              docs)
        return x, ctx, tape_state if tape_state is not None else ctx.tape_init

    def _abacus_embedding(self, input_ids: torch.Tensor, cache: KVCache | None, offsets: torch.Tensor | None,
                          shard: SequenceShard) -> torch.Tensor:
        """The digits' place embeddings (B, T, C) (model/abacus.py); a number begun in the cache keeps counting."""
        if shard.size > 1:
            raise ValueError("model.abacus counts digit places along whole sequences; it does not run with sequence "
                             "parallelism (set parallel.sequence_parallel=1)")
        digit_ids = torch.tensor(self.cfg.abacus_digit_ids, device=input_ids.device)
        places = digit_places(torch.isin(input_ids, digit_ids), cache.abacus_carry if cache is not None else None)
        if cache is not None:
            cache.abacus_carry = places[:, -1]  # (B,) the place of the last cached token
        if offsets is None and self.training and self.cfg.abacus_train_offset > 1:
            offsets = torch.randint(0, self.cfg.abacus_train_offset, (input_ids.shape[0],), device=input_ids.device)
        places = offset_places(places, offsets if self.training else None)
        check_places(places, self.cfg.abacus_max_places)
        return self.abacus(places)

    def _positions(
        self, batch: int, length: int, positions: torch.Tensor | None, offset: int, cache: KVCache | None,
        doc_ids: torch.Tensor | None, shard: SequenceShard, device: torch.device,
    ) -> tuple[torch.Tensor, DocumentMask | None, bool]:
        """The whole sequences' positions (B, length) float64, their documents, and whether randpe drew them."""
        sample = positions is None and cache is None and self.pe.samples_positions  # randpe's random positions
        if doc_ids is not None:
            docs = DocumentMask.of(doc_ids.expand(batch, length))
            return self.pe.document_positions(docs, offset, sample, shard), docs, sample
        if positions is None:
            past = cache.length if cache is not None else 0
            return self.pe.default_positions(batch, length, past, offset, device, sample, shard), None, sample
        return positions.to(torch.float64).expand(batch, length), None, sample

    def _check_inputs(self, input_ids: torch.Tensor, shard: SequenceShard, positions: torch.Tensor | None,
                      cache: KVCache | None, tape_state: torch.Tensor | None, doc_ids: torch.Tensor | None) -> None:
        b, t = input_ids.shape
        if doc_ids is not None:
            self._check_documents(doc_ids, positions, cache, t * shard.size)
        if shard.size > 1 and (cache is not None or tape_state is not None):
            raise ValueError("a sequence-parallel forward takes no KV cache and no tape_state; generate and test "
                             "the O(2) property without a sequence shard (shard_sequence(None))")
        self._check_ids(input_ids)
        if tape_state is not None and tape_state.shape != (b, t, self.cfg.n_heads, self.cfg.head_dim):
            raise ValueError(
                f"tape_state has shape {tuple(tape_state.shape)}; it must be token-major (B, T, M, D) = "
                f"({b}, {t}, {self.cfg.n_heads}, {self.cfg.head_dim}), the layout of PositionContext.tape_init"
            )

    def _check_ids(self, input_ids: torch.Tensor) -> None:
        # Host-side check only: on an accelerator this read would synchronise every micro-step, and there the data
        # readers (PackedDataset, eval token files) already refuse ids >= vocab_size when a window is read.
        if input_ids.device.type == "cpu" and input_ids.numel() and int(input_ids.max()) >= self.cfg.vocab_size:
            raise ValueError(
                f"token id {int(input_ids.max())} >= model.vocab_size={self.cfg.vocab_size}: the data was "
                "tokenized with a different tokenizer; re-run prepare or fix model.vocab_size"
            )

    def _check_documents(self, doc_ids: torch.Tensor, positions: torch.Tensor | None, cache: KVCache | None,
                         length: int) -> None:
        if cache is not None or positions is not None:
            raise ValueError("doc_ids (the document mask) sets positions itself and takes no KV cache; generate one "
                             "document at a time without doc_ids")
        if self.cfg.s2_attn and self.training:
            raise ValueError("doc_ids with model.s2_attn: shifted sparse attention has no document mask")
        if doc_ids.shape[-1] != length:
            raise ValueError(f"doc_ids are the whole sequences' ({length} tokens, with sequence parallelism too), "
                             f"got {doc_ids.shape[-1]}")

    def _decode(self, x: torch.Tensor, ctx: PositionContext, state: torch.Tensor | None,
                cache: KVCache | None) -> torch.Tensor:
        """The decoder layers and the final norm: embeddings (B, T, C) -> hidden states (B, T, C)."""
        use_checkpoint = self.cfg.activation_checkpointing and self.training and cache is None
        for i, layer in enumerate(self.layers):
            layer_cache = cache.layers[i] if cache is not None else None
            if use_checkpoint:
                x, state = checkpoint(layer, x, ctx, state, self.pe, layer_cache, use_reentrant=False)
            else:
                x, state = layer(x, ctx, state, self.pe, layer_cache)
        return self.norm(x)

    # ---- bookkeeping -------------------------------------------------------------------------------------------

    def num_params(self, trainable_only: bool = False) -> int:
        params = {id(p): p for p in self.parameters() if p.requires_grad or not trainable_only}
        return sum(p.numel() for p in params.values())

    def tape_params(self) -> int:
        return sum(p.numel() for n, p in self.named_parameters() if "tape" in n)

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """Model FLOPs per token (PaLM/nanoGPT convention: 2·matmul params + full-context attention, ×3 to train).

        Attention: QKᵀ and A·V cost 2·2·H·D·T per token per layer; TAPE adds A·E (another 2·H·D·T), its head mix
        (2·H²·D), the MLP update (2·C·I + 4·I·H·D + I·D) and the state rotation of q and k (~12·H·D).
        """
        cfg = self.cfg
        h, d, hk, c = cfg.n_heads, cfg.head_dim, cfg.kv_heads, cfg.d_model
        per_layer = 2 * (2 * c * h * d + 2 * c * hk * d + 3 * c * cfg.ffn_dim)
        per_layer += 4 * h * d * seq_len
        updating = 0  # TAPE's state updates, present in every layer but the last
        if cfg.pe == "tape":
            per_layer += 12 * h * d
            if cfg.tape_attn_update:
                updating += 2 * h * d * seq_len + 2 * h * h * d
            if cfg.tape_mlp_update:
                i = cfg.tape_dim
                updating += 2 * c * i + 4 * i * h * d + i * d
        n_updating = sum(cfg.updates_tape_state(i) for i in range(cfg.n_layers))
        forward = cfg.n_layers * per_layer + n_updating * updating + 2 * c * cfg.vocab_size
        return float(3 * forward if training else forward)

    # ---- generation --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_id: int | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Greedy (temperature 0) or sampled continuation; returns (B, T + new) ids. Stops early when every row
        has produced eos_id (rows that finished are padded with eos_id)."""
        was_training = self.training
        self.eval()
        cache = KVCache(self.cfg.n_layers) if use_cache else None
        ids = input_ids
        finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        step_input = ids
        for _ in range(max_new_tokens):
            logits = self(step_input if use_cache else ids, cache=cache, logits_to_keep=1).logits[:, -1, :].float()
            next_id = sample_next(logits, temperature, top_k, top_p, generator)
            if eos_id is not None:
                next_id = torch.where(finished, torch.full_like(next_id, eos_id), next_id)
                finished |= next_id == eos_id
            ids = torch.cat([ids, next_id[:, None]], dim=1)
            step_input = next_id[:, None]
            if eos_id is not None and bool(finished.all()):
                break
        self.train(was_training)
        return ids


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """(B, V) logits -> (B,) next ids."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the first token past top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def estimate_mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the device's peak."""
    return flops_per_token * tokens_per_s / peak_flops if peak_flops > 0 else math.nan

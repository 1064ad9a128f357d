"""A Llama-style decoder with a choice of positional encoding, TAPE included. Plain single-device PyTorch.

Each layer carries two streams: token features x (B, T, C) and, for TAPE, the positional state E (B, T, M, D),
token-major (M = n_heads; see model/tape.py).

    h  = x + Attn(RMSNorm(x); E)        logits from q̃ = E^T q, k̃ = E^T k; values [V ‖ E] share one softmax
    E  = E + (A·E) ×_heads W_A           attention-side update
    m  = SwiGLU(RMSNorm(h)); x' = h + m
    E' = E + W_down(SiLU(W_x m) ⊙ W_up E) MLP-side update; the final E is dropped
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tapetrain.model.attention import attention, shifted_sparse_attention
from tapetrain.model.cache import KVCache, LayerCache
from tapetrain.model.config import ModelConfig
from tapetrain.model.fire import FireBias
from tapetrain.model.loss import IGNORE_INDEX, LMHead, upcast
from tapetrain.model.positions import PositionalEncoding, PositionContext
from tapetrain.model.tape import TapeHeadMix, TapeMlpUpdate, TapeMlpUpdateNonEquivariant, rotate_by_state


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
    def __init__(self, cfg: ModelConfig, updates_state: bool):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=False)
        self.tape_mix = (
            TapeHeadMix(cfg.n_heads, cfg.tape_head_mix)
            if cfg.pe == "tape" and cfg.tape_attn_update and updates_state
            else None
        )

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
        e_values = None  # E as extra value channels (B, S, M, D), for layers that update it
        if state is not None:
            # E (B, T, M, D) is per query head, so keys are expanded to query heads before rotation (GQA memory
            # cost: H/Hkv). Everything stays token-major; the attention backends take heads-first views.
            groups = self.n_heads // self.n_kv
            k = rotate_by_state(k.repeat_interleave(groups, dim=2) if groups > 1 else k, state).transpose(1, 2)
            q = rotate_by_state(q, state).transpose(1, 2)
            e_values = state if self.tape_mix is not None else None
        else:
            q, k = pe.rotate_qk(q.transpose(1, 2), k.transpose(1, 2), ctx)
        if cache is not None:
            k, v, e_values = cache.append(k, v, e_values)
        e_values = e_values.transpose(1, 2) if e_values is not None else None  # (B, M, S, D) view
        if self.cfg.s2_attn and self.training and cache is None:
            group = max(2, int(t * self.cfg.s2_attn_group_fraction))
            out, attended = shifted_sparse_attention(q, k, v, group, self.cfg.attn_backend), None
        else:
            out, attended = attention(
                q, k, v, e_values, causal=self.cfg.causal, bias=ctx.bias, backend=self.cfg.attn_backend,
                decay=ctx.xpos,
            )
        out = self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
        if attended is not None:
            state = self.tape_mix(state, attended.transpose(1, 2))  # A·E back to token-major (B, T, M, D)
        return out, state


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        # The final E is dropped, so the last layer's E updates could never affect the output: not created
        # (dead parameters would only get None gradients). model.tape_layers limits the updates to some layers.
        updates_state = cfg.updates_tape_state(layer)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, updates_state)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_dim)
        self.tape_mlp = (
            TapeMlpUpdate(cfg.d_model, cfg.n_heads, cfg.tape_dim) if updates_state and cfg.tape_mlp_update else None
        )
        if self.tape_mlp is not None and not cfg.tape_equivariant:  # the ablation without equivariance
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
        if self.fire is not None:
            ctx = dataclasses.replace(ctx, bias=self.fire(ctx.positions, ctx.key_positions).to(x.dtype))
        attn_out, state = self.attn(self.attn_norm(x), ctx, state, pe, cache)
        x = x + attn_out
        mlp_out = self.mlp(self.mlp_norm(x))
        x = x + mlp_out
        if self.tape_mlp is not None:
            state = self.tape_mlp(state, mlp_out)  # conditioned on the MLP output m, not its input
        return x, state


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pe = PositionalEncoding(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size, loss_backend=cfg.loss_backend, chunk_mib=cfg.loss_chunk_mib)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        if cfg.compile:
            self.compile_layers()

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
    ) -> ModelOutput:
        """input_ids (B, T); labels (B, T) aligned with the inputs (already shifted; -100 = ignore). With labels the
        loss is computed by model.loss_backend and logits are None (except the plain backend).

        positions (B, T) or (T,) overrides the default positions (past + arange(T) + position_offset);
        tape_state (B, T, M, D) overrides TAPE's E^(0) (tests of the O(2) property use it).
        logits_to_keep > 0 computes the logits of the last that many positions only, (B, keep, V): a long prompt's
        prefill needs one row, not T rows of V.
        """
        b, t = input_ids.shape
        # Host-side check only: on an accelerator this read would synchronise every micro-step, and there the data
        # readers (PackedDataset, eval token files) already refuse ids >= vocab_size when a window is read.
        if input_ids.device.type == "cpu" and input_ids.numel() and int(input_ids.max()) >= self.cfg.vocab_size:
            raise ValueError(
                f"token id {int(input_ids.max())} >= model.vocab_size={self.cfg.vocab_size}: the data was "
                "tokenized with a different tokenizer; re-run prepare or fix model.vocab_size"
            )
        past = cache.length if cache is not None else 0
        sample = positions is None and cache is None and self.pe.samples_positions  # randpe's random positions
        if positions is None:
            positions = self.pe.default_positions(b, t, past, position_offset, input_ids.device, sample)
        else:
            positions = positions.to(torch.float64).expand(b, t)
        key_positions = cache.extend_positions(positions) if cache is not None else positions
        x = self.embed(input_ids)
        ctx = self.pe.context(positions, key_positions, x.dtype, sample)
        if tape_state is not None and tape_state.shape != (b, t, self.cfg.n_heads, self.cfg.head_dim):
            raise ValueError(
                f"tape_state has shape {tuple(tape_state.shape)}; it must be token-major (B, T, M, D) = "
                f"({b}, {t}, {self.cfg.n_heads}, {self.cfg.head_dim}), the layout of PositionContext.tape_init"
            )
        state = tape_state if tape_state is not None else ctx.tape_init  # (B, T, M, D)
        use_checkpoint = self.cfg.activation_checkpointing and self.training and cache is None
        for i, layer in enumerate(self.layers):
            layer_cache = cache.layers[i] if cache is not None else None
            if use_checkpoint:
                x, state = checkpoint(layer, x, ctx, state, self.pe, layer_cache, use_reentrant=False)
            else:
                x, state = layer(x, ctx, state, self.pe, layer_cache)
        hidden = self.norm(x)  # (B, T, C)
        if labels is not None and isinstance(self.lm_head, LMHead) and self.lm_head.loss_backend != "plain":
            # Fused loss inside lm_head's forward (ZeRO-3 gathers its weight there); no (B, T, V) logits.
            # (A LoRA-wrapped lm_head is no LMHead and takes the plain path.)
            return ModelOutput(logits=None, loss=self.lm_head(hidden, labels))
        if logits_to_keep > 0 and labels is None:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(upcast(logits).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        return ModelOutput(logits=logits, loss=loss)

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

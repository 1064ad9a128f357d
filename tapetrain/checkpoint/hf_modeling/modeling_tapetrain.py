"""A tapetrain decoder (TAPE or a baseline positional encoding) as a Hugging Face causal LM.

Self-contained remote code: `tapetrain export-hf` copies this file and configuration_tapetrain.py next to the
weights, and `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` loads it where tapetrain is not
installed. It re-implements exactly what tapetrain/model computes (the export verifies the logits):

    h  = x + Attn(RMSNorm(x); E)         TAPE logits from q̃ = E^T q, k̃ = E^T k; values [V ‖ E] share one softmax
    E  = E + (A·E) ×_heads W_A            attention-side update
    m  = SwiGLU(RMSNorm(h)); x' = h + m
    E' = E + W_down(SiLU(W_x m) ⊙ W_up E) MLP-side update; the final E is dropped

E is (B, M, T, D) per head and token: F = D/2 rotate-half blocks (c, s) stored as [c ‖ s]; E^(0) is RoPE.
Generation caches rotated keys, values, TAPE's E and the token positions per layer (`TapetrainCache`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_tapetrain import TapetrainConfig

ROTARY = ("rope", "randpe", "xpos")

# ---- positions ---------------------------------------------------------------------------------------------------


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float, pi_factor: float):
    """cos, sin of t·θ_f (t = position / pi_factor, θ_f = theta^(−2f/D)): (B, T) -> (B, T, F), float64.

    float64 because fp32 angles at positions in the thousands are off by ~1e-4 rad.
    """
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = (positions.to(torch.float64) / pi_factor)[..., None] * freqs
    return torch.cos(angles), torch.sin(angles)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the rotate-half pairs (i, i + D/2) of x (..., D) by blocks (cos, sin) (..., D/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotate_by_state(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """x̃ = E^T x blockwise; x, E (B, M, T, D) with E = [c ‖ s]."""
    half = state.shape[-1] // 2
    return rotate_pairs(x, state[..., :half], state[..., half:])


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's geometric head slopes, with the standard interleave for non-powers of two; (H,) float64."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_two(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float64)


class FireBias(nn.Module):
    """FIRE: bias_h(i, j) = f_θ(ψ(i − j) / ψ(max(L, i))), ψ(x) = log(c·x + 1); f_θ a 1 -> hidden -> H MLP."""

    def __init__(self, n_heads: int, hidden: int, init_threshold: float):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, n_heads))
        self.log_c = nn.Parameter(torch.zeros(1))
        self.threshold = nn.Parameter(torch.full((1,), float(init_threshold)))  # (1,): no 0-dim (DeepSpeed)

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """(B, T), (B, S) positions -> (B, H, T, S) bias (causal: future distances clamp to 0, then masked)."""
        c = self.log_c.exp()
        rel = (q_pos[:, :, None] - k_pos[:, None, :]).clamp(min=0)  # (B, T, S)
        denom = torch.log(c * torch.maximum(self.threshold.abs(), q_pos.to(c.dtype)) + 1)[:, :, None]
        normalised = torch.log(c * rel.to(c.dtype) + 1) / denom
        return self.mlp(normalised[..., None]).permute(0, 3, 1, 2)


class PositionModule(nn.Module):
    """Holds the learned positional parameters (FIRE's bias MLP); the other encodings have none."""

    def __init__(self, config: TapetrainConfig):
        super().__init__()
        if config.pe == "fire":
            self.fire = FireBias(config.num_attention_heads, config.fire_hidden, config.max_position_embeddings)


class PositionContext:
    """Per-forward positional inputs shared by all layers (see tapetrain.model.positions).

    cos, sin (B, 1, T, F); q_scale/k_scale (B, 1, T, D) for xpos; bias (B, H, T, S) for alibi/fire;
    tape_init (B, H, T, D) = E^(0).
    """

    def __init__(self):
        self.cos = self.sin = self.q_scale = self.k_scale = self.bias = self.tape_init = None


def position_context(
    config: TapetrainConfig, positions: torch.Tensor, key_positions: torch.Tensor, dtype, pe_module: PositionModule
) -> PositionContext:
    """positions (B, T), key_positions (B, S), both float64."""
    ctx = PositionContext()
    pe, d = config.pe, config.head_dim
    if pe in ("rope", "randpe", "xpos", "tape"):
        cos, sin = rope_angles(positions, d, config.rope_theta, config.pi_factor)  # (B, T, F)
        if pe == "tape":
            e0 = torch.cat([cos, sin], dim=-1).to(dtype)  # (B, T, D)
            ctx.tape_init = e0[:, None].expand(-1, config.num_attention_heads, -1, -1)
        else:
            ctx.cos, ctx.sin = cos[:, None].to(dtype), sin[:, None].to(dtype)
    if pe == "xpos":
        zeta = (torch.arange(0, d, 2, dtype=torch.float64, device=positions.device) + 0.4 * d) / (1.4 * d)
        zeta = torch.cat([zeta, zeta])
        power = (positions / config.xpos_scale_base)[..., None]  # (B, T, 1)
        ctx.q_scale = (zeta**power)[:, None].to(dtype)
        ctx.k_scale = (zeta ** (-power))[:, None].to(dtype)
    if pe == "alibi":
        slopes = alibi_slopes(config.num_attention_heads).to(positions.device)
        dist = (positions[:, :, None] - key_positions[:, None, :]).clamp(min=0)  # (B, T, S)
        ctx.bias = (-slopes[None, :, None, None] * dist[:, None]).to(dtype)
    if pe == "fire":
        ctx.bias = pe_module.fire(positions, key_positions).to(dtype)
    return ctx


# ---- cache -------------------------------------------------------------------------------------------------------


class TapetrainCache(DynamicCache):
    """DynamicCache of rotated keys (per query head for TAPE) and values, plus TAPE's state E of the cached
    tokens per layer (one more value stream, (B, H, S, D)) and their positions (B, S) float64 (ALiBi/FIRE)."""

    def __init__(self):
        super().__init__()
        self.states: dict[int, torch.Tensor] = {}
        self.positions: torch.Tensor | None = None

    def update_state(self, state: torch.Tensor, layer_idx: int) -> torch.Tensor:
        old = self.states.get(layer_idx)
        self.states[layer_idx] = state if old is None else torch.cat([old, state], dim=-2)
        return self.states[layer_idx]

    def extend_positions(self, new: torch.Tensor) -> torch.Tensor:
        self.positions = new if self.positions is None else torch.cat([self.positions, new], dim=1)
        return self.positions

    def _map_batch(self, fn) -> None:
        self.states = {i: fn(s) for i, s in self.states.items()}
        if self.positions is not None:
            self.positions = fn(self.positions)

    def reorder_cache(self, beam_idx: torch.LongTensor):
        super().reorder_cache(beam_idx)
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor):
        super().batch_select_indices(indices)
        self._map_batch(lambda t: t[indices])

    def crop(self, *args, **kwargs):
        super().crop(*args, **kwargs)
        length = self.get_seq_length()
        self.states = {i: s[..., :length, :] for i, s in self.states.items()}
        if self.positions is not None:
            self.positions = self.positions[:, :length]


def as_tapetrain_cache(past_key_values) -> TapetrainCache:
    if past_key_values is None:
        return TapetrainCache()
    if isinstance(past_key_values, TapetrainCache):
        return past_key_values
    if isinstance(past_key_values, Cache) and past_key_values.get_seq_length() == 0:
        return TapetrainCache()  # an empty generic cache (e.g. made by generate): ours replaces it
    raise ValueError(
        f"past_key_values is a {type(past_key_values).__name__}; this model needs its own TapetrainCache (it also "
        "caches TAPE's positional state): pass None and reuse the past_key_values the model returns"
    )


# ---- layers ------------------------------------------------------------------------------------------------------


def expand_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, Hx, S, D) -> (B, n_heads, S, D), repeating each head (grouped-query attention)."""
    groups = n_heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def causal_mask(t: int, s: int, device) -> torch.Tensor:
    """(T, S) bool, True where allowed; bottom-right aligned (query t sits at key position S − T + t)."""
    return torch.arange(s, device=device)[None, :] <= torch.arange(s - t, s, device=device)[:, None]


def attention(q, k, v, e=None, bias=None, key_mask=None):
    """One softmax over values [V ‖ E]: q (B, H, T, D), k (B, Hk, S, D), v (B, Hkv, S, D), e (B, H, S, D) or None,
    bias (B, H, T, S), key_mask (B, S) bool (False = padding). Returns (A·V, A·E or None)."""
    n_heads, t, s = q.shape[1], q.shape[2], k.shape[2]
    k = expand_heads(k, n_heads)
    dv = v.shape[-1]
    values = expand_heads(v, n_heads) if e is None else torch.cat([expand_heads(v, n_heads), e], dim=-1)
    mask, is_causal = None, False
    if key_mask is not None:
        # Padding: a large finite negative keeps fully masked (padding) query rows finite instead of NaN.
        allowed = key_mask[:, None, None, :] & causal_mask(t, s, q.device)
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
        mask = mask.masked_fill(~allowed, torch.finfo(q.dtype).min)
        if bias is not None:
            mask = mask + bias
    elif bias is not None:
        mask = bias.masked_fill(~causal_mask(t, s, q.device), float("-inf")) if t > 1 else bias
    elif t > 1:
        if t == s:
            is_causal = True
        else:
            mask = causal_mask(t, s, q.device)
    out = F.scaled_dot_product_attention(q, k, values, attn_mask=mask, is_causal=is_causal)
    return (out, None) if e is None else (out[..., :dv], out[..., dv:])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TapeHeadMix(nn.Module):
    """E ← E + (A·E) ×_heads W_A; W_A (M, M) ('full') or a per-head gain (M,) ('gain')."""

    def __init__(self, n_heads: int, mode: str):
        super().__init__()
        self.mode = mode
        self.weight = nn.Parameter(torch.zeros((n_heads, n_heads) if mode == "full" else (n_heads,)))

    def forward(self, state: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        if self.mode == "full":
            mixed = torch.einsum("bgtd,hg->bhtd", attended, self.weight.to(attended.dtype))
        else:
            mixed = attended * self.weight.to(attended.dtype)[None, :, None, None]
        return state + mixed


class TapeMlpUpdate(nn.Module):
    """E ← E + W_down · (SiLU(W_x · m) ⊙ (W_up · E)), contractions over heads; m (B, T, C) the MLP output."""

    def __init__(self, hidden_size: int, n_heads: int, channels: int):
        super().__init__()
        self.x_proj = nn.Linear(hidden_size, channels, bias=False)
        self.up_proj = nn.Linear(n_heads, channels, bias=False)
        self.down_proj = nn.Linear(channels, n_heads, bias=False)

    def forward(self, state: torch.Tensor, mlp_out: torch.Tensor) -> torch.Tensor:
        gate = F.silu(self.x_proj(mlp_out))  # (B, T, I)
        up = torch.einsum("bmtd,im->bitd", state, self.up_proj.weight)  # (B, I, T, D)
        hidden = up * gate.transpose(1, 2)[..., None]
        return state + torch.einsum("bitd,mi->bmtd", hidden, self.down_proj.weight)


class TapetrainAttention(nn.Module):
    def __init__(self, config: TapetrainConfig, layer_idx: int, updates_state: bool):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
        use_mix = config.pe == "tape" and config.tape_attn_update and updates_state
        self.tape_mix = TapeHeadMix(self.n_heads, config.tape_head_mix) if use_mix else None

    def forward(self, x, ctx: PositionContext, state, cache: TapetrainCache | None, key_mask):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        e_values = None
        if state is not None:  # TAPE: E is per query head, so keys are expanded before rotation
            k = rotate_by_state(expand_heads(k, self.n_heads), state)
            q = rotate_by_state(q, state)
            e_values = state if self.tape_mix is not None else None
        elif ctx.cos is not None:
            q, k = rotate_pairs(q, ctx.cos, ctx.sin), rotate_pairs(k, ctx.cos, ctx.sin)
            if ctx.q_scale is not None:
                q, k = q * ctx.q_scale, k * ctx.k_scale
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
            if e_values is not None:
                e_values = cache.update_state(e_values, self.layer_idx)
        out, attended = attention(q, k, v, e_values, bias=ctx.bias, key_mask=key_mask)
        out = self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
        if attended is not None:
            state = self.tape_mix(state, attended)
        return out, state


class TapetrainDecoderLayer(nn.Module):
    def __init__(self, config: TapetrainConfig, layer_idx: int):
        super().__init__()
        # The final E is dropped: the last layer has no state updates.
        updates_state = config.pe == "tape" and layer_idx < config.num_hidden_layers - 1
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = TapetrainAttention(config, layer_idx, updates_state)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        channels = config.tape_channels or 4 * config.num_attention_heads
        use_mlp_update = updates_state and config.tape_mlp_update
        heads = config.num_attention_heads
        self.tape_mlp = TapeMlpUpdate(config.hidden_size, heads, channels) if use_mlp_update else None

    def forward(self, x, ctx, state, cache, key_mask):
        attn_out, state = self.self_attn(self.input_layernorm(x), ctx, state, cache, key_mask)
        x = x + attn_out
        mlp_out = self.mlp(self.post_attention_layernorm(x))
        x = x + mlp_out
        if self.tape_mlp is not None:
            state = self.tape_mlp(state, mlp_out)
        return x, state


# ---- models ------------------------------------------------------------------------------------------------------


class TapetrainPreTrainedModel(PreTrainedModel):
    config_class = TapetrainConfig
    base_model_prefix = "model"
    _no_split_modules = ["TapetrainDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    supports_gradient_checkpointing = False
    _supports_sdpa = True

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own TapetrainCache

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """tapetrain's init; every parameter is normally loaded from the checkpoint."""
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, TapeHeadMix):
            nn.init.zeros_(module.weight)
        elif isinstance(module, TapeMlpUpdate):
            nn.init.zeros_(module.down_proj.weight)  # zero W_down: the RoPE twin at init
        elif isinstance(module, FireBias):
            nn.init.zeros_(module.log_c)
            module.threshold.fill_(float(self.config.max_position_embeddings))


class TapetrainModel(TapetrainPreTrainedModel):
    def __init__(self, config: TapetrainConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pe = PositionModule(config)
        self.layers = nn.ModuleList(TapetrainDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if input_ids is not None:
            if input_ids.numel() and int(input_ids.max()) >= self.config.vocab_size:
                raise ValueError(f"token id {int(input_ids.max())} >= vocab_size={self.config.vocab_size}: the input "
                                 "was tokenized with a different tokenizer")
            inputs_embeds = self.embed_tokens(input_ids)
        x = inputs_embeds
        b, t = x.shape[:2]
        use_cache = getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        cache = as_tapetrain_cache(past_key_values) if (use_cache or past_key_values is not None) else None
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            positions = torch.arange(past, past + t, device=x.device, dtype=torch.float64).expand(b, t)
        else:
            positions = position_ids.to(torch.float64).expand(b, t)
        key_positions = cache.extend_positions(positions) if cache is not None else positions
        key_mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError("attention_mask must be 2-D (batch, past + new tokens) with 1 = attend, 0 = padding")
            if not bool(attention_mask.all()):
                key_mask = attention_mask[:, -(past + t):].bool()
        ctx = position_context(self.config, positions, key_positions, x.dtype, self.pe)
        state = ctx.tape_init
        for layer in self.layers:
            x, state = layer(x, ctx, state, cache, key_mask)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x), past_key_values=cache if use_cache else None)


class TapetrainForCausalLM(TapetrainPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: TapetrainConfig):
        super().__init__(config)
        self.model = TapetrainModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """labels (B, T) are the input ids (shifted here, as in Llama); -100 = ignore."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep > 0 else hidden
        else:
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten().to(logits.device), ignore_index=-100
            )
        result = CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)
        return result if return_dict is not False else result.to_tuple()

"""A tapetrain decoder (TAPE or a baseline positional encoding) as a Hugging Face causal LM.

Self-contained remote code: `tapetrain export hf` copies this file and configuration_tapetrain.py next to the
weights, and `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` loads it where tapetrain is not
installed. It re-implements exactly what tapetrain/model computes (the export verifies the logits); the blocks
marked `# Copied from tapetrain.model.<name>` are verbatim copies that tests/unit/test_hf_copies.py keeps in step.

    h  = x + Attn(RMSNorm(x); E)         TAPE logits from q̃ = E^T q, k̃ = E^T k; values [V ‖ E] share one softmax
    E  = E + (A·E) ×_heads W_A            attention-side update
    m  = SwiGLU(RMSNorm(h)); x' = h + m
    E' = E + W_down(SiLU(W_x m) ⊙ W_up E) MLP-side update; the final E is dropped

E is token-major, (B, T, M, D) per token and head (M = heads): F = D/2 rotate-half blocks (c, s) stored as
[c ‖ s]; E^(0) is RoPE with the model's RoPE scaling (`rotary_scaling`, transformers' rope_parameters spelling;
YaRN/LongRoPE's attention temperature scales the logits only, never E). Attention takes heads-first views of it,
E.transpose(1, 2), as it does of q, k and v. `family` adds Qwen2's q/k/v biases or Qwen3's q/k RMSNorm.
Generation caches rotated keys, values, TAPE's E and the token positions per layer (`TapetrainCache`, which
`generate` gets in place of its default DynamicCache: greedy, sampling, beam search, assisted and prompt-lookup
decoding and left-padded batches all run with it). The baselines follow the TAPE paper's (xPos with γ = 2048,
applied query block by block so nothing overflows; FIRE per layer with c₀ = 0.1 and L = |m·512|; RandPE at sorted
random positions from [0, 2·max_len) in every layer, at evaluation too, except with a KV cache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_tapetrain import TapetrainConfig

ROTARY = ("rope", "randpe", "xpos")

# ---- positions ---------------------------------------------------------------------------------------------------


# Copied from tapetrain.model.rope_scaling.rope_parameters
def rope_parameters(theta: float, pi_factor: float, scaling: dict | None) -> dict:
    """The rotary settings as one dict, transformers' rope_parameters: {"rope_type", "rope_theta", ...}.

    `pi_factor` (linear position interpolation) is linear scaling: it becomes {"rope_type": "linear", "factor":
    pi_factor} when `scaling` sets no other type (ModelConfig refuses the two together unless they agree).
    """
    params = {k: v for k, v in (scaling or {}).items() if v is not None}
    params.setdefault("rope_type", "default")
    if pi_factor != 1.0 and params["rope_type"] == "default":
        params = {"rope_type": "linear", "factor": float(pi_factor)}
    return {**params, "rope_theta": float(theta)}


# Copied from tapetrain.model.rope_scaling.rope_attention_factor
def rope_attention_factor(rope: dict) -> float:
    """The factor transformers multiplies cos and sin by (yarn, longrope; else 1): logits scale by its square."""
    kind = rope["rope_type"]
    if kind not in ("yarn", "longrope"):
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor = rope["factor"]
    if kind == "longrope":
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(rope["original_max_position_embeddings"]))

    def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return yarn_mscale(factor, rope["mscale"]) / yarn_mscale(factor, rope["mscale_all_dim"])
    return yarn_mscale(factor)


# Copied from tapetrain.model.rope_scaling.rope_frequencies
def rope_frequencies(
    head_dim: int, rope: dict, length: torch.Tensor | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """Inverse frequencies θ_f (F,) float64 for `rope` (rope_parameters()); `length` (0-dim tensor) is the forward's
    length for the length-dependent types (None = up to L₀). Stays on the device: no host synchronisation."""
    kind, theta = rope["rope_type"], rope["rope_theta"]
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim  # 2f/D, (F,)
    if kind == "dynamic":  # NTK: a larger base once the length passes L₀
        original, factor = rope["original_max_position_embeddings"], rope["factor"]
        if length is None:
            return theta ** (-exponents)
        grown = torch.clamp(length.to(torch.float64), min=original)
        base = theta * (factor * grown / original - (factor - 1)) ** (head_dim / (head_dim - 2))
        return base ** (-exponents)
    inv_freq = theta ** (-exponents)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / rope["factor"]
    if kind == "longrope":
        short = torch.tensor(rope["short_factor"], dtype=torch.float64, device=device)
        if length is None:
            return inv_freq / short
        long = torch.tensor(rope["long_factor"], dtype=torch.float64, device=device)
        return inv_freq / torch.where(length > rope["original_max_position_embeddings"], long, short)
    if kind == "llama3":
        original, factor = rope["original_max_position_embeddings"], rope["factor"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)  # long waves interpolated
        smooth = (original / wavelength - low) / (high - low)  # 0 at L₀/low .. 1 at L₀/high
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelength >= original / high) & (wavelength <= original / low)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        original, factor = rope["original_max_position_embeddings"], rope["factor"]
        beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

        def dim_of(rotations: float) -> float:  # the (fractional) pair index that turns `rotations` times over L₀
            return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dim_of(beta_fast), dim_of(beta_slow)
        if rope.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # a step instead of a ramp
        pairs = torch.arange(head_dim // 2, dtype=torch.float64, device=device)
        ramp = ((pairs - low) / (high - low)).clamp(0, 1)  # 0: fast pairs, kept; 1: slow pairs, interpolated
        return inv_freq * (1 - ramp) + inv_freq / factor * ramp
    raise ValueError(f"unknown rope_type {kind!r}")


# Copied from tapetrain.model.rope_scaling.frequencies_for
def frequencies_for(head_dim: int, rope: dict, key_positions: torch.Tensor) -> torch.Tensor:
    """θ_f (F,) float64 for one forward over `key_positions` (B, S) float64, cached positions included: the
    length-dependent types use their span max − min + 1 (transformers' max(position_ids) + 1 from position 0;
    unchanged by a global shift)."""
    length = None
    if rope["rope_type"] in ("dynamic", "longrope"):
        length = key_positions.max() - key_positions.min() + 1
    return rope_frequencies(head_dim, rope, length, key_positions.device)


# Copied from tapetrain.model.positions.rope_angles
def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of p·θ_f for positions p (..., T) and frequencies θ_f (F,) (rope_scaling.frequencies_for);
    (..., T) -> (..., T, F) float64.

    Computed in float64: fp32 angles at positions in the thousands are off by ~1e-4 rad, enough to break the
    exact shift-invariance of TAPE that the tests check.
    """
    angles = positions.to(torch.float64)[..., None] * inv_freq.to(torch.float64)
    return torch.cos(angles), torch.sin(angles)


# Copied from tapetrain.model.positions.rotate_pairs
def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate rotate-half pairs of x (..., D) by blocks (cos, sin) (..., F); broadcasting over heads/batch."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# Copied from tapetrain.model.tape.rotate_by_state
def rotate_by_state(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """x̃ = E^T x blockwise: x and state E = [c ‖ s] of one shape, e.g. (B, T, M, D). For E = RoPE this is RoPE."""
    half = state.shape[-1] // 2
    return rotate_pairs(x, state[..., :half], state[..., half:])


# Copied from tapetrain.model.positions.alibi_slopes
def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's geometric head slopes (Press et al.), with the standard interleave for non-powers of two."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_two(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float64)


# Copied from tapetrain.model.fire.FireBias
class FireBias(nn.Module):
    """FIRE's attention bias f_θ(ψ(i − j) / (ψ(max(L, i)) + ε)), ψ(x) = log(|c·x| + 1), L = |m·L₀|, per head."""

    def __init__(self, n_heads: int, hidden: int, init_c: float = 0.1, init_threshold: float = 512.0,
                 eps: float = 1e-6):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, n_heads))
        self.init_c, self.init_threshold, self.eps = init_c, init_threshold, eps
        # (1,), not 0-dim: deepspeed.initialize broadcasts every parameter as a byte view, which 0-dim tensors refuse
        self.c = nn.Parameter(torch.full((1,), float(init_c)))
        self.threshold_scale = nn.Parameter(torch.ones(1))  # the multiplier m; L = |m · L₀|

    def reset_scalars(self) -> None:
        """c and m back to their inits (the MLP's Linear layers are initialised like every other Linear)."""
        with torch.no_grad():
            self.c.fill_(self.init_c)
            self.threshold_scale.fill_(1.0)

    @property
    def threshold(self) -> torch.Tensor:
        return (self.threshold_scale * self.init_threshold).abs()

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Query positions (B, T), key positions (B, S) (float64) -> bias (B, H, T, S) in the MLP's dtype.

        Distances are taken as |i − j| (the future half is causally masked anyway) and computed in fp32 or wider.
        """
        dtype = torch.promote_types(self.c.dtype, torch.float32)
        c = self.c.to(dtype)
        rel = (q_pos[:, :, None] - k_pos[:, None, :]).to(dtype)  # (B, T, S)
        normaliser = torch.maximum(q_pos.to(dtype), self.threshold.to(dtype))  # (B, T)
        distance = torch.log(torch.abs(c * rel) + 1)
        scale = torch.log(torch.abs(c * normaliser) + 1)[:, :, None] + self.eps  # (B, T, 1)
        weight = self.mlp[0].weight
        return self.mlp((distance / scale).to(weight.dtype)[..., None]).permute(0, 3, 1, 2)  # (B, H, T, S)


# Copied from tapetrain.model.randpe.randpe_limit
def randpe_limit(max_position: int | None, max_seq_len: int) -> int:
    return max_position or 2 * max_seq_len


# Copied from tapetrain.model.randpe.draw_positions
def draw_positions(length: int, limit: int, device: torch.device) -> torch.Tensor:
    """(length,) float64: a sorted draw of `length` distinct integers from [0, max(limit, length))."""
    return torch.randperm(max(limit, length), device=device)[:length].sort().values.to(torch.float64)


# Copied from tapetrain.model.xpos.xpos_zeta
def xpos_zeta(head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """ζ (D,) float64: (2f + 0.4·D) / (1.4·D) for pair f, repeated for both halves of the rotate-half layout."""
    zeta = (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) + 0.4 * head_dim) / (1.4 * head_dim)
    return torch.cat([zeta, zeta])


# Copied from tapetrain.model.xpos.XposDecay
@dataclass
class XposDecay:
    """What one forward needs to apply the decay: ζ (D,), γ, query positions (B, T), key positions (B, S)."""

    zeta: torch.Tensor
    scale_base: float
    q_pos: torch.Tensor
    k_pos: torch.Tensor

    @property
    def block(self) -> int:
        return max(1, int(self.scale_base))

    def factors(self, first: int, stop: int, keys: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Query factors (B, 1, stop − first, D) and key factors (B, 1, keys, D) for queries [first, stop) and the
        first `keys` keys, centred at the block's largest query position (float64)."""
        q_pos = self.q_pos[:, first:stop]  # (B, Tb)
        centre = q_pos.max(dim=1, keepdim=True).values  # (B, 1)
        k_offset = centre - self.k_pos[:, :keys]  # (B, Sb): >= 0 for every key a causal query may see
        if causal:
            k_offset = k_offset.clamp(min=0)
        q_factor = self.zeta ** ((q_pos - centre) / self.scale_base)[..., None]  # (B, Tb, D)
        k_factor = self.zeta ** (k_offset / self.scale_base)[..., None]  # (B, Sb, D)
        return q_factor[:, None], k_factor[:, None]


def new_fire(config: TapetrainConfig) -> FireBias:
    return FireBias(config.num_attention_heads, config.fire_hidden, config.fire_init_c, config.fire_init_threshold)


class PositionModule(nn.Module):
    """Holds FIRE's bias module when one is shared by all layers (fire_shared); the baseline has one per layer."""

    def __init__(self, config: TapetrainConfig):
        super().__init__()
        if config.pe == "fire" and config.fire_shared:
            self.fire = new_fire(config)


def rope_settings(config: TapetrainConfig) -> dict:
    """transformers-style rope_parameters of the model: rope_theta, pi_factor and rotary_scaling in one dict."""
    return rope_parameters(config.rope_theta, config.pi_factor, config.rotary_scaling)


def attention_scale(config: TapetrainConfig) -> float | None:
    """YaRN/LongRoPE's temperature on the logits only (never on TAPE's E): factor² / √D, or None = 1/√D."""
    factor = rope_attention_factor(rope_settings(config))
    return None if factor == 1.0 else factor**2 / math.sqrt(config.head_dim)


def randpe_draw(n: int, config: TapetrainConfig, device) -> torch.Tensor:
    """(n,) float64: n sorted distinct integers from [0, max(randpe range, n)), the range 2·max_len by default."""
    return draw_positions(n, randpe_limit(config.randpe_max_position, config.max_position_embeddings), device)


class PositionContext:
    """Per-forward positional inputs shared by all layers (see tapetrain.model.positions).

    inv_freq (F,) float64, this forward's rotary frequencies (rotary_scaling); cos, sin (B, 1, T, F); xpos an
    XposDecay; bias (B, H, T, S) for alibi/shared fire; tape_init (B, T, M, D) = E^(0), token-major like E
    everywhere; positions/key_positions (B, T)/(B, S) float64; randpe_index (B, T) long when every layer draws
    its own randpe positions.
    """

    def __init__(self, positions: torch.Tensor, key_positions: torch.Tensor):
        self.positions, self.key_positions = positions, key_positions
        self.inv_freq = self.cos = self.sin = self.xpos = self.bias = self.tape_init = self.randpe_index = None


def position_context(
    config: TapetrainConfig, positions: torch.Tensor, key_positions: torch.Tensor, dtype, pe_module: PositionModule,
    randpe_index: torch.Tensor | None = None,
) -> PositionContext:
    """positions (B, T), key_positions (B, S), both float64; randpe_index: draw per layer at these indices."""
    ctx = PositionContext(positions, key_positions)
    pe, d = config.pe, config.head_dim
    ctx.randpe_index = randpe_index
    if pe in ("rope", "randpe", "xpos", "tape"):  # every rotary angle comes from these frequencies
        ctx.inv_freq = frequencies_for(d, rope_settings(config), key_positions)  # (F,)
    if pe in ("rope", "randpe", "xpos", "tape") and randpe_index is None:
        cos, sin = rope_angles(positions, ctx.inv_freq)  # (B, T, F)
        if pe == "tape":
            e0 = torch.cat([cos, sin], dim=-1).to(dtype)  # (B, T, D)
            ctx.tape_init = e0[:, :, None].expand(-1, -1, config.num_attention_heads, -1)  # (B, T, M, D)
        else:
            ctx.cos, ctx.sin = cos[:, None].to(dtype), sin[:, None].to(dtype)
    if pe == "xpos":
        ctx.xpos = XposDecay(xpos_zeta(d, positions.device), float(config.xpos_scale_base), positions, key_positions)
    if pe == "alibi":
        slopes = alibi_slopes(config.num_attention_heads).to(positions.device)
        dist = (positions[:, :, None] - key_positions[:, None, :]).clamp(min=0)  # (B, T, S)
        ctx.bias = (-slopes[None, :, None, None] * dist[:, None]).to(dtype)
    if pe == "fire" and config.fire_shared:
        ctx.bias = pe_module.fire(positions, key_positions).to(dtype)
    return ctx


# ---- Abacus digit places (abacus=True) ---------------------------------------------------------------------------


# Copied from tapetrain.model.abacus.digit_places
def digit_places(is_digit: torch.Tensor, carry: torch.Tensor | None = None) -> torch.Tensor:
    """is_digit (B, T) bool -> places (B, T) int64: 1, 2, ... along every run of consecutive digits, 0 elsewhere.

    carry (B,) int64: the place of the token just before these (the last cached token; 0 = not a digit), so a
    number that began in a cached prefix keeps counting where the prefix stopped."""
    b, t = is_digit.shape
    index = torch.arange(t, device=is_digit.device).expand(b, t)  # (B, T)
    # The last non-digit at or before each token; before the first one it is a virtual token `carry` places back.
    before = -1 - (carry if carry is not None else torch.zeros(b, dtype=torch.long, device=is_digit.device))
    last_break = torch.where(is_digit, before[:, None].expand(b, t), index).cummax(dim=1).values  # (B, T)
    return torch.where(is_digit, index - last_break, torch.zeros_like(index))


# Copied from tapetrain.model.abacus.AbacusEmbedding
class AbacusEmbedding(nn.Module):
    """Learned embeddings of places 1..max_places; place 0 (not a digit) adds nothing."""

    def __init__(self, max_places: int, d_model: int):
        super().__init__()
        self.max_places = max_places
        self.embed = nn.Embedding(max_places + 1, d_model)

    def forward(self, places: torch.Tensor) -> torch.Tensor:
        """places (B, T) int64 -> (B, T, C). Places past max_places are refused on CPU (`check_places`); elsewhere
        they are clamped to the last embedding rather than read out of bounds."""
        vectors = self.embed(places.clamp(max=self.max_places))
        return vectors * (places > 0).unsqueeze(-1).to(vectors.dtype)


def training_offset(config: TapetrainConfig, places: torch.Tensor) -> torch.Tensor:
    """places (B, T) with a random offset in [0, abacus_train_offset) per sequence added to its digits' places, as
    while training (tapetrain keys its offsets on the data order; here they come from torch's RNG)."""
    if config.abacus_train_offset <= 1:
        return places
    offsets = torch.randint(0, config.abacus_train_offset, (places.shape[0],), device=places.device)
    return torch.where(places > 0, places + offsets[:, None], places)


# ---- cache -------------------------------------------------------------------------------------------------------


class TapetrainCache(DynamicCache):
    """DynamicCache of rotated keys (per query head for TAPE) and values, plus TAPE's state E of the cached
    tokens per layer (one more value stream, token-major (B, S, M, D)), their positions (B, S) float64 and, with
    Abacus, their digit places (B, S) int64 (a number begun in the prompt keeps counting)."""

    def __init__(self):
        super().__init__()
        self.states: dict[int, torch.Tensor] = {}
        self.positions: torch.Tensor | None = None
        self.places: torch.Tensor | None = None

    def extend_places(self, new: torch.Tensor) -> None:
        self.places = new if self.places is None else torch.cat([self.places, new], dim=1)

    def place_carry(self) -> torch.Tensor | None:
        """(B,) the digit place of the last cached token, None when nothing is cached."""
        return None if self.places is None or self.places.shape[1] == 0 else self.places[:, -1]

    def update_state(self, state: torch.Tensor, layer_idx: int) -> torch.Tensor:
        old = self.states.get(layer_idx)
        self.states[layer_idx] = state if old is None else torch.cat([old, state], dim=1)
        return self.states[layer_idx]

    def extend_positions(self, new: torch.Tensor) -> torch.Tensor:
        self.positions = new if self.positions is None else torch.cat([self.positions, new], dim=1)
        return self.positions

    def _map_batch(self, fn) -> None:
        self.states = {i: fn(s) for i, s in self.states.items()}
        if self.positions is not None:
            self.positions = fn(self.positions)
        if self.places is not None:
            self.places = fn(self.places)

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
        self.states = {i: s[:, :length] for i, s in self.states.items()}
        if self.positions is not None:
            self.positions = self.positions[:, :length]
        if self.places is not None:
            self.places = self.places[:, :length]


# transformers 5.24 renamed `past_key_values` to `cache` (forward arguments, generate's model_kwargs, output fields).
# This file runs under whichever transformers the user has, so it takes both spellings and writes the output field
# its transformers declares.
CACHE_KWARGS = ("cache", "past_key_values")
_OUTPUT_CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def given_cache(cache: Cache | None, past_key_values: Cache | None) -> Cache | None:
    """The cache a caller passed under either name (both at once is an error, as in transformers)."""
    if cache is not None and past_key_values is not None:
        raise ValueError("pass the cache once: as `cache` (transformers >= 5.24) or as `past_key_values`")
    return cache if cache is not None else past_key_values


def as_tapetrain_cache(past_key_values) -> TapetrainCache:
    if past_key_values is None:
        return TapetrainCache()
    if isinstance(past_key_values, TapetrainCache):
        return past_key_values
    if type(past_key_values) is DynamicCache and past_key_values.get_seq_length() == 0:
        return TapetrainCache()  # an empty default cache: ours replaces it (it is returned as past_key_values)
    raise ValueError(
        f"past_key_values is a {type(past_key_values).__name__}; this model needs its own TapetrainCache (it also "
        "caches TAPE's positional state and the token positions): pass None, or reuse the past_key_values the model "
        "returns; static, quantized and offloaded caches are not supported"
    )


# ---- layers ------------------------------------------------------------------------------------------------------


# Copied from tapetrain.model.attention.expand_heads
def expand_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, Hx, S, D) -> (B, n_heads, S, D) by repeating each head n_heads // Hx times (GQA)."""
    groups = n_heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


# Copied from tapetrain.model.attention.causal_mask
def causal_mask(t: int, s: int, device: torch.device) -> torch.Tensor:
    """Boolean (T, S) mask, True where attention is allowed; bottom-right aligned."""
    q_pos = torch.arange(s - t, s, device=device)[:, None]
    k_pos = torch.arange(s, device=device)[None, :]
    return k_pos <= q_pos


def xpos_attention(q, k, v, e, decay: XposDecay, bias=None, key_mask=None, scale=None):
    """attention() with xPos's decay ζ^((p_i − p_j)/γ), query block by block (γ queries each), every block
    centred at its largest query position (XposDecay.factors), so nothing overflows at any length or dtype.
    q, k rotated, not yet decayed; causal, bottom-right aligned."""
    t, s = q.shape[2], k.shape[2]
    outs, attended = [], []
    for first in range(0, t, decay.block):
        stop = min(t, first + decay.block)
        keys = s - t + stop  # the block's last query sits at key keys − 1
        q_factor, k_factor = decay.factors(first, stop, keys, causal=True)
        out, out_e = attention(
            q[:, :, first:stop] * q_factor.to(q.dtype), k[:, :, :keys] * k_factor.to(k.dtype), v[:, :, :keys],
            None if e is None else e[:, :, :keys], None if bias is None else bias[..., first:stop, :keys],
            None if key_mask is None else key_mask[:, :keys], scale,
        )
        outs.append(out)
        attended.append(out_e)
    return torch.cat(outs, dim=2), None if e is None else torch.cat(attended, dim=2)


def attention(q, k, v, e=None, bias=None, key_mask=None, scale=None):
    """One softmax over values [V ‖ E]: q (B, H, T, D), k (B, Hk, S, D), v (B, Hkv, S, D), e (B, H, S, D) (the
    heads-first view of the token-major E) or None, bias (B, H, T, S), key_mask (B, S) bool (False = padding),
    scale the logit scale (None = 1/√D). Returns (A·V, A·E or None)."""
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
    out = F.scaled_dot_product_attention(q, k, values, attn_mask=mask, is_causal=is_causal, scale=scale)
    return (out, None) if e is None else (out[..., :dv], out[..., dv:])


# Copied from tapetrain.model.transformer.RMSNorm
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


# Copied from tapetrain.model.transformer.SwiGLU
class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# Copied from tapetrain.model.tape.TapeHeadMix
class TapeHeadMix(nn.Module):
    """Attention-side update E ← E + (A·E) ×_heads W_A.

    'full': W_A ∈ R^{M×M} mixes heads (the paper). 'gain': a per-head scalar (what the official code realises).
    Zero-initialised, so a fresh or retrofitted model starts as its RoPE twin.
    """

    def __init__(self, n_heads: int, mode: str):
        super().__init__()
        self.mode = mode
        shape = (n_heads, n_heads) if mode == "full" else (n_heads,)
        self.weight = nn.Parameter(torch.zeros(shape))

    def forward(self, state: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """state, attended = A·E: (B, T, M, D) -> updated state (B, T, M, D)."""
        weight = self.weight.to(attended.dtype)
        if self.mode == "full":
            mixed = torch.matmul(weight, attended)  # (M, M) @ (B, T, M, D): one small product per token
        else:
            mixed = attended * weight[:, None]
        return state + mixed


# Copied from tapetrain.model.tape.TapeMlpUpdate
class TapeMlpUpdate(nn.Module):
    """MLP-side update E ← E + W_down · (SiLU(W_x · m) ⊙ (W_up · E)), contractions over heads.

    m is the MLP block's output for each token (B, T, C); I = channels (4·M by default). W_down starts at zero
    (the paper's zero W2); W_x and W_up keep the normal init so W_down receives gradient from step 0.
    """

    def __init__(self, d_model: int, n_heads: int, channels: int):
        super().__init__()
        self.x_proj = nn.Linear(d_model, channels, bias=False)  # W_x: C -> I
        self.up_proj = nn.Linear(n_heads, channels, bias=False)  # W_up: M -> I
        self.down_proj = nn.Linear(channels, n_heads, bias=False)  # W_down: I -> M
        self.down_proj.zero_init = True  # zeroed by the weight init: a fresh model is its RoPE twin

    def forward(self, state: torch.Tensor, mlp_out: torch.Tensor) -> torch.Tensor:
        """state (B, T, M, D), mlp_out (B, T, C) -> updated state (B, T, M, D)."""
        gate = F.silu(self.x_proj(mlp_out))  # (B, T, I)
        up = torch.matmul(self.up_proj.weight, state)  # (I, M) @ (B, T, M, D) -> (B, T, I, D)
        hidden = up * gate[..., None]  # (B, T, I, D)
        return state + torch.matmul(self.down_proj.weight, hidden)  # (M, I) @ (B, T, I, D) -> (B, T, M, D)


# Copied from tapetrain.model.tape.TapeMlpUpdateNonEquivariant
class TapeMlpUpdateNonEquivariant(nn.Module):
    """The ablation without TAPE's equivariance constraints (the official code's non-equivariant variant).

    The official variant flattens its cos and sin tensors (heads × head dim) and mixes that whole axis:
    c ← c + W_down(SiLU(W_x m) ⊙ W_up c), the same for s, with the same weights. Here that acts on our layout: the
    c and the s halves of E, each flattened over heads × frequencies (M·F = C/2 channels). Mixing frequencies
    breaks O(2) equivariance and with it shift invariance. (The official code stores cos and sin with duplicated
    halves that its update lets drift apart, i.e. general 2×2 blocks; our D-number state keeps blocks c·I + s·J.)
    W_down starts at zero, so a fresh model is still its RoPE twin.
    """

    def __init__(self, d_model: int, n_heads: int, head_dim: int, channels: int):
        super().__init__()
        width = n_heads * (head_dim // 2)  # M·F
        self.x_proj = nn.Linear(d_model, channels, bias=False)  # W_x: C -> I
        self.up_proj = nn.Linear(width, channels, bias=False)  # W_up: M·F -> I
        self.down_proj = nn.Linear(channels, width, bias=False)  # W_down: I -> M·F
        self.down_proj.zero_init = True  # zeroed by the weight init: a fresh model is its RoPE twin

    def forward(self, state: torch.Tensor, mlp_out: torch.Tensor) -> torch.Tensor:
        """state (B, T, M, D) token-major, mlp_out (B, T, C) -> updated state (B, T, M, D)."""
        b, t, m, d = state.shape
        gate = F.silu(self.x_proj(mlp_out))  # (B, T, I)
        halves = state.reshape(b, t, m, 2, d // 2).permute(0, 3, 1, 2, 4).reshape(b, 2, t, m * (d // 2))  # c, s
        update = self.down_proj(self.up_proj(halves) * gate[:, None])  # (B, 2, T, M·F)
        update = update.view(b, 2, t, m, d // 2).permute(0, 2, 3, 1, 4).reshape(b, t, m, d)
        return state + update


def randpe_rotation(ctx: PositionContext, config: TapetrainConfig, dtype):
    """One layer's own randpe draw at ctx.randpe_index: cos, sin (B, 1, T, F)."""
    index = ctx.randpe_index
    positions = randpe_draw(int(index.max()) + 1, config, index.device)[index]
    cos, sin = rope_angles(positions, ctx.inv_freq)
    return cos[:, None].to(dtype), sin[:, None].to(dtype)


class TapetrainAttention(nn.Module):
    def __init__(self, config: TapetrainConfig, layer_idx: int, updates_state: bool):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        qkv_bias = config.family == "qwen2"  # Qwen2/2.5: q, k and v projections with biases
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
        qk_norm = config.family == "qwen3"  # Qwen3: per-head RMSNorm of q and k before the rotation
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.scale = attention_scale(config)
        use_mix = config.pe == "tape" and config.tape_attn_update and updates_state
        self.tape_mix = TapeHeadMix(self.n_heads, config.tape_head_mix) if use_mix else None

    def forward(self, x, ctx: PositionContext, state, cache: TapetrainCache | None, key_mask, bias=None):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)  # (B, T, H, D)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim)  # (B, T, Hkv, D)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        e_values = None  # E as extra value channels (B, S, M, D), for layers that update it
        if state is not None:  # TAPE: E (B, T, M, D) is per query head, so keys are expanded before rotation
            groups = self.n_heads // self.n_kv
            k = rotate_by_state(k.repeat_interleave(groups, dim=2) if groups > 1 else k, state).transpose(1, 2)
            q = rotate_by_state(q, state).transpose(1, 2)
            e_values = state if self.tape_mix is not None else None
        else:
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, D), (B, Hkv, T, D)
            if ctx.randpe_index is not None:  # randpe, drawing per layer: this layer's own positions
                cos, sin = randpe_rotation(ctx, self.config, q.dtype)
                q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
            elif ctx.cos is not None:
                q, k = rotate_pairs(q, ctx.cos, ctx.sin), rotate_pairs(k, ctx.cos, ctx.sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
            if e_values is not None:
                e_values = cache.update_state(e_values, self.layer_idx)
        e_values = e_values.transpose(1, 2) if e_values is not None else None  # (B, M, S, D) view
        if ctx.xpos is not None:
            out, attended = xpos_attention(q, k, v, e_values, ctx.xpos, bias=bias, key_mask=key_mask, scale=self.scale)
        else:
            out, attended = attention(q, k, v, e_values, bias=bias, key_mask=key_mask, scale=self.scale)
        out = self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
        if attended is not None:
            state = self.tape_mix(state, attended.transpose(1, 2))  # A·E back to token-major (B, T, M, D)
        return out, state


class TapetrainDecoderLayer(nn.Module):
    def __init__(self, config: TapetrainConfig, layer_idx: int):
        super().__init__()
        # The final E is dropped: the last layer has no state updates; tape_layers limits them to some layers.
        updates_state = config.pe == "tape" and layer_idx < config.num_hidden_layers - 1
        if config.tape_layers is not None:
            updates_state = updates_state and layer_idx in config.tape_layers
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = TapetrainAttention(config, layer_idx, updates_state)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        channels = config.tape_channels or 4 * config.num_attention_heads
        use_mlp_update = updates_state and config.tape_mlp_update
        heads = config.num_attention_heads
        self.tape_mlp = TapeMlpUpdate(config.hidden_size, heads, channels) if use_mlp_update else None
        if use_mlp_update and not config.tape_equivariant:
            self.tape_mlp = TapeMlpUpdateNonEquivariant(config.hidden_size, heads, config.head_dim, channels)
        self.fire = new_fire(config) if config.pe == "fire" and not config.fire_shared else None  # per layer

    def forward(self, x, ctx, state, cache, key_mask):
        bias = ctx.bias if self.fire is None else self.fire(ctx.positions, ctx.key_positions).to(x.dtype)
        attn_out, state = self.self_attn(self.input_layernorm(x), ctx, state, cache, key_mask, bias)
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
    _skip_keys_device_placement = ["past_key_values", "cache"]
    supports_gradient_checkpointing = False
    _supports_sdpa = True

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return True  # generate makes a cache up front (assisted decoding needs one); ours takes its place

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
        elif isinstance(module, FireBias):
            module.reset_scalars()
        if isinstance(module, nn.Linear) and getattr(module, "zero_init", False):
            nn.init.zeros_(module.weight)  # TAPE's W_down: the RoPE twin at init


class TapetrainModel(TapetrainPreTrainedModel):
    def __init__(self, config: TapetrainConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.abacus = AbacusEmbedding(config.abacus_max_places, config.hidden_size) if config.abacus else None
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
        cache: Cache | None = None,
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
        past_key_values = given_cache(cache, past_key_values)
        cache = as_tapetrain_cache(past_key_values) if (use_cache or past_key_values is not None) else None
        past = cache.get_seq_length() if cache is not None else 0
        if self.abacus is not None:
            if input_ids is None:
                raise ValueError("this model adds Abacus digit-place embeddings, computed from the token ids: pass "
                                 "input_ids, not inputs_embeds")
            digit_ids = torch.tensor(self.config.abacus_digit_ids, device=input_ids.device)
            places = digit_places(torch.isin(input_ids, digit_ids), cache.place_carry() if cache is not None else None)
            if cache is not None:
                cache.extend_places(places)  # (B, S): the places without offsets
            x = x + self.abacus(training_offset(self.config, places) if self.training else places)
        index = position_ids.expand(b, t) if position_ids is not None else None
        if index is None:
            index = torch.arange(past, past + t, device=x.device).expand(b, t)
        positions = index.to(torch.float64)
        # RandPE as the baseline: without a cache, positions are a sorted random draw, indexed by the position ids.
        sample = self.config.pe == "randpe" and cache is None and (self.training or self.config.randpe_sample_at_eval)
        per_layer = sample and self.config.randpe_per_layer
        if sample and not per_layer:
            positions = randpe_draw(int(index.max()) + 1, self.config, x.device)[index]
        key_positions = cache.extend_positions(positions) if cache is not None else positions
        key_mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError("attention_mask must be 2-D (batch, past + new tokens) with 1 = attend, 0 = padding")
            if not bool(attention_mask.all()):
                key_mask = attention_mask[:, -(past + t):].bool()
        ctx = position_context(self.config, positions, key_positions, x.dtype, self.pe, index if per_layer else None)
        state = ctx.tape_init
        for layer in self.layers:
            x, state = layer(x, ctx, state, cache, key_mask)
        returned = {_OUTPUT_CACHE_FIELD: cache if use_cache else None}
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x), **returned)


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

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """generate's default DynamicCache becomes a TapetrainCache before the first forward, so every decoding
        mode (assisted and prompt-lookup decoding need the cache up front) works on the cache this model needs."""
        result = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        for key in CACHE_KWARGS:  # generate keeps it under "cache" from transformers 5.24 on
            cache = model_kwargs.get(key)
            if type(cache) is DynamicCache and cache.get_seq_length() == 0:
                model_kwargs[key] = TapetrainCache()
        return result

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
        cache: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """labels (B, T) are the input ids (shifted here, as in Llama); -100 = ignore."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=given_cache(cache, past_key_values),
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
        returned = getattr(out, _OUTPUT_CACHE_FIELD)
        result = CausalLMOutputWithPast(loss=loss, logits=logits, **{_OUTPUT_CACHE_FIELD: returned})
        return result if return_dict is not False else result.to_tuple()

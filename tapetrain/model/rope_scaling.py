"""RoPE scaling: the rotary frequencies and attention temperature of every scaling method transformers ships.

One setting, `model.rope_scaling` (transformers' `rope_parameters` spelling), feeds every rotary angle: the RoPE
twins, TAPE's E⁽⁰⁾, RandPE, xPos's rotation, cached generation and the exported remote code (whose copies of the
functions below tests/unit/test_hf_copies.py keeps verbatim). The functions work on a plain dict,
`{"rope_type", "rope_theta", ...}` as `rope_parameters()` builds it, so the remote code can call them unchanged.

    default    θ_f = theta^(−2f/D)
    linear     θ_f / factor (position interpolation; `model.pi_factor: k` is exactly `{rope_type: linear, factor: k}`)
    dynamic    NTK: theta·(factor·L/L₀ − factor + 1)^(D/(D−2)) as base once the length L exceeds L₀, else default
    yarn       NTK-by-parts: interpolate the low frequencies by `factor`, keep the high ones, ramp in between, and
               scale the logits by attention_factor² (the "temperature"; 0.1·ln(factor) + 1 unless given)
    llama3     Llama-3.1's: divide the low frequencies by `factor`, keep the high ones, smooth in between
    longrope   θ_f / short_factor_f up to L₀, θ_f / long_factor_f beyond; logits scaled by attention_factor²

L₀ = original_max_position_embeddings. The attention factor multiplies transformers' cos and sin, i.e. scales every
logit by its square; here it is applied to the logits only (the attention scale), so TAPE's E, whose blocks also
serve as value channels, keeps unit blocks and its updates never see the temperature.

Length-dependent types (dynamic, longrope) take L = the span of positions one forward sees, max − min + 1: that is
transformers' max(position_ids) + 1 whenever positions start at 0, and a global shift of every position leaves it
unchanged, so RoPE and TAPE stay shift-invariant under them. With a KV cache each step sees every cached position,
so L grows with the sequence as in transformers, and cached keys (and TAPE's cached E) keep the frequencies of the
step that computed them: past L₀, cached decoding differs from a full forward over the same tokens, exactly as it
does in transformers (up to L₀ the frequencies are fixed and the two agree).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Literal, get_args

import torch

from tapetrain.errors import ConfigError
from tapetrain.fields import option

RopeTypeName = Literal["default", "linear", "dynamic", "yarn", "llama3", "longrope"]
ROPE_TYPES: tuple[str, ...] = get_args(RopeTypeName)
LENGTH_DEPENDENT = ("dynamic", "longrope")  # their frequencies depend on the length of the forward

# Keys each type requires / may take besides rope_type (transformers' validation, with the lengths made explicit).
REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "longrope": ("factor", "original_max_position_embeddings", "short_factor", "long_factor"),
}
OPTIONAL: dict[str, tuple[str, ...]] = {
    "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    "longrope": ("attention_factor",),
}


@dataclass
class RopeScaling:
    """RoPE scaling, as transformers' rope_parameters (rope_theta stays model.rope_theta)."""

    rope_type: RopeTypeName = option(
        "default", "default, linear (PI), dynamic (NTK), yarn, llama3 or longrope (docs/tape.md#rope-scaling)."
    )
    factor: float | None = option(None, "Context extension factor (every type but default).")
    original_max_position_embeddings: int | None = option(
        None, "L₀, the length the model was pretrained at (dynamic, yarn, llama3, longrope)."
    )
    attention_factor: float | None = option(
        None, "yarn/longrope: the attention temperature (null = the method's default from factor)."
    )
    beta_fast: float | None = option(None, "yarn: rotations above which frequencies are kept (null = 32).")
    beta_slow: float | None = option(None, "yarn: rotations below which frequencies are interpolated (null = 1).")
    mscale: float | None = option(None, "yarn: numerator scale of the attention factor (with mscale_all_dim).")
    mscale_all_dim: float | None = option(None, "yarn: denominator scale of the attention factor (with mscale).")
    truncate: bool | None = option(None, "yarn: round the ramp's ends to whole dims (null = true).")
    low_freq_factor: float | None = option(None, "llama3: wavelengths above L₀/this are divided by factor.")
    high_freq_factor: float | None = option(None, "llama3: wavelengths below L₀/this are kept.")
    short_factor: list[float] | None = option(None, "longrope: per-frequency divisors up to L₀ (head_dim/2).")
    long_factor: list[float] | None = option(None, "longrope: per-frequency divisors beyond L₀ (head_dim/2).")

    def as_dict(self) -> dict:
        """The keys that are set, in transformers' spelling (no rope_theta)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_value(cls, value: RopeScaling | dict, key: str = "model.rope_scaling") -> RopeScaling:
        """A RopeScaling from itself or a mapping (model_config.json, an export's config); unknown keys are errors."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping such as {{rope_type: yarn, factor: 2.0, "
                              f"original_max_position_embeddings: 4096}}, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            hint = " ('type' is spelled rope_type)" if "type" in unknown else ""
            raise ConfigError(f"{key}: unknown key(s) {', '.join(unknown)}{hint}; valid keys: "
                              f"{', '.join(sorted(known))}")
        return cls(**value)

    def validate(self, head_dim: int, key: str = "model.rope_scaling") -> None:
        kind = self.rope_type
        if kind not in ROPE_TYPES:
            raise ConfigError(f"{key}.rope_type: unknown type {kind!r}; choose one of {', '.join(ROPE_TYPES)}")
        given = set(self.as_dict()) - {"rope_type"}
        missing = [k for k in REQUIRED[kind] if k not in given]
        if missing:
            raise ConfigError(f"{key}: rope_type {kind} needs {', '.join(missing)}; set "
                              + ", ".join(f"{key}.{k}" for k in missing))
        extra = sorted(given - set(REQUIRED[kind]) - set(OPTIONAL.get(kind, ())))
        if extra:
            raise ConfigError(f"{key}: {', '.join(extra)} do(es) not apply to rope_type {kind}; remove it")
        if self.factor is not None and not self.factor > 0:
            raise ConfigError(f"{key}.factor: must be > 0, got {self.factor}")
        if kind in ("dynamic", "yarn", "llama3") and self.factor < 1:
            raise ConfigError(f"{key}.factor: {kind} extends the context, so factor must be >= 1, got {self.factor}")
        original = self.original_max_position_embeddings
        if original is not None and original <= 0:
            raise ConfigError(f"{key}.original_max_position_embeddings: must be positive, got {original}")
        if kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ConfigError(f"{key}: llama3 needs high_freq_factor > low_freq_factor, got "
                              f"{self.high_freq_factor} <= {self.low_freq_factor}")
        if kind == "longrope":
            for name in ("short_factor", "long_factor"):
                values = getattr(self, name)
                if len(values) != head_dim // 2 or not all(v > 0 for v in values):
                    raise ConfigError(f"{key}.{name}: needs head_dim/2 = {head_dim // 2} positive numbers (one per "
                                      f"frequency), got {len(values)}")
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ConfigError(f"{key}.attention_factor: must be > 0, got {self.attention_factor}")


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


def frequencies_for(head_dim: int, rope: dict, key_positions: torch.Tensor) -> torch.Tensor:
    """θ_f (F,) float64 for one forward over `key_positions` (B, S) float64, cached positions included: the
    length-dependent types use their span max − min + 1 (transformers' max(position_ids) + 1 from position 0;
    unchanged by a global shift)."""
    length = None
    if rope["rope_type"] in ("dynamic", "longrope"):
        length = key_positions.max() - key_positions.min() + 1
    return rope_frequencies(head_dim, rope, length, key_positions.device)

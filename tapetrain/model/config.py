"""Model configuration: one dataclass, validated with errors that name the key and the fix."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Literal, get_args

from tapetrain.errors import ConfigError
from tapetrain.fields import option
from tapetrain.model.rope_scaling import RopeScaling, rope_attention_factor, rope_parameters

# The choices of the string-valued keys: the run config's loader checks YAML values against these annotations,
# validate() checks values set from Python.
PositionalEncodingName = Literal["tape", "rope", "nope", "alibi", "randpe", "xpos", "fire"]
# "flash": flash-attn 2; "fa4*": flash-attn-4, one name per way of carrying TAPE's E (tapetrain/kernels/flash4.py)
AttnBackendName = Literal["auto", "eager", "sdpa", "triton", "flash", "flex", "fa4", "fa4_wide", "fa4_wide_fwd",
                          "fa4_padded"]
LossBackendName = Literal["auto", "chunked", "liger", "plain"]
TapeHeadMixName = Literal["full", "gain"]
FamilyName = Literal["llama", "mistral", "qwen2", "qwen3"]

POSITIONAL_ENCODINGS: tuple[str, ...] = get_args(PositionalEncodingName)
ROTARY_ENCODINGS = ("tape", "rope", "randpe", "xpos")  # need an even head dim
ATTN_BACKENDS: tuple[str, ...] = get_args(AttnBackendName)
LOSS_BACKENDS: tuple[str, ...] = get_args(LossBackendName)
TAPE_HEAD_MIX: tuple[str, ...] = get_args(TapeHeadMixName)
FAMILIES: tuple[str, ...] = get_args(FamilyName)


@dataclass
class ModelConfig:
    """A Llama-style decoder (RMSNorm, SwiGLU, GQA) with a choice of positional encoding."""

    vocab_size: int = option(32000, "Tokenizer vocabulary size; token ids must be < vocab_size.")
    d_model: int = option(768, "Hidden size C.")
    n_layers: int = option(12, "Number of decoder layers.")
    n_heads: int = option(12, "Query heads M; d_model / n_heads is the head dim D.")
    n_kv_heads: int | None = option(None, "Key/value heads for grouped-query attention (None = n_heads).")
    head_size: int | None = option(
        None, "Per-head width D when it is not d_model / n_heads (null = d_model / n_heads; Qwen3 and Mistral-Nemo "
        "checkpoints set it apart)."
    )
    family: FamilyName = option(
        "llama",
        "Layer layout of the transformers family it matches: llama and mistral (plain), qwen2 (q/k/v biases), qwen3 "
        "(per-head RMSNorm of q and k before the rotation). Set by the import; a RoPE model exports as that class.",
    )
    ffn_hidden: int | None = option(
        None, "SwiGLU intermediate size (None = 8/3·d_model rounded up to a multiple of 256, as Llama)."
    )
    max_seq_len: int = option(1024, "Training context length; longer inputs are allowed at evaluation.")
    pe: PositionalEncodingName = option("tape", "Positional encoding: tape, rope, nope, alibi, randpe, xpos or fire.")
    norm_eps: float = option(1e-5, "RMSNorm epsilon.")
    rope_theta: float = option(10000.0, "Rotary base (theta scaling raises it, e.g. 1e6).")
    pi_factor: float = option(
        1.0,
        "Linear position interpolation: positions are divided by this (2 for 4K->8K); the same as rope_scaling "
        "{rope_type: linear, factor: pi_factor}.",
    )
    rope_scaling: RopeScaling | None = option(
        None,
        "RoPE scaling for every rotary angle (RoPE, TAPE's E^(0), RandPE, xPos, generation), spelled as "
        "transformers' rope_parameters: {rope_type: linear|dynamic|yarn|llama3|longrope, factor, "
        "original_max_position_embeddings, ...} (null = none, or with init_from the checkpoint's; "
        "{rope_type: default} drops the checkpoint's).",
        shown_type="{rope_type, factor, original_max_position_embeddings, ...} or null",
    )
    tie_embeddings: bool = option(False, "Share the input embedding and the LM head.")
    loss_backend: LossBackendName = option(
        "auto",
        "Training cross-entropy: auto (liger-kernel's fused kernel on CUDA when installed, else chunked), chunked "
        "(plain torch, any device), liger, or plain (materialises the (B, T, V) logits). Only plain returns logits "
        "with the loss.",
    )
    loss_chunk_mib: float = option(
        256.0, "chunked loss: tokens per chunk are chosen so that one chunk's fp32 logits take at most this many MiB."
    )
    attn_backend: AttnBackendName = option(
        "auto", "Attention backend: auto, eager, sdpa, triton, flash (flash-attn 2), flex (FlexAttention; document "
        "masks only), or flash-attn-4: fa4 (E as a second call), fa4_wide (one call, values [V ‖ E]), fa4_wide_fwd "
        "(that forward, a two-call backward) or fa4_padded (q, k padded to 2D).",
    )
    activation_checkpointing: bool = option(False, "Recompute each layer in backward to save activation memory.")
    tiled_mlp: int | Literal["auto"] = option(
        0,
        "Tiled MLP: SwiGLU and TAPE's MLP-side update of E run over this many chunks of each sequence's (this rank's) "
        "tokens and are recomputed chunk by chunk in backward, so their (B, T, ffn) intermediates are never kept "
        "whole (ALST's TiledMLP). 0 or 1 = off; auto = ceil(tokens / d_model) chunks. Same results; one more MLP "
        "forward per step. With or without sequence parallelism.",
    )
    compile: bool = option(
        False,
        "torch.compile each decoder layer (as torchtitan): fuses norms, rotations and TAPE's state updates. The first "
        "steps are slower while it compiles; not with ZeRO-3.",
    )
    causal: bool = option(True, "Causal (decoder) masking; False only for equivariance tests.")
    init_std: float = option(0.02, "Std of the normal init of linear and embedding weights.")
    tape_attn_update: bool = option(True, "TAPE: attention-side update E += (A·E) W_A (ablation switch).")
    tape_mlp_update: bool = option(True, "TAPE: MLP-side position update (ablation switch).")
    tape_channels: int | None = option(None, "TAPE: MLP-update channels I (None = 4·n_heads).")
    tape_head_mix: TapeHeadMixName = option(
        "full", "TAPE: W_A as a full head-mixing M×M matrix ('full', the paper) or a per-head gain ('gain', the code)."
    )
    tape_equivariant: bool = option(
        True,
        "TAPE: keep the MLP update equivariant (contract heads only). false = the ablation without the equivariance "
        "constraints, as the official code's non-equivariant variant: the update mixes all heads × frequencies.",
    )
    tape_fused_updates: bool | Literal["auto"] = option(
        "auto",
        "TAPE: run E's updates (the q/k rotation by E, the head mix and the MLP-side update) as fused Triton kernels "
        "that never write the (B, T, I, D) intermediates. auto = on a GPU where they passed their gpu-marked tests "
        "(the kernel record), eager elsewhere; true = always (on CPU only under TRITON_INTERPRET=1, for "
        "checks); false = eager. Same results; the non-equivariant ablation always runs eager.",
    )
    tape_layers: list[int] | None = option(
        None,
        "TAPE: indices of the layers that update E (null = all; the last layer's update is never built, as the final "
        "E is dropped). Other layers pass E on unchanged (the paper's ablation of TAPE in a subset of layers).",
    )
    randpe_max_position: int | None = option(
        None,
        "randpe: positions are a sorted random subset of [0, this) (null = 2·max_seq_len, the TAPE paper's baseline).",
    )
    randpe_sample_at_eval: bool = option(
        True, "randpe: draw random positions at evaluation too, as the TAPE paper's baseline (false = 0..T−1 at eval)."
    )
    randpe_per_layer: bool = option(
        True,
        "randpe: every layer draws its own positions, as the TAPE paper's baseline (false = one draw for all layers).",
    )
    xpos_scale_base: float = option(
        2048.0, "xpos: decay length scale γ (2048, the TAPE paper's baseline); logits decay as ζ^((i−j)/γ)."
    )
    fire_hidden: int = option(32, "fire: hidden width of the bias MLP.")
    fire_shared: bool = option(
        False, "fire: one FIRE module for all layers (false = one per layer, the TAPE paper's baseline)."
    )
    fire_init_c: float = option(0.1, "fire: initial c of ψ(x) = log(|c·x| + 1) (0.1, the baseline).")
    fire_init_threshold: float = option(
        512.0, "fire: L₀ of the threshold L = |m·L₀|, m a learned multiplier starting at 1 (512, the baseline)."
    )
    abacus: bool = option(
        False,
        "Abacus digit-place embeddings (McLeish et al. 2024; the TAPE paper's arithmetic): every digit token also "
        "gets a learned embedding of its place in its number (1st, 2nd, ... digit, in token order), any PE.",
    )
    abacus_digit_ids: list[int] = option(
        [4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
        "abacus: the token ids of the digits (default: 0-9 of `tapetrain data arith`'s character vocabulary).",
    )
    abacus_max_places: int = option(256, "abacus: places with an embedding (longest number + training offset).")
    abacus_train_offset: int = option(
        100,
        "abacus: while training, every place of a sequence is shifted by a random offset in [0, this), drawn from "
        "(run.seed, the sample's slot in the data order), so longer numbers' places are trained (0 = none; none at "
        "evaluation).",
    )
    s2_attn: bool = option(
        False, "LongLoRA shifted sparse attention while training (full attention at evaluation); rope/nope only."
    )
    s2_attn_group_fraction: float = option(0.25, "S²-Attn group size as a fraction of the sequence length.")

    def __post_init__(self) -> None:
        if self.rope_scaling is not None:  # a mapping from model_config.json or a Python caller
            self.rope_scaling = RopeScaling.from_value(self.rope_scaling)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def qkv_bias(self) -> bool:
        """q, k and v projections with biases (Qwen2/2.5)."""
        return self.family == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm of q and k before the rotation (Qwen3)."""
        return self.family == "qwen3"

    @property
    def rope_parameters(self) -> dict:
        """rope_theta, pi_factor and rope_scaling as one dict in transformers' spelling (rope_scaling.py)."""
        scaling = self.rope_scaling.as_dict() if self.rope_scaling is not None else None
        return rope_parameters(self.rope_theta, self.pi_factor, scaling)

    @property
    def attention_scale(self) -> float | None:
        """The logit scale: 1/√D times the square of the scaling's attention factor (yarn, longrope); None = the
        backends' default 1/√D. On the logits only, never on TAPE's E."""
        factor = rope_attention_factor(self.rope_parameters)
        return None if factor == 1.0 else factor**2 / math.sqrt(self.head_dim)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        hidden = int(2 * (4 * self.d_model) / 3)
        return 256 * ((hidden + 255) // 256)

    @property
    def tape_dim(self) -> int:
        return self.tape_channels or 4 * self.n_heads

    def updates_tape_state(self, layer: int) -> bool:
        """Whether layer `layer` has TAPE's E updates: pe=tape, not the last layer, and in tape_layers if set."""
        if self.pe != "tape" or layer >= self.n_layers - 1:
            return False
        return self.tape_layers is None or layer in self.tape_layers

    def carries_e(self, layer: int) -> bool:
        """Whether layer `layer`'s attention carries TAPE's E as extra value channels ([V ‖ E], one softmax): a layer
        that updates E with the attention-side update (model.tape_attn_update)."""
        return self.e_in_attention(self.updates_tape_state(layer))

    def e_in_attention(self, updates_state: bool) -> bool:
        """`carries_e` for a layer that does (or does not) update E: the memory model's per-kind-of-layer terms."""
        return self.pe == "tape" and updates_state and self.tape_attn_update

    @property
    def shift_invariant(self) -> bool:
        """Whether logits are unchanged by a global position offset (what train.random_position_offset needs).
        FIRE normalises by the absolute query position; TAPE without its equivariance constraints mixes the
        frequencies of E. Every other encoding sees only position differences."""
        return self.pe != "fire" and not (self.pe == "tape" and not self.tape_equivariant)

    def validate(self) -> ModelConfig:
        def fail(key: str, problem: str, fix: str) -> None:
            raise ConfigError(f"model.{key}: {problem}; {fix}")

        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            if getattr(self, key) <= 0:
                fail(key, f"must be positive, got {getattr(self, key)}", "set a positive integer")
        if self.pe not in POSITIONAL_ENCODINGS:
            fail("pe", f"unknown positional encoding {self.pe!r}", f"choose one of {', '.join(POSITIONAL_ENCODINGS)}")
        if self.head_size is not None and self.head_size <= 0:
            fail("head_size", f"must be positive, got {self.head_size}", "set null for d_model / n_heads")
        if self.family not in FAMILIES:
            fail("family", f"unknown family {self.family!r}", f"choose one of {', '.join(FAMILIES)}")
        if self.head_size is None and self.d_model % self.n_heads:
            fail(
                "n_heads",
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}",
                "choose n_heads dividing d_model (e.g. d_model=768, n_heads=12)",
            )
        if self.n_kv_heads is not None and (self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads):
            fail(
                "n_kv_heads",
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}",
                "choose n_kv_heads dividing n_heads (or null for multi-head attention)",
            )
        if self.pe in ROTARY_ENCODINGS and self.head_dim % 2:
            fail(
                "n_heads",
                f"pe={self.pe} rotates pairs of dims but the head dim d_model/n_heads={self.head_dim} is odd",
                "choose d_model and n_heads with an even head dim",
            )
        if self.pi_factor <= 0:
            fail("pi_factor", f"must be > 0, got {self.pi_factor}", "use 1 for no interpolation")
        if self.rope_theta <= 1:
            fail("rope_theta", f"must be > 1, got {self.rope_theta}", "use 10000 (Llama) or larger")
        self._validate_rope_scaling(fail)
        if self.tape_head_mix not in TAPE_HEAD_MIX:
            fail("tape_head_mix", f"got {self.tape_head_mix!r}", "choose 'full' or 'gain'")
        if self.ffn_hidden is not None and self.ffn_hidden <= 0:
            fail("ffn_hidden", f"must be positive, got {self.ffn_hidden}", "set null for the Llama default")
        if self.tape_channels is not None and self.tape_channels <= 0:
            fail("tape_channels", f"must be positive, got {self.tape_channels}", "set null for 4·n_heads")
        if self.tape_layers is not None:
            bad = [i for i in self.tape_layers if not isinstance(i, int) or not 0 <= i < self.n_layers]
            if bad or len(set(self.tape_layers)) != len(self.tape_layers):
                fail("tape_layers", f"{self.tape_layers} holds duplicates or indices outside 0..{self.n_layers - 1}",
                     f"list distinct layer indices in 0..{self.n_layers - 1}, or null for all layers")
            if self.pe != "tape":
                fail("tape_layers", f"applies to pe=tape, not pe={self.pe}", "set it to null")
        if self.randpe_max_position is not None and self.randpe_max_position < self.max_seq_len:
            fail("randpe_max_position", f"{self.randpe_max_position} < max_seq_len={self.max_seq_len} leaves no "
                 "room to draw training positions", "set null (2·max_seq_len) or at least max_seq_len")
        if not self.xpos_scale_base > 0:
            fail("xpos_scale_base", f"must be > 0, got {self.xpos_scale_base}", "use 2048")
        if self.fire_hidden <= 0 or not self.fire_init_threshold > 0:
            fail("fire_hidden" if self.fire_hidden <= 0 else "fire_init_threshold",
                 f"must be positive, got {self.fire_hidden} / {self.fire_init_threshold}", "use 32 / 512")
        if self.s2_attn and self.pe not in ("rope", "nope"):
            fail("s2_attn", f"shifted sparse attention is implemented for rope and nope, not {self.pe}", "set false")
        if not 0 < self.s2_attn_group_fraction <= 1:
            fail("s2_attn_group_fraction", f"must be in (0, 1], got {self.s2_attn_group_fraction}", "use 0.25")
        self._validate_abacus(fail)
        if self.loss_backend not in LOSS_BACKENDS:
            fail("loss_backend", f"unknown backend {self.loss_backend!r}", f"choose one of {', '.join(LOSS_BACKENDS)}")
        if not self.loss_chunk_mib > 0:
            fail("loss_chunk_mib", f"must be > 0, got {self.loss_chunk_mib}", "use e.g. 256 (MiB of fp32 logits)")
        if self.tiled_mlp != "auto" and (isinstance(self.tiled_mlp, bool) or not isinstance(self.tiled_mlp, int)
                                         or self.tiled_mlp < 0):
            fail("tiled_mlp", f"must be a chunk count >= 0 or 'auto', got {self.tiled_mlp!r}", "use 0 (off), 4 or auto")
        if self.tape_fused_updates not in (True, False, "auto"):
            fail("tape_fused_updates", f"must be true, false or auto, got {self.tape_fused_updates!r}", "use auto")
        if self.attn_backend not in ATTN_BACKENDS:
            fail("attn_backend", f"unknown backend {self.attn_backend!r}", f"choose one of {', '.join(ATTN_BACKENDS)}")
        return self

    def _validate_abacus(self, fail) -> None:
        ids = self.abacus_digit_ids
        if not ids or len(set(ids)) != len(ids) or any(not isinstance(i, int) or not 0 <= i < self.vocab_size
                                                       for i in ids):
            fail("abacus_digit_ids", f"{ids} must be distinct token ids in 0..{self.vocab_size - 1}",
                 "list the ids of the digit tokens (4..13 for `tapetrain data arith`)")
        if self.abacus_max_places < 1:
            fail("abacus_max_places", f"must be >= 1, got {self.abacus_max_places}", "use e.g. 256")
        if not 0 <= self.abacus_train_offset < self.abacus_max_places:
            fail("abacus_train_offset", f"{self.abacus_train_offset} must be in [0, abacus_max_places="
                 f"{self.abacus_max_places})", "lower it, or raise model.abacus_max_places")

    def _validate_rope_scaling(self, fail) -> None:
        scaling = self.rope_scaling
        kind = scaling.rope_type if scaling is not None else "default"
        if kind != "default" or self.pi_factor != 1.0:
            if self.pe not in ROTARY_ENCODINGS:
                key = "rope_scaling" if kind != "default" else "pi_factor"
                fail(key, f"scales rotary angles, and pe={self.pe} has none",
                     f"use it with pe in {', '.join(ROTARY_ENCODINGS)}, or remove it")
        if scaling is None:
            return
        scaling.validate(self.head_dim)
        if self.pi_factor != 1.0 and kind != "default":
            same = kind == "linear" and scaling.factor == self.pi_factor
            if not same:
                fail("pi_factor", f"pi_factor={self.pi_factor} is linear scaling, i.e. rope_scaling {{rope_type: "
                     f"linear, factor: {self.pi_factor}}}, and rope_scaling says rope_type {kind} factor "
                     f"{scaling.factor}", "set only one of them (pi_factor: 1.0 to keep rope_scaling)")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            import difflib

            hints = [
                f"{k!r} (did you mean {difflib.get_close_matches(k, known, 1)[0]!r}?)"
                if difflib.get_close_matches(k, known, 1)
                else repr(k)
                for k in unknown
            ]
            raise ConfigError(f"model: unknown key(s) {', '.join(hints)}; valid keys: {', '.join(sorted(known))}")
        return cls(**values).validate()

"""Configuration of a tapetrain decoder exported to Hugging Face format (loaded with trust_remote_code=True).

Self-contained: copied next to the weights by `tapetrain export hf`; it must not import tapetrain.
Field names follow Llama's where the meaning is the same (hidden_size, num_hidden_layers, ...).
"""

try:  # transformers >= 5
    from transformers import PreTrainedConfig
except ImportError:  # transformers 4.x
    from transformers import PretrainedConfig as PreTrainedConfig

POSITIONAL_ENCODINGS = ("tape", "rope", "nope", "alibi", "randpe", "xpos", "fire")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # llama/mistral plain, qwen2 q/k/v biases, qwen3 q/k RMSNorm


class TapetrainConfig(PreTrainedConfig):
    model_type = "tapetrain"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 768,
        intermediate_size: int = 2048,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,  # None = hidden_size / num_attention_heads
        family: str = "llama",  # the layer layout: llama, mistral, qwen2 (q/k/v biases), qwen3 (q/k RMSNorm)
        max_position_embeddings: int = 1024,  # the training context; longer inputs run (extrapolation)
        rms_norm_eps: float = 1e-5,
        pe: str = "tape",  # tape, rope, nope, alibi, randpe, xpos or fire
        rope_theta: float = 10000.0,
        pi_factor: float = 1.0,  # linear position interpolation: positions are divided by this
        rotary_scaling: dict | None = None,  # RoPE scaling as transformers' rope_parameters (without rope_theta)
        tape_attn_update: bool = True,  # TAPE: E += (A·E) W_A
        tape_mlp_update: bool = True,  # TAPE: E += W_down(SiLU(W_x m) ⊙ W_up E)
        tape_channels: int | None = None,  # TAPE: MLP-update channels I (None = 4 · heads)
        tape_head_mix: str = "full",  # TAPE: W_A as a full heads×heads matrix or a per-head 'gain'
        tape_equivariant: bool = True,  # False: the ablation whose MLP update mixes heads × frequencies
        tape_layers: list[int] | None = None,  # TAPE: layers that update E (None = all but the last)
        randpe_max_position: int | None = None,  # randpe: positions from [0, this) (None = 2 · max positions)
        randpe_sample_at_eval: bool = True,  # randpe: random positions at evaluation too (not with a KV cache)
        randpe_per_layer: bool = True,  # randpe: every layer draws its own positions
        xpos_scale_base: float = 2048.0,  # xpos: decay length scale γ
        fire_hidden: int = 32,
        fire_shared: bool = False,  # fire: one module for all layers instead of one per layer
        fire_init_c: float = 0.1,
        fire_init_threshold: float = 512.0,  # fire: L₀ of L = |m · L₀|
        abacus: bool = False,  # Abacus digit-place embeddings (McLeish et al. 2024)
        abacus_digit_ids: list[int] | None = None,  # abacus: the digit tokens' ids
        abacus_max_places: int = 256,  # abacus: places with an embedding
        abacus_train_offset: int = 100,  # abacus: random place offset in [0, this) while training
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        **kwargs,
    ):
        if pe not in POSITIONAL_ENCODINGS:
            raise ValueError(f"pe={pe!r} is not one of {', '.join(POSITIONAL_ENCODINGS)}")
        if family not in FAMILIES:
            raise ValueError(f"family={family!r} is not one of {', '.join(FAMILIES)}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.family = family
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.pe = pe
        self.rope_theta = rope_theta
        self.pi_factor = pi_factor
        self.rotary_scaling = dict(rotary_scaling) if rotary_scaling else None
        self.tape_attn_update = tape_attn_update
        self.tape_mlp_update = tape_mlp_update
        self.tape_channels = tape_channels
        self.tape_head_mix = tape_head_mix
        self.tape_equivariant = tape_equivariant
        self.tape_layers = list(tape_layers) if tape_layers is not None else None
        self.randpe_max_position = randpe_max_position
        self.randpe_sample_at_eval = randpe_sample_at_eval
        self.randpe_per_layer = randpe_per_layer
        self.xpos_scale_base = xpos_scale_base
        self.fire_hidden = fire_hidden
        self.fire_shared = fire_shared
        self.fire_init_c = fire_init_c
        self.fire_init_threshold = fire_init_threshold
        self.abacus = abacus
        self.abacus_digit_ids = list(abacus_digit_ids) if abacus_digit_ids is not None else list(range(4, 14))
        self.abacus_max_places = abacus_max_places
        self.abacus_train_offset = abacus_train_offset
        self.initializer_range = initializer_range
        # Passed up, not set here: transformers 4.x's base __init__ would overwrite them with its defaults.
        super().__init__(
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            **kwargs,
        )

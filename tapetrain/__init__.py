"""tapetrain: DeepSpeed-based distributed pretraining of transformers with TAPE positional encoding."""

__version__ = "0.1.0"

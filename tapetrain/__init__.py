"""tapetrain: DeepSpeed-based distributed pretraining of transformers with TAPE positional encoding."""

from tapetrain import import_noise

__version__ = "0.1.0"

import_noise.install()  # before anything imports torchao (transformers does when it is installed)

"""Remote code for exported non-RoPE models: copied next to the weights by `tapetrain export hf`.

The two modules here must stay self-contained (no tapetrain import): the export loads where tapetrain is not
installed. `MODELING_FILES` lists what the export copies.
"""

import os

HERE = os.path.dirname(os.path.abspath(__file__))
MODELING_FILES = ("configuration_tapetrain.py", "modeling_tapetrain.py")
AUTO_MAP = {
    "AutoConfig": "configuration_tapetrain.TapetrainConfig",
    "AutoModelForCausalLM": "modeling_tapetrain.TapetrainForCausalLM",
}

#!/usr/bin/env python
"""Export a tapetrain run's checkpoint to a Hugging Face model directory (= `tapetrain export hf`).

    python tools/convert_to_hf.py RUN_DIR [--step N] --out HF_DIR [--dtype fp32|bf16|fp16]
"""

import sys

from tapetrain.cli import main

if __name__ == "__main__":
    sys.exit(main(["export", "hf", *sys.argv[1:]], prog="tools/convert_to_hf.py"))

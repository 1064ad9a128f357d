#!/usr/bin/env python
"""Export a tapetrain run's checkpoint to a Hugging Face model directory (same as `tapetrain export-hf`).

    python tools/convert_to_hf.py RUN_DIR [--step N] --out HF_DIR [--dtype fp32|bf16|fp16]
"""

import argparse
import logging
import sys

from tapetrain.eval.cli import configure_export_parser

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = configure_export_parser(argparse.ArgumentParser(description=__doc__)).parse_args()
    sys.exit(args.func(args))

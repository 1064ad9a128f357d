#!/usr/bin/env python
"""Perplexity across context lengths (same as `tapetrain eval-ppl`); several ranks under torchrun/deepspeed.

    python tools/eval_ppl.py MODEL --data PATH [--lengths 1024,2048,4096,8192] [--stride N] [--out R.json]
    torchrun --nproc_per_node 8 tools/eval_ppl.py MODEL --data PATH ...
"""

import argparse
import logging
import sys

from tapetrain.eval.cli import configure_eval_ppl_parser

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = configure_eval_ppl_parser(argparse.ArgumentParser(description=__doc__)).parse_args()
    sys.exit(args.func(args))

#!/usr/bin/env python
"""Passkey retrieval across context lengths (same as `tapetrain eval-passkey`).

    python tools/eval_passkey.py MODEL [--lengths 1024,2048,4096,8192] [--trials 20] [--out R.json] [--plot P.png]
"""

import argparse
import logging
import sys

from tapetrain.eval.cli import configure_eval_passkey_parser

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = configure_eval_passkey_parser(argparse.ArgumentParser(description=__doc__)).parse_args()
    sys.exit(args.func(args))

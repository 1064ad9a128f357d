#!/usr/bin/env python
"""Perplexity across context lengths (= `tapetrain eval ppl`); several ranks under torchrun/deepspeed.

    python tools/eval_ppl.py MODEL --data PATH [--lengths 1024,2048,4096,8192] [--stride N] [--out R.json]
    torchrun --nproc_per_node 8 tools/eval_ppl.py MODEL --data PATH ...
"""

import sys

from tapetrain.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "ppl", *sys.argv[1:]], prog="tools/eval_ppl.py"))

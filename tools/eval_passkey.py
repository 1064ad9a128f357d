#!/usr/bin/env python
"""Passkey retrieval across context lengths (= `tapetrain eval passkey`).

    python tools/eval_passkey.py MODEL [--lengths 1024,2048,4096,8192] [--trials 20] [--out R.json] [--plot P.png]
"""

import sys

from tapetrain.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "passkey", *sys.argv[1:]], prog="tools/eval_passkey.py"))

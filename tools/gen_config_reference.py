"""Rewrite the README's configuration reference from the config dataclasses (tests fail when it is stale).

    python tools/gen_config_reference.py          # update README.md in place
"""

from __future__ import annotations

import sys
from pathlib import Path

from tapetrain.config.reference import render_reference

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def with_reference(text: str) -> str:
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{render_reference().strip()}\n{END}{tail}"


def main() -> int:
    text = README.read_text()
    README.write_text(with_reference(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())

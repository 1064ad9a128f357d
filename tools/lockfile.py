"""Read the hashed lock files in requirements/ (pip-compile's format: `name==version \\` then `--hash=` lines).

    python tools/lockfile.py pins LOCK NAME[==FALLBACK] ...   name==version for each NAME, the lock's version where
                                                             the lock has NAME, else the ==FALLBACK given
    python tools/lockfile.py without LOCK NAME ...            the lock's entries (with their hashes) except NAME's

`make gpu-wheels` takes its versions from the first, `make setup TORCH_SPEC=...` (a torch of your choice) installs
the second. No third-party imports: it runs under the bare Python that creates .venv.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;\\]+)")


def normalize(name: str) -> str:
    """PEP 503 name: lowercase, runs of -_. become one '-'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def entries(text: str) -> dict[str, tuple[str, str]]:
    """normalized name -> (version, the entry's text: its pin line and continuation lines, comments dropped)."""
    out: dict[str, tuple[str, str]] = {}
    name = None
    for line in text.splitlines():
        match = _ENTRY.match(line)
        if match:
            name = normalize(match.group(1))
            out[name] = (match.group(3), line)
        elif name and line.startswith(" ") and not line.strip().startswith("#"):
            out[name] = (out[name][0], out[name][1] + "\n" + line)
        elif not line.startswith(" "):
            name = None
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("pins", "without"):
        print(__doc__, file=sys.stderr)
        return 2
    command, lock, names = argv[0], Path(argv[1]), argv[2:]
    locked = entries(lock.read_text())
    if command == "pins":
        pins = []
        for spec in names:
            name, _, fallback = spec.partition("==")
            if normalize(name) in locked:
                pins.append(f"{name}=={locked[normalize(name)][0]}")
            elif fallback:
                pins.append(spec)
            else:
                print(f"lockfile.py: {name} is not in {lock} and has no ==fallback", file=sys.stderr)
                return 1
        print(" ".join(pins))
    else:
        drop = {normalize(n) for n in names}
        print("\n".join(text for name, (_, text) in locked.items() if name not in drop))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

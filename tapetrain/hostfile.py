"""DeepSpeed hostfiles, checked before a multi-node launch (launch/multi_node.sh runs `python -m tapetrain.hostfile`).

DeepSpeed's runner raises a ValueError traceback on a malformed line and, worse, accepts a line with trailing junk
(`node1 slots=8 gpu`, `node1 slots=8x`): the job starts and rank 0 waits for ranks that never come. Here every line
is `HOST slots=N` (N >= 1), optionally followed by a `# comment`; blank lines and `#` lines are skipped, as DeepSpeed
skips them. Standard library only: the launch script runs this before any heavy import.
"""

from __future__ import annotations

import re
import sys
from typing import NamedTuple

from tapetrain.errors import InputError

ENTRY = re.compile(r"(?P<host>[^\s#]+)\s+slots=(?P<slots>\d+)\s*(#.*)?")
FORM = "'HOST slots=N'"


class Node(NamedTuple):
    host: str
    slots: int
    line: int


def parse_hostfile(path: str) -> list[Node]:
    """The nodes of a hostfile, in order (node i is NODE_RANK=i); InputError naming the first bad line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"cannot read hostfile {path} ({err}); pass a text file of {FORM} lines") from None
    nodes: list[Node] = []
    for number, raw in enumerate(lines, start=1):
        node = _parse_line(path, number, raw)
        if node is None:
            continue
        first = next((n for n in nodes if n.host == node.host), None)
        if first is not None:
            raise InputError(
                f"{path}:{number}: {raw.strip()!r} names {node.host} a second time (first on line "
                f"{first.line}); list every host once, as {FORM}"
            )
        nodes.append(node)
    if not nodes:
        raise InputError(f"{path}: no hosts; write one {FORM} line per node (e.g. 'node0 slots=8')")
    return nodes


def _parse_line(path: str, number: int, raw: str) -> Node | None:
    line = raw.strip()
    if not line or line.startswith("#"):
        return None
    match = ENTRY.fullmatch(line)
    if match is None or int(match["slots"]) < 1:
        raise InputError(
            f"{path}:{number}: {line!r} is not a hostfile entry; write {FORM} (N >= 1 GPUs on HOST, "
            "e.g. 'node0 slots=8'), one per line; '#' comments and blank lines are allowed"
        )
    return Node(match["host"], int(match["slots"]), number)


def describe(nodes: list[Node]) -> str:
    """`2 nodes, 16 ranks: node0 (NODE_RANK=0, 8 slots), node1 (NODE_RANK=1, 8 slots)`."""
    listed = ", ".join(f"{n.host} (NODE_RANK={i}, {n.slots} slots)" for i, n in enumerate(nodes))
    return f"{len(nodes)} nodes, {sum(n.slots for n in nodes)} ranks: {listed}"


def main(argv: list[str]) -> int:
    """`python -m tapetrain.hostfile HOSTFILE`: prints the first host, then the description; exit 2 if malformed."""
    if len(argv) != 1:
        print("usage: python -m tapetrain.hostfile HOSTFILE", file=sys.stderr)
        return 2
    try:
        nodes = parse_hostfile(argv[0])
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(nodes[0].host)
    print(describe(nodes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

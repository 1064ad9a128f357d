"""A checkpoint's manifest.json: every file's size and xxh3-64 checksum, so a resume can tell an intact checkpoint
from a damaged one before it trusts it (a truncated or flipped file otherwise fails deep inside torch.load, or
worse, loads).

Written last by a save (after trainer_state.json, atomically), inside the .tmp directory before it is renamed
complete. Hashing is spread over the ranks (each reads a share of the files; the shared filesystem that
checkpoints already assume makes every file visible to every rank) and runs off the training thread: each rank
writes its share as a part file (manifest.rankNNNNN.json, tapetrain.checkpoint.completion), rank 0 merges them.
xxh3-64 hashes ~25 GiB/s in memory on one core, so the cost is reading the checkpoint once, which the page cache
usually serves right after a save.

trainer_state.json records `"manifest": "manifest.json"`, so a checkpoint that should have a manifest and lacks
one is damaged; a checkpoint without that key was written before manifests existed and stays resumable unchecked.
Imports neither torch nor deepspeed (`tapetrain data verify` uses it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tapetrain import atomic_io

MANIFEST = "manifest.json"
PART = re.compile(r"^manifest\.rank\d{5}\.(json|failed)$")  # one rank's share, removed once merged
STATE_FILE = "trainer_state.json"
ALGORITHM = "xxh3_64"
_BLOCK = 8 << 20


@dataclass(frozen=True)
class Defect:
    """Why a checkpoint cannot be trusted: `kind` is 'damaged' or 'incomplete'; `detail` names the file."""

    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}, {self.detail}"


INCOMPLETE = Defect(
    "incomplete", f"no {STATE_FILE} (a save writes it last: the save did not finish, or the file was deleted)"
)


def checksum(path: Path) -> str:
    import xxhash

    digest = xxhash.xxh3_64()
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_files(checkpoint: Path) -> list[str]:
    """Every file of a checkpoint, relative and sorted, but the manifest itself, its parts and leftover temp files
    (a part another rank writes while this one lists is no checkpoint file either)."""
    return sorted(
        str(p.relative_to(checkpoint))
        for p in checkpoint.rglob("*")
        if p.is_file() and p.name != MANIFEST and not PART.match(p.name) and not p.name.endswith(".tmp")
    )


def describe(checkpoint: Path, names: list[str]) -> dict[str, dict]:
    """name -> {"bytes", ALGORITHM} for `names`; a file that cannot be read is left out (reported as missing)."""
    entries = {}
    for name in names:
        path = checkpoint / name
        try:
            entries[name] = {"bytes": path.stat().st_size, ALGORITHM: checksum(path)}
        except OSError:
            pass
    return entries


def describe_strict(checkpoint: Path, names: list[str]) -> dict[str, dict]:
    """describe(), but a file that cannot be read raises OSError: a save must not leave a file out of its manifest."""
    return {name: {"bytes": (checkpoint / name).stat().st_size, ALGORITHM: checksum(checkpoint / name)}
            for name in names}


def describe_shared(checkpoint: Path, names: list[str]) -> dict[str, dict]:
    """describe() with the files spread over the ranks of the process group (collective when there is one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return describe(checkpoint, names)
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, describe(checkpoint, names[rank::world]))
    return {name: entry for part in gathered for name, entry in part.items()}


def write_manifest(checkpoint: Path, entries: dict[str, dict], hashed_by: dict[str, str] | None = None) -> None:
    """manifest.json, atomically (temp name, fsync, rename): it exists whole or not at all. `hashed_by`: rank ->
    the thread that hashed its share (shows that a save hashed off the training thread)."""
    payload: dict = {"algorithm": ALGORITHM, "files": dict(sorted(entries.items()))}
    if hashed_by:
        payload["hashed_by"] = hashed_by
    atomic_io.write_json(checkpoint / MANIFEST, payload, indent=1, newline=False)


def read_state(checkpoint: Path) -> dict | Defect:
    """trainer_state.json, or the Defect that makes it unusable."""
    path = checkpoint / STATE_FILE
    if not path.is_file():
        return INCOMPLETE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return Defect("damaged", f"{checkpoint.name}/{STATE_FILE} is unreadable ({err})")
    return state if isinstance(state, dict) else Defect("damaged", f"{checkpoint.name}/{STATE_FILE} is not an object")


def find_defect(checkpoint: Path, describe_files: Callable[[Path, list[str]], dict] = describe) -> Defect | None:
    """The first reason not to trust `checkpoint` (None: intact, or written before manifests and readable).

    Sizes first (cheap, catches truncation), then every checksum; `describe_files` is describe_shared in a
    training job. Collective whenever describe_files is: every rank must call it for the same checkpoint."""
    if not (checkpoint / STATE_FILE).is_file():  # written last: its absence means incomplete, not damaged
        return INCOMPLETE
    manifest_path = checkpoint / MANIFEST
    listed = None
    if manifest_path.is_file():
        try:
            listed = json.loads(manifest_path.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            listed = Defect("damaged", f"{checkpoint.name}/{MANIFEST} is unreadable ({err})")
    if isinstance(listed, dict):
        sizes = _size_defect(checkpoint, listed)
        found = describe_files(checkpoint, sorted(listed)) if sizes is None else {}  # collective: same on all ranks
        return sizes or _checksum_defect(checkpoint, listed, found) or _state_defect(checkpoint, expect_manifest=True)
    if isinstance(listed, Defect):
        return listed
    return _state_defect(checkpoint, expect_manifest=False)


def has_manifest(checkpoint: Path) -> bool:
    return (checkpoint / MANIFEST).is_file()


def _state_defect(checkpoint: Path, *, expect_manifest: bool) -> Defect | None:
    state = read_state(checkpoint)
    if isinstance(state, Defect):
        return state
    if not expect_manifest and state.get("manifest"):
        return Defect("damaged", f"{checkpoint.name}/{MANIFEST} is missing (its {STATE_FILE} says one was written)")
    return None


def _size_defect(checkpoint: Path, listed: dict[str, dict]) -> Defect | None:
    for name, entry in sorted(listed.items()):
        path = checkpoint / name
        if not path.is_file():
            return Defect("damaged", f"{checkpoint.name}/{name} is missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            return Defect("damaged", f"{checkpoint.name}/{name} has {size} bytes, the manifest lists {entry['bytes']}")
    return None


def _checksum_defect(checkpoint: Path, listed: dict[str, dict], found: dict[str, dict]) -> Defect | None:
    for name, entry in sorted(listed.items()):
        if name not in found:
            return Defect("damaged", f"{checkpoint.name}/{name} could not be read")
        if found[name][ALGORITHM] != entry[ALGORITHM]:
            return Defect(
                "damaged",
                f"{checkpoint.name}/{name} has {ALGORITHM} checksum {found[name][ALGORITHM]}, "
                f"the manifest lists {entry[ALGORITHM]} (the file changed after it was saved)",
            )
    return None


# ---- `tapetrain data verify RUN_DIR` --------------------------------------------------------------------------------

_STEP = re.compile(r"^step_\d{8}$")


def is_run_or_checkpoint(path: Path) -> bool:
    """A run directory or a checkpoint directory (a prepared dataset has a manifest.json too: not enough)."""
    return (path / "checkpoints").is_dir() or (path / STATE_FILE).is_file() or bool(_STEP.match(path.name))


def verify_checkpoints(path: Path) -> tuple[list[str], list[str]]:
    """(problems, notes) of every checkpoint in a run directory (or of one checkpoint directory): sizes and
    checksums against each manifest; checkpoints from before manifests and set-aside ones are notes."""
    problems: list[str] = []
    notes: list[str] = []
    if (path / "checkpoints").is_dir():
        children = sorted((path / "checkpoints").iterdir())
        checkpoints = [c for c in children if c.is_dir() and _STEP.match(c.name)]
        notes += [
            f"{c.name}: set aside by a resume (damaged or incomplete), not checked"
            for c in children
            if c.name.endswith(".damaged")
        ]
    else:
        checkpoints = [path]
    for checkpoint in checkpoints:
        defect = find_defect(checkpoint)
        if defect is not None:
            problems.append(f"{checkpoint.name}: {defect}")
        elif not has_manifest(checkpoint):
            notes.append(f"{checkpoint.name}: no manifest.json (written before checkpoint manifests), not checked")
    if not checkpoints:
        notes.append("no checkpoints")
    return problems, notes

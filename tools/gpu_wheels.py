"""The GPU machine's wheel set in parts that each fit one device call's carry (64 MiB with the repository), and
their installation there, part by part, on the warm machine.

    python tools/gpu_wheels.py split gpu-wheels [--max-mib 54] [--first NAME,...]   # here, after make gpu-wheels
    python tools/gpu_wheels.py install gpu-wheels/part-1 --site /tmp/tapetrain-gpu-site   # there, one call a part

`split` moves the wheels of a directory into part-1/, part-2/, ... of at most --max-mib each: whole wheels first
(largest first, into the first part with room), and a wheel larger than a part (nvidia-cutlass-dsl-libs-cu13,
92 MB) cut into byte chunks spread over parts. Every part holds manifest.json: each wheel's sha256 and size, and
where its chunks are. `install` copies a part's files into a staging directory that outlives the call
(/tmp/tapetrain-gpu-wheels), rejoins every wheel whose chunks are all there, checks its sha256 against the manifest
(so the wheel installed is byte for byte the one downloaded), and installs the wheels not installed yet with pip
(--no-deps --target SITE). It exits 0 when every wheel of the manifest is installed, 3 when some wait for a part
still to come, 1 on a checksum mismatch. Standard library and tapetrain.atomic_io only: it runs before anything
else is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from tapetrain.atomic_io import write_via  # stdlib only; gpu_check.sh puts the repository on PYTHONPATH

MIB = 2**20
MANIFEST = "manifest.json"
DEFAULT_MAX_MIB = 54  # a part plus the repository's ~9 MiB stay under the 64 MiB one call carries
DEFAULT_STAGE = Path("/tmp/tapetrain-gpu-wheels")
WAITING = 3


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def plan(sizes: dict[str, int], max_bytes: int) -> tuple[list[list[tuple[str, int, int]]], dict[str, int]]:
    """Parts as lists of (wheel, offset, length) pieces, and each wheel's chunk count. Whole wheels go largest
    first into the first part with room (first-fit decreasing); a wheel larger than a part is cut into chunks of
    at most `max_bytes`, each placed the same way."""
    pieces: list[tuple[str, int, int]] = []
    chunks: dict[str, int] = {}
    for name, size in sizes.items():
        n = max(1, -(-size // max_bytes))
        chunks[name] = n
        step = -(-size // n)
        pieces += [(name, off, min(step, size - off)) for off in range(0, size, step)] or [(name, 0, 0)]
    parts: list[list[tuple[str, int, int]]] = []
    room: list[int] = []
    for piece in sorted(pieces, key=lambda p: (-p[2], p[0], p[1])):
        for i, left in enumerate(room):
            if piece[2] <= left:
                parts[i].append(piece)
                room[i] -= piece[2]
                break
        else:
            parts.append([piece])
            room.append(max_bytes - piece[2])
    return parts, chunks


def normalised(name: str) -> str:
    """A distribution name as pip compares them ("Liger-Kernel" = "liger_kernel")."""
    return name.lower().replace("-", "_").replace(".", "_")


def distribution(wheel_name: str) -> str:
    """A wheel file's distribution name, normalised (the file name's first field; wheel names use '_' for '-')."""
    return normalised(wheel_name.split("-")[0])


def split(directory: Path, max_mib: float, first: list[str] | None = None) -> list[Path]:
    """Lay the wheels of `directory` out into part-N/ directories (see the module docstring); returns the parts.
    `first`: distributions that go, whole and alone, into part-1, so that its call can use them before the rest
    (the large flash-attn-4 set) has arrived."""
    wheels = sorted(directory.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"no wheels in {directory}: run `make gpu-wheels` (it downloads them, then splits)")
    sizes = {w.name: w.stat().st_size for w in wheels}
    wanted = {normalised(n) for n in first or []}
    early = {name: size for name, size in sizes.items() if distribution(name) in wanted}
    missing = sorted(wanted - {distribution(name) for name in early})
    if missing:
        raise SystemExit(f"--first names no wheel for: {', '.join(missing)} (in {directory})")
    max_bytes = int(max_mib * MIB)
    if sum(early.values()) > max_bytes:
        raise SystemExit(f"the --first wheels ({sum(early.values()) / MIB:.1f} MiB) do not fit one part of "
                         f"{max_mib} MiB: name fewer or raise --max-mib")
    for old in directory.glob("part-*"):
        shutil.rmtree(old)
    parts, chunks = plan(early, max_bytes) if early else ([], {})
    later, later_chunks = plan({n: s for n, s in sizes.items() if n not in early}, max_bytes)
    parts, chunks = parts + later, {**chunks, **later_chunks}
    manifest: dict = {"max_mib": max_mib, "parts": len(parts), "wheels": {}}
    for w in wheels:
        manifest["wheels"][w.name] = {"sha256": sha256(w), "size": sizes[w.name], "chunks": []}
    dirs = []
    for number, pieces in enumerate(parts, start=1):
        part = directory / f"part-{number}"
        part.mkdir()
        dirs.append(part)
        for name, offset, length in pieces:
            entry = manifest["wheels"][name]
            if chunks[name] == 1:
                shutil.copyfile(directory / name, part / name)
                entry["chunks"].append({"file": name, "part": number, "offset": 0, "size": length})
                continue
            index = offset // -(-sizes[name] // chunks[name])
            chunk = part / f"{name}.chunk-{index + 1}-of-{chunks[name]}"
            with (directory / name).open("rb") as src:
                src.seek(offset)
                chunk.write_bytes(src.read(length))
            entry["chunks"].append({"file": chunk.name, "part": number, "offset": offset, "size": length,
                                    "sha256": sha256(chunk)})
    for entry in manifest["wheels"].values():
        entry["chunks"].sort(key=lambda c: c["offset"])
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    for part in dirs:
        (part / MANIFEST).write_text(text)
    for w in wheels:  # the parts are the set now; the whole wheels would travel twice
        w.unlink()
    (directory / MANIFEST).write_text(text)
    return dirs


def _join(name: str, entry: dict, stage: Path) -> Path | None:
    """The wheel rebuilt in `stage` from its chunks there (None while one is missing); checked by sha256."""
    target = stage / name
    if target.exists() and sha256(target) == entry["sha256"]:
        return target
    files = [stage / c["file"] for c in entry["chunks"]]
    if not all(f.exists() for f in files):
        return None

    def join(partial: Path) -> None:
        with partial.open("wb") as out:
            for f in files:
                with f.open("rb") as src:
                    shutil.copyfileobj(src, out)
        got = sha256(partial)
        if got != entry["sha256"]:  # raising here removes the temp: no wrong wheel is ever in place
            raise ValueError(f"{name}: rejoined from {len(files)} chunk(s), sha256 {got} is not the manifest's "
                             f"{entry['sha256']}; copy the parts again (make gpu-wheels)")

    return write_via(target, join)


def install(part: Path, site: Path, stage: Path, python: str) -> int:
    manifest = json.loads((part / MANIFEST).read_text())
    stage.mkdir(parents=True, exist_ok=True)
    for f in part.iterdir():
        if f.name != MANIFEST and not (stage / f.name).exists():
            shutil.copyfile(f, stage / f.name)
    # Every complete wheel goes in with one pip call, also those an earlier part installed: pip --target --upgrade
    # replaces a top-level directory that exists, so wheels that share one (CuTe DSL's nvidia_cutlass_dsl/) must
    # be installed together, or the later part deletes the earlier one's files.
    ready, waiting = [], []
    for name, entry in sorted(manifest["wheels"].items()):
        if (stage / f"{name}.installed").exists():
            ready.append(stage / name)
            continue
        try:
            wheel = _join(name, entry, stage)
        except ValueError as err:
            print(f"gpu_wheels: {err}", file=sys.stderr)
            return 1
        if wheel is None:
            waiting.append(f"{name} (parts {sorted({c['part'] for c in entry['chunks']})})")
        else:
            ready.append(wheel)
    if any(not (stage / f"{wheel.name}.installed").exists() for wheel in ready):
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, ready)], check=True)
        for wheel in ready:
            (stage / f"{wheel.name}.installed").touch()
        print(f"gpu_wheels: installed {len(ready)} wheel(s) into {site} from {part.name} (all complete so far)")
    if waiting:
        print("gpu_wheels: waiting for another part: " + ", ".join(waiting))
        return WAITING
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("split", help="lay the downloaded wheels out into parts")
    p.add_argument("directory", type=Path)
    p.add_argument("--max-mib", type=float, default=DEFAULT_MAX_MIB, help=f"part size (default {DEFAULT_MAX_MIB})")
    p.add_argument("--first", default="", help="comma-separated distributions that travel alone in part-1")
    p = sub.add_parser("install", help="install what a part completes (on the GPU machine)")
    p.add_argument("part", type=Path, help="a part-N directory (or the whole set, every part present)")
    p.add_argument("--site", type=Path, required=True, help="pip --target directory (on PYTHONPATH)")
    p.add_argument("--stage", type=Path, default=DEFAULT_STAGE, help=f"kept across calls (default {DEFAULT_STAGE})")
    p.add_argument("--python", default=sys.executable, help="the interpreter whose pip installs")
    args = parser.parse_args(argv)
    if args.command == "split":
        first = [name for name in args.first.split(",") if name]
        for part in split(args.directory, args.max_mib, first):
            size = sum(f.stat().st_size for f in part.iterdir()) / MIB
            print(f"{part}: {size:.1f} MiB, {len(list(part.iterdir())) - 1} file(s)")
        return 0
    return install(args.part, args.site, args.stage, args.python)


if __name__ == "__main__":
    raise SystemExit(main())

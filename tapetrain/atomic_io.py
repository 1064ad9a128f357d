"""The one way package code puts a file (or a finished directory) in place.

Guarantee of every file writer here: the content goes to a hidden temp file in the target's directory (same
filesystem, so the rename is atomic), which is fsynced, given the project's file mode (file_modes: mkstemp
makes 0600), renamed over the target, and then the directory is fsynced so the rename survives a crash. On any
failure the temp file is removed and the target is left as it was. A reader sees the old file or the new one,
never half of one.

Lowest layer: imports nothing from tapetrain except file_modes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tapetrain.file_modes import use_umask_mode

PathLike = str | os.PathLike


def _fsync_file(path: PathLike) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(directory: PathLike) -> None:
    """Make a rename in `directory` durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_sibling(target: Path) -> Path:
    """A fresh hidden `.NAME.XXXX.tmp` next to `target`: the .tmp suffix is what the cleanup of prepare and of
    checkpoints already ignores or removes."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    return Path(tmp)


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def publish_file(src: PathLike, path: PathLike) -> Path:
    """Put the finished file `src` (same filesystem as `path`) at `path` with the guarantee above; `src` is
    removed if this fails."""
    src, path = Path(src), Path(path)
    try:
        _fsync_file(src)
        use_umask_mode(src)
        os.replace(src, path)
    except BaseException:
        _remove_quietly(src)
        raise
    _fsync_dir(path.parent)
    return path


def write_via(path: PathLike, write: Callable[[Path], Any], *, parents: bool = False) -> Path:
    """Call `write(tmp)` to fill a temp path next to `path` (for writers that need a file name: torch.save,
    savefig, copyfile), then publish it. `parents`: create missing parent directories first."""
    path = Path(path)
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(path)
    try:
        write(tmp)
    except BaseException:
        _remove_quietly(tmp)
        raise
    return publish_file(tmp, path)


def write_bytes(path: PathLike, data: bytes | memoryview, *, parents: bool = False) -> Path:
    def fill(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    return write_via(path, fill, parents=parents)


def write_text(path: PathLike, text: str, *, encoding: str = "utf-8", parents: bool = False) -> Path:
    return write_bytes(path, text.encode(encoding), parents=parents)


def write_lines(path: PathLike, lines: Any, *, parents: bool = False) -> Path:
    """Each item of the iterable `lines` plus a newline, streamed (for files too long to build as one string)."""

    def fill(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(line + "\n")

    return write_via(path, fill, parents=parents)


def write_json(path: PathLike, obj: Any, *, indent: int | None = 2, newline: bool = True, allow_nan: bool = True,
               parents: bool = False) -> Path:
    """`obj` as JSON. The options keep each caller's existing bytes: `indent`, a final `newline`, and
    `allow_nan=False` for strict JSON (the caller maps NaN to null first). Serialised before any file is made."""
    text = json.dumps(obj, indent=indent, allow_nan=allow_nan) + ("\n" if newline else "")
    return write_text(path, text, parents=parents)


def save_figure(fig: Any, path: PathLike, *, dpi: int = 120) -> Path:
    """A matplotlib figure as PNG (parent directories created)."""
    return write_via(path, lambda tmp: fig.savefig(tmp, format="png", dpi=dpi, bbox_inches="tight"), parents=True)


def publish_dir(tmp: PathLike, final: PathLike, aside: PathLike | None = None, *,
                remove_aside: bool = True) -> Path | None:
    """Put the finished directory `tmp` (a sibling of `final`) at `final`. An existing `final` is first renamed to
    `aside` (default: hidden `.NAME.old` next to it; a leftover there is removed) and then removed, unless
    `remove_aside` is False: then its path is returned for the caller to take files from and remove. The files in
    `tmp` are the caller's to have written durably; this makes the renames durable."""
    tmp, final = Path(tmp), Path(final)
    aside = Path(aside) if aside is not None else final.with_name(f".{final.name}.old")
    moved_aside = None
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
        moved_aside = aside
    try:
        os.replace(tmp, final)
    except BaseException:
        if moved_aside is not None:
            os.replace(moved_aside, final)  # never leave `final` missing
        raise
    _fsync_dir(final.parent)
    if moved_aside is not None and remove_aside:
        shutil.rmtree(moved_aside, ignore_errors=True)
        return None
    return moved_aside

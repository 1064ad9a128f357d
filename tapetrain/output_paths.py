"""Output paths checked before any work starts: a command that would fail to write its result at the end (a file
where a directory is needed, a read-only filesystem) says so at once, in one line naming the path and the option.

Nothing is created or written here: writability is asked of the kernel (access(2), which also reports a read-only
mount to root, for whom permission bits do not count).
"""

from __future__ import annotations

import os

from tapetrain.errors import InputError, UserError


def check_output_dir(path: str | os.PathLike, option: str, *, error: type[UserError] = InputError) -> None:
    """`path` is a directory the command fills (created, with its parents, if missing)."""
    target = os.path.abspath(path)
    if os.path.exists(target) and not os.path.isdir(target):
        raise error(f"{option} {path}: is a file, not a directory; choose another {option} (or move the file)")
    _require_creatable(target, option, path, error)


def check_output_file(path: str | os.PathLike, option: str, *, error: type[UserError] = InputError) -> None:
    """`path` is a file the command writes or replaces (its directory created if missing)."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        raise error(f"{option} {path}: is a directory; name a file, e.g. {os.path.join(str(path), 'out.json')}")
    _require_creatable(os.path.dirname(target), option, path, error)


def _require_creatable(directory: str, option: str, given: str | os.PathLike, error: type[UserError]) -> None:
    """`directory` exists and is writable, or its nearest existing ancestor is a writable directory."""
    existing = _nearest_existing(directory)
    if not os.path.isdir(existing):
        raise error(
            f"{option} {given}: {existing} is a file, so no directory can be created under it; choose another {option}"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise error(
            f"{option} {given}: cannot write in {existing} ({_why_not_writable(existing)}); choose an "
            f"{option} on a writable filesystem, or make {existing} writable"
        )


def _nearest_existing(path: str) -> str:
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _why_not_writable(path: str) -> str:
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return "read-only file system" if read_only else "no write permission"

"""The mode a new file gets under the process umask, for files created 0600 by mkstemp or by safetensors.

Atomic writes (temp file, then rename) would otherwise leave config.yaml, exported weights and eval results
readable by their owner only, unlike every other file of a run directory shared by a team.
"""

from __future__ import annotations

import os


def _umask() -> int:
    """The umask without changing it (Linux reports it in /proc); elsewhere set-and-restore."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def new_file_mode() -> int:
    """0666 minus the umask: what open(path, "w") gives a new file (0644 under umask 022)."""
    return 0o666 & ~_umask()


def use_umask_mode(path: str | os.PathLike) -> None:
    """chmod `path` to the mode a freshly opened file would have."""
    os.chmod(path, new_file_mode())

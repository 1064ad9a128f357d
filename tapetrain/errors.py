"""Exceptions shared across tapetrain; messages always name the offending key/file and the fix."""


class ConfigError(ValueError):
    """A configuration value is missing, unknown or impossible."""


class RunError(RuntimeError):
    """A run cannot start or continue without risking its run directory (locked, disk full, diverged, ...).

    `reported_elsewhere` marks a copy raised on a rank other than the one that prints the message (every rank
    stops, one rank says why).
    """

    def __init__(self, message: str, *, reported_elsewhere: bool = False):
        super().__init__(message)
        self.reported_elsewhere = reported_elsewhere


class DiskSpaceError(RunError):
    """Not enough free space for a checkpoint (or a checkpoint conversion) in the run directory."""


class RunDirLockedError(RunError):
    """Another job holds the run directory."""

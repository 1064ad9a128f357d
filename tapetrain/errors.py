"""Exceptions shared across tapetrain; messages always name the offending key/file and the fix.

Every error a user can cause and fix derives from `UserError`: the command line prints its message as one line
and exits 1. Anything else reaching the command line is a bug (traceback, exit 70).
"""


class UserError(Exception):
    """A problem with what the user gave (command line, config, data, run directory); the message says the fix."""


class ConfigError(UserError, ValueError):
    """A configuration value is missing, unknown or impossible."""


class DataError(UserError, ValueError):
    """Input data, a prepared dataset or a data setting is unusable as given."""


class InputError(UserError, ValueError):
    """A command's argument, or a model, checkpoint, result or eval file it names, is unusable as given."""


class MissingInputError(UserError, FileNotFoundError):
    """A path named on the command line (or in a run directory) does not exist or is incomplete."""


class RunError(UserError, RuntimeError):
    """A run cannot start or continue without risking its run directory (locked, disk full, diverged, ...).

    `reported_elsewhere` marks a copy raised on a rank other than the one that prints the message (every rank
    stops, one rank says why).
    """

    def __init__(self, message: str, *, reported_elsewhere: bool = False):
        super().__init__(message)
        self.reported_elsewhere = reported_elsewhere


class DiskSpaceError(RunError):
    """Not enough free space for a checkpoint (or a checkpoint conversion) in the run directory."""


class CheckpointError(RunError):
    """A checkpoint could not be completed (its background hashing or rename failed); it stays incomplete."""


class RunDirLockedError(RunError):
    """Another job holds the run directory."""


class MissingPackageError(UserError, ImportError):
    """An optional package that this job needs is not installed; the message names the pip command."""

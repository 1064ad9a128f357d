"""Exceptions shared across tapetrain; messages always name the offending key/file and the fix."""


class ConfigError(ValueError):
    """A configuration value is missing, unknown or impossible."""

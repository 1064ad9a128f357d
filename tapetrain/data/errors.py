"""Errors raised by the data layer; messages name the offending file/line/key and the fix."""

from tapetrain.errors import UserError


class DataError(UserError, ValueError):
    """Input data, a prepared dataset or a data setting is unusable as given."""

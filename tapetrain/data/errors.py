"""Errors raised by the data layer; messages name the offending file/line/key and the fix."""


class DataError(ValueError):
    """Input data, a prepared dataset or a data setting is unusable as given."""

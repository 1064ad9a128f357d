"""Errors raised by the data layer; messages name the offending file/line/key and the fix. DataError itself lives in
tapetrain/errors.py with the other user errors (rooms below data raise it too); it is re-exported here."""

from tapetrain.errors import DataError

__all__ = ["DataError"]

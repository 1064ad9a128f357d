"""Datasets in object storage: URL handling and byte transfer through fsspec.

A data path with a scheme (s3://, gs://, hf://, https://, http://) names a prepared directory in object storage;
a plain path (or file://) is local. Credentials never come from the run config: s3fs, gcsfs and huggingface_hub read
their usual environment variables and config files (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN, ...), and
fsspec's FSSPEC_<PROTOCOL>_<OPTION> variables set anything else (e.g. FSSPEC_S3_ENDPOINT_URL for MinIO).

Shards are fetched in ranges of `chunk_bytes` (one GET with a Range header each), so a dropped connection costs
one chunk: the retry resumes at the first byte not yet written. The sha256 is computed while writing. Only
transient failures are retried (tapetrain.data.remote_errors), TAPETRAIN_REMOTE_RETRIES times (default 6) from
TAPETRAIN_REMOTE_BACKOFF_S (default 0.5 s), doubling.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from functools import lru_cache
from typing import Any, BinaryIO
from urllib.parse import urlsplit

from tapetrain.data import remote_errors
from tapetrain.data.errors import DataError
from tapetrain.retry import call_with_retries, retry_after

log = logging.getLogger("tapetrain.data")

REMOTE_SCHEMES = ("s3", "gs", "gcs", "hf", "http", "https")
INSTALL_HINT = "install the object-storage extras: pip install 'tapetrain[remote]'"
CHUNK_BYTES = 16 << 20  # bytes per ranged GET: a dropped connection re-reads at most this much
# Attempts after the first, with exponential backoff and jitter (0.5, 1, 2, 4, 8, 16 s ± 25%: about 30 s;
# tapetrain/retry.py); environment overrides.
RETRIES = int(os.environ.get("TAPETRAIN_REMOTE_RETRIES", "6"))
BACKOFF_S = float(os.environ.get("TAPETRAIN_REMOTE_BACKOFF_S", "0.5"))


def is_remote(path: str | os.PathLike) -> bool:
    """Whether `path` names object storage (a URL with one of REMOTE_SCHEMES), not a local path."""
    text = os.fspath(path)
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.lower() in REMOTE_SCHEMES


def join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


@lru_cache(maxsize=32)
def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path within it) for `url`; one filesystem instance per protocol and options."""
    try:
        import fsspec
    except ImportError as err:  # pragma: no cover - fsspec ships with datasets
        raise DataError(f"reading {url} needs fsspec; {INSTALL_HINT}") from err
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as err:
        raise DataError(f"reading {url} needs a package that is not installed ({err}); {INSTALL_HINT}") from err


def _transient(err: BaseException) -> bool:
    """A failure worth retrying: connection reset or refused, timeout, truncated body, server error."""
    return remote_errors.kind(err) == "transient"


class _Endpoint:
    """Retries of one endpoint (scheme and host), shared by every thread of the process: while one reader retries,
    the others wait for its answer instead of retrying (and logging) in parallel, and once it gave up every read
    of that endpoint fails at once with the same message."""

    _all: dict[str, _Endpoint] = {}
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.retrying = threading.Lock()
        self.gave_up: str | None = None

    @classmethod
    def of(cls, url: str) -> _Endpoint:
        parts = urlsplit(url)
        key = f"{parts.scheme}://{parts.netloc}"
        with cls._lock:
            return cls._all.setdefault(key, cls())

    @classmethod
    def forget(cls) -> None:
        with cls._lock:
            cls._all.clear()


def forget_failures() -> None:
    """Let endpoints that this process gave up on be tried again (tests start and stop servers)."""
    _Endpoint.forget()


def _read_once(fs: Any, path: str, start: int | None, end: int | None) -> bytes:
    return fs.cat_file(path, start=start, end=end)


def read_bytes(url: str, start: int | None = None, end: int | None = None, retries: int | None = None) -> bytes:
    """The object's bytes [start, end) (all of it by default). Transient failures are retried with backoff
    (`retries` times, default TAPETRAIN_REMOTE_RETRIES), once per endpoint however many threads read from it;
    permanent ones (not found, credentials, access denied, DNS) are not.

    Raises DataError naming the object and the fix."""
    retries = RETRIES if retries is None else retries
    fs, path = filesystem(url)
    endpoint = _Endpoint.of(url)
    if endpoint.gave_up:
        raise DataError(endpoint.gave_up)
    try:
        data = _read_once(fs, path, start, end)
    except Exception as err:
        if not _transient(err) or retries <= 0:
            raise remote_errors.describe(url, err, retries) from err
        data = _retry(fs, path, url, start, end, retries, endpoint, err)
    return _checked_length(url, data, start, end)


def _retry(fs: Any, path: str, url: str, start: int | None, end: int | None, retries: int, endpoint: _Endpoint,
           first: Exception) -> bytes:
    with endpoint.retrying:  # one thread retries an endpoint at a time; the others wait for its outcome
        if endpoint.gave_up:
            raise DataError(endpoint.gave_up) from first

        def logged(attempt: int, delay: float, err: BaseException) -> None:
            log.warning("reading %s failed (%s: %s); retry %d/%d in %.1fs", url, type(err).__name__, err, attempt,
                        retries, delay)

        try:
            return retry_after(first, lambda: _read_once(fs, path, start, end), retries=retries, base_s=BACKOFF_S,
                               transient=_transient, on_retry=logged)
        except Exception as err:
            error = remote_errors.describe(url, err, retries)
            if _transient(err):  # the retries are spent: every later read of this endpoint fails at once
                endpoint.gave_up = str(error)
            raise error from err


def _checked_length(url: str, data: bytes, start: int | None, end: int | None) -> bytes:
    if start is not None and end is not None and len(data) != end - start:
        if len(data) > end - start and len(data) >= end:  # the server ignored Range: the whole object
            return data[start:end]
        # a complete response (a dropped one raises above): the object is shorter than listed
        raise DataError(
            f"{url}: asked for bytes [{start}, {end}) and got {len(data)}; the object is "
            "shorter than its manifest lists: re-upload the dataset"
        )
    return data


@lru_cache(maxsize=64)
def read_json(url: str) -> Any:
    """A small JSON object (manifest.json); cached, so every check at start-up costs one request."""
    raw = read_bytes(url)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{url} is not valid JSON ({err}); re-upload the dataset") from err


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    try:
        return bool(fs.exists(path))
    except Exception as err:
        raise DataError(f"cannot reach {url} ({type(err).__name__}: {err}); check the URL and credentials") from err


def download(
    url: str,
    out: BinaryIO,
    size: int,
    sha256: str,
    chunk_bytes: int | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """Write the object's `size` bytes to `out` in ranged chunks, then check the sha256 against the manifest's.

    A chunk that fails is fetched again from its first byte (Range), `RETRIES` times with backoff; a 404 or a
    checksum mismatch raises DataError naming the object; a full disk raises DataError naming the cache."""
    digest = hashlib.sha256()
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    pos = 0
    while pos < size:
        end = min(pos + chunk_bytes, size)
        data = read_bytes(url, pos, end)
        try:
            out.write(data)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise DataError(
                    f"no space left writing {url} into {getattr(out, 'name', 'the cache')}: the "
                    "cache disk is full; free space there, lower data.cache_limit_gb or point "
                    "data.cache_dir at a larger disk"
                ) from err
            raise
        digest.update(data)
        pos = end
        if on_bytes is not None:
            on_bytes(len(data))
    if digest.hexdigest() != sha256:
        raise DataError(
            f"{url}: sha256 {digest.hexdigest()} but the manifest lists {sha256}: the object is corrupt "
            "or changed after upload; re-upload it (tapetrain data prepare --out URL)"
        )


def upload_tree(local_dir: str, url: str, last: str | None = None) -> list[str]:
    """Upload every file under `local_dir` to `url` (the file named `last`, e.g. manifest.json, after all the
    others, so a reader never sees a manifest whose shards are missing). Returns the uploaded names."""
    fs, root = filesystem(url)
    names = sorted(os.path.relpath(os.path.join(d, f), local_dir) for d, _, files in os.walk(local_dir) for f in files)
    ordered = [n for n in names if n != last] + ([last] if last in names else [])
    for name in ordered:
        target = root.rstrip("/") + "/" + name.replace(os.sep, "/")
        source = os.path.join(local_dir, name)
        try:
            call_with_retries(lambda source=source, target=target: fs.put_file(source, target), retries=RETRIES,
                              base_s=BACKOFF_S, transient=_transient)
        except Exception as err:
            raise DataError(
                f"uploading {name} to {url} failed ({type(err).__name__}: {err}); check the URL and credentials"
            ) from err
    read_json.cache_clear()
    return ordered

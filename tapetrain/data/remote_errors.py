"""Which failures of object storage are worth retrying, and what to tell the user about the others.

Retried (transient): timeouts, resets, refused or dropped connections, 5xx, 408, 429 — a restart or a busy server.
Not retried (permanent): a missing object (404), no credentials, access denied (401/403), a host name that does
not resolve, any other 4xx: retrying costs minutes of backoff and ends with the same answer.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

from tapetrain.data.errors import DataError

# Exception class names of the storage clients that mean "no usable credentials" (botocore, google-auth, ...).
CREDENTIAL_ERRORS = frozenset({"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                               "NoAuthTokenError", "DefaultCredentialsError", "RefreshError", "ProfileNotFound"})
TRANSIENT_STATUS = frozenset({408, 425, 429})  # and every 5xx
CLIENT_MODULES = ("aiohttp", "botocore", "aiobotocore", "urllib3", "requests", "fsspec")
CREDENTIAL_HINT = ("set them where the storage client reads them: s3:// AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                   "(or AWS_PROFILE), gs:// GOOGLE_APPLICATION_CREDENTIALS, hf:// HF_TOKEN")


def _chain(err: BaseException) -> Iterator[BaseException]:
    """`err`, its causes and contexts, and a wrapped OSError (aiohttp's os_error), each once."""
    seen: set[int] = set()
    todo = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__, getattr(e, "os_error", None)]


def _status(err: BaseException) -> int | None:
    for e in _chain(err):
        status = getattr(e, "status", None) or getattr(e, "status_code", None)
        if isinstance(status, int):
            return status
    return None


def kind(err: BaseException) -> str:
    """'not_found', 'credentials', 'forbidden', 'dns', 'transient' or 'permanent'."""
    chain = list(_chain(err))
    status = _status(err)
    if isinstance(err, FileNotFoundError) or status in (404, 410):
        return "not_found"
    if any(type(e).__name__ in CREDENTIAL_ERRORS for e in chain):
        return "credentials"
    if isinstance(err, PermissionError) or status in (401, 403):
        return "forbidden"
    if any(isinstance(e, socket.gaierror) or type(e).__name__ == "ClientConnectorDNSError" for e in chain):
        return "dns"
    if status is not None:
        return "transient" if status >= 500 or status in TRANSIENT_STATUS else "permanent"
    if isinstance(err, DataError):
        return "permanent"
    transient = isinstance(err, (OSError, TimeoutError, ConnectionError)) or type(err).__module__.startswith(
        CLIENT_MODULES)
    return "transient" if transient else "permanent"


def _connection_failed(err: BaseException) -> bool:
    return any(isinstance(e, ConnectionRefusedError) or type(e).__name__ in (
        "ClientConnectorError", "EndpointConnectionError", "ConnectTimeoutError") for e in _chain(err))


def describe(url: str, err: BaseException, retries: int = 0) -> DataError:
    """One line naming the object, what went wrong and the fix."""
    what = f"{type(err).__name__}: {err}"
    k = kind(err)
    if k == "not_found":
        return DataError(f"{url} does not exist (404 / not found); check the data path, or re-upload the dataset "
                         "with `tapetrain data prepare --out URL`")
    if k == "credentials":
        return DataError(f"cannot read {url}: no usable credentials ({what}); {CREDENTIAL_HINT}")
    if k == "forbidden":
        status = _status(err) or 403
        return DataError(f"cannot read {url}: access denied ({status} / {what}); the credentials in use may not read "
                         f"it: check the bucket's permissions, or {CREDENTIAL_HINT}")
    if k == "dns":
        host = urlsplit(url).hostname or url
        return DataError(f"cannot read {url}: the host name {host} does not resolve ({what}); check the URL (for "
                         "S3-compatible storage, the endpoint: AWS_ENDPOINT_URL or FSSPEC_S3_ENDPOINT_URL)")
    if k == "transient":
        failed = "cannot connect to it" if _connection_failed(err) else "the connection kept failing"
        return DataError(f"cannot read {url}: {failed} after {retries} retries ({what}); check that the storage "
                         "endpoint is up and reachable from this node, then start the same command again")
    return DataError(f"cannot read {url} ({what}); check the URL, network and credentials (the usual environment "
                     "variables and config files)")

"""Real object-storage servers on 127.0.0.1 for the remote-data tests, stopped by the test that starts them.

ShardServer (tapetrain.bench.shard_server): static files over HTTP with Range, latency and injected faults.
moto_s3: moto's standalone S3 server with dummy credentials in the environment, for s3fs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from tapetrain.bench.shard_server import ShardServer

__all__ = ["ShardServer", "moto_s3"]


@contextlib.contextmanager
def moto_s3() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 (yields its endpoint); s3fs (botocore) reaches it through AWS_ENDPOINT_URL and
    dummy credentials in the environment, as a real deployment would set them."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _forget_s3_filesystems()
    try:
        yield endpoint
    finally:
        server.stop()
        _forget_s3_filesystems()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _forget_s3_filesystems() -> None:
    """fsspec caches S3FileSystem instances by their arguments, and the endpoint comes from the environment, not
    the arguments: without this a later server (another port) would be reached through an earlier one's client."""
    try:
        import s3fs
    except ImportError:
        return
    s3fs.S3FileSystem.clear_instance_cache()

"""`tapetrain data prepare --out URL`: prepare into a local temporary directory, upload, verify the upload.

manifest.json is uploaded after every shard, so a reader never finds a manifest whose shards are missing; a run
interrupted mid-upload leaves no manifest (the URL is not a dataset yet) and is simply run again.
"""

from __future__ import annotations

import logging

from tapetrain.data import remote
from tapetrain.data.errors import DataError
from tapetrain.data.format import MANIFEST

log = logging.getLogger("tapetrain.data")


def check_destination(url: str, overwrite: bool) -> None:
    """Refuse to replace a finished dataset at `url` unless overwrite (touches nothing)."""
    if not overwrite and remote.exists(remote.join(url, MANIFEST)):
        raise DataError(
            f"{url} already holds a prepared dataset ({MANIFEST}); pick another --out or pass --overwrite to replace it"
        )


def publish(local_dir: str, url: str, progress: bool = True) -> None:
    """Upload the prepared dataset in `local_dir` to `url` (manifest last), then check every object's sha256."""
    from tapetrain.data.verify import verify_dataset

    names = remote.upload_tree(local_dir, url, last=MANIFEST)
    log.info("uploaded %d files to %s", len(names), url)
    problems = verify_dataset(url, progress=progress)
    if problems:
        raise DataError(
            f"the upload to {url} does not match the prepared files: {'; '.join(problems[:5])}; run the prepare again"
        )

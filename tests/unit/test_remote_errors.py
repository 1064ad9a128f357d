"""Issue #40: a remote data path that cannot work fails at once with its error as the last line; only transient
failures (timeouts, resets, refused connections) are retried, the documented number of times, once per run.

Each case is a real `tapetrain train --dry-run` process against a real endpoint on 127.0.0.1 (the fault-injecting
HTTP server, moto's S3 server without credentials) or a name that does not resolve."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from remote_servers import ShardServer, moto_s3  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "tiny-cpu.yaml")


def dry_run(tmp_path: Path, url: str, **env: str) -> tuple[subprocess.CompletedProcess, float, list[str]]:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tapetrain.cli", "train", CONFIG, f"data.train={url}",
                           f"run.out_dir={tmp_path / 'run'}", "--dry-run"], cwd=REPO, env={**base, **env},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return proc, time.monotonic() - started, lines


def no_credentials(endpoint: str) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
            "AWS_CONFIG_FILE": "/nonexistent", "AWS_EC2_METADATA_DISABLED": "true", "AWS_ENDPOINT_URL": endpoint}


@pytest.mark.slow
def test_permanent_remote_errors_are_not_retried_and_end_the_output(tmp_path):
    with moto_s3() as endpoint:
        s3 = dry_run(tmp_path, "s3://bucket/ds", **no_credentials(endpoint))
    with ShardServer(tmp_path) as server:
        server.status["/ds/manifest.json"] = 403
        forbidden = dry_run(tmp_path, f"{server.url}/ds")
    dns = dry_run(tmp_path, "http://no-such-host.invalid/ds")
    for (proc, seconds, lines), expected in ((s3, "credentials"), (forbidden, "403"), (dns, "does not resolve")):
        assert proc.returncode == 1, proc.stdout[-3000:]
        assert not [line for line in lines if "retry" in line], proc.stdout[-3000:]
        assert expected in lines[-1] and "manifest.json" in lines[-1], lines[-1]
        assert seconds < 30, (seconds, lines[-1])
        assert "Traceback" not in proc.stdout


@pytest.mark.slow
def test_a_server_that_is_down_is_retried_once_then_named(tmp_path):
    with ShardServer(tmp_path) as server:
        url = f"{server.url}/ds"  # stopped: nothing listens on its port any more
    proc, _, lines = dry_run(tmp_path, url, TAPETRAIN_REMOTE_RETRIES="2", TAPETRAIN_REMOTE_BACKOFF_S="0.1")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert len([line for line in lines if "retry" in line]) == 2, proc.stdout[-3000:]  # once, not once per reader
    assert "cannot connect" in lines[-1] and "manifest.json" in lines[-1], lines[-1]

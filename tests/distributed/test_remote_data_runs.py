"""Training from shards in object storage (servers on 127.0.0.1): the same losses as from local paths, one download
per shard per node, and an exact resume after SIGKILL with the cache wiped."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO, attempt, env, launcher_cmd, losses, run, single_cmd, write_config
from test_resume_and_faults import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from remote_servers import ShardServer, moto_s3  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_shards(shard_dir, tmp_path_factory):
    """shard_dir's corpus in shards of 2048 tokens: a run reads many of them."""
    from tapetrain.data.prepare import prepare

    root = tmp_path_factory.mktemp("remote_shards")
    prepare(
        [str(shard_dir.parent / "corpus.jsonl")],
        str(shard_dir.parent / "tok.model"),
        str(root / "data"),
        shard_tokens=2048,
        progress=False,
    )
    return root


def test_two_ranks_from_http_equal_local_paths_and_fetch_each_shard_once(small_shards, tmp_path):
    local = tmp_path / "local"
    run(launcher_cmd(write_config(tmp_path / "l.yaml", small_shards / "data", local), 2))
    with ShardServer(small_shards, latency_s=0.005) as server:
        out = tmp_path / "remote"
        cfg = write_config(
            tmp_path / "r.yaml",
            small_shards / "data",
            out,
            data={"train": f"{server.url}/data", "cache_dir": str(tmp_path / "cache")},
        )
        run(launcher_cmd(cfg, 2))
        names = [
            s["file"]
            for s in json.loads((small_shards / "data/manifest.json").read_text())["splits"]["train"]["shards"]
        ]
        fetched = {n: len(server.gets(f"/data/{n}")) for n in names}
    assert losses(out) == losses(local)  # identical per-step losses
    assert set(fetched.values()) <= {0, 1} and sum(fetched.values()) > 1  # once per node, whichever rank
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("data_fetched_bytes", 0) > 0 for r in records) and all(
        "data_wait_s" in r for r in records if "loss" in r
    )


def test_a_missing_object_stops_the_run_with_its_name(small_shards, tmp_path):
    served = tmp_path / "served"
    shutil.copytree(small_shards / "data", served / "data")
    for shard in (served / "data").glob("train-*.bin"):
        shard.unlink()
    with ShardServer(served) as server:
        cfg = write_config(
            tmp_path / "m.yaml",
            small_shards / "data",
            tmp_path / "run",
            data={"train": f"{server.url}/data", "cache_dir": str(tmp_path / "cache")},
        )
        proc = attempt(single_cmd(cfg))
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert re.search(rf"{server.url}/data/train-\d{{5}}\.bin does not exist", proc.stdout), proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout


def test_sigkill_and_resume_with_a_cold_cache_from_s3(small_shards, tmp_path):
    steps = {"steps": 12}
    straight = tmp_path / "straight"
    run(single_cmd(write_config(tmp_path / "a.yaml", small_shards / "data", straight, train=steps)))
    with moto_s3():
        from tapetrain.data import remote

        fs, _ = remote.filesystem("s3://runs")
        fs.mkdir("runs")
        fs.put(str(small_shards / "data"), "runs/tok", recursive=True)
        cache = tmp_path / "cache"
        resumed = tmp_path / "resumed"
        cfg = write_config(
            tmp_path / "b.yaml",
            small_shards / "data",
            resumed,
            train={**steps, "save_interval": 2},
            data={"train": "s3://runs/tok", "cache_dir": str(cache), "cache_limit_gb": 0.001},
        )
        proc = subprocess.Popen(
            single_cmd(cfg), cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for(resumed / "checkpoints" / "step_00000002" / "trainer_state.json")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not (resumed / "DONE.json").exists()
        shutil.rmtree(cache)  # a cold cache: the resumed run fetches everything again
        run(single_cmd(cfg))
    a, b = losses(straight), losses(resumed)
    records = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("data_fetched_bytes", 0) > 0 for r in records)  # it did read from S3
    assert sorted(b) == list(range(1, 13))
    assert a == b



def test_a_dataset_replaced_at_its_url_is_fetched_again_not_read_from_a_warm_cache(small_shards, shard_dir, tmp_path):
    """Issue #40: another dataset at the same URL (same shard names, other bytes and sha256s) with a warm cache: the
    cached shards no longer match the manifest, so they are fetched again; the run equals a local run of it."""
    from conftest import write_stdlib_corpus

    from tapetrain.data.cache import ShardCache
    from tapetrain.data.prepare import prepare

    write_stdlib_corpus(tmp_path / "other.jsonl", slice(40, 60))
    other = tmp_path / "other"
    prepare([str(tmp_path / "other.jsonl")], str(shard_dir.parent / "tok.model"), str(other / "data"),
            shard_tokens=2048, progress=False)
    first = json.loads((small_shards / "data/manifest.json").read_text())["splits"]["train"]["shards"]
    second = json.loads((other / "data/manifest.json").read_text())["splits"]["train"]["shards"]
    assert {s["file"] for s in first} & {s["file"] for s in second}  # the same names, other bytes
    served = tmp_path / "served"
    cache = ShardCache(str(tmp_path / "cache"), None)
    steps = {"steps": 2, "save_interval": 0}
    local = tmp_path / "local"
    run(single_cmd(write_config(tmp_path / "l.yaml", other / "data", local, train=steps)))
    shutil.copytree(small_shards / "data", served / "data")
    with ShardServer(served) as server:
        url = f"{server.url}/data"
        for s in first:  # the first dataset warms the cache (the reader that training uses)
            cache.pin(url, s["file"], (served / "data" / s["file"]).stat().st_size, s["sha256"]).release()
        shutil.rmtree(served / "data")
        shutil.copytree(other / "data", served / "data")  # replaced at the same URL
        out = tmp_path / "remote"
        cfg = write_config(tmp_path / "r.yaml", other / "data", out, train=steps,
                           data={"train": url, "cache_dir": cache.root})
        proc = run(single_cmd(cfg))
        refetched = [n for n in {s["file"] for s in first} & {s["file"] for s in second} if server.gets(f"/data/{n}")]
    assert losses(out) == losses(local)
    assert refetched
    assert (proc.stdout + proc.stderr).count("does not match the manifest") == 1  # one line, not one per shard


def test_dry_run_finds_what_would_fail_later(small_shards, tmp_path):
    """Issue #40: each of these passed --dry-run and failed later (at the first read of a shard, or at step 1 with a
    traceback); --print-config accepted data.document_mask with model.s2_attn, which a start refuses."""
    served = tmp_path / "served"
    shutil.copytree(small_shards / "data", served / "data")
    missing = sorted((served / "data").glob("train-*.bin"))[-1]
    missing.unlink()
    read_only = tmp_path / "ro-cache"
    read_only.mkdir()
    with ShardServer(served) as server:
        url = f"{server.url}/data"
        cfg = write_config(tmp_path / "d.yaml", small_shards / "data", tmp_path / "run",
                           data={"train": url, "cache_dir": str(tmp_path / "cache")})
        cases = [
            (single_cmd(cfg, "--dry-run"), f"{url}/{missing.name} does not exist"),
            (single_cmd(cfg, "--dry-run", "data.cache_limit_gb=0.000001"), "data.cache_limit_gb=1e-06 is smaller"),
            (["unshare", "-rm", "sh", "-c", 'mount --bind -o ro "$0" "$0" && shift && exec "$@"', str(read_only),
              "--", *single_cmd(cfg, "--dry-run", f"data.cache_dir={read_only}")], f"data.cache_dir {read_only}"),
        ]
        for cmd, expected in cases:
            proc = attempt(cmd)
            assert proc.returncode == 1 and expected in proc.stdout, (cmd[-1], proc.stdout[-3000:])
            assert "Traceback" not in proc.stdout
    local = write_config(tmp_path / "l.yaml", small_shards / "data", tmp_path / "run")
    for backend in ("flash", "triton"):
        proc = attempt(single_cmd(local, "--dry-run", f"model.attn_backend={backend}"))
        assert proc.returncode == 1 and f"model.attn_backend={backend}" in proc.stdout, proc.stdout[-3000:]
    proc = attempt(single_cmd(local, "--print-config", "data.document_mask=true", "model.pe=rope",
                                  "model.s2_attn=true"))
    assert proc.returncode == 1 and "data.document_mask with model.s2_attn" in proc.stdout, proc.stdout[-3000:]

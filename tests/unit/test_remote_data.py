"""Shards in object storage, against real servers on 127.0.0.1: an HTTP server that injects faults and moto's S3.

The reader from a URL gives the local reader's windows and order; a dropped connection resumes with a Range; a
404 or a checksum mismatch names the object; a full disk is a clear error; the cache limit holds without evicting
a shard in use; two processes of one node fetch each shard once; prepare/verify work on an s3:// destination."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tapetrain.data import remote
from tapetrain.data.batches import BatchIterator
from tapetrain.data.cache import STATS, ShardCache
from tapetrain.data.errors import DataError
from tapetrain.data.packed import PackedDataset
from tapetrain.data.prepare import prepare
from tapetrain.data.tokenizer import train_tokenizer
from tapetrain.data.verify import verify_dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from remote_servers import ShardServer, moto_s3  # noqa: E402
from test_data_stream import make_docs  # noqa: E402

SEQ = 16
SHARD_TOKENS = 97  # 194-byte shards: dozens of them, windows straddle shard boundaries


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """root/data: a prepared dataset of small shards (and its tokenizer and corpus)."""
    root = tmp_path_factory.mktemp("remote")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in make_docs(150, 5)), encoding="utf-8")
    tok = train_tokenizer([str(corpus)], 320, str(root / "tok.model"))
    prepare([str(corpus)], tok, str(root / "data"), val_fraction=0.2, shard_tokens=SHARD_TOKENS, progress=False)
    return root


@pytest.fixture(autouse=True)
def _fresh_reads():
    remote.read_json.cache_clear()  # servers come and go between tests: no manifest remembered across them
    remote.forget_failures()
    yield
    remote.read_json.cache_clear()
    remote.forget_failures()


def test_urls_are_remote_and_paths_are_not():
    assert all(map(remote.is_remote, ["s3://b/k", "gs://b/k", "hf://datasets/o/r/d", "https://h/d", "HTTP://h/d"]))
    assert not any(map(remote.is_remote, ["data/tok", "/abs/tok", "hf:wikitext", "file:///tmp/x", "C:/x"]))


def test_a_missing_backend_names_the_extra(monkeypatch):
    import fsspec

    def missing(url, **kwargs):
        raise ImportError("Install gcsfs to access Google Storage")

    monkeypatch.setattr(fsspec.core, "url_to_fs", missing)
    remote.filesystem.cache_clear()
    with pytest.raises(DataError, match=r"pip install 'tapetrain\[remote\]'"):
        remote.filesystem("gs://bucket/tok")
    remote.filesystem.cache_clear()


def windows(ds: PackedDataset) -> np.ndarray:
    return np.stack([ds[i] for i in range(ds.num_samples)])


def shard_names(path: Path, split: str = "train") -> list[str]:
    return [s["file"] for s in json.loads((path / "manifest.json").read_text())["splits"][split]["shards"]]


def test_http_reader_gives_the_local_windows_and_order(served, tmp_path):
    local = PackedDataset(str(served / "data"), SEQ)
    with ShardServer(served) as server:
        cache = ShardCache(str(tmp_path / "cache"), None)
        before = STATS.snapshot()
        ds = PackedDataset(server.url + "/data", SEQ, cache=cache)
        assert (ds.num_samples, ds.vocab_size) == (local.num_samples, local.vocab_size)
        assert not any(p.endswith(".bin") for _, p, _ in server.requests)  # opening reads the manifest only
        np.testing.assert_array_equal(windows(ds), windows(local))
        for world in (1, 2):  # the rank-count independent order is untouched
            it = BatchIterator(ds, global_batch_size=4, micro_batch_size=2, rank=0, world_size=world, seed=7)
            ref = BatchIterator(local, global_batch_size=4, micro_batch_size=2, rank=0, world_size=world, seed=7)
            for _ in range(5):
                assert np.array_equal(it.next_micro_batch().numpy(), ref.next_micro_batch().numpy())
        after = STATS.snapshot()
        names = shard_names(served / "data")
        assert after["data_cache_misses"] - before["data_cache_misses"] == len(names)
        assert after["data_fetched_bytes"] - before["data_fetched_bytes"] == sum(
            (served / "data" / n).stat().st_size for n in names
        )
        assert all(len(server.gets(f"/data/{n}")) == 1 for n in names)  # each fetched once, then read locally
        ds.close()


def test_dropped_connection_resumes_with_a_range(served, tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "CHUNK_BYTES", 64)
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    name = shard_names(served / "data")[0]
    with ShardServer(served) as server:
        server.drop[f"/data/{name}"] = 2  # the second ranged GET dies half way
        ds = PackedDataset(server.url + "/data", SEQ, cache=ShardCache(str(tmp_path / "cache"), None))
        np.testing.assert_array_equal(ds[0], PackedDataset(str(served / "data"), SEQ)[0])
        assert server.gets(f"/data/{name}") == [
            "bytes=0-63",
            "bytes=64-127",
            "bytes=64-127",
            "bytes=128-191",
            "bytes=192-193",
        ]


def test_missing_object_stops_with_its_name(served, tmp_path):
    copy = tmp_path / "srv"
    shutil.copytree(served / "data", copy / "data")
    name = shard_names(copy / "data")[0]
    (copy / "data" / name).unlink()
    with ShardServer(copy) as server:
        ds = PackedDataset(server.url + "/data", SEQ, cache=ShardCache(str(tmp_path / "cache"), None))
        with pytest.raises(DataError, match=f"{server.url}/data/{name} does not exist"):
            ds[0]
        assert len(server.gets(f"/data/{name}")) == 1  # not retried
        with pytest.raises(DataError, match="has no manifest.json"):
            PackedDataset(server.url + "/nothing", SEQ)


def test_checksum_mismatch_stops_with_the_object_name(served, tmp_path):
    name = shard_names(served / "data")[0]
    with ShardServer(served) as server:
        server.corrupt.add(f"/data/{name}")
        cache = ShardCache(str(tmp_path / "cache"), None)
        ds = PackedDataset(server.url + "/data", SEQ, cache=cache)
        with pytest.raises(DataError, match=rf"{server.url}/data/{name}: sha256 .* but the manifest lists"):
            ds[0]
        assert cache.usage() == 0  # nothing unverified is kept (no shard, no .part)


def test_a_full_cache_disk_is_a_clear_error(served, tmp_path):
    """A real full disk: the cache directory is a 4 KiB tmpfs (a private mount namespace through `unshare -rm`, so
    only the reading process sees it) and the first shard does not fit there."""
    import subprocess

    if not shutil.which("unshare"):
        pytest.skip("needs `unshare` (util-linux) to mount a small tmpfs")
    mount = tmp_path / "cache"
    mount.mkdir()
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=4k tmpfs "$0"', str(mount)],
                           capture_output=True)  # fmt: skip
    if probe.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs `unshare -rm` with user namespaces)")
    # Fill the 4 KiB filesystem first (as a full node-local disk would be): nothing more can be written there.
    read = (
        "import sys\n"
        "from tapetrain.data.cache import ShardCache\n"
        "from tapetrain.data.errors import DataError\n"
        "from tapetrain.data.packed import PackedDataset\n"
        "import os\n"
        "try:\n"
        "    with open(os.path.join(sys.argv[2], 'filler'), 'wb') as f:\n"
        "        f.write(b'x' * 8192)\n"
        "except OSError:\n"
        "    pass\n"
        "ds = PackedDataset(sys.argv[1], 16, cache=ShardCache(sys.argv[2], None))\n"
        "try:\n"
        "    ds[0]\n"
        "except DataError as err:\n"
        "    print('DataError:', err)\n"
        "    sys.exit(3)\n"
    )
    with ShardServer(served) as server:
        proc = subprocess.run(
            ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=4k tmpfs "$0" || exit 99; shift; exec "$@"',
             str(mount), "--", sys.executable, "-c", read, server.url + "/data", str(mount)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "the cache disk is full" in proc.stdout and "data.cache_dir" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr


def test_cache_limit_holds_and_never_evicts_a_shard_in_use(served, tmp_path):
    names = shard_names(served / "data")
    size = (served / "data" / names[0]).stat().st_size
    limit = 6 * size
    local = PackedDataset(str(served / "data"), SEQ)
    with ShardServer(served) as server:
        cache = ShardCache(str(tmp_path / "cache"), limit / 1e9)
        url = server.url + "/data"
        held = cache.pin(url, names[1], size, local.shards[1]["sha256"])
        ds = PackedDataset(url, SEQ, cache=cache)
        assert ds._remote.max_open == 2  # a quarter of what the limit holds, at least 2
        it = BatchIterator(ds, global_batch_size=4, micro_batch_size=4, seed=1)
        ref = BatchIterator(local, global_batch_size=4, micro_batch_size=4, seed=1)
        for _ in range(ds.num_samples // 4):  # an epoch in shuffled order: shards come and go
            assert np.array_equal(it.next_micro_batch().numpy(), ref.next_micro_batch().numpy())
            assert cache.usage() <= limit
            assert os.path.exists(held.path)  # pinned: never evicted
        held.release()
        assert sum(len(server.gets(f"/data/{n}")) for n in names) > len(names)  # evicted shards were fetched again
        ds.close()


def test_an_evicted_shard_takes_its_record_with_it(served, tmp_path):
    """Issue #46: eviction removed the shard but left its .verified/ record behind (a download's _forget removes
    both), so records of shards long gone piled up in the cache."""
    names = shard_names(served / "data")[:3]
    size = (served / "data" / names[0]).stat().st_size
    local = PackedDataset(str(served / "data"), SEQ)
    with ShardServer(served) as server:
        cache = ShardCache(str(tmp_path / "cache"), 2 * size / 1e9)  # room for two shards
        url = server.url + "/data"
        for i, name in enumerate(names):  # the third evicts the least recently used: the first
            cache.pin(url, name, size, local.shards[i]["sha256"]).release()
        d = Path(cache.source_dir(url))
        assert [(d / n).exists() for n in names] == [False, True, True]
        assert [(d / ".verified" / n).exists() for n in names] == [False, True, True]


def test_the_source_note_is_whole_or_absent(tmp_path):
    """Issue #46: the cache wrote `source.txt` (the URL a cache directory holds) with a plain open(): a write cut
    short (here by a file size limit, as by a full disk) left half a URL there for good, since a note that exists
    is never written again. It goes through atomic_io now: the old note or the whole new one."""
    url = "https://data.example.org/" + "d" * 300
    code = (
        "import resource, signal, sys\n"
        "from tapetrain.data.cache import ShardCache\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        "try:\n"
        f"    ShardCache(sys.argv[1], None).source_dir({url!r})\n"
        "except OSError as err:\n"
        "    sys.exit(3 if 'too large' in str(err) else 4)\n"
    )
    cut_short = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cache")], capture_output=True, text=True)
    assert cut_short.returncode == 3, cut_short.stderr[-2000:]  # the write failed, as a full disk's would
    cache = ShardCache(str(tmp_path / "cache"), None)
    note = Path(cache.source_dir(url)) / "source.txt"
    assert note.read_text() == url + "\n"
    assert [p.name for p in note.parent.iterdir() if p.name.endswith(".tmp")] == []


def _read_all(url: str, cache_dir: str, seed: int) -> None:
    ds = PackedDataset(url, SEQ, cache=ShardCache(cache_dir, None))
    it = BatchIterator(ds, global_batch_size=4, micro_batch_size=2, rank=seed % 2, world_size=2, seed=3)
    for _ in range(ds.num_samples // 2):
        it.next_micro_batch()
    ds.close()


def test_two_processes_of_a_node_fetch_each_shard_once(served, tmp_path):
    with ShardServer(served, latency_s=0.01) as server:
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_read_all, args=(server.url + "/data", str(tmp_path / "cache"), r)) for r in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        assert [p.exitcode for p in procs] == [0, 0]
        names = shard_names(served / "data")
        assert {n: len(server.gets(f"/data/{n}")) for n in names} == {n: 1 for n in names}


def test_cold_cache_resume_gives_the_same_batches(served, tmp_path):
    with ShardServer(served) as server:
        url = server.url + "/data"
        ds = PackedDataset(url, SEQ, cache=ShardCache(str(tmp_path / "a"), None))
        it = BatchIterator(ds, global_batch_size=4, micro_batch_size=2, seed=5)
        for _ in range(6):
            it.next_micro_batch()
        state = it.state_dict()
        expected = [it.next_micro_batch().numpy() for _ in range(6)]
        cold = PackedDataset(url, SEQ, cache=ShardCache(str(tmp_path / "b"), None))  # an empty cache
        resumed = BatchIterator(cold, global_batch_size=4, micro_batch_size=2, seed=5)
        resumed.load_state_dict(state)
        assert all(np.array_equal(resumed.next_micro_batch().numpy(), e) for e in expected)


def test_prefetch_fetches_ahead_in_the_background(served, tmp_path):
    with ShardServer(served) as server:
        cache = ShardCache(str(tmp_path / "cache"), None)
        ds = PackedDataset(server.url + "/data", SEQ, cache=cache)
        it = BatchIterator(ds, global_batch_size=4, micro_batch_size=2, seed=5)
        needed = ds.shards_of(np.concatenate([it.indices_ahead(k) for k in range(1, 5)]))
        it.prefetch_ahead(1, 4)
        ds._remote._pool.shutdown(wait=True)
        d = cache.source_dir(server.url + "/data")
        assert all(os.path.exists(os.path.join(d, ds.shards[k]["file"])) for k in needed)


def test_prepare_upload_and_verify_on_s3(served, tmp_path, monkeypatch):
    from tapetrain.data import cache as cache_module

    monkeypatch.setattr(cache_module, "default_cache_dir", lambda: str(tmp_path / "default-cache"))
    local = PackedDataset(str(served / "data"), SEQ, split="val")
    with moto_s3():
        fs, _ = remote.filesystem("s3://tapetrain-test")
        fs.mkdir("tapetrain-test")
        url = "s3://tapetrain-test/tok"
        prepare(
            [str(served / "corpus.jsonl")],
            str(served / "tok.model"),
            url,
            val_fraction=0.2,
            shard_tokens=SHARD_TOKENS,
            progress=False,
        )
        assert verify_dataset(url, progress=False) == []
        ds = PackedDataset(url, SEQ, split="val", cache=ShardCache(str(tmp_path / "cache"), None))
        np.testing.assert_array_equal(windows(ds), windows(local))
        with pytest.raises(DataError, match="already holds a prepared dataset"):
            prepare([str(served / "corpus.jsonl")], str(served / "tok.model"), url, progress=False)
        name = shard_names(served / "data")[1]
        fs.pipe(f"tapetrain-test/tok/{name}", b"\x00" * (SHARD_TOKENS * 2))
        problems = verify_dataset(url, progress=False)
        assert len(problems) == 1 and problems[0].startswith(f"{name}: sha256")
        from tapetrain.checkpoint import commands

        assert commands.verify([url], quiet=True) == 1  # `tapetrain data verify s3://...` exits 1

        from tapetrain.eval.tokens import open_eval_tokens

        tokens = open_eval_tokens(url)  # eval --data accepts the URL (its val split)
        assert tokens.num_tokens == local.num_tokens


def test_a_mixture_of_a_remote_and_a_local_source_reads_like_two_local_ones(served, tmp_path):
    from tapetrain.data.stream import open_dataset

    local = str(served / "data")
    ref = open_dataset([{"path": local, "weight": 2}, {"path": local, "weight": 1}], SEQ, seed=4)
    with ShardServer(served) as server:
        cache = ShardCache(str(tmp_path / "cache"), None)
        mixed = open_dataset(
            [{"path": local, "weight": 2}, {"path": server.url + "/data", "weight": 1}], SEQ, seed=4, cache=cache
        )
        assert mixed.fetches_remote and not ref.fetches_remote
        it = BatchIterator(mixed, global_batch_size=4, micro_batch_size=2, seed=9)
        ref_it = BatchIterator(ref, global_batch_size=4, micro_batch_size=2, seed=9)
        for _ in range(8):
            assert np.array_equal(it.next_micro_batch().numpy(), ref_it.next_micro_batch().numpy())
        it.close()

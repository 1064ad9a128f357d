"""Training reader: windows, manifest checks, deterministic rank-independent order, O(1) resume, mixtures."""

from __future__ import annotations

import json
import pickle
import random
import shutil

import numpy as np
import pytest
import torch

import tapetrain.data.order as order_module
from tapetrain.data.errors import DataError
from tapetrain.data.flat_tokens import FlatTokenFile
from tapetrain.data.order import FeistelPermutation, SampleOrder
from tapetrain.data.prepare import prepare
from tapetrain.data.stream import BatchIterator, MixedDataset, PackedDataset, open_dataset
from tapetrain.data.tokenizer import train_tokenizer

SEQ = 16


def make_docs(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    syllables = ["ka", "to", "ri", "mu", "sen", "lo", "pa", "qui", "dor", "ve", "ny", "zä"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(150)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 30))) for _ in range(n)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    paths = {}
    for name, seed, n in [("a", 1, 200), ("b", 2, 60)]:
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in make_docs(n, seed)), encoding="utf-8")
        paths[name] = str(path)
    tok = train_tokenizer([paths["a"], paths["b"]], 320, str(root / "tok.model"))
    out = {"root": root, "tok": tok}
    for name in ("a", "b"):  # small shards so windows straddle shard boundaries
        out[name] = str(root / f"{name}_out")
        prepare([paths[name]], tok, out[name], val_fraction=0.2, shard_tokens=97, progress=False)
    return out


def copy_of(data, tmp_path, name="a") -> str:
    dst = str(tmp_path / "copy")
    shutil.copytree(data[name], dst)
    return dst


def stream_of(path, split="train") -> np.ndarray:
    manifest = json.load(open(f"{path}/manifest.json"))
    return np.concatenate([np.fromfile(f"{path}/{s['file']}", dtype="<u2")
                           for s in manifest["splits"][split]["shards"]]).astype(np.int64)


def test_windows_are_non_overlapping_slices_of_the_stream(data):
    ds = PackedDataset(data["a"], SEQ)
    tokens = stream_of(data["a"])
    assert len(ds.shards) > 5 and ds.num_tokens == len(tokens) and ds.vocab_size == 320
    assert ds.num_samples == len(ds) == (len(tokens) - 1) // SEQ
    for i in range(ds.num_samples):
        window = ds[i]
        assert type(window) is np.ndarray and window.dtype == np.int64 and window.shape == (SEQ + 1,)
        np.testing.assert_array_equal(window, tokens[i * SEQ:i * SEQ + SEQ + 1])
    with pytest.raises(IndexError):
        ds[ds.num_samples]
    val = PackedDataset(data["a"], SEQ, split="val")
    np.testing.assert_array_equal(val[0], stream_of(data["a"], "val")[:SEQ + 1])


def test_pickle_reopens_memmaps(data):
    ds = PackedDataset(data["a"], SEQ)
    clone = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 20_000  # no token data inside
    np.testing.assert_array_equal(clone[3], ds[3])


def batches(ds, steps, **kw) -> list[torch.Tensor]:
    it = BatchIterator(ds, **kw)
    return [it.next_micro_batch() for _ in range(steps * it.grad_accum_steps)]


def test_same_seed_same_stream_different_seed_different(data):
    ds = PackedDataset(data["a"], SEQ)
    kw = dict(global_batch_size=8, micro_batch_size=4)
    a, b, c = batches(ds, 5, seed=3, **kw), batches(ds, 5, seed=3, **kw), batches(ds, 5, seed=4, **kw)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    assert a[0].shape == (4, SEQ + 1) and a[0].dtype == torch.int64


def test_one_epoch_visits_every_sample_once(data):
    ds = PackedDataset(data["a"], SEQ)
    order = SampleOrder(ds.num_samples, seed=7)
    first, second = order(np.arange(ds.num_samples)), order(np.arange(ds.num_samples, 2 * ds.num_samples))
    assert sorted(first) == list(range(ds.num_samples)) == sorted(second)
    assert not np.array_equal(first, second)  # a fresh permutation per epoch
    np.testing.assert_array_equal(SampleOrder(ds.num_samples, 7, shuffle=False)(np.arange(3)), [0, 1, 2])


def step_samples(ds, world_size, micro, steps, seed=5) -> list[list[tuple]]:
    """Per optimizer step: the sorted rows of all ranks' micro batches."""
    its = [BatchIterator(ds, global_batch_size=8, micro_batch_size=micro, rank=r, world_size=world_size,
                         seed=seed) for r in range(world_size)]
    out = []
    for _ in range(steps):
        rows = [tuple(row.tolist())
                for it in its for _ in range(it.grad_accum_steps) for row in it.next_micro_batch()]
        out.append(sorted(rows))
    assert all(it.consumed_samples == 8 * steps for it in its)
    return out


def test_global_order_is_independent_of_world_size(data):
    ds = PackedDataset(data["a"], SEQ)
    steps = ds.num_samples // 8 + 3  # crosses an epoch boundary
    reference = step_samples(ds, 1, 2, steps)
    assert step_samples(ds, 2, 2, steps) == reference
    assert step_samples(ds, 4, 1, steps) == reference
    assert step_samples(ds, 4, 2, steps) == reference


def test_resume_mid_epoch_continues_exactly(data):
    ds = PackedDataset(data["a"], SEQ)
    kw = dict(global_batch_size=12, micro_batch_size=2, rank=1, world_size=2, seed=9)
    total_steps = ds.num_samples // 12 + 4
    full = batches(ds, total_steps, **kw)
    it = BatchIterator(ds, **kw)
    for _ in range(5 * it.grad_accum_steps + 1):  # 5 steps plus one micro batch of an unfinished step
        it.next_micro_batch()
    state = it.state_dict()
    assert state["consumed_samples"] == 60 and state["seed"] == 9
    resumed = BatchIterator(ds, **kw)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON checkpoint
    rest = [resumed.next_micro_batch() for _ in range((total_steps - 5) * resumed.grad_accum_steps)]
    assert all(torch.equal(x, y) for x, y in zip(full[5 * 3:], rest, strict=True))
    also = BatchIterator(ds, consumed_samples=60, **kw)  # constructor argument is equivalent
    assert torch.equal(also.next_micro_batch(), full[15])


def test_resume_refuses_another_seed(data):
    ds = PackedDataset(data["a"], SEQ)
    it = BatchIterator(ds, global_batch_size=4, micro_batch_size=4, seed=1)
    with pytest.raises(DataError, match="set run.seed=2 to resume exactly"):
        it.load_state_dict({"consumed_samples": 8, "seed": 2, "shuffle": True})


def test_batch_size_not_divisible(data):
    ds = PackedDataset(data["a"], SEQ)
    with pytest.raises(DataError, match=r"train.global_batch_size=10 is not divisible by "
                                        r"train.micro_batch_size=2 "
                                        r"x world_size=4 = 8.*multiple of 8 \(e.g. 8\)"):
        BatchIterator(ds, global_batch_size=10, micro_batch_size=2, world_size=4)
    assert BatchIterator(ds, global_batch_size=16, micro_batch_size=2, world_size=4).grad_accum_steps == 2


def test_vocab_mismatch(data):
    with pytest.raises(DataError, match=r"tokenized with vocab 320 but model.vocab_size is 512; re-run "
                                        r"prepare"):
        PackedDataset(data["a"], SEQ, expected_vocab_size=512)
    assert PackedDataset(data["a"], SEQ, expected_vocab_size=320).vocab_size == 320


def test_truncated_shard(data, tmp_path):
    path = copy_of(data, tmp_path)
    with open(f"{path}/train-00002.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match=r"shard train-00002.bin is 100 bytes but the manifest lists 97 "
                                        r"tokens of "
                                        r"uint16 \(194 bytes\): the shard is truncated; re-run `tapetrain "
                                        r"data prepare`"):
        PackedDataset(path, SEQ)


def test_missing_shard_and_manifest(data, tmp_path):
    path = copy_of(data, tmp_path)
    (tmp_path / "copy" / "train-00001.bin").unlink()
    with pytest.raises(DataError, match="train-00001.bin listed in the manifest is missing"):
        PackedDataset(path, SEQ)
    (tmp_path / "copy" / "manifest.json").unlink()
    with pytest.raises(DataError, match="holds token shards but no manifest.json .*; prepare it again: `tapetrain "
                                        "data prepare .* --overwrite`"):
        PackedDataset(path, SEQ)
    with pytest.raises(DataError, match="does not exist"):
        PackedDataset(str(tmp_path / "nowhere"), SEQ)


def test_flipped_byte_fails_checksum(data, tmp_path):
    path = copy_of(data, tmp_path)
    with open(f"{path}/train-00003.bin", "r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 0x01]))
    PackedDataset(path, SEQ)  # sizes still match: only the checksum can tell
    with pytest.raises(DataError, match=r"train-00003.bin has sha256 [0-9a-f]+ but the manifest lists "
                                        r"[0-9a-f]+: "
                                        r"the file is corrupt"):
        PackedDataset(path, SEQ, verify_checksums=True)


def test_token_id_beyond_vocab(data, tmp_path):
    path = copy_of(data, tmp_path)
    shard = np.memmap(f"{path}/train-00001.bin", dtype="<u2", mode="r+")
    shard[5] = 999
    shard.flush()
    del shard
    with pytest.raises(DataError, match=r"train-00001.bin .* holds token id 999 at position 5 but "
                                        r"vocab_size is 320"):
        PackedDataset(path, SEQ)  # scanned on open (small shards)
    ds = PackedDataset(path, SEQ, verify_tokens=False)  # not scanned: caught when the window is read
    ds[0]
    with pytest.raises(DataError, match="holds token id 999 at position 5"):
        ds[(97 + 5) // SEQ]


def test_missing_val_split(data, tmp_path):
    path = str(tmp_path / "noval")
    prepare([str(data["root"] / "b.jsonl")], data["tok"], path, progress=False)
    with pytest.raises(DataError, match=r"has no 'val' split.*--val-fraction"):
        PackedDataset(path, SEQ, split="val")
    with pytest.raises(DataError, match="fewer than seq_len"):
        PackedDataset(path, 10**7)


def test_incomplete_prepare_is_rejected(data, tmp_path):
    path = copy_of(data, tmp_path)
    (tmp_path / "copy" / ".prepare-incomplete").write_text("{}")
    with pytest.raises(DataError, match="incomplete prepare run"):
        PackedDataset(path, SEQ)


def test_mixture_weights_determinism_and_coverage(data):
    a, b = PackedDataset(data["a"], SEQ), PackedDataset(data["b"], SEQ)
    assert a.num_samples > 3 * b.num_samples
    mix = MixedDataset([(a, 1.0), (b, 3.0)], seed=0)
    located = [mix.locate(j) for j in range(mix.num_samples)]
    share_b = sum(s for s, _ in located) / mix.num_samples
    assert share_b == pytest.approx(0.75, abs=0.01)
    for s, ds in enumerate((a, b)):  # every sample of every source is used within one mixture epoch
        assert {i for src, i in located if src == s} == set(range(ds.num_samples))
    window = np.random.default_rng(0).integers(0, mix.num_samples, 200)
    again = MixedDataset([(a, 1.0), (b, 3.0)], seed=0)
    assert [mix.locate(j) for j in window] == [again.locate(j) for j in window]
    other = MixedDataset([(a, 1.0), (b, 3.0)], seed=1)
    assert [mix.locate(j) for j in range(64)] != [other.locate(j) for j in range(64)]
    src, i = mix.locate(17)
    np.testing.assert_array_equal(mix[17], (a, b)[src][i])
    it = BatchIterator(mix, global_batch_size=8, micro_batch_size=4, seed=0)
    assert it.next_micro_batch().shape == (4, SEQ + 1)


def test_open_dataset(data):
    assert isinstance(open_dataset(data["a"], SEQ), PackedDataset)
    mix = open_dataset([{"path": data["a"], "weight": 0.5}, {"path": data["b"], "weight": 0.5}], SEQ, seed=3)
    assert isinstance(mix, MixedDataset) and (mix.seq_len, mix.vocab_size) == (SEQ, 320)
    assert open_dataset([{"path": data["a"], "weight": 1}], SEQ, split="val").num_samples > 0
    with pytest.raises(DataError, match="must be a dict with 'path' and 'weight'"):
        open_dataset([{"path": data["a"]}], SEQ)
    with pytest.raises(DataError, match="must be a positive number"):
        open_dataset([{"path": data["a"], "weight": 0}], SEQ)
    with pytest.raises(DataError, match="model.vocab_size is 7"):
        open_dataset([{"path": data["a"], "weight": 1}], SEQ, expected_vocab_size=7)


def test_feistel_permutation_is_a_seeded_bijection(monkeypatch):
    for n in (1, 2, 5, 1000, 4097):
        perm = FeistelPermutation(n, seed=3, epoch=0)(np.arange(n))
        assert sorted(perm) == list(range(n))
    p0 = FeistelPermutation(1000, 3, 0)(np.arange(1000))
    assert not np.array_equal(p0, FeistelPermutation(1000, 3, 1)(np.arange(1000)))
    assert not np.array_equal(p0, FeistelPermutation(1000, 4, 0)(np.arange(1000)))
    monkeypatch.setattr(order_module, "MAX_CACHED_PERMUTATION", 10)  # large-dataset path
    order = SampleOrder(1000, seed=3)
    np.testing.assert_array_equal(order(np.arange(1000)), p0)


def test_flat_token_file(tmp_path):
    tokens = np.arange(1000, dtype="<u2") % 300
    tokens.tofile(tmp_path / "t.bin")
    flat = FlatTokenFile(str(tmp_path / "t.bin"), vocab_size=300)
    assert len(flat) == 1000 and flat.tokens.dtype == np.dtype("<u2")
    windows = list(flat.windows(100))
    assert len(windows) == flat.num_windows(100) == 9  # 9 * 100 + 1 <= 1000 < 10 * 100 + 1
    np.testing.assert_array_equal(windows[1], tokens[100:201].astype(np.int64))
    assert len(list(flat.windows(100, stride=50))) == 18
    with pytest.raises(DataError, match="holds id 299 at position 299 but vocab_size is 299"):
        FlatTokenFile(str(tmp_path / "t.bin"), vocab_size=299)
    (tmp_path / "odd.bin").write_bytes(b"\0\0\0")
    with pytest.raises(DataError, match="3 bytes, not a multiple of 2"):
        FlatTokenFile(str(tmp_path / "odd.bin"))
    with pytest.raises(DataError, match="does not exist"):
        FlatTokenFile(str(tmp_path / "missing.bin"))

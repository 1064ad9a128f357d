"""The supervised example path: the on-disk store, padding and packing with answer-only labels, the model's loss
on those labels, the batch order (rank-count independent, O(1) resume) and clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tapetrain.data.char_vocab import write_char_vocab
from tapetrain.data.errors import DataError
from tapetrain.data.examples import ExampleStore, ExampleWriter, example_dir_writer, write_manifest
from tapetrain.data.stream import BatchIterator, open_dataset
from tapetrain.data.supervised import IGNORE_INDEX, ExampleBatch, SupervisedDataset, inputs_and_labels, pack_boundaries
from tapetrain.model import ModelConfig, Transformer

EOS, PAD = 2, 3


def make_store(path, examples: list[tuple[list[int], list[int]]], vocab: int = 16, val: list | None = None) -> str:
    """A store of the given (prompt, answer-with-EOS) pairs; tokenizer = the arithmetic alphabet."""
    with example_dir_writer(str(path)) as tmp:
        splits = {}
        for split, rows in (("train", examples), ("val", val)):
            if rows:
                writer = ExampleWriter(tmp, split, vocab)
                for prompt, answer in rows:
                    writer.add(prompt, answer)
                splits[split] = writer.close()
        write_char_vocab("0123456789+=", f"{tmp}/tokenizer.model")
        write_manifest(tmp, vocab_size=vocab, bos_id=1, eos_id=EOS, pad_id=PAD, splits=splits, task={"name": "t"},
                       tokenizer_source=None)
    return str(path)


def random_examples(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = [1, *rng.integers(4, 16, size=int(rng.integers(1, 8))).tolist()]
        answer = [*rng.integers(4, 16, size=int(rng.integers(1, 5))).tolist(), EOS]
        out.append((prompt, answer))
    return out


def test_store_round_trip_and_damage_is_detected(tmp_path):
    examples = random_examples(50)
    path = make_store(tmp_path / "s", examples)
    store = ExampleStore(path)
    assert store.num_examples == 50 and store.dtype == np.uint8
    assert store.max_length == max(len(p) + len(a) for p, a in examples)
    for i, (prompt, answer) in enumerate(examples):
        ids, prompt_len = store.example(i)
        assert ids.tolist() == prompt + answer and prompt_len == len(prompt)
    with open(tmp_path / "s" / "train.tokens.bin", "ab") as f:
        f.write(b"\0")
    with pytest.raises(DataError, match="damaged"):
        ExampleStore(path)
    with pytest.raises(DataError, match="already exists"):
        make_store(tmp_path / "s", examples)


def test_padding_labels_only_the_answer_and_its_eos(tmp_path):
    examples = [([1, 5, 14, 6, 15], [11, EOS]), ([1, 7, 15], [4, 9, 5, EOS])]
    ds = SupervisedDataset(make_store(tmp_path / "s", examples), seq_len=8)
    batch = ds.collate([ds[0], ds[1]])
    assert batch.input_ids.tolist() == [[1, 5, 14, 6, 15, 11, EOS, PAD], [1, 7, 15, 4, 9, 5, EOS, PAD]]
    x = IGNORE_INDEX
    # labels[t] is the target for input t: only the answer tokens (and EOS) are targets
    assert batch.labels.tolist() == [[x, x, x, x, 11, EOS, x, x], [x, x, 4, 9, 5, EOS, x, x]]
    inputs, labels = inputs_and_labels(batch)
    assert inputs is batch.input_ids and labels is batch.labels
    window = torch.arange(10)[None]
    assert [t.tolist() for t in inputs_and_labels(window)] == [[list(range(9))], [list(range(1, 10))]]


def test_packing_keeps_every_example_and_its_own_mask(tmp_path):
    examples = random_examples(200, seed=1)
    path = make_store(tmp_path / "s", examples)
    padded = SupervisedDataset(path, seq_len=24)
    packed = SupervisedDataset(path, seq_len=24, packing=True)
    assert padded.num_samples == 200 and packed.num_samples < 200 / 2
    seen_tokens, seen_mask = [], []
    for i in range(packed.num_samples):
        sample = packed[i]
        tokens, mask = sample[0].tolist(), sample[1].tolist()
        used = sum(t != PAD for t in tokens)  # PAD never occurs inside these examples
        assert all(t == PAD for t in tokens[used:])
        seen_tokens += tokens[:used]
        seen_mask += mask[:used]
        assert not any(mask[used:])
    assert seen_tokens == [t for p, a in examples for t in p + a]
    assert seen_mask == [m for p, a in examples for m in [0] * len(p) + [1] * len(a)]
    lengths = np.array([len(p) + len(a) for p, a in examples])
    bounds = pack_boundaries(lengths, 25)
    sizes = [lengths[b:e].sum() for b, e in zip(bounds[:-1], bounds[1:], strict=True)]
    assert max(sizes) <= 25 and all(s + lengths[e] > 25 for s, e in zip(sizes[:-1], bounds[1:-1], strict=True))


def test_model_loss_is_the_mean_over_answer_tokens_only(tmp_path):
    ds = SupervisedDataset(make_store(tmp_path / "s", random_examples(8, seed=2)), seq_len=12)
    batch = ds.collate([ds[i] for i in range(8)])
    model = Transformer(ModelConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=2, ffn_hidden=64, max_seq_len=16,
                                    pe="tape", loss_backend="plain"))  # plain: the logits come back with the loss
    out = model(batch.input_ids, labels=batch.labels)
    keep = batch.labels != IGNORE_INDEX
    by_hand = F.cross_entropy(out.logits[keep].float(), batch.labels[keep])
    assert torch.allclose(out.loss, by_hand, atol=1e-6)
    model.lm_head.loss_backend = "chunked"  # the fused training loss masks the same way
    assert torch.allclose(model(batch.input_ids, labels=batch.labels).loss, by_hand, atol=1e-6)
    # exactly the answer tokens (EOS included) are scored
    assert int(keep.sum()) == sum(len(a) for _, a in random_examples(8, seed=2))


def test_order_is_rank_count_independent_and_resumes_in_o1(tmp_path):
    ds = open_dataset(make_store(tmp_path / "s", random_examples(100, seed=3)), 16)
    assert isinstance(ds, SupervisedDataset)

    def step_rows(world: int, steps: int, consumed: int = 0) -> list[list[list[int]]]:
        """Per optimizer step: the input rows seen by all ranks, sorted (the global batch of that step)."""
        iters = [BatchIterator(ds, global_batch_size=8, micro_batch_size=2, rank=r, world_size=world, seed=7,
                               consumed_samples=consumed) for r in range(world)]
        out = []
        for _ in range(steps):
            rows = []
            for it in iters:
                for _ in range(it.grad_accum_steps):
                    batch = it.next_micro_batch()
                    assert isinstance(batch, ExampleBatch)
                    rows += batch.input_ids.tolist()
            out.append(sorted(rows))
        return out

    one, two = step_rows(1, 30), step_rows(2, 30)  # 30 steps x 8 = 2.4 epochs: crosses epoch boundaries
    assert one == two
    it = BatchIterator(ds, global_batch_size=8, micro_batch_size=2, seed=7)
    for _ in range(4 * 17):
        it.next_micro_batch()
    state = it.state_dict()
    assert state["consumed_samples"] == 17 * 8
    assert step_rows(2, 13, consumed=state["consumed_samples"]) == one[17:]


def test_errors_name_the_fix(tmp_path):
    from tapetrain.data.prepare import prepare

    path = make_store(tmp_path / "s", [([1, 4, 4, 4, 4, 4], [5, 5, 5, EOS])])
    (tmp_path / "text.jsonl").write_text("\n".join('{"text": "12+34=46"}' for _ in range(20)))
    write_char_vocab("0123456789+=", str(tmp_path / "tok.model"))
    shard_dir = tmp_path / "shards"
    prepare([str(tmp_path / "text.jsonl")], str(tmp_path / "tok.model"), str(shard_dir), progress=False)
    with pytest.raises(DataError, match="set data.seq_len to at least 9"):
        SupervisedDataset(path, seq_len=5)
    with pytest.raises(DataError, match="model.vocab_size"):
        open_dataset(path, 16, expected_vocab_size=512)
    with pytest.raises(DataError, match="no 'val' split"):
        open_dataset(path, 16, split="val")
    with pytest.raises(DataError, match="mixes token shards and example stores"):
        open_dataset([{"path": path, "weight": 1}, {"path": str(shard_dir), "weight": 1}], 16)
    mixed = open_dataset([{"path": path, "weight": 1}, {"path": path, "weight": 2}], 16)
    assert isinstance(mixed.collate([mixed[0]]), ExampleBatch)


def test_example_stores_pass_the_tokenizer_checks(tmp_path):
    """A run's start-up compares the tokenizer of every data source; example stores record theirs in their own
    manifest format (the check used to reject them as 'not a tokens dataset')."""
    from tapetrain.data.format import file_sha256
    from tapetrain.data.provenance import common_tokenizer

    store = make_store(tmp_path / "s", random_examples(4, seed=5))
    sha = file_sha256(f"{store}/tokenizer.model")
    assert common_tokenizer([store]) == sha
    assert common_tokenizer([store, store], f"{store}/tokenizer.model") == sha
    other = tmp_path / "other.model"
    other.write_bytes(b"not the same tokenizer")
    with pytest.raises(DataError, match="is not the tokenizer the data was prepared with"):
        common_tokenizer([store], str(other))


def test_verify_checks_example_stores_too(tmp_path):
    """`tapetrain data verify` / data.verify on arith or scrolls data used to fail with "re-run tapetrain prepare"."""
    from tapetrain.data.verify import verify_dataset

    store = make_store(tmp_path / "s", random_examples(6, seed=4), val=random_examples(2, seed=9))
    assert verify_dataset(store, progress=False) == []
    tokens = tmp_path / "s" / "train.tokens.bin"
    assert tokens.is_file(), sorted(p.name for p in (tmp_path / "s").iterdir())
    raw = bytearray(tokens.read_bytes())
    raw[0] ^= 0x01
    tokens.write_bytes(bytes(raw))
    problems = verify_dataset(store, progress=False)
    assert len(problems) == 1 and "train.tokens.bin: sha256" in problems[0], problems

"""Document ids from the readers (data.document_mask): EOS in token shards, example boundaries in packed example
stores; the ids are a function of the sample alone (resume, rank count), and packed examples with the mask score
exactly as padded ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tapetrain.data.documents import TokenBatch, document_ids_from_eos, document_stats
from tapetrain.data.stream import BatchIterator, open_dataset
from tapetrain.data.supervised import IGNORE_INDEX, ExampleBatch, SupervisedDataset, document_ids, inputs_and_labels
from tapetrain.model import ModelConfig, Transformer
from tests.unit.test_data_stream import data  # noqa: F401  (the module-scoped fixture of prepared shards)
from tests.unit.test_supervised_examples import EOS, make_store, random_examples


def test_ids_count_the_eos_before_each_token():
    window = np.array([[5, 6, 2, 7, 2, 2, 9, 8]])
    assert document_ids_from_eos(window, 2).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]  # an EOS ends its document


def test_token_shards_batches_carry_ids_only_with_the_mask(data):  # noqa: F811
    plain = open_dataset(data["a"], 16)
    masked = open_dataset(data["a"], 16, document_mask=True)
    assert not plain.document_mask and masked.document_mask
    it_plain = BatchIterator(plain, global_batch_size=4, micro_batch_size=2, seed=3)
    it_masked = BatchIterator(masked, global_batch_size=4, micro_batch_size=2, seed=3)
    for _ in range(6):
        a, b = it_plain.next_micro_batch(), it_masked.next_micro_batch()
        assert isinstance(a, torch.Tensor) and document_ids(a) is None  # the mask off: today's batches
        assert isinstance(b, TokenBatch) and torch.equal(a, b.tokens)
        inputs, _ = inputs_and_labels(b)
        assert b.doc_ids.dtype == torch.int32 and b.doc_ids.shape == inputs.shape
        assert b.doc_ids.tolist() == document_ids_from_eos(inputs.numpy(), masked.eos_id).tolist()
    # a resumed iterator reads the same ids, on one rank or split over two: they are a function of the window
    state = it_masked.state_dict()
    nxt = it_masked.next_micro_batch()
    one = BatchIterator(masked, global_batch_size=4, micro_batch_size=2, seed=3)
    one.load_state_dict(state)
    assert torch.equal(one.next_micro_batch().doc_ids, nxt.doc_ids)
    halves = []
    for rank in (0, 1):
        two = BatchIterator(masked, global_batch_size=4, micro_batch_size=1, seed=3, rank=rank, world_size=2)
        two.load_state_dict(state)
        halves.append(two.next_micro_batch().doc_ids)
    assert torch.equal(torch.cat(halves), nxt.doc_ids)


def test_mixtures_keep_the_mask(data):  # noqa: F811
    mixed = open_dataset([{"path": data["a"], "weight": 1}, {"path": data["b"], "weight": 1}], 16, document_mask=True)
    assert mixed.document_mask
    batch = BatchIterator(mixed, global_batch_size=2, micro_batch_size=2).next_micro_batch()
    assert isinstance(batch, TokenBatch)


def test_supervised_packing_masks_by_default(tmp_path):
    path = make_store(tmp_path / "s", random_examples(40, seed=4))
    assert SupervisedDataset(path, 24, packing=True).document_mask
    assert not SupervisedDataset(path, 24, packing=True, document_mask=False).document_mask
    assert not SupervisedDataset(path, 24).document_mask  # padding: one example per sequence
    ds = SupervisedDataset(path, 24, packing=True)
    batch = ds.collate([ds[0], ds[1]])
    assert isinstance(batch, ExampleBatch) and batch.doc_ids.shape == batch.input_ids.shape
    assert batch.to("cpu").doc_ids is not None


@pytest.mark.parametrize("pe", ["tape", "rope", "alibi"])
def test_packed_examples_with_the_mask_score_like_padded_ones(tmp_path, pe):
    """Per-example answer losses: packing with document_mask equals padding (1e-5); without the mask it does not."""
    examples = random_examples(30, seed=5)
    path = make_store(tmp_path / "s", examples)
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(
            vocab_size=16,
            d_model=32,
            n_layers=2,
            n_heads=2,
            ffn_hidden=64,
            max_seq_len=32,
            pe=pe,
            loss_backend="plain",
            init_std=0.2,
        )
    ).eval()

    @torch.no_grad()
    def per_example_losses(ds: SupervisedDataset) -> list[float]:
        """Summed answer cross-entropy of every example, in store order."""
        out = []
        for i in range(ds.num_samples):
            batch = ds.collate([ds[i]])
            kw = {} if batch.doc_ids is None else {"doc_ids": batch.doc_ids}
            logits = model(batch.input_ids, **kw).logits[0]
            nll = F.cross_entropy(logits, batch.labels[0], ignore_index=IGNORE_INDEX, reduction="none")
            # split the window's answer tokens by example: an example's answer ends with its EOS label
            keep = batch.labels[0] != IGNORE_INDEX
            ends = (batch.labels[0] == EOS) & keep
            acc = 0.0
            for t in range(len(nll)):
                acc += float(nll[t]) if keep[t] else 0.0
                if ends[t]:
                    out.append(acc)
                    acc = 0.0
        return out

    padded = per_example_losses(SupervisedDataset(path, 16))
    packed = per_example_losses(SupervisedDataset(path, 40, packing=True))
    unmasked = per_example_losses(SupervisedDataset(path, 40, packing=True, document_mask=False))
    assert len(padded) == len(packed) == 30
    np.testing.assert_allclose(packed, padded, atol=1e-5, rtol=0)
    assert not np.allclose(unmasked, padded, atol=1e-3)  # examples saw each other before


def test_document_stats():
    ids = torch.tensor(document_ids_from_eos(np.array([[1] * 300 + [2] + [1] * 211]), 2))
    per_doc, skipped = document_stats(ids, 128)
    assert per_doc == 256.0 and skipped == pytest.approx(2 / 10)  # 4 tiles, 10 causal pairs, 2 across documents

"""One forward for every layout (model/sequence_shard.py): the whole sequence is the shard of size 1, and the parts
that differ with N ranks (the kept logits, the loss's reduction) are the shard's, checked here without processes."""

from __future__ import annotations

import pytest
import torch

from tapetrain.model.sequence_shard import WHOLE_SEQUENCE, kept_tokens, whole_sequence_mean
from tests.unit.model_helpers import build, randomize_tape


class SameOnEveryRank:
    """A group of `size` ranks whose slices all hold the same numbers: its sums are size × this rank's."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach() * self.size


@pytest.mark.parametrize("keep", [0, 1, 5, 8, 100])
def test_kept_tokens_of_a_group_are_the_whole_sequences_last_ones(keep: int):
    whole = torch.arange(16)
    expected = whole if keep == 0 else whole[-keep:]
    assert torch.equal(whole[kept_tokens(WHOLE_SEQUENCE, 16, keep)], expected)
    parts = [whole[r * 4:(r + 1) * 4][kept_tokens(SameOnEveryRank(r, 4), 4, keep)] for r in range(4)]
    assert torch.equal(torch.cat(parts), expected)


def test_the_group_mean_is_the_value_and_the_slice_share_the_gradient():
    """Two ranks holding equal slices: the value is the mean over both slices' labels (= this slice's mean), the
    gradient this slice's share of it (half); one rank is the plain mean, untouched."""
    labels = torch.tensor([[1, 2, -100, 3]])
    losses = torch.tensor([0.5, 1.5, 9.0, 2.5], requires_grad=True)

    def mean(count: torch.Tensor | None) -> torch.Tensor:
        kept = losses[labels[0] != -100]
        return kept.mean() if count is None else kept.sum() / count

    one = whole_sequence_mean(WHOLE_SEQUENCE, labels, mean)
    (grad_one,) = torch.autograd.grad(one, losses)
    two = whole_sequence_mean(SameOnEveryRank(0, 2), labels, mean)
    (grad_two,) = torch.autograd.grad(two, losses)
    assert one.item() == pytest.approx(1.5) and two.item() == pytest.approx(1.5)
    torch.testing.assert_close(grad_two, grad_one / 2)


class OneRankShard:
    """The SequenceShard protocol for a group of one rank, given to the model as a shard."""

    rank, size = 0, 1

    def attend(self, local_attention, q, k, values):
        return local_attention(q, k, values)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().clone()

    def same(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().clone()


@pytest.mark.parametrize("pe", ["tape", "alibi", "randpe"])
@pytest.mark.parametrize("loss_backend", ["plain", "chunked"])
def test_a_shard_of_one_rank_is_the_forward_without_a_shard_bit_for_bit(pe: str, loss_backend: str):
    model = build(pe, loss_backend=loss_backend, attn_backend="sdpa").train()
    randomize_tape(model)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.roll(-1, dims=1)
    results = []
    for shard in (None, OneRankShard()):
        model.shard_sequence(shard)
        model.zero_grad()
        torch.manual_seed(3)
        loss = model(ids, labels=labels).loss
        loss.backward()
        torch.manual_seed(3)
        kept = model(ids, logits_to_keep=3).logits
        results.append((loss.detach(), kept.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_a, kept_a, grads_a), (loss_b, kept_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(kept_a, kept_b) and kept_a.shape[1] == 3
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))

"""Abacus digit-place embeddings (model.abacus): the places of real addition prompts, training offsets keyed on the
data order (the same on any rank count and after a resume), the KV cache continuing a number's places, and the
Hugging Face export computing the same logits and generations through its remote code."""

import numpy as np
import pytest
import torch
from model_helpers import build, randomize_tape

from tapetrain.data.arith import DIGIT0, answer_ids, problem_ids
from tapetrain.data.batches import BatchIterator
from tapetrain.errors import ConfigError
from tapetrain.model import ModelConfig
from tapetrain.model.abacus import abacus_offsets, digit_places

ARITH_DIGITS = list(range(DIGIT0, DIGIT0 + 10))


def places_of(ids: list[int]) -> list[int]:
    row = torch.tensor([ids])
    return digit_places(torch.isin(row, torch.tensor(ARITH_DIGITS)))[0].tolist()


def abacus_model(pe: str = "tape", **overrides):
    """A tiny model over the 16 ids of `tapetrain data arith`, its Abacus table random (not its init) so every
    place makes a visible difference."""
    settings = {"vocab_size": 16, "abacus": True, "abacus_max_places": 64, "abacus_train_offset": 20, **overrides}
    model = build(pe, **settings)
    randomize_tape(model)
    with torch.no_grad():
        model.abacus.embed.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(5))
    return model


def test_places_of_mixed_length_operands_count_from_the_units():
    # 987 + 4563 = 5550, written reversed: <s> 789 + 3654 = 0555 </s>
    ids = problem_ids("987", "4563") + answer_ids("5550")
    assert places_of(ids) == [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0]
    assert places_of(problem_ids("5", "12") + answer_ids("17")) == [0, 1, 0, 1, 2, 0, 1, 2, 0]
    # a number split between a cached prefix and new tokens keeps counting from the carry
    row = torch.isin(torch.tensor([ids[6:10], ids[1:5]]), torch.tensor(ARITH_DIGITS))
    assert digit_places(row, torch.tensor([2, 0])).tolist() == [[3, 4, 5, 0], [1, 2, 3, 0]]


def test_default_digit_ids_are_the_arith_vocabulary_and_bad_settings_are_refused():
    assert ModelConfig().abacus_digit_ids == ARITH_DIGITS
    with pytest.raises(ConfigError, match="model.abacus_digit_ids"):
        ModelConfig(vocab_size=8, abacus_digit_ids=[4, 5, 9]).validate()
    with pytest.raises(ConfigError, match="model.abacus_train_offset"):
        ModelConfig(abacus_max_places=50, abacus_train_offset=50).validate()
    model = abacus_model(abacus_max_places=3, abacus_train_offset=0)
    with pytest.raises(ValueError, match="model.abacus_max_places=3"):
        model(torch.tensor([problem_ids("1234", "5")]))


def test_offsets_are_keyed_on_seed_and_slot_alike_on_any_rank_count_and_after_a_resume():
    first = abacus_offsets(7, np.arange(1000), 100)
    assert first.dtype == torch.int64 and int(first.min()) >= 0 and int(first.max()) < 100
    assert len(set(first.tolist())) > 90  # spread over the range, not a constant
    assert torch.equal(first, abacus_offsets(7, np.arange(1000), 100))
    assert not torch.equal(first, abacus_offsets(8, np.arange(1000), 100))  # another run.seed, other offsets

    class Samples:
        num_samples = 10_000

    def step_slots(iterator: BatchIterator) -> list[int]:
        slots = []
        for _ in range(iterator.grad_accum_steps):
            slots += iterator.slots_ahead(0).tolist()
            iterator.advance()
        return slots

    one = BatchIterator(Samples(), global_batch_size=8, micro_batch_size=2, seed=3)
    ranks = [BatchIterator(Samples(), global_batch_size=8, micro_batch_size=2, rank=r, world_size=2, seed=3)
             for r in range(2)]
    for _ in range(3):  # the same samples, hence the same offsets, on 1 and on 2 ranks
        assert sorted(step_slots(one)) == sorted(step_slots(ranks[0]) + step_slots(ranks[1]))
    resumed = BatchIterator(Samples(), global_batch_size=8, micro_batch_size=2, seed=3)
    resumed.load_state_dict(one.state_dict())
    assert step_slots(resumed) == step_slots(one)


def test_offsets_shift_the_places_while_training_only():
    model = abacus_model()
    ids = torch.tensor([problem_ids("987", "4563") + answer_ids("5550")] * 2)  # (2, 15)
    reference = model(ids).logits  # eval mode: no offsets
    model.train()
    zero = model(ids, abacus_offsets=torch.tensor([0, 0])).logits
    shifted = model(ids, abacus_offsets=torch.tensor([0, 9])).logits
    assert torch.allclose(zero, reference, atol=1e-5)
    assert torch.allclose(shifted[0], reference[0], atol=1e-5)
    assert (shifted[1] - reference[1]).abs().max() > 1e-2  # the offset row computes at other places
    model.eval()
    assert torch.equal(model(ids, abacus_offsets=torch.tensor([0, 9])).logits, reference)


def test_cache_continues_the_places_of_a_cached_number():
    model = abacus_model()
    ids = torch.tensor([problem_ids("987", "4563") + answer_ids("5550"), problem_ids("12", "3") + [7] * 9])
    whole = model(ids).logits
    from tapetrain.model.cache import KVCache

    cache = KVCache(model.cfg.n_layers)
    pieces = [model(ids[:, a:b], cache=cache).logits for a, b in ((0, 3), (3, 7), (7, 8), (8, 15))]  # splits numbers
    assert torch.allclose(torch.cat(pieces, dim=1), whole, atol=1e-5)
    prompt = ids[:, :9]
    assert torch.equal(model.generate(prompt, 12), model.generate(prompt, 12, use_cache=False))


def test_export_computes_the_same_places_logits_and_generations(tmp_path):
    """RoPE with Abacus: the place code is the same for every PE, and this one must leave the plain Llama export
    for the remote code (the other PEs' exports are tested in test_hf_export.py)."""
    from test_hf_export import ATOL, logits_diff

    from tapetrain.checkpoint.hf_export import export_model

    transformers = pytest.importorskip("transformers")
    pe = "rope"
    model = abacus_model(pe)
    result = export_model(model, str(tmp_path / pe))
    assert result["verification"]["passed"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / pe, trust_remote_code=True).eval()
    assert type(theirs).__name__ == "TapetrainForCausalLM"  # rope with Abacus needs the remote code too
    ids = torch.tensor([problem_ids("98765", "4563") + answer_ids("103328"), problem_ids("1", "2") + [13] * 14])
    assert torch.equal(theirs.model.abacus.embed.weight, model.abacus.embed.weight)  # the places' table came along
    assert logits_diff(model, theirs, ids) <= ATOL
    prompt = torch.tensor([problem_ids("98765", "4563"), problem_ids("12345", "6789")])  # generates digits
    cached = theirs.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=True)
    uncached = theirs.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, model.generate(prompt, 10))
    assert bool(torch.isin(cached[:, prompt.shape[1]:], torch.tensor(ARITH_DIGITS)).any())  # digits were generated

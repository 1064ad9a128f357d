"""Every standard decoding mode of the exported remote-code model, each against decoding without a cache.

The model keeps TAPE's state E and the token positions in its own cache, which `generate` must use in every mode:
greedy with the default cache, prompt-lookup and assisted decoding (they roll the cache back on rejected tokens),
beam search (reorders and repeats it), sampling, and left-padded batches (positions from the attention mask).
"""

import pytest
import torch
from model_helpers import build, randomize_fire, randomize_tape

from tapetrain.checkpoint.hf_export import export_model

PES = ["tape", "fire", "xpos"]  # E in the cache; per-layer position bias; position-dependent decay


@pytest.fixture(scope="module", params=PES)
def exported(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    pe = request.param
    model = build(pe, n_kv_heads=2)
    if pe == "tape":
        randomize_tape(model)
    randomize_fire(model)
    out = tmp_path_factory.mktemp(pe) / "hf"
    export_model(model, str(out))
    return model, AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()


def prompt(rows: int = 1, length: int = 14) -> torch.Tensor:
    base = torch.randint(3, 512, (rows, 5), generator=torch.Generator().manual_seed(8))
    return base.repeat(1, 3)[:, :length]  # repeated n-grams give prompt lookup candidates to propose


def greedy_without_cache(model, ids: torch.Tensor, new: int = 12) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=new, do_sample=False, use_cache=False)


def test_default_cache_greedy(exported):
    ours, theirs = exported
    ids = prompt(2)
    expected = greedy_without_cache(theirs, ids)
    assert torch.equal(theirs.generate(ids, max_new_tokens=12, do_sample=False), expected)
    assert torch.equal(ours.generate(ids, 12), expected)


def test_prompt_lookup_decoding(exported):
    _, theirs = exported
    ids = prompt(1)
    got = theirs.generate(ids, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=4)
    assert torch.equal(got, greedy_without_cache(theirs, ids))


def test_assisted_decoding(exported):
    _, theirs = exported
    ids = prompt(1)
    got = theirs.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=theirs, num_assistant_tokens=3)
    assert torch.equal(got, greedy_without_cache(theirs, ids))


def test_beam_search(exported):
    _, theirs = exported
    ids = prompt(2)
    kwargs = dict(max_new_tokens=10, do_sample=False, num_beams=3, num_return_sequences=2)
    cached = theirs.generate(ids, **kwargs)
    assert cached.shape[0] == 4
    assert torch.equal(cached, theirs.generate(ids, use_cache=False, **kwargs))


def test_sampling(exported):
    _, theirs = exported
    ids = prompt(2)
    kwargs = dict(max_new_tokens=12, do_sample=True, top_k=20, temperature=0.9)
    torch.manual_seed(3)
    cached = theirs.generate(ids, **kwargs)
    torch.manual_seed(3)
    assert torch.equal(cached, theirs.generate(ids, use_cache=False, **kwargs))


def test_left_padded_batch(exported):
    _, theirs = exported
    ids = torch.randint(3, 512, (2, 10), generator=torch.Generator().manual_seed(4))
    batch, mask = ids.clone(), torch.ones_like(ids)
    batch[1, :4], mask[1, :4] = 0, 0  # row 1 is a 6-token prompt, left-padded
    for use_cache in (True, False):
        both = theirs.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                               use_cache=use_cache)
        assert torch.equal(both[0, 10:], greedy_without_cache(theirs, ids[:1], 8)[0, 10:])
        assert torch.equal(both[1, 10:], greedy_without_cache(theirs, ids[1:, 4:], 8)[0, 6:])


def test_prefill_computes_the_last_rows_logits_only(exported):
    """A long prompt's prefill must not materialise (T, V) logits: generation needs the last row only (at 128K
    tokens and a 32K vocabulary the full tensor alone is 16 GB in fp32). Both the remote code (transformers passes
    logits_to_keep=1) and tapetrain's own generate are checked by the shapes their lm_head returns."""
    ours, theirs = exported
    ids = prompt(2, 14).repeat(1, 12)  # (2, 168)
    for model in (ours, theirs):
        rows: list[int] = []
        hook = model.lm_head.register_forward_hook(lambda _m, _i, out, rows=rows: rows.append(out.shape[1]))
        try:
            model.generate(ids, 5) if model is ours else model.generate(ids, max_new_tokens=5, do_sample=False)
        finally:
            hook.remove()
        assert rows == [1] * 5, (type(model).__name__, rows)

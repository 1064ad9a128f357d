"""Perplexity protocols against re-statements of the reference scripts' own logic (written out below), and the
shard split rule of `eval ppl`.

References restated here (read for understanding; no code copied):
  LongLoRA eval_distributed.py and the TAPE repository's eval_llama.py: Pg19Dataset takes window starts
      list(range(0, len(data) - seq_len, 256)); each window's labels are its own inputs, so the model scores its
      seq_len - 1 next-token predictions; torchmetrics' Perplexity sums NLL and counts over everything it saw.
      A DistributedSampler (shuffle on, seed 0) pads the window list to a multiple of the number of GPUs.
  LongLoRA eval.py: get_as_batch builds the same start list, then pops its last element; batches of batch_size
      consecutive windows; a batch's loss is the model's mean loss over its predictions; val_loss is the mean of
      the batch losses and the perplexity 2.71828 ** val_loss.
"""

import logging
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from model_helpers import build

from tapetrain.eval import windows as windows_module
from tapetrain.eval.models import EvalModel
from tapetrain.eval.ppl import evaluate_ppl, run_eval_ppl
from tapetrain.eval.tokens import EvalTokens
from tapetrain.eval.windows import make_windows


def eval_distributed_starts(n_tokens: int, seq_len: int, step: int = 256) -> list[int]:
    return list(range(0, n_tokens - seq_len, step))


def eval_py_starts(n_tokens: int, seq_len: int, step: int = 256) -> list[int]:
    starts = list(range(0, n_tokens - seq_len, step))
    starts.pop()
    return starts


def distributed_sampler_repeats(n_windows: int, ranks: int) -> list[int]:
    """torch DistributedSampler(shuffle=True, seed=0, drop_last=False): randperm with a generator seeded 0, then
    the first (total - n) indices of it appended; total = ceil(n / ranks) * ranks."""
    gen = torch.Generator()
    gen.manual_seed(0)
    order = torch.randperm(n_windows, generator=gen).tolist()
    total = math.ceil(n_windows / ranks) * ranks
    return order[: total - n_windows]


@pytest.mark.parametrize("n_tokens, counts", [(10000, (36, 35)), (9216, (32, 31)), (9217, (33, 32))])
def test_reference_window_starts_and_counts(n_tokens, counts):
    longlora = make_windows(n_tokens, 1024, "longlora")
    eval_py = make_windows(n_tokens, 1024, "longlora-eval")
    assert [w.start for w in longlora] == eval_distributed_starts(n_tokens, 1024)
    assert [w.start for w in eval_py] == eval_py_starts(n_tokens, 1024)
    assert (len(longlora), len(eval_py)) == counts
    # labels = inputs: offsets 0 .. L-2 predict x[start+1 .. start+L-1]
    assert all((w.score_from, w.score_to) == (0, 1023) for w in longlora + eval_py)


def test_distributed_sampler_padding_repeats_the_reference_windows():
    base = make_windows(10000, 1024, "longlora")  # 36 windows
    for ranks in (1, 5, 8):
        padded = make_windows(10000, 1024, "longlora", reference_ranks=ranks)
        expected = base + [base[i] for i in distributed_sampler_repeats(len(base), ranks)]
        assert sorted(padded) == sorted(expected)
        assert len(padded) % ranks == 0
    assert len(make_windows(10000, 1024, "longlora", reference_ranks=8)) == 40


def hf_mean_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """A Hugging Face causal LM's loss with labels = input_ids: mean NLL over the batch's shifted predictions."""
    with torch.no_grad():
        logits = model(batch).logits.double()
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())


def in_memory(tokens: np.ndarray) -> EvalTokens:
    return EvalTokens(lambda a, b: tokens[a:b].astype(np.int64), len(tokens), "in-memory")


def eval_model(model) -> EvalModel:
    return EvalModel(model.eval(), "run", "tiny", model.cfg.vocab_size, model.cfg.max_seq_len, None,
                     torch.device("cpu"), "fp32")


def test_reference_perplexities_match_restatement(monkeypatch):
    step, seq_len, batch = 4, 8, 4
    monkeypatch.setattr(windows_module, "LONGLORA_STEP", step)  # 256 in the references; small for a tiny stream
    model = build("rope")
    tokens = np.random.default_rng(0).integers(0, 512, 47)
    x = torch.from_numpy(tokens)

    # eval_distributed.py / eval_llama.py: token-weighted over all windows, one forward per window
    starts = eval_distributed_starts(len(tokens), seq_len, step)
    nll = sum(float(hf_mean_loss(model, x[s:s + seq_len][None])) * (seq_len - 1) for s in starts)
    distributed_ppl = math.exp(nll / (len(starts) * (seq_len - 1)))

    # eval.py: batches of `batch` consecutive windows, mean of the batch means, 2.71828 ** mean
    starts = eval_py_starts(len(tokens), seq_len, step)
    losses = [float(hf_mean_loss(model, torch.stack([x[s:s + seq_len] for s in starts[i:i + batch]])))
              for i in range(0, len(starts), batch)]
    eval_py_ppl = 2.71828 ** (sum(losses) / len(losses))
    assert len(starts) % batch != 0  # the short last batch weighs as much as a full one: the test would notice

    for forward_batch in (1, 2, 5):  # windows per forward pass never change a result
        [longlora] = evaluate_ppl(eval_model(model), in_memory(tokens), [seq_len], "longlora", batch_size=forward_batch)
        [eval_py] = evaluate_ppl(eval_model(model), in_memory(tokens), [seq_len], "longlora-eval",
                                 batch_size=forward_batch, reference_batch_size=batch)
        assert longlora["ppl"] == pytest.approx(distributed_ppl, rel=1e-6)  # fp32 logits vs float64 here
        assert eval_py["ppl"] == pytest.approx(eval_py_ppl, rel=1e-6)
        assert (longlora["windows"], eval_py["windows"], eval_py["batches"]) == (10, 9, 3)
    token_weighted = math.exp(eval_py["nll_sum"] / eval_py["tokens"])
    assert abs(token_weighted / eval_py["ppl"] - 1) > 1e-3  # the two averagings really differ here


def test_reference_protocols_need_enough_tokens_and_reject_foreign_knobs():
    model = eval_model(build("rope"))
    tokens = in_memory(np.arange(1024 + 256, dtype=np.int64) % 512)
    with pytest.raises(ValueError, match="needs at least 1281 tokens .*longlora-eval"):
        evaluate_ppl(model, tokens, [1024], "longlora-eval")
    with pytest.raises(ValueError, match="--reference-ranks applies to --protocol longlora"):
        make_windows(5000, 1024, "nonoverlap", reference_ranks=4)


def write_shards(directory, splits: dict[str, np.ndarray]) -> None:
    from tapetrain import atomic_io
    from tapetrain.data import format as fmt

    directory.mkdir()
    manifest_splits = {}
    for split, tokens in splits.items():
        writer = fmt.ShardWriter(str(directory), split, "uint16", shard_tokens=128)
        writer.add(tokens, np.array([len(tokens)]))
        manifest_splits[split] = writer.close()
    manifest = {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION, "vocab_size": 512, "dtype": "uint16",
                "bos_id": 1, "eos_id": 2, "num_tokens": sum(len(t) for t in splits.values()),
                "splits": manifest_splits}
    atomic_io.write_json(str(directory / fmt.MANIFEST), manifest)


def test_shards_without_val_split_need_split_train(tmp_path, caplog):
    from tapetrain.checkpoint.hf_export import export_model

    export_model(build("rope"), str(tmp_path / "hf"))
    train = np.random.default_rng(3).integers(0, 512, 300)
    write_shards(tmp_path / "data", {"train": train})
    with pytest.raises(ValueError, match="has no val split; pass --split train"):
        run_eval_ppl(str(tmp_path / "hf"), str(tmp_path / "data"), [32])
    with pytest.raises(ValueError, match="--split val: .* has no val split"):
        run_eval_ppl(str(tmp_path / "hf"), str(tmp_path / "data"), [32], split="val")
    with caplog.at_level(logging.WARNING):
        report = run_eval_ppl(str(tmp_path / "hf"), str(tmp_path / "data"), [32], split="train")
    assert "(train split)" in report["data"] and report["data_tokens"] == 300
    assert "TRAINING split" in caplog.text
    train.astype(np.uint16).tofile(tmp_path / "train.bin")
    flat = run_eval_ppl(str(tmp_path / "hf"), str(tmp_path / "train.bin"), [32])
    assert report["results"][0]["ppl"] == pytest.approx(flat["results"][0]["ppl"], rel=1e-9)
    with pytest.raises(ValueError, match="--split applies to shard directories"):
        run_eval_ppl(str(tmp_path / "hf"), str(tmp_path / "train.bin"), [32], split="train")


def test_randpe_evaluation_is_random_but_seeded(tmp_path):
    """RandPE draws positions at evaluation (as its reference); the eval tools seed torch so reruns agree."""
    from tapetrain.checkpoint.hf_export import export_model

    export_model(build("randpe"), str(tmp_path / "hf"))
    np.random.default_rng(5).integers(0, 512, 400).astype(np.uint16).tofile(tmp_path / "t.bin")
    first = run_eval_ppl(str(tmp_path / "hf"), str(tmp_path / "t.bin"), [64])["results"][0]["ppl"]
    assert run_eval_ppl(str(tmp_path / "hf"), str(tmp_path / "t.bin"), [64])["results"][0]["ppl"] == first
    export_model(build("randpe", randpe_sample_at_eval=False), str(tmp_path / "fixed"))
    fixed = run_eval_ppl(str(tmp_path / "fixed"), str(tmp_path / "t.bin"), [64])["results"][0]["ppl"]
    assert abs(fixed / first - 1) > 1e-4

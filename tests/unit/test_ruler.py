"""RULER through lm-evaluation-harness on tiny exports, with the network cut off in this process.

The six offline-capable RULER tasks run on a TAPE export (remote code) and a RoPE export (plain Llama) at two
lengths; every answer lm-eval generated for a few prompts must equal tapetrain's own greedy decoding of the same
prompt (BOS + prompt, as the harness encodes it), and every score RULER's string match of that answer. The answer
budget is capped (--ruler-max-new-tokens) to keep CPU time down; the prompts are RULER's own. Skipped without the
lm-eval extra (`pip install -e ".[lm-eval]"` in a clone of tapetrain).
"""

from __future__ import annotations

import socket

import pytest
import torch
from model_helpers import build, randomize_tape
from test_hf_runs import train_tiny_tokenizer

from tapetrain.checkpoint.hf_export import export_model
from tapetrain.compare.suites import SUITES, CompareOptions
from tapetrain.eval.ruler import OFFLINE_TASKS, evaluate_ruler

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

LENGTHS = [1536, 1792]  # ruler_vt's generator needs about 1350 tokens of this 512-piece tokenizer
MAX_NEW_TOKENS = 16
LOCAL = ("127.0.0.1", "::1", "localhost")


@pytest.fixture
def no_network(monkeypatch):
    """Any connection or name lookup beyond this machine raises, as on a machine without network."""
    real_connect, real_lookup = socket.socket.connect, socket.getaddrinfo

    def connect(sock, address):
        if isinstance(address, tuple) and address[0] not in LOCAL:
            raise OSError(f"no network in this test: connect to {address}")
        return real_connect(sock, address)

    def getaddrinfo(host, *args, **kwargs):
        if host not in LOCAL:
            raise OSError(f"no network in this test: lookup of {host}")
        return real_lookup(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("ruler")
    tokenizer = train_tiny_tokenizer(root / "tok.model")
    out = {}
    for pe in ("tape", "rope"):
        model = build(pe)
        if pe == "tape":
            randomize_tape(model)
        export_model(model, str(root / pe), tokenizer=tokenizer)
        out[pe] = (model, root / pe)
    return out


def tapetrain_answer(model, tokenizer, prompt: str, new_tokens: int) -> str:
    """tapetrain's own greedy decoding (its KV cache, not transformers') of BOS + prompt, up to EOS."""
    ids = tokenizer(prompt)["input_ids"]  # with BOS: what the harness feeds for this tokenizer
    out = model.generate(torch.tensor([ids]), new_tokens, eos_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
    if tokenizer.eos_token_id in out:
        out = out[:out.index(tokenizer.eos_token_id)]
    return tokenizer.decode(out, skip_special_tokens=True)


def test_too_short_lengths_are_refused_before_lm_eval_runs(exports, no_network):
    _, path = exports["rope"]
    with pytest.raises(ValueError, match=r"too short for ruler_cwe, ruler_fwe, ruler_vt .* use lengths >= \d+"):
        evaluate_ruler(str(path), [512])


def test_offline_ruler_tasks_match_tapetrains_greedy_decoding(exports, no_network):
    from lm_eval.tasks.ruler.common_utils import process_results
    from transformers import AutoTokenizer

    for pe, (model, path) in exports.items():
        report = evaluate_ruler(str(path), LENGTHS, samples=1, max_new_tokens=MAX_NEW_TOKENS, keep_prompts=True)
        assert report["tasks"] == list(OFFLINE_TASKS) and report["trained_context"] == model.cfg.max_seq_len
        assert [r["length"] for r in report["results"]] == LENGTHS
        records = report["records"]
        assert sorted((r["task"], r["length"]) for r in records) == sorted(
            (t, n) for t in OFFLINE_TASKS for n in LENGTHS)
        for result in report["results"]:
            assert set(result["by_task"]) == set(OFFLINE_TASKS)
            assert result["score"] == pytest.approx(sum(result["by_task"].values()) / len(OFFLINE_TASKS))
        for record in records:
            assert record["prompt_tokens"] <= record["length"]
            doc = {"max_length": record["length"], "outputs": record["target"]}
            assert record["score"] == process_results(doc, [record["generated"]])[str(record["length"])]
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=True)
        few = [r for r in records if r["task"] in ("niah_single_1", "ruler_vt", "ruler_fwe")]
        for record in few:
            assert record["max_new_tokens"] == MAX_NEW_TOKENS
            ours = tapetrain_answer(model, tokenizer, record["prompt"], MAX_NEW_TOKENS)
            assert ours == record["generated"], (pe, record["task"], record["length"])
        # compare's view of the result: per-length score with an interval over samples, within each task
        options = CompareOptions(lengths=LENGTHS, resamples=200)
        for value in SUITES["ruler"].values(report, options):
            assert value.low <= value.value <= value.high and value.n == len(OFFLINE_TASKS)


def test_a_task_that_cannot_fit_this_tokenizer_is_refused_by_name_before_lm_eval_starts(tmp_path):
    """Issue #40: with a tokenizer trained on code, ruler_vt's in-context example (which lm-eval always sizes to
    500 tokens) needs about 630: its generator looped forever printing, filling the disk, at any --lengths. Now the
    pre-check names the task and the tokens it needs, and lm-eval never starts."""
    import subprocess
    import sys
    import sysconfig
    from pathlib import Path

    from tapetrain.data.tokenizer import train_tokenizer

    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:3]
    (tmp_path / "code.txt").write_text("".join(p.read_text(errors="replace") for p in stdlib))
    tokenizer = train_tokenizer([str(tmp_path / "code.txt")], 512, str(tmp_path / "code.model"))
    export_model(build("tape"), str(tmp_path / "export"), tokenizer=tokenizer)
    cmd = [sys.executable, "-m", "tapetrain.cli", "eval", "ruler", str(tmp_path / "export"), "--lengths", "2048",
           "--samples", "2", "--max-new-tokens", "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "ruler_vt" in last and "in-context example" in last, last
    needs = int(__import__("re").search(r"needs (\d+) tokens", last).group(1))
    assert 560 < needs < 700, last
    assert "Max length" not in proc.stdout  # lm-eval's generator never ran

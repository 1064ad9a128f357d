"""SCROLLS: metrics against SCROLLS' documented examples and hand computation, prompt formats and truncation,
`data scrolls` on local files in the real record format (jsonl and parquet), `eval scrolls --predictions` and
generation, and clear errors."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from tapetrain.cli import main
from tapetrain.data.errors import DataError
from tapetrain.data.examples import ExampleStore
from tapetrain.data.scrolls import PromptBuilder, iter_records, references_by_id, write_scrolls_data
from tapetrain.data.tokenizer import Tokenizer, train_tokenizer
from tapetrain.eval.decoding import Sampling, generate
from tapetrain.eval.models import EvalModel
from tapetrain.eval.scrolls import generate_predictions, run_eval_scrolls, sampling_for
from tapetrain.eval.scrolls_metrics import normalize_answer, rouge_scores, score, token_f1
from tapetrain.model import ModelConfig, Transformer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "scrolls"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    """A real BPE sentencepiece model (vocab 400) trained on Python's standard library and the fixtures."""
    root = tmp_path_factory.mktemp("tok")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    with (root / "corpus.jsonl").open("w") as f:
        for path in sorted(stdlib.glob("*.py"))[:20]:
            f.write(json.dumps({"text": path.read_text(encoding="utf-8", errors="replace")}) + "\n")
        for fixture in sorted(FIXTURES.glob("*.jsonl")):
            for line in fixture.read_text().splitlines():
                f.write(json.dumps({"text": json.loads(line)["input"]}) + "\n")
    return Tokenizer(train_tokenizer([str(root / "corpus.jsonl")], 400, str(root / "tok.model")))


# ---- metrics ------------------------------------------------------------------------------------------------


def test_metrics_reproduce_the_examples_of_scrolls_scorer_documentation():
    predictions = {"1": "exact match example", "2": "hello there", "3": "general kenobi"}
    references = {"1": ["exact match example"], "2": ["hello", "hi there"], "3": ["commander kenobi"]}
    rouge = score("gov_report", predictions, references)
    assert {k: round(v, 4) for k, v in rouge.items() if k.startswith("rouge/")} == {
        "rouge/rouge1": 72.2222, "rouge/rouge2": 33.3333, "rouge/rougeL": 72.2222, "rouge/geometric_mean": 55.8136}
    assert round(score("contract_nli", predictions, references)["exact_match"], 4) == 33.3333
    assert round(score("narrative_qa", predictions, references)["f1"], 4) == 72.2222
    assert score("qmsum", predictions, references)["scrolls_score_key"] == "rouge/geometric_mean"


def test_metrics_against_hand_computation():
    assert normalize_answer("  The Cat, an  ANIMAL!") == "cat animal"
    # "the cat sat on a mat" vs "a cat is on the mat": normalised [cat sat on mat] vs [cat is on mat]: 3 common
    assert token_f1("the cat sat on a mat", "a cat is on the mat") == pytest.approx(2 * 0.75 * 0.75 / 1.5)
    assert token_f1("cat cat", "cat") == pytest.approx(2 * 0.5 * 1 / 1.5)  # bag of words: one cat in common
    assert token_f1("", "cat") == 0.0
    # ROUGE keeps articles: [the cat sat on mat] vs [the cat is on the mat]
    r = rouge_scores("the cat sat on mat", "the cat is on the mat")
    assert r["rouge1"] == pytest.approx(2 * (4 / 5) * (4 / 6) / (4 / 5 + 4 / 6))  # the, cat, on, mat
    assert r["rougeL"] == pytest.approx(r["rouge1"])  # LCS "the cat on mat"
    assert r["rouge2"] == pytest.approx(2 * (1 / 4) * (1 / 5) / (1 / 4 + 1 / 5))  # only "the cat"
    # several references: the best per id, then the mean over ids (in percent)
    em = score("quality", {"a": "Yes.", "b": "no"}, {"a": ["no", "yes"], "b": ["maybe"]})
    assert em["exact_match"] == 50.0 and em["num_predicted"] == 2
    with pytest.raises(ValueError, match="1 missing"):
        score("quality", {"a": "x"}, {"a": ["x"], "b": ["y"]})
    with pytest.raises(ValueError, match="1 unknown"):
        score("quality", {"a": "x", "c": "z"}, {"a": ["x"]})
    with pytest.raises(ValueError, match="unknown SCROLLS task"):
        score("squad", {"a": "x"}, {"a": ["x"]})


# ---- prompts and data ---------------------------------------------------------------------------------------


def test_prompt_budgets_match_the_official_code(tokenizer):
    qa, summary = PromptBuilder("qasper", tokenizer), PromptBuilder("gov_report", tokenizer)
    assert (qa.prompt_budget, qa.max_answer) == (7991, 200)  # 7991 + 200 + EOS = 8192
    assert (summary.prompt_budget, summary.max_answer) == (7191, 1000)  # 7184 + 7 (Llama-2) + 1000 + EOS


def test_qa_and_summary_prompts_truncate_as_specified(tokenizer):
    long_doc = "The committee met again. " * 400
    qa = PromptBuilder("narrative_qa", tokenizer, seq_len=256, max_answer_tokens=20)
    prompt, cut = qa.prompt("Who met?\n\n" + long_doc)
    assert cut and len(prompt) == 256 - 20 - 1 and prompt[0] == tokenizer.bos_id
    assert tokenizer.decode(prompt[1:]).startswith("Who met?")  # the question comes first and survives
    short, cut = qa.prompt("Who met?\n\nThe committee.")
    assert not cut and tokenizer.decode(short[1:]) == "Who met?\n\nThe committee."
    answer, cut = qa.answer("word " * 50)
    assert cut and len(answer) == 21 and answer[-1] == tokenizer.eos_id

    summ = PromptBuilder("summ_screen_fd", tokenizer, seq_len=300, max_answer_tokens=40)
    prompt, cut = summ.prompt(long_doc)
    assert cut and len(prompt) == 300 - 40 - 1
    text = tokenizer.decode(prompt[1:])
    assert text.startswith("Context:\nThe committee met again.")
    assert text.endswith("\n Please summarize this report:")  # head + the instruction's tokens
    full, cut = summ.prompt("A short report.")
    assert not cut and tokenizer.decode(full[1:]) == "Context:\nA short report.\n Please summarize this report:"
    with pytest.raises(DataError, match="raise --seq-len"):
        PromptBuilder("gov_report", tokenizer, seq_len=1000)


def test_scrolls_data_from_jsonl_and_parquet(tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (FIXTURES / "qasper.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "qasper.parquet")
    a = write_scrolls_data("qasper", str(FIXTURES / "qasper.jsonl"), tokenizer.path, str(tmp_path / "a"),
                           seq_len=128, max_answer_tokens=16, progress=False)
    b = write_scrolls_data("qasper", str(tmp_path / "qasper.parquet"), tokenizer.path, str(tmp_path / "b"),
                           seq_len=128, max_answer_tokens=16, progress=False)
    assert a["splits"]["train"]["files"] == b["splits"]["train"]["files"]
    task = a["task"]
    assert (task["records"], task["ids"], task["truncated_prompts"]) == (4, 3, 4)  # q-001 has two references
    store = ExampleStore(str(tmp_path / "a"))
    assert store.max_length <= 128
    builder = PromptBuilder("qasper", tokenizer, 128, 16)
    for i, row in enumerate(rows):
        ids, prompt_len = store.example(i)
        assert ids[:prompt_len].tolist() == builder.prompt(row["input"])[0]
        assert ids[prompt_len:].tolist() == tokenizer.encode(row["output"])[:16] + [tokenizer.eos_id]
    assert Tokenizer(str(tmp_path / "a" / "tokenizer.model")).checksum == tokenizer.checksum


def test_scrolls_cli_and_errors(tokenizer, tmp_path, capsys):
    out = tmp_path / "gov"
    args = ["data", "scrolls", "--task", "gov_report", "--input", str(FIXTURES / "gov_report.jsonl"),
            "--tokenizer", tokenizer.path, "--out", str(out), "--seq-len", "200", "--max-answer-tokens", "30"]
    assert main(args) == 0
    assert "3 training examples" in capsys.readouterr().out
    assert main(args) == 1 and "already exists" in capsys.readouterr().err
    bad = ["data", "scrolls", "--task", "qasper", "--input", str(FIXTURES / "unlabelled_test.jsonl"),
           "--tokenizer", tokenizer.path, "--out", str(tmp_path / "t"), "--seq-len", "200", "--max-answer-tokens", "8"]
    assert main(bad) == 1
    assert "has no output" in capsys.readouterr().err and not (tmp_path / "t").exists()
    (tmp_path / "broken.jsonl").write_text('{"id": "x", "output": "y"}\n')
    with pytest.raises(DataError, match="lacks input"):
        list(iter_records(str(tmp_path / "broken.jsonl")))


# ---- eval scrolls --------------------------------------------------------------------------------------------


def test_eval_scrolls_scores_given_predictions(tmp_path):
    predictions = {"q-001": "contextual equivariant positional encoding", "q-002": "arithmetic and summarization",
                   "q-003": "no"}
    (tmp_path / "pred.json").write_text(json.dumps(predictions))
    report = run_eval_scrolls("none", "qasper", str(FIXTURES / "qasper.jsonl"), str(tmp_path / "r.json"),
                              predictions=str(tmp_path / "pred.json"))
    # q-001 matches its second reference exactly; q-002: "arithmetic and summarization" (3 words) against the
    # 6 words "arithmetic longcontext question answering and summarization": 3 common, P = 1, R = 1/2;
    # q-003: "no" = "No" after normalisation
    f1_q2 = 2 * 1 * 0.5 / 1.5
    assert report["scores"]["f1"] == pytest.approx(100 * (1 + f1_q2 + 1) / 3)
    assert json.loads((tmp_path / "r.json").read_text())["scores"]["scrolls_score"] == report["scores"]["f1"]
    (tmp_path / "short.json").write_text(json.dumps({"q-001": "x"}))
    with pytest.raises(ValueError, match="2 missing"):
        run_eval_scrolls("none", "qasper", str(FIXTURES / "qasper.jsonl"), str(tmp_path / "r2.json"),
                         predictions=str(tmp_path / "short.json"))
    with pytest.raises(DataError, match="has no output"):
        references_by_id(list(iter_records(str(FIXTURES / "unlabelled_test.jsonl"))))


def test_generation_follows_the_task_settings(tokenizer):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_layers=2, n_heads=2,
                                    ffn_hidden=64, max_seq_len=256, pe="tape"))
    em = EvalModel(model.eval(), "run", "tiny", tokenizer.vocab_size, 256, tokenizer.path, torch.device("cpu"), "fp32")
    inputs, _ = references_by_id(list(iter_records(str(FIXTURES / "gov_report.jsonl"))))
    sampled = generate_predictions(em, tokenizer, "summ_screen_fd", inputs, seq_len=256, max_answer_tokens=12, seed=1)
    again = generate_predictions(em, tokenizer, "summ_screen_fd", inputs, seq_len=256, max_answer_tokens=12, seed=1)
    other = generate_predictions(em, tokenizer, "summ_screen_fd", inputs, seq_len=256, max_answer_tokens=12, seed=2)
    assert sampled == again and sampled != other  # sampling, seeded per example
    prompt = torch.tensor([PromptBuilder("summ_screen_fd", tokenizer, 256, 12).prompt(inputs["g-001"])[0]])
    for seed in range(5):
        cont = generate(em, prompt, 12, tokenizer.eos_id, sampling_for("summ_screen_fd"),
                        torch.Generator().manual_seed(seed))[0]
        assert len(cont.tokens) <= 12
    assert sampling_for("gov_report") == Sampling(1.0, 50, 1.0) and sampling_for("quality").greedy
    greedy = generate_predictions(em, tokenizer, "qasper", inputs, seq_len=256, max_answer_tokens=12, seed=1)
    builder = PromptBuilder("qasper", tokenizer, 256, 12)
    for rid, text in greedy.items():  # greedy: the argmax continuation, recomputed without the cache
        ids = torch.tensor([builder.prompt(inputs[rid])[0]])
        new = []
        for _ in range(12):
            nxt = int(model(ids).logits[0, -1].argmax())
            if nxt == tokenizer.eos_id:
                break
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        assert text == tokenizer.decode(new)


def test_missing_rouge_score_is_a_clear_error(monkeypatch):
    import sys

    from tapetrain.eval import scrolls_metrics

    scrolls_metrics._rouge_scorer.cache_clear()
    monkeypatch.setitem(sys.modules, "rouge_score", None)  # import fails as if not installed
    try:
        with pytest.raises(ImportError, match=r"pip install 'tapetrain\[scrolls\]'"):
            score("qmsum", {"a": "x"}, {"a": ["x"]})
        assert score("quality", {"a": "x"}, {"a": ["x"]})["exact_match"] == 100.0  # EM/F1 need no ROUGE
    finally:
        scrolls_metrics._rouge_scorer.cache_clear()


def test_the_console_line_prints_scores_as_percent():
    """Scores are percentages: 1 exact match in 200 is 0.5%, printed with its sign (it read "0.50", a fraction's
    look)."""
    from tapetrain.eval.scrolls import format_scrolls_line

    references = {f"q{i}": ["yes"] for i in range(200)}
    predictions = {i: ("yes" if i == "q0" else "no") for i in references}
    scores = score("quality", predictions, references)
    report = {"task": "quality", "model": "m", "scores": scores, "num_predicted": 200}
    assert format_scrolls_line(report) == "SCROLLS quality (200 ids) of m: exact_match = 0.50% (exact_match 0.50%)"
    rouge = {"rouge/rouge1": 40.0, "rouge/rouge2": 10.0, "rouge/rougeL": 30.0, "rouge/geometric_mean": 22.89,
             "scrolls_score": 22.89, "scrolls_score_key": "rouge/geometric_mean"}
    line = format_scrolls_line({"task": "qmsum", "model": "m", "scores": rouge, "num_predicted": 3})
    assert line.endswith("rouge/geometric_mean = 22.89% (rouge/rouge1 40.00%, rouge/rouge2 10.00%, rouge/rougeL "
                         "30.00%, rouge/geometric_mean 22.89%)"), line

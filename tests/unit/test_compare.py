"""`tapetrain compare` over tiny real runs (DeepSpeed checkpoints): a TAPE run, a RoPE run and a group of two seed
runs (NAME/seed-0, NAME/seed-1), with ppl and the needle grid.

The tables must hold exactly the numbers of the individual result files (and of `tapetrain eval ppl/passkey` run
on their own), the intervals must contain their point estimates and narrow with more windows, a second run must
reuse every result without a single module forward (counted with a global forward hook), and bad arguments must
stop with one line naming the fix before any model runs.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
from pathlib import Path

import pytest
import torch
from test_hf_runs import make_run, train_tiny_tokenizer

from tapetrain.cli import main
from tapetrain.compare.command import run_compare
from tapetrain.eval.bootstrap import ppl_interval
from tapetrain.eval.passkey import run_eval_passkey
from tapetrain.eval.ppl import run_eval_ppl

pytestmark = pytest.mark.slow

LENGTHS = [128, 256]
DEPTHS = [0.0, 0.5, 1.0]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    tokenizer = train_tiny_tokenizer(root / "tok.model")
    tape = make_run(root / "runs" / "tape", "tape", tokenizer=tokenizer)
    rope = make_run(root / "runs" / "rope", "rope", tokenizer=tokenizer)
    seeds = root / "runs" / "tape-seeds"
    seeds.mkdir()
    os.symlink(tape, seeds / "seed-0")  # the TAPE run again: the group's seed 0 must give the TAPE row's numbers
    make_run(seeds / "seed-1", "tape", tokenizer=tokenizer, seed=1)
    data = root / "eval.txt"
    data.write_text(Path(tokenizer).with_suffix(".txt").read_text()[:9000])  # about 2K tokens: 16 windows of 128
    return {"tape": tape, "rope": rope, "tape-seeds": seeds, "data": data}


class ForwardCounter:
    """Every nn.Module forward in this process (a global hook): model forwards, whatever the model kind."""

    def __enter__(self):
        self.count = 0
        self.handle = torch.nn.modules.module.register_module_forward_hook(self.hook)
        return self

    def hook(self, *_):
        self.count += 1

    def __exit__(self, *exc):
        self.handle.remove()


def compare_args(models: dict, out: Path, *extra: str) -> list[str]:
    return ["compare", str(models["tape"]), str(models["rope"]), str(models["tape-seeds"]), "--suite", "ppl,needle",
            "--data", str(models["data"]), "--lengths", ",".join(map(str, LENGTHS)), "--depths", "0,0.5,1",
            "--trials", "2", "--out", str(out), *extra]


def table_rows(readme: str, title: str) -> dict[str, list[str]]:
    """{model label: cells} of the first markdown table under `## title` (the values; the paired one follows)."""
    section = readme.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    table = section.split("\n| model |", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    return {r.strip("|").split("|")[0].strip(): [c.strip() for c in r.strip("|").split("|")[1:]] for r in rows}


def test_compare_tables_intervals_and_reuse(models, tmp_path, capsys):
    out = tmp_path / "report"
    with ForwardCounter() as first:
        assert main(compare_args(models, out)) == 0
    assert first.count > 0
    summary = json.loads((out / "summary.json").read_text())
    readme = (out / "README.md").read_text()
    for name in ("ppl_vs_length.png", "needle_heatmaps.png"):
        assert (out / name).stat().st_size > 10_000
    ppl, needle = summary["evaluations"]["ppl"], summary["evaluations"]["needle"]

    # The table against the individual result files.
    for evaluation, key in ((ppl, "ppl"), (needle, "accuracy")):
        for row in evaluation["rows"]:
            for cell in row["cells"]:
                for run in cell["runs"]:
                    result = json.loads((out / run["result"]).read_text())
                    (value,) = [r[key] for r in result["results"] if r["length"] == cell["length"]]
                    assert run["value"] == value
    by_label = {row["label"]: row for row in ppl["rows"]}
    # ... and against `tapetrain eval ppl` / `eval passkey` run on their own with the same settings.
    alone = run_eval_ppl(str(models["tape"]), str(models["data"]), LENGTHS)
    assert [c["value"] for c in by_label["tape"]["cells"]] == [r["ppl"] for r in alone["results"]]
    grid = run_eval_passkey(str(models["tape"]), LENGTHS, protocol="tapetrain", depths=DEPTHS, trials=2)
    tape_needle = json.loads((out / "results" / "tape" / "needle.json").read_text())
    assert tape_needle["cells"] == grid["cells"]
    assert [r["records"] for r in tape_needle["results"]] == [r["records"] for r in grid["results"]]

    # Intervals contain the point estimate; a group is the mean ± spread of its seed runs (seed 0 is the TAPE run).
    seeds = {row["label"]: row for row in needle["rows"]}["tape-seeds"]
    assert seeds["seeds"] == [0, 1]
    for evaluation in (ppl, needle):
        for row in evaluation["rows"]:
            for cell in row["cells"]:
                for run in cell["runs"]:
                    assert run["ci"][0] <= run["value"] <= run["ci"][1]
                if row["seeds"] is None:
                    assert cell["ci"] == cell["runs"][0]["ci"] and cell["spread"] is None
                else:
                    values = [r["value"] for r in cell["runs"]]
                    assert cell["value"] == pytest.approx(statistics.fmean(values))
                    assert cell["spread"] == pytest.approx(statistics.stdev(values))
    for tape_cell, group_cell in zip(by_label["tape"]["cells"], by_label["tape-seeds"]["cells"], strict=True):
        assert group_cell["runs"][0]["value"] == tape_cell["value"]
    # ... and narrow with more windows: the TAPE run's first 16 windows at 128 tokens against each quarter of them
    # (about half as wide: the width goes as 1/sqrt(windows)).
    windows = json.loads((out / "results" / "tape" / "ppl.json").read_text())["results"][0]
    nll, tokens = windows["window_nll"][:16], windows["window_tokens"][:16]
    assert len(nll) == 16

    def width(part: slice) -> float:
        low, high = ppl_interval(nll[part], tokens[part])
        return high - low

    quarters = [width(slice(i, i + 4)) for i in range(0, 16, 4)]
    assert width(slice(None)) < 0.75 * statistics.fmean(quarters), (width(slice(None)), quarters)

    # README: one table per evaluation with the printed values and no value marked best; the paired differences
    # from the first model (tape), with the seed group's mean over its two seed pairs.
    for evaluation, title in ((ppl, "Perplexity"), (needle, "Needle in a haystack (passkey grid)")):
        rows = table_rows(readme, title)
        assert {label.split(" (")[0] for label in rows} == {"tape", "rope", "tape-seeds"}
        for i in range(len(LENGTHS)):
            values = {row["label"]: row["cells"][i]["value"] for row in evaluation["rows"]}
            for label, cells in rows.items():
                shown = f"{100 * values[label.split(' (')[0]]:.1f}%" if evaluation["percent"] else \
                    f"{values[label.split(' (')[0]]:.2f}"
                assert cells[i].startswith(shown), (title, label, cells[i])
        assert "**" not in readme.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
        paired = {row["label"]: row["paired"] for row in evaluation["rows"]}
        assert paired["tape"] is None
        for cell, tape_cell, rope_cell in zip(paired["rope"], by_label["tape"]["cells"], by_label["rope"]["cells"],
                                             strict=True):
            if evaluation is ppl:
                assert cell["difference"] == pytest.approx(rope_cell["value"] - tape_cell["value"])
                assert cell["ci"][0] <= cell["difference"] <= cell["ci"][1]
        group = paired["tape-seeds"][0]
        assert [(p["key"], p["reference_key"]) for p in group["pairs"]] == [("tape-seeds/seed-0", "tape"),
                                                                             ("tape-seeds/seed-1", "tape")]
        assert group["pairs"][0]["ci"] == [0.0, 0.0]  # seed 0 is the TAPE run itself
        assert group["verdict"] == "not resolved" and group["spread"] is not None
    assert "Paired difference from tape" in readme
    assert "| tape-seeds | " in readme and "not resolved (a seed pair's interval contains 0" in readme
    assert "± " in rows["tape-seeds (2 seeds)"][0]

    # A second run: every result reused, no forward at all, the same report.
    with ForwardCounter() as second:
        assert main(compare_args(models, out)) == 0
    assert second.count == 0
    assert "0 results computed, 8 reused" in capsys.readouterr().out
    assert (out / "README.md").read_text() == readme
    # A changed setting recomputes what it changes only.
    result = run_compare([str(models["tape"]), str(models["rope"])], out=str(out), suite="ppl,needle",
                         data=str(models["data"]), lengths=LENGTHS, depths=DEPTHS, trials=3)
    assert sorted(result["computed"]) == ["rope/needle", "tape/needle"]
    assert sorted(result["reused"]) == ["rope/ppl", "tape/ppl"]


def test_compare_errors_name_the_fix_before_any_forward(models, tmp_path, capsys):
    cases = [
        (["compare", str(tmp_path / "nope"), "--out", str(tmp_path / "o1"), "--data", str(models["data"])],
         "model", "does not exist"),
        (["compare", str(models["tape"]), "--suite", "ppl,bleu", "--out", str(tmp_path / "o2")],
         "unknown evaluation 'bleu' in --suite; choose from ppl, needle, ruler", ""),
        (["compare", str(models["tape"]), str(models["rope"]), "--data", str(models["data"]), "--lengths",
          "128,100000", "--out", str(tmp_path / "o3")], "--lengths 100000 need more eval data", "--lengths 128"),
        (["compare", str(models["tape"]), "--suite", "ppl", "--out", str(tmp_path / "o4")], "needs --data", ""),
        (["compare", str(models["tape"]), str(models["tape"]), "--suite", "needle", "--out", str(tmp_path / "o5")],
         "share the label tape", "--labels"),
        (["compare", str(models["tape"]), "--suite", "ppl,needle", "--data", str(models["data"]), "--lengths",
          "20,128", "--out", str(tmp_path / "o6")], "needle, tape: passkey length 20 is too short", "--needle-lengths"),
    ]
    for args, message, fix in cases:
        with ForwardCounter() as counter:
            assert main(args) == 1
        err = capsys.readouterr().err
        assert message in err and fix in err, err
        assert counter.count == 0
        assert not (Path(args[args.index("--out") + 1]) / "README.md").exists()


def test_run_directories_are_exported_once_for_export_only_evaluations(models, tmp_path):
    """RULER runs Hugging Face exports: a run directory is exported into OUT/exports/<label> once, reused while its
    checkpoint is the same."""
    from tapetrain.compare.entries import resolve_entries
    from tapetrain.compare.models import ModelHandle

    (entry,) = resolve_entries([str(models["rope"])])
    export = Path(ModelHandle(entry.runs[0], "fp32", str(tmp_path)).export_dir())
    assert export == tmp_path / "exports" / "rope" and (export / "config.json").is_file()
    stamp = (export / "tapetrain_export.json").stat().st_mtime_ns
    assert ModelHandle(entry.runs[0], "fp32", str(tmp_path)).export_dir() == str(export)
    assert (export / "tapetrain_export.json").stat().st_mtime_ns == stamp


def test_paired_difference_calls_a_model_better_only_when_resolved(models, tmp_path):
    """The same model twice: a paired difference of exactly 0 and neither called better. An export with one weight
    matrix drowned in noise: the interval excludes 0 and the report names the intact model as better. Results of
    other windows are not paired."""
    from safetensors.torch import load_file, save_file

    from tapetrain.checkpoint.hf_export import export_hf
    from tapetrain.compare.suites import SUITES

    def paired_ppl(paths: list[Path], labels: list[str], out: Path) -> tuple[dict, str]:
        run_compare([str(p) for p in paths], out=str(out), suite="ppl", data=str(models["data"]), lengths=[128],
                    max_tokens=512, labels=labels)  # 4 windows: the training table is under test
        summary = json.loads((out / "summary.json").read_text())["evaluations"]["ppl"]
        return summary["rows"][1]["paired"][0], (out / "README.md").read_text()

    same, readme = paired_ppl([models["tape"], models["tape"]], ["tape", "again"], tmp_path / "same")
    assert same["difference"] == 0.0 and same["ci"] == [0.0, 0.0] and same["verdict"] == "not resolved"
    assert "| again | +0.00 [+0.00, +0.00]: not resolved (the interval contains 0) |" in readme
    assert "better (" not in readme

    intact, damaged = tmp_path / "intact", tmp_path / "damaged"
    export_hf(str(models["tape"]), str(intact))
    shutil.copytree(intact, damaged)
    weights = load_file(damaged / "model.safetensors")
    name = next(k for k, w in weights.items() if w.ndim == 2 and "mlp" in k)
    generator = torch.Generator().manual_seed(0)
    weights[name] = weights[name] + 3 * weights[name].std() * torch.randn(weights[name].shape, generator=generator)
    save_file(weights, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    worse, readme = paired_ppl([intact, damaged], ["intact", "damaged"], tmp_path / "damage")
    assert worse["ci"][0] > 0 and worse["verdict"] == "worse", worse
    assert "| damaged | +" in readme and ": intact better (interval excludes 0) |" in readme

    # Not the same windows: said, and not paired.
    ref = json.loads((tmp_path / "damage" / "results" / "intact" / "ppl.json").read_text())
    other = json.loads(json.dumps(ref))
    other["results"][0]["window_tokens"][0] -= 1
    assert SUITES["ppl"].unpaired(ref, ref, 128) is None
    assert "not the same windows" in SUITES["ppl"].unpaired(ref, other, 128)
    other["compare_settings"]["protocol"] = "sliding"
    assert SUITES["ppl"].unpaired(ref, other, 128) == "computed with different protocol"


def training_table(readme: str) -> dict[str, list[str]]:
    """{run: cells} of the README's Training table ({} when there is none)."""
    if "## Training\n" not in readme:
        return {}
    section = readme.split("## Training\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| run |")]
    return {r.strip("|").split("|")[0].strip(): [c.strip() for c in r.strip("|").split("|")[1:]] for r in rows}


def test_training_rows_from_any_directory_and_after_the_run_moved(models, tmp_path, monkeypatch):
    """An export records where its run is (absolute, and relative to the export) and the run's config hash: the
    Training table keeps every row when compare runs from another directory, after the whole workspace moved, and
    after the run alone moved (found among the compared runs by its config hash, else the row says it is missing)."""
    from tapetrain.checkpoint.hf_export import export_hf

    work = tmp_path / "W"
    shutil.copytree(models["rope"], work / "runs" / "rope")
    records = [{"step": 1, "loss": 6.25, "tokens_per_s": 1000.0}, {"step": 2, "loss": 6.0, "tokens_per_s": 1200.0}]
    (work / "runs" / "rope" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.chdir(work)
    export_hf("runs/rope", "hf/rope", verify=False)  # the run as typed, relative to W (verified elsewhere)
    shutil.copytree(work / "hf" / "rope", work / "hf" / "rope_copy")

    def training(paths: list[Path], out: Path, labels: list[str] | None = None) -> dict[str, list[str]]:
        monkeypatch.chdir("/")
        run_compare([str(p) for p in paths], out=str(out), suite="ppl", data=str(models["data"]), lengths=[128],
                    max_tokens=512, labels=labels)  # 4 windows: the training table is under test
        return training_table((out / "README.md").read_text())

    rows = training([work / "hf" / "rope", work / "hf" / "rope_copy"], tmp_path / "c1")
    assert rows == {"rope": ["2", "6.0000", "–", "–", "1200"], "rope_copy": ["2", "6.0000", "–", "–", "1200"]}

    moved = tmp_path / "W2"
    shutil.move(work, moved)  # the whole workspace: the export finds its run relative to itself
    assert training([moved / "hf" / "rope_copy"], tmp_path / "c2") == {"rope_copy": rows["rope_copy"]}

    (moved / "elsewhere").mkdir()
    shutil.move(moved / "runs" / "rope", moved / "elsewhere" / "rope")  # the run alone
    rows = training([moved / "hf" / "rope", moved / "elsewhere" / "rope"], tmp_path / "c3", ["export", "moved"])
    assert rows == {"export": ["2", "6.0000", "–", "–", "1200"], "moved": ["2", "6.0000", "–", "–", "1200"]}
    (row,) = training([moved / "hf" / "rope"], tmp_path / "c4").values()
    assert "run not found" in row[0] and str(work / "runs" / "rope") in row[0], row

"""The multi-seed addition table: its means, sds and ranges are those of the per-seed result files, a difference is
"resolved" only when the per-seed ranges are disjoint, and the summary files say so."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from tapetrain.config import load_run_config
from tapetrain.eval.arith import summarize
from tapetrain.eval.arith_seeds import (
    METRICS,
    Spread,
    cell_stats,
    chance_of_separation,
    compare_pair,
    markdown_table,
    pairwise,
    spreads,
)
from tapetrain.eval.arith_sweep import NAMES, PAPER, PES, SeedPair, Sweep, seed_pairs, write_summary


def fake_report(rng: np.random.Generator, skill: float, train: int = 2, size: int = 3) -> dict:
    """A result in the format `tapetrain eval arith` writes: summarize()'s cells and means plus its header keys."""
    counts = {}
    for la in range(1, size + 1):
        for lb in range(1, size + 1):
            p = skill if la <= train and lb <= train else skill / 10
            counts[(la, lb)] = (int(rng.binomial(20, p)), 20)
    return {
        "model": "runs/x",
        "train_max_digits": train,
        "eval_max_digits": size,
        "problems": 20 * size * size,
        **summarize(counts, train),
    }


def write_results(root: Path, skills: dict[str, list[float]]) -> dict[str, list[Path]]:
    rng = np.random.default_rng(0)
    files: dict[str, list[Path]] = {}
    for pe, per_seed in skills.items():
        files[pe] = []
        for seed, skill in enumerate(per_seed):
            path = root / "results" / pe / f"seed-{seed}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(fake_report(rng, skill)))
            files[pe].append(path)
    return files


def test_summary_numbers_are_recomputed_from_the_per_seed_files(tmp_path):
    files = write_results(tmp_path, {"tape": [0.95, 0.6, 0.9], "rope": [0.5, 0.4, 0.7], "nope": [0.2, 0.1, 0.3]})
    reports = {pe: [json.loads(p.read_text()) for p in paths] for pe, paths in files.items()}
    sweep = Sweep(out=tmp_path, pes=list(files), pairs=seed_pairs(3), config="c.yaml", data_args=[])
    write_summary(sweep, reports)
    summary = json.loads((tmp_path / "summary.json").read_text())
    for pe, paths in files.items():
        for metric in METRICS:
            values = [json.loads(p.read_text())[metric] for p in paths]
            got = summary["results"][pe][metric]
            assert got["per_seed"] == values
            assert got["mean"] == pytest.approx(sum(values) / 3)
            assert got["sd"] == pytest.approx(statistics.stdev(values))
            assert (got["min"], got["max"]) == (min(values), max(values))
    assert summary["seed_pairs"][2] == {"data_seed": 44, "model_seed": 2}
    md = (tmp_path / "summary.md").read_text()
    tape = summary["results"]["tape"]["mean_in_distribution"]
    assert (
        f"| TAPE | {100 * tape['mean']:.1f} ± {100 * tape['sd']:.1f} ({100 * tape['min']:.1f}–"
        f"{100 * tape['max']:.1f}) |"
    ) in md
    assert "ranges (min–max) do not overlap" in md and "(0.100 for N = 3)" in md
    assert (tmp_path / "heatmaps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_per_cell_mean_and_sd_over_seeds():
    rng = np.random.default_rng(1)
    runs = [fake_report(rng, s) for s in (0.2, 0.8)]
    mean, sd = cell_stats(runs)
    first = {(c["len_a"], c["len_b"]): c["accuracy"] for c in runs[0]["cells"]}
    second = {(c["len_a"], c["len_b"]): c["accuracy"] for c in runs[1]["cells"]}
    a, b = 100 * first[(1, 2)], 100 * second[(1, 2)]
    assert mean[0, 1] == pytest.approx((a + b) / 2) and sd[0, 1] == pytest.approx(abs(a - b) / math.sqrt(2))


def test_resolved_only_when_per_seed_ranges_are_disjoint():
    high, low = Spread((0.90, 0.95, 0.92)), Spread((0.50, 0.60, 0.55))
    verdict = compare_pair(high, low)
    assert verdict["resolved"] and verdict["leader"] == "a" and verdict["a_better_seeds"] == 3
    assert compare_pair(low, high)["leader"] == "b"
    # one bad seed makes the ranges overlap although the first PE is better on 2 of 3 seeds: unresolved
    wide = Spread((0.50, 0.97, 0.96))
    verdict = compare_pair(wide, high)
    assert not verdict["resolved"] and verdict["leader"] is None and verdict["a_better_seeds"] == 2
    assert not compare_pair(Spread((0.6, 0.7)), Spread((0.5, 0.6)))["resolved"]  # touching ranges overlap
    assert not compare_pair(Spread((0.9,)), Spread((0.1,)))["resolved"]  # one seed never resolves anything
    assert chance_of_separation(3) == pytest.approx(0.1) and chance_of_separation(5) == pytest.approx(2 / 252)


def test_pairwise_verdicts_name_the_leader():
    table = spreads(
        {
            pe: [{m: v for m in METRICS} for v in values]
            for pe, values in {"tape": [0.9, 0.95], "rope": [0.5, 0.92], "nope": [0.1, 0.2]}.items()
        }
    )
    resolved = {(r["a"], r["b"]): r["leader"] for r in pairwise(table) if r["metric"] == "mean_all"}
    assert resolved == {("tape", "rope"): None, ("tape", "nope"): "tape", ("rope", "nope"): "rope"}


def test_table_cells_and_the_papers_column():
    table = spreads({"tape": [{m: 0.98444 for m in METRICS}], "fire": [{m: 0.5 for m in METRICS}]})
    lines = markdown_table(table, NAMES, PAPER).splitlines()
    assert lines[0].endswith("| paper (whole 2x grid) |")
    assert lines[2:] == ["| TAPE | 98.4 | 98.4 | 98.4 | 32.82 |", "| FIRE | 50.0 | 50.0 | 50.0 | 26.98 |"]


def test_seed_pairs_move_data_and_model_seed_together():
    assert seed_pairs(3) == [SeedPair(42, 0), SeedPair(43, 1), SeedPair(44, 2)]
    assert seed_pairs(2, 7, 5) == [SeedPair(7, 5), SeedPair(8, 6)]
    sweep = Sweep(out=Path("o"), pes=["tape"], pairs=seed_pairs(2), config="c.yaml", data_args=[])
    dirs = {sweep.run_dir("tape", p) for p in sweep.pairs} | {sweep.run_dir("rope", p) for p in sweep.pairs}
    assert len(dirs) == 4 and sweep.run_dir("tape", SeedPair(43, 1)) == Path("o/runs/tape/seed-1")


def test_tiny_abacus_scale_runs_randpe_and_nope_without_abacus_as_the_paper():
    from tapetrain.config import load_run_config
    from tapetrain.eval.arith_sweep import PE_OVERRIDES, SCALES, train_cmd, train_steps

    repo = Path(__file__).resolve().parents[2]
    sweep = Sweep(out=Path("o"), pes=list(PES), pairs=seed_pairs(1), config=SCALES["tiny-abacus"]["config"],
                  data_args=SCALES["tiny-abacus"]["data"], overrides=["train.steps=700"],
                  pe_overrides=PE_OVERRIDES["tiny-abacus"], cwd=repo)
    for pe in PES:
        cmd = train_cmd(sweep, pe, sweep.pairs[0])
        config, overrides = cmd[cmd.index("train") + 1], cmd[cmd.index("train") + 2:]
        cfg = load_run_config(str(repo / config), overrides)
        assert (cfg.model.pe, cfg.model.abacus) == (pe, pe in ("tape", "rope", "fire"))
        assert overrides[-1] == "train.steps=700" and train_steps(sweep, pe) == 700  # --set comes last, wins


def test_loss_curves_are_each_runs_logged_losses(tmp_path):
    """loss_curves.json holds every (step, loss) each run logged, seed by seed; a run not on disk is left out."""
    files = write_results(tmp_path, {"tape": [0.9, 0.8], "rope": [0.7, 0.6]})
    reports = {pe: [json.loads(p.read_text()) for p in paths] for pe, paths in files.items()}
    sweep = Sweep(out=tmp_path, pes=list(files), pairs=seed_pairs(2), config="c.yaml", data_args=[])
    logged = {}
    for pe, pair in (("tape", sweep.pairs[0]), ("tape", sweep.pairs[1]), ("rope", sweep.pairs[1])):
        rows = [{"step": s, "loss": 2.0 / s + pair.model_seed, "lr": 1e-3} for s in (50, 100, 150)]
        metrics = sweep.run_dir(pe, pair) / "metrics.jsonl"
        metrics.parent.mkdir(parents=True)
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 200, "lo')  # a line being written
        logged.setdefault(pe, {})[f"seed-{pair.model_seed}"] = [[r["step"], r["loss"]] for r in rows]
    write_summary(sweep, reports)
    assert json.loads((tmp_path / "loss_curves.json").read_text()) == logged
    assert (tmp_path / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


@pytest.mark.parametrize("name", ["arith-tiny", "arith-tiny-3000-steps", "arith-tiny-tuning"])
def test_committed_multi_seed_table_is_its_per_seed_results(name):
    """docs/results/arith-tiny (the recipe's report), arith-tiny-3000-steps (the 3000-step recipe's report, which
    showed it did not hold) and arith-tiny-tuning (the seeds the first recipe was chosen on): summary.json's means,
    sds and ranges recomputed from the committed per-seed JSONs, and summary.md's rows from summary.json (what
    recipes.md quotes)."""
    root = RESULTS / name
    summary = json.loads((root / "summary.json").read_text())
    seeds = [pair["model_seed"] for pair in summary["seed_pairs"]]
    assert len(seeds) >= 3 and set(summary["pes"]) == {"tape", "rope", "randpe", "nope", "fire"}
    reports = {pe: [json.loads((root / "results" / pe / f"seed-{m}.json").read_text()) for m in seeds]
               for pe in summary["pes"]}  # fmt: skip
    recomputed = spreads(reports)
    for pe in summary["pes"]:
        for metric in METRICS:
            got, want = summary["results"][pe][metric], recomputed[pe][metric]
            assert got["per_seed"] == list(want.values)
            assert (got["mean"], got["min"], got["max"]) == pytest.approx((want.mean, want.low, want.high))
            assert got["sd"] == pytest.approx(want.sd)
    md = (root / "summary.md").read_text()
    tape = summary["results"]["tape"]["mean_in_distribution"]
    assert f"| TAPE | {100 * tape['mean']:.1f} ± {100 * tape['sd']:.1f}" in md
    if name == "arith-tiny-tuning":  # what the recipe was chosen for, on these seeds (the reported ones: recipes.md)
        assert min(summary["results"]["tape"]["mean_in_distribution"]["per_seed"]) >= 0.95
        assert min(summary["results"]["rope"]["mean_in_distribution"]["per_seed"]) >= 0.95


def _seen_by_the_tiny_recipe() -> tuple[set[int], set[int]]:
    """(data seeds, model seeds) that chose or reported a version of the tiny recipe before its current report: the
    first recipe's tuning seeds and held-out probes, its 3000-step report, and the 8000-step tuning pairs."""
    probes = json.loads((RESULTS / "arith-tiny-tuning" / "probes" / "seed_pairs.json").read_text())
    pairs = [p for name in ("arith-tiny-tuning", "arith-tiny-3000-steps", "arith-tiny-tuning/steps-8000")
             for p in json.loads((RESULTS / name / "summary.json").read_text())["seed_pairs"]]  # fmt: skip
    data, model = {p["data_seed"] for p in pairs}, {p["model_seed"] for p in pairs}
    return data | set(probes.values()), model | set(map(int, probes))


def test_the_reported_seeds_are_not_the_ones_the_recipe_was_chosen_on():
    """The 8000-step recipe was chosen on the tuning pairs of arith-tiny-tuning/steps-8000, after the 3000-step one
    (chosen on data seeds 42-46 and the probes) failed on its report's seeds 62-66; the report (arith-tiny) uses none
    of those data or model seeds and runs the committed config unchanged to its last step."""
    seen_data, seen_model = _seen_by_the_tiny_recipe()
    summary = json.loads((RESULTS / "arith-tiny" / "summary.json").read_text())
    reported = summary["seed_pairs"]
    assert not {p["data_seed"] for p in reported} & seen_data
    assert not {p["model_seed"] for p in reported} & seen_model
    assert summary["config"] == "configs/arith-tiny-cpu.yaml" and not summary["overrides"]
    steps = load_run_config(str(Path(__file__).resolve().parents[2] / summary["config"])).train.steps
    for pe in summary["pes"]:
        for pair in reported:  # each result is the run it claims to be, trained to the config's last step
            path = RESULTS / "arith-tiny" / "results" / pe / f"seed-{pair['model_seed']}.json"
            report = json.loads(path.read_text())
            assert report["data"].endswith(f"seed-{pair['data_seed']}")
            assert report["model"].endswith(f"seed-{pair['model_seed']}@step{steps}")
    probes = json.loads((RESULTS / "arith-tiny-tuning" / "probes" / "seed_pairs.json").read_text())
    for model_seed, data_seed in probes.items():  # each probe is the run it claims to be
        probe = json.loads((RESULTS / "arith-tiny-tuning" / "probes" / "tape" / f"seed-{model_seed}.json").read_text())
        assert probe["data"].endswith(f"seed-{data_seed}") and probe["model"].endswith(f"seed-{model_seed}@step3000")


def test_the_abacus_recipe_is_reported_on_seeds_it_was_not_chosen_on():
    """configs/arith-tiny-abacus-cpu.yaml was chosen on arith-abacus-tuning's seeds (which the tiny recipe had tuned
    on too); arith-abacus reports it on data and model seeds that neither search, nor the tiny table, used. Its
    summary is its per-seed results."""
    tuning = json.loads((RESULTS / "arith-abacus-tuning" / "summary.json").read_text())["seed_pairs"]
    earlier = [json.loads((RESULTS / name / "summary.json").read_text())["seed_pairs"]
               for name in ("arith-tiny-tuning", "arith-tiny-3000-steps")]
    probes = json.loads((RESULTS / "arith-tiny-tuning" / "probes" / "seed_pairs.json").read_text())
    seen_data = {p["data_seed"] for pairs in (tuning, *earlier) for p in pairs} | set(probes.values())
    seen_model = {p["model_seed"] for pairs in (tuning, *earlier) for p in pairs} | {int(m) for m in probes}
    root = RESULTS / "arith-abacus"
    summary = json.loads((root / "summary.json").read_text())
    reported = summary["seed_pairs"]
    assert not {p["data_seed"] for p in reported} & seen_data
    assert not {p["model_seed"] for p in reported} & seen_model
    assert summary["config"] == "configs/arith-tiny-abacus-cpu.yaml" and not summary["overrides"]
    reports = {pe: [json.loads((root / "results" / pe / f"seed-{p['model_seed']}.json").read_text()) for p in reported]
               for pe in summary["pes"]}  # fmt: skip
    for pe, spread in spreads(reports).items():
        for metric in METRICS:
            assert summary["results"][pe][metric]["per_seed"] == list(spread[metric].values)
        for report, pair in zip(reports[pe], reported, strict=True):  # each result is the run it claims to be
            assert report["data"].endswith(f"seed-{pair['data_seed']}")
            assert report["model"].endswith(f"seed-{pair['model_seed']}@step2000")

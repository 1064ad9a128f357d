"""One real single-process training run (tiny TAPE, 3 steps, DeepSpeed ZeRO-2 on CPU) that checks what a user
sees and gets: start-up phases with times, save and validation progress, the collective timeout, W&B offline
files in the run directory, a torch.profiler trace, file modes under umask 022; then --dry-run and
--print-config on it. Before this work the start was silent until the first logged step, and config.yaml was
written 0600."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
from harness import REPO, attempt, env, files, single_cmd, write_config

pytestmark = pytest.mark.slow

try:
    import wandb  # noqa: F401

    HAVE_WANDB = True
except ImportError:
    HAVE_WANDB = False


@pytest.fixture(scope="module")
def feature_run(tmp_path_factory, shard_dir):
    root = tmp_path_factory.mktemp("features")
    logging = {"tensorboard": False}
    if HAVE_WANDB:
        logging["wandb"] = {"project": "tapetrain-test", "tags": ["ci"], "mode": "offline"}
    cfg = write_config(root / "c.yaml", shard_dir, root / "run", logging=logging,
                       data={"train": str(shard_dir), "val": str(shard_dir), "seq_len": 64},
                       train={"steps": 3, "save_interval": 2, "eval_interval": 2, "eval_steps": 1,
                              "profile": {"start_step": 2, "steps": 1}},
                       deepspeed={"zero_stage": 2, "precision": "fp32", "timeout_minutes": 7})
    proc = subprocess.run(single_cmd(cfg), cwd=REPO, env={**env(), "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
                          preexec_fn=lambda: os.umask(0o022))
    assert proc.returncode == 0, proc.stdout[-4000:]
    return cfg, root / "run", proc.stdout


def test_start_up_phases_saves_and_validation_are_logged(feature_run):
    _, _, out = feature_run
    for i, phase in enumerate(["config", "data", "model", "engine", "first step"], start=1):
        assert re.search(rf"start-up \[{i}/5\] {phase}: .*\(\d+\.\d s", out), (phase, out[-4000:])
    assert "collective timeout 7 min" in out  # deepspeed.timeout_minutes, read back from the process group
    assert "from process start to the end of the first step" in out
    saving, saved = out.index("saving checkpoint of step 2"), out.index("saved checkpoint")
    assert saving < saved and re.search(r"saved checkpoint \S+step_00000002 \(\d+\.\d MiB in \d+\.\d s\)", out)
    assert "validation @ step 2" in out  # the progress bar
    assert re.search(r"step 2 \| val_loss \d+\.\d+ \| val_ppl .* 8 samples \(512 tokens\)", out)
    # the execution plan is resolved once and logged once (its per-layer lines: one per kind of layer)
    assert out.count("execution plan: attention") == 1
    assert "FutureWarning" not in out and "Traceback" not in out


def test_a_finished_run_ends_with_a_closing_line(feature_run):
    """A finished run used to end in silence after the last save: no word that it was done or what comes next."""
    _, run_dir, out = feature_run
    lines = [line for line in out.splitlines() if "tapetrain.train:" in line]
    assert re.search(rf"done: {re.escape(str(run_dir))}, 3 steps in \d+s; next: tapetrain export hf "
                     rf"{re.escape(str(run_dir))} --out \S+", lines[-1]), lines[-3:]
    assert out.index("saved checkpoint") < out.index("done: ")


def test_files_written_atomically_respect_the_umask(feature_run):
    _, run_dir, _ = feature_run
    mine = [p for p in run_dir.rglob("*") if p.is_file() and "wandb" not in p.parts]
    modes = {str(p.relative_to(run_dir)): stat.S_IMODE(p.stat().st_mode) for p in mine}
    assert "config.yaml" in modes and any(k.startswith("config_history/") for k in modes)
    assert {k: m & 0o666 for k, m in modes.items()} == dict.fromkeys(modes, 0o644)  # (DeepSpeed's scripts are 0744)


def test_profiler_trace_on_cpu(feature_run):
    _, run_dir, out = feature_run
    traces = list((run_dir / "profile").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1, out[-3000:]
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("ProfilerStep#") for n in names)  # one profiler step per optimizer step
    assert any(n.startswith("aten::") for n in names) and any("mm" in n for n in names)
    assert "profile written" in out


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of the offline .wandb file: W&B's LevelDB-style log (7-byte header, 32 KiB blocks of
    records: crc32 (4), length (2, little-endian), type (1: full, 2: first, 3: middle, 4: last)) of protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    rows, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


@pytest.mark.skipif(not HAVE_WANDB, reason="wandb is optional: pip install 'tapetrain[wandb]'")
def test_wandb_offline_mirrors_metrics(feature_run):
    _, run_dir, _ = feature_run
    assert (run_dir / "wandb" / "run_id").is_file()
    rows = {row["_step"]: row for row in wandb_history(run_dir)}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(rows) == [1, 2, 3]
    for record in metrics:
        row = rows[record["step"]]
        for key, value in record.items():
            name = f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"
            if key != "step" and value is not None:
                assert row[name] == pytest.approx(value), (record["step"], key)


def test_dry_run_checks_everything_and_writes_nothing(feature_run):
    cfg, run_dir, _ = feature_run
    before = files(run_dir)
    ok = attempt(single_cmd(cfg, "--dry-run", "train.steps=5"))
    assert ok.returncode == 0, ok.stdout[-3000:]
    assert "dry run OK, nothing written" in ok.stdout and "resuming from" in ok.stdout
    refused = attempt(single_cmd(cfg, "--dry-run", "model.n_layers=3"))
    assert refused.returncode == 1 and refused.stdout.count("cannot resume from") == 1
    assert "Traceback" not in refused.stdout
    assert files(run_dir) == before


def test_print_config_shows_what_the_config_resolves_to(feature_run, capsys):
    from tapetrain.cli import main

    cfg, run_dir, _ = feature_run
    assert main(["train", str(cfg), "--print-config", "--world-size", "2", "train.global_batch_size=16"]) == 0
    out = capsys.readouterr().out
    assert "global_batch_size: 16" in out and '"gradient_accumulation_steps": 4' in out
    assert "gradient accumulation: 4 (global batch 16 = micro batch 2 x 2 rank(s) x 4)" in out
    assert "tokens per step: 1,024 (16 x 64)" in out and "memory estimate per GPU" in out
    assert not (run_dir / "checkpoints" / "step_00000005").exists()

"""Building blocks of runs that cannot be silently corrupted: run lock, resume checks, tokenizer provenance,
`tapetrain data verify`, read-ahead batches, checkpoint size estimates and config-wins optimizer settings.

The multi-rank behaviour of each (real DeepSpeed, 2 ranks) is in tests/distributed/test_safe_runs.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from tapetrain.config import RunConfig
from tapetrain.data.errors import DataError
from tapetrain.data.prepare import prepare
from tapetrain.data.provenance import common_tokenizer
from tapetrain.data.stream import BatchIterator, open_dataset
from tapetrain.data.tokenizer import train_tokenizer
from tapetrain.errors import ConfigError, RunDirLockedError
from tapetrain.model import ModelConfig
from tapetrain.train import resume_checks
from tapetrain.train.run_lock import RunLock

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """Two tokenizers with the same vocab size (different training text) and a dataset from each."""
    root = tmp_path_factory.mktemp("safety")
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta", "lambda", "zeta"]
    rng = np.random.default_rng(0)
    texts = {
        "a": [" ".join(rng.choice(words, 40)) + f" {i}." for i in range(300)],
        "b": ["".join(rng.choice(list("xyzwvq123 "), 200)) for _ in range(300)],
    }
    out = {"root": root}
    for name, docs in texts.items():
        corpus = root / f"{name}.jsonl"
        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        out[f"tok_{name}"] = train_tokenizer([str(corpus)], 300, str(root / f"{name}.model"))
        out[f"data_{name}"] = str(root / f"data_{name}")
        prepare([str(corpus)], out[f"tok_{name}"], out[f"data_{name}"], val_fraction=0.1, shard_tokens=500,
                progress=False)
    # the same text with tokenizer a: another source of a consistent mixture
    out["data_a2"] = str(root / "data_a2")
    prepare([str(root / "b.jsonl")], out["tok_a"], out["data_a2"], progress=False)
    return out


# ---- run lock ---------------------------------------------------------------------------------------------------


def test_second_job_on_a_run_dir_is_refused_and_named(tmp_path):
    first = RunLock(tmp_path / "run")
    first.acquire()
    with pytest.raises(RunDirLockedError, match=r"in use by another job \(host .*, pid \d+, started .*command"):
        RunLock(tmp_path / "run").acquire()
    first.release()
    again = RunLock(tmp_path / "run")
    again.acquire()  # free again once released (the kernel also releases it when the process dies)
    again.release()


def test_lock_is_released_when_the_holder_is_killed(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            sys.path.insert(0, {str(REPO)!r})
            from tapetrain.train.run_lock import RunLock
            RunLock({str(tmp_path / 'run')!r}).acquire()
            print("locked", flush=True)
            time.sleep(60)
        """)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirLockedError, match=f"pid {holder.pid}"):
            RunLock(tmp_path / "run").acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(tmp_path / "run")
    lock.acquire()
    lock.release()


def test_failed_start_in_a_new_directory_leaves_nothing(tmp_path):
    lock = RunLock(tmp_path / "typo" / "run")
    lock.acquire()
    lock.release(failed_start=True)
    assert not (tmp_path / "typo" / "run").exists()


# ---- resume checks ----------------------------------------------------------------------------------------------


def _checkpoint_with(tmp_path: Path, config: ModelConfig) -> Path:
    ckpt = tmp_path / "checkpoints" / "step_00000003"
    ckpt.mkdir(parents=True)
    (ckpt / "model_config.json").write_text(json.dumps(config.to_dict()))
    return ckpt


def test_a_changed_model_is_refused_naming_every_key(tmp_path):
    saved = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, pe="tape")
    ckpt = _checkpoint_with(tmp_path, saved)
    changed = ModelConfig(vocab_size=512, d_model=64, n_layers=1, n_heads=4, pe="rope")
    with pytest.raises(ConfigError) as err:
        resume_checks.check_same_model(ckpt, changed, tmp_path)
    text = str(err.value)
    assert "model.pe: checkpoint 'tape', config 'rope'" in text and "model.n_layers: checkpoint 2, config 1" in text
    assert "run.out_dir" in text and "model.init_from" in text and "model.d_model" not in text
    # how the same model is computed may change
    same = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, pe="tape", attn_backend="eager",
                       activation_checkpointing=True, compile=True, loss_backend="plain", loss_chunk_mib=64.0,
                       tiled_mlp="auto")
    resume_checks.check_same_model(ckpt, same, tmp_path)


def test_trainable_set_lora_and_tokenizer_must_match_the_checkpoint(tmp_path):
    cfg = RunConfig.from_dict({"model": {"preset": "tiny"}, "data": {"train": "d"}})
    state = {"step": 3, **resume_checks.training_settings(cfg), "tokenizer_sha256": "a" * 64}
    resume_checks.check_same_training_setup(tmp_path, state, cfg, "a" * 64)
    with pytest.raises(ConfigError, match="tokenizer: the checkpoint was trained on data tokenized by sha256 aaaa"):
        resume_checks.check_same_training_setup(tmp_path, state, cfg, "b" * 64)
    lora = RunConfig.from_dict({"model": {"preset": "tiny"}, "data": {"train": "d"},
                                "train": {"trainable": "lora", "lora": {"r": 4}}})
    with pytest.raises(ConfigError, match="train.trainable: checkpoint 'all', config 'lora'; train.lora"):
        resume_checks.check_same_training_setup(tmp_path, state, lora, "a" * 64)


def test_resume_none_refuses_a_directory_with_checkpoints(tmp_path):
    cfg = RunConfig.from_dict({"model": {"preset": "tiny"}, "data": {"train": "d"}, "train": {"resume": "none"}})
    resume_checks.check_fresh_start(cfg, tmp_path)
    ckpt = tmp_path / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    with pytest.raises(ConfigError, match="already holds checkpoints .*step 2"):
        resume_checks.check_fresh_start(cfg, tmp_path)


def test_checkpoint_manager_check_finds_what_train_resume_names(tmp_path):
    """auto = the newest complete checkpoint (an interrupted .tmp save is never chosen), a path = that checkpoint,
    a path without trainer_state.json is refused; the data's tokenizer is kept for the next save."""
    from tapetrain.distributed import DistEnv
    from tapetrain.train.checkpointing import CheckpointManager, ResumePoint, TrainingProgress

    run_dir = tmp_path / "run"
    cfg = RunConfig.from_dict({"model": {"preset": "tiny"}, "data": {"train": "d"}, "run": {"out_dir": str(run_dir)}})
    model_config = cfg.model.model_config()
    for name, step in [("step_00000002", 2), ("step_00000004", 4), ("step_00000006.tmp", 6)]:
        ckpt = run_dir / "checkpoints" / name
        ckpt.mkdir(parents=True)
        (ckpt / "model_config.json").write_text(json.dumps(model_config.to_dict()))
        if not name.endswith(".tmp"):
            (ckpt / "trainer_state.json").write_text(json.dumps({"step": step, "tokens": 64 * step}))

    def manager(resume: str) -> CheckpointManager:
        resumed = RunConfig.from_dict({**cfg.to_dict(), "train": {**cfg.to_dict()["train"], "resume": resume}})
        return CheckpointManager(resumed, DistEnv(0, 0, 1, torch.device("cpu")), model_config)

    newest = manager("auto")
    point = newest.check()
    assert point == ResumePoint(run_dir / "checkpoints" / "step_00000004", {"step": 4, "tokens": 256})
    assert point.progress == TrainingProgress(step=4, tokens=256, skipped_steps=0)
    newest.check_training_setup("a" * 64)
    assert newest.tokenizer_sha256 == "a" * 64
    assert manager(str(run_dir / "checkpoints" / "step_00000002")).check().progress.step == 2
    with pytest.raises(ConfigError, match=r"step_00000006.tmp' is not a complete checkpoint directory \(no "
                                          r"trainer_state.json\); point it at RUN_DIR/checkpoints/step_XXXXXXXX"):
        manager(str(run_dir / "checkpoints" / "step_00000006.tmp")).check()
    assert CheckpointManager(cfg, DistEnv(0, 0, 1, torch.device("cpu")), model_config).check() == point
    shutil.rmtree(run_dir / "checkpoints")
    assert manager("none").check() is None


def test_setting_and_batch_changes_are_described(tmp_path):
    old = RunConfig.from_dict({"model": {"preset": "tiny"}, "data": {"train": "d"}})
    new = RunConfig.from_dict({"model": {"preset": "tiny"}, "data": {"train": "d"},
                               "optim": {"lr": 1e-4, "betas": [0.8, 0.9]}, "train": {"grad_clip": 0.5}})
    state = {"step": 3, **resume_checks.training_settings(old),
             "data": {"global_batch_size": 8, "consumed_samples": 24}}
    changes = resume_checks.setting_changes(json.loads(json.dumps(state)), new, tmp_path)
    assert changes == ["optim.betas: [0.9, 0.95] -> [0.8, 0.9]", "optim.lr: 0.0003 -> 0.0001",
                       "train.grad_clip: 1.0 -> 0.5"]
    assert resume_checks.setting_changes(json.loads(json.dumps(state)), old, tmp_path) == []
    assert resume_checks.batch_size_change(state, 8) is None
    assert "train.global_batch_size changed on resume: 8 -> 16" in resume_checks.batch_size_change(state, 16)


# ---- tokenizer provenance -----------------------------------------------------------------------------------------


def test_sources_must_share_one_tokenizer(datasets):
    sha = common_tokenizer([datasets["data_a"], datasets["data_a2"]], datasets["tok_a"])
    assert sha == json.loads((Path(datasets["data_a"]) / "manifest.json").read_text())["tokenizer"]["sha256"]
    with pytest.raises(DataError, match=r"different tokenizers \(.*data_a: sha256 .*data_b: sha256"):
        common_tokenizer([datasets["data_a"], datasets["data_b"]])
    with pytest.raises(DataError, match=r"data.tokenizer=.*b.model \(sha256 .*\) is not the tokenizer the data"):
        common_tokenizer([datasets["data_a"]], datasets["tok_b"])
    with pytest.raises(DataError, match="data.tokenizer=.*missing.model does not exist"):
        common_tokenizer([datasets["data_a"]], str(datasets["root"] / "missing.model"))


# ---- tapetrain data verify----------------------------------------------------------------------------------------


def _verify(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tapetrain.cli", "data", "verify", "--quiet", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_verify_finds_a_flipped_byte_and_bad_ids(datasets, tmp_path):
    good = _verify(datasets["data_a"])
    assert good.returncode == 0 and "OK" in good.stdout
    copy = tmp_path / "copy"
    shutil.copytree(datasets["data_a"], copy)
    shard = copy / "train-00001.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0x01  # a flipped bit: same size, ids still < vocab
    shard.write_bytes(bytes(raw))
    bad = _verify(str(copy))
    assert bad.returncode == 1
    assert "train-00001.bin: sha256" in bad.stderr and "the file changed after prepare wrote it" in bad.stderr
    # an id >= vocab_size with a manifest that agrees about the checksum: the id check alone catches it
    raw[20:22] = np.array([299 + 7], dtype="<u2").tobytes()
    shard.write_bytes(bytes(raw))
    manifest = json.loads((copy / "manifest.json").read_text())
    import hashlib

    for entry in manifest["splits"]["train"]["shards"]:
        if entry["file"] == shard.name:
            entry["sha256"] = hashlib.sha256(bytes(raw)).hexdigest()
    (copy / "manifest.json").write_text(json.dumps(manifest))
    ids = _verify(str(copy))
    assert ids.returncode == 1 and "token id 306 >= vocab_size 300 (first at token 10)" in ids.stderr
    assert "sha256" not in ids.stderr


# ---- read-ahead batches --------------------------------------------------------------------------------------------


def test_prefetched_batches_equal_reading_in_process_across_a_resume(datasets):
    from tapetrain.data.prefetch import PrefetchingBatches

    ds = open_dataset(datasets["data_a"], 16)
    kw = dict(global_batch_size=8, micro_batch_size=2, rank=1, world_size=2, seed=5)
    plain, ahead = BatchIterator(ds, **kw), PrefetchingBatches(BatchIterator(ds, **kw), num_workers=2)
    try:
        for _ in range(7):
            assert torch.equal(plain.next_micro_batch(), ahead.next_micro_batch())
        assert ahead.state_dict() == plain.state_dict()
        state = {**plain.state_dict(), "consumed_samples": 40}
        plain.load_state_dict(state)
        ahead.load_state_dict(state)
        for _ in range(int(ds.num_samples)):  # past the end of the epoch
            assert torch.equal(plain.next_micro_batch(), ahead.next_micro_batch())
        assert ahead.epoch == plain.epoch >= 1
    finally:
        ahead.close()


# ---- checkpoint size and free space ------------------------------------------------------------------------------


def test_free_space_check_names_the_directory_and_the_bytes(tmp_path):
    from tapetrain.checkpoint import disk
    from tapetrain.errors import DiskSpaceError

    disk.require_free_space(tmp_path / "not" / "yet", 1, "one checkpoint")  # the nearest existing parent counts
    with pytest.raises(DiskSpaceError, match=rf"no space left for one checkpoint in {tmp_path}: it needs about "
                                             r".* \(\d+ bytes\) but only .* are free"):
        disk.require_free_space(tmp_path, 1 << 62, "one checkpoint")
    # 1M trainable fp32 parameters under ZeRO-2 on 2 ranks: 4 MB weights + 12 MB optimizer (+5%, + 1 MiB per file)
    assert disk.checkpoint_bytes(10**6, 10**6, "fp32", 2, 2) == int(16e6 * 1.05) + 5 * (1 << 20)
    assert disk.checkpoint_bytes(10**6, 10**3, "bf16", 3, 2) < disk.checkpoint_bytes(10**6, 10**3, "bf16", 2, 2)


# ---- config wins over restored optimizer settings -----------------------------------------------------------------


def test_optimizer_settings_follow_the_config_after_a_load():
    from types import SimpleNamespace

    from tapetrain.train.checkpointing import apply_config_settings, group_hyperparameters
    from tapetrain.train.optim import build_optimizer
    from tapetrain.train.schedule import build_scheduler, lr_at

    def cfg(**optim):
        return RunConfig.from_dict({"model": {"preset": "tiny"}, "data": {"train": "d"}, "train": {"steps": 20},
                                    "optim": {"warmup_steps": 2, **optim}})

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    old = cfg(lr=1e-3, betas=[0.9, 0.95], weight_decay=0.1)
    opt = build_optimizer(model, old.optim)
    sched = build_scheduler(opt, old.optim, 20)
    for _ in range(5):
        opt.step()
        sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()

    new = cfg(lr=5e-4, betas=[0.8, 0.9], weight_decay=0.01, schedule="linear", min_lr=1e-5)
    opt2 = build_optimizer(model, new.optim)
    sched2 = build_scheduler(opt2, new.optim, 20)
    hyper = group_hyperparameters(opt2)
    opt2.load_state_dict(saved_opt)  # what a checkpoint load does: the old values come back
    sched2.load_state_dict(saved_sched)
    assert opt2.param_groups[0]["betas"] == (0.9, 0.95)
    engine = SimpleNamespace(basic_optimizer=opt2, optimizer=SimpleNamespace(clip_grad=1.0))
    apply_config_settings(engine, sched2, new, 5, hyper)
    assert [g["weight_decay"] for g in opt2.param_groups] == [0.01, 0.0]
    lr = lr_at(5, new.optim, 20)
    assert all(g["betas"] == (0.8, 0.9) and g["lr"] == pytest.approx(lr) for g in opt2.param_groups)
    assert engine.optimizer.clip_grad == new.train.grad_clip
    opt2.step()
    sched2.step()  # the LambdaLR continues from the config's position
    assert opt2.param_groups[0]["lr"] == pytest.approx(lr_at(6, new.optim, 20))

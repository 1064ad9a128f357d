"""train.float8 under real 2-rank DeepSpeed (CPU, gloo) in torchao's emulation (TAPETRAIN_FLOAT8_EMULATE=1).

Economy: every training of this file runs in one launch of run_cases_worker.py, one case after another; each test
reads its case's run directory or the launch's log. Cases (4 steps, checkpoints every 2, fp32 masters):
  off     ZeRO-1, float8 off: the reference the float8 curves are compared with
  z1, z3  ZeRO-1 and ZeRO-3, rowwise
  z2      ZeRO-2, tensorwise: the uninterrupted run
  resumed z2's step-2 checkpoint continued to step 4 (a new run directory): bit-identical to z2
  toggled the same, with float8 off: allowed, and named in the changed-settings line
  layout  ZeRO-2 rowwise with activation checkpointing, tiled MLP and sequence parallelism 2
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO, attempt, losses, run, script_launcher_cmd, single_cmd, write_config

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("run_cases_worker.py")
FOUR_STEPS = {"steps": 4, "save_interval": 2}


@pytest.fixture(scope="module")
def float8_runs(tmp_path_factory, shard_dir) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("float8")

    def case(name: str, float8: str, stage: int, *overrides: str, **sections) -> dict:
        cfg = write_config(root / f"{name}.yaml", shard_dir, root / name, deepspeed={"zero_stage": stage},
                           train={**FOUR_STEPS, "float8": float8}, **sections)
        return {"config": str(cfg), "overrides": list(overrides)}

    resume_from = f"train.resume={root / 'z2' / 'checkpoints' / 'step_00000002'}"
    cases = [
        case("off", "off", 1),
        case("z1", "rowwise", 1),
        case("z3", "rowwise", 3),
        case("z2", "tensorwise", 2),
        case("resumed", "tensorwise", 2, resume_from),
        case("toggled", "off", 2, resume_from),
        case("layout", "rowwise", 2, model={"activation_checkpointing": True, "tiled_mlp": 2},
             parallel={"sequence_parallel": 2}),
    ]
    (root / "cases.json").write_text(json.dumps(cases))
    launched = run(script_launcher_cmd(WORKER, 2, str(root / "cases.json")), timeout=900,
                   extra_env={"TAPETRAIN_FLOAT8_EMULATE": "1"})  # the ranks inherit it from the launcher
    return root, launched.stdout + launched.stderr


def close(a: dict[int, float], b: dict[int, float], tolerance: float) -> bool:
    return a.keys() == b.keys() and all(abs(a[s] - b[s]) <= tolerance * abs(b[s]) for s in a)


@pytest.mark.parametrize("name", ["z1", "z2", "z3", "layout"])
def test_float8_trains_close_to_high_precision_on_every_zero_stage(float8_runs, name):
    """FP8 rounding changes every loss a little (the float8 path ran) and none by more than 2%; it learns."""
    root, log = float8_runs
    reference, curve = losses(root / "off"), losses(root / name)
    assert sorted(curve) == [1, 2, 3, 4] and all(v > 0 for v in reference.values())
    assert curve[1] != reference[1]  # the first step's loss, same weights: only FP8 rounding can change it
    assert close(curve, reference, 0.02), (curve, reference)
    assert curve[4] < curve[1] - 0.1
    assert "linear(s) in FP8" in log and "torchao's emulation" in log


def test_zero3_partitioned_float8_matches_zero1(float8_runs):
    """ZeRO-3 gathers each Float8Linear's weight for its forward and backward as for nn.Linear: same recipe, same
    losses as ZeRO-1 up to the reduction order of fp32 gradients."""
    root, _ = float8_runs
    assert close(losses(root / "z3"), losses(root / "z1"), 1e-4), (losses(root / "z3"), losses(root / "z1"))


def test_float8_resume_is_bit_identical(float8_runs):
    """Dynamic scaling keeps no state: steps 3 and 4 after a resume are the uninterrupted run's, bit for bit."""
    root, _ = float8_runs
    straight, resumed = losses(root / "z2"), losses(root / "resumed")
    assert sorted(resumed) == [3, 4]
    assert resumed == {s: straight[s] for s in (3, 4)}


def test_turning_float8_off_on_resume_is_named(float8_runs):
    root, log = float8_runs
    assert "train.float8: 'tensorwise' -> 'off'" in log
    straight, toggled = losses(root / "z2"), losses(root / "toggled")
    assert sorted(toggled) == [3, 4] and toggled[3] != straight[3]  # it ran in high precision from step 3


def test_float8_export_loads_in_transformers_without_torchao(float8_runs, tmp_path):
    """The HF export of a float8 run holds the high-precision weights under plain nn.Linear keys; transformers loads
    it in a process where torchao cannot be imported."""
    root, _ = float8_runs
    out = tmp_path / "hf"
    run([sys.executable, "-m", "tapetrain.cli", "export", "hf", str(root / "z2"), "--out", str(out)])
    probe = (
        "import sys; sys.modules['torchao'] = None\n"  # `import torchao` now raises ImportError
        "import torch, transformers\n"
        f"m = transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)\n"
        "keys = m.state_dict().keys()\n"
        "assert any(k.endswith('attn.q_proj.weight') or k.endswith('self_attn.q_proj.weight') for k in keys), keys\n"
        "assert all(p.dtype in (torch.float32, torch.bfloat16) for p in m.parameters())\n"
        "ids = torch.randint(0, 512, (1, 16))\n"
        "assert torch.isfinite(m(ids).logits).all()\n"
        "assert not any(k.startswith('torchao') for k in sys.modules if sys.modules[k] is not None)\n"
        "print('loaded', sum(p.numel() for p in m.parameters()))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr[-3000:]


def test_a_cpu_start_asking_for_float8_is_refused_before_writing(tmp_path, shard_dir):
    """Without the test switch a CPU start refuses float8 in one line naming the fix, and writes no run files."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", shard_dir, out, train={**FOUR_STEPS, "float8": "rowwise"})
    proc = attempt(single_cmd(cfg))
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "train.float8=rowwise on cpu" in proc.stdout and "set train.float8=off" in proc.stdout
    assert not (out / "config.yaml").exists() and not (out / "checkpoints").exists()

"""Starting a CPU job must not depend on DeepSpeed's JIT-built shared-memory op: a build killed mid-way leaves a
lock file behind, and every later start used to wait on it forever (how CI once hung for 90 minutes)."""

import os
import subprocess
import sys
from pathlib import Path

RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def test_cpu_start_ignores_a_stale_extension_build_lock(tmp_path):
    stale = tmp_path / "deepspeed_shm_comm"
    stale.mkdir()
    (stale / "lock").write_text("")  # what a killed `torch.utils.cpp_extension.load` leaves
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path)
    code = (
        "from tapetrain.distributed import init_distributed\n"
        "dist = init_distributed()\n"
        "print('world', dist.world_size, dist.device)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 1 cpu" in proc.stdout
    assert (stale / "lock").exists()  # untouched: nothing tried to build


def test_a_lone_process_leaves_no_rank_variables_for_its_children(tmp_path):
    """Used in-process (eval tools, benchmarks, notebooks), init_distributed used to write RANK, WORLD_SIZE and
    MASTER_PORT into os.environ: every child process then took itself for rank 0 of that group and failed to bind
    the parent's port (EADDRINUSE), or joined the parent's group."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    child = "from tapetrain.distributed import init_distributed; print('child world', init_distributed().world_size)"
    code = (
        "import os, subprocess, sys\n"
        "from tapetrain.distributed import init_distributed\n"
        "init_distributed()\n"
        "print('left', sorted(k for k in ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT') if k in os.environ))\n"
        f"out = subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True, timeout=120)\n"
        "print(out.stdout, out.stderr[-2000:])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "left []" in proc.stdout and "child world 1" in proc.stdout, proc.stdout[-3000:]


def run_lone_process(code: str) -> str:
    """stdout of `code` run by a fresh interpreter with no launcher variables, in the repository root."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_a_process_that_left_its_group_can_start_deepspeed_again():
    """The training CLI leaves its process group when it returns (gloo threads left to interpreter shutdown
    aborted ranks). Torch's own destroy_process_group left DeepSpeed's cached groups pointing at the destroyed
    world: the next deepspeed.initialize in that process (a notebook, a test session) failed with "Group ... is not
    registered" (how the CI run's tests after an in-process `tapetrain train` errored)."""
    code = (
        "import deepspeed, torch\n"
        "from tapetrain.distributed import init_distributed\n"
        "from tapetrain.train.run import leave_process_group\n"
        "config = {'train_micro_batch_size_per_gpu': 1, 'zero_optimization': {'stage': 0}}\n"
        "for attempt in range(2):\n"
        "    init_distributed()\n"
        "    model = torch.nn.Linear(4, 4)\n"
        "    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),\n"
        "                                      config=config)\n"
        "    engine.destroy()\n"
        "    leave_process_group()\n"
        "    print('started', attempt)\n"
    )
    assert "started 1" in run_lone_process(code)


def test_train_in_process_keeps_a_process_group_it_did_not_start():
    """`tapetrain train --print-config` called in-process (how a test of the full run called it) tore down the
    caller's process group: every later DeepSpeed start in that pytest process failed (9 failures, 26 errors)."""
    code = (
        "import torch\n"
        "from tapetrain.cli import main\n"
        "from tapetrain.distributed import init_distributed\n"
        "init_distributed()\n"
        "group = torch.distributed.group.WORLD\n"
        "assert main(['train', 'configs/demo-tape.yaml', '--print-config']) == 0\n"
        "print('kept', torch.distributed.is_initialized() and torch.distributed.group.WORLD is group)\n"
    )
    assert "kept True" in run_lone_process(code)

"""Starting a CPU job must not depend on DeepSpeed's JIT-built shared-memory op: a build killed mid-way leaves a
lock file behind, and every later start used to wait on it forever (how CI once hung for 90 minutes)."""

import os
import subprocess
import sys


def test_cpu_start_ignores_a_stale_extension_build_lock(tmp_path):
    stale = tmp_path / "deepspeed_shm_comm"
    stale.mkdir()
    (stale / "lock").write_text("")  # what a killed `torch.utils.cpp_extension.load` leaves
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
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

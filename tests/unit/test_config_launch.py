"""launch/ scripts: shell syntax and the launcher command lines they build (stand-ins for deepspeed/SLURM)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
SCRIPTS = ["single_node.sh", "multi_node.sh", "slurm.sbatch"]
CONFIG = str(REPO / "configs" / "tiny-cpu.yaml")

# A stand-in `deepspeed` that records its arguments (one per line) and the hostfile it was given.
FAKE_DEEPSPEED = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$RECORD/args.$$"
prev=""
for a in "$@"; do
    if [[ $prev == --hostfile ]]; then cp "$a" "$RECORD/hostfile.$$"; fi
    prev=$a
done
echo "node=${SLURM_NODEID:-}" > "$RECORD/env.$$"
if [[ -n ${FAKE_SLEEP:-} ]]; then
    trap 'echo term > "$RECORD/term.$$"; exit 0' TERM
    touch "$RECORD/started.$$"
    for _ in $(seq 1 200); do sleep 0.1; done
fi
"""
# `srun [options] CMD...` -> run CMD as node 0; `scontrol show hostnames LIST` -> two hosts.
FAKE_SRUN = """#!/usr/bin/env bash
while [[ $1 == --* ]]; do shift; done
SLURM_NODEID=0 exec "$@"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
printf 'gpu-node-a\\ngpu-node-b\\n'
"""


@pytest.fixture
def fake_bin(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("deepspeed", FAKE_DEEPSPEED), ("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    record = tmp_path / "record"
    record.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NUM_GPUS", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")
    }
    env.update(PATH=f"{bin_dir}:{env['PATH']}", RECORD=str(record), TAPETRAIN_ROOT=str(REPO))
    return env, record


def recorded(record: Path, prefix: str = "args") -> list[str]:
    files = sorted(record.glob(f"{prefix}.*"))
    assert len(files) == 1, files
    return files[0].read_text().splitlines()


def run(script: str, args: list[str], env: dict, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(LAUNCH / script), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_launch_scripts_parse(script):
    assert shutil.which("bash")
    result = subprocess.run(["bash", "-n", str(LAUNCH / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_single_node_command(fake_bin):
    env, record = fake_bin
    result = run("single_node.sh", [CONFIG, "train.steps=3"], env)
    assert result.returncode == 0, result.stderr
    args = recorded(record)
    assert "--num_gpus" not in args  # all GPUs by default
    assert args[-4:] == ["--module", "tapetrain.train", CONFIG, "train.steps=3"]
    assert args[args.index("--master_port") + 1] == "29500"


def test_single_node_num_gpus_and_errors(fake_bin):
    env, record = fake_bin
    result = run("single_node.sh", [CONFIG], {**env, "NUM_GPUS": "2", "MASTER_PORT": "1234"})
    assert result.returncode == 0, result.stderr
    args = recorded(record)
    assert args[args.index("--num_gpus") + 1] == "2" and args[args.index("--master_port") + 1] == "1234"
    assert run("single_node.sh", [], env).returncode == 2
    missing = run("single_node.sh", ["nope.yaml"], env)
    assert missing.returncode == 2 and "config file not found: nope.yaml" in missing.stderr


def test_multi_node_command_with_ssh_and_without(fake_bin, tmp_path):
    env, record = fake_bin
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# comment\nnode0 slots=1\nnode1 slots=1\n")
    result = run("multi_node.sh", [str(hostfile), CONFIG, "train.steps=2"], env)
    assert result.returncode == 0, result.stderr
    args = recorded(record)
    assert args[args.index("--hostfile") + 1] == str(hostfile)
    assert args[args.index("--master_addr") + 1] == "node0"  # first host by default
    assert "--no_ssh" not in args and args[args.index("--launcher") + 1] == "pdsh"
    assert args[-4:] == ["--module", "tapetrain.train", CONFIG, "train.steps=2"]

    for f in record.iterdir():
        f.unlink()
    env2 = {**env, "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4321"}
    result = run("multi_node.sh", [str(hostfile), CONFIG], env2)
    assert result.returncode == 0, result.stderr
    args = recorded(record)
    assert "--no_ssh" in args and args[args.index("--node_rank") + 1] == "1"
    assert args[args.index("--master_addr") + 1] == "127.0.0.1"
    assert args[args.index("--master_port") + 1] == "4321"
    assert run("multi_node.sh", [CONFIG], env).returncode == 2


def test_slurm_builds_hostfile_and_launches_each_node_without_ssh(fake_bin, tmp_path):
    env, record = fake_bin
    env = {**env, "SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "gpu-node-[a-b]"}
    result = run("slurm.sbatch", [CONFIG, "train.steps=5"], env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    args = recorded(record)
    assert "--no_ssh" in args and "--node_rank=0" in args
    assert args[args.index("--master_addr") + 1] == "gpu-node-a"
    assert args[args.index("--master_port") + 1] == str(20000 + 1234)
    assert args[-4:] == ["--module", "tapetrain.train", CONFIG, "train.steps=5"]
    assert recorded(record, "hostfile") == ["gpu-node-a slots=8", "gpu-node-b slots=8"]
    assert recorded(record, "env") == ["node=0"]
    assert not list(tmp_path.glob(".hostfile-*"))  # cleaned up
    text = (LAUNCH / "slurm.sbatch").read_text()
    assert "#SBATCH --signal=B:TERM@120" in text and "#SBATCH --gpus-per-node=8" in text


def test_slurm_forwards_sigterm_to_the_ranks(fake_bin, tmp_path):
    env, record = fake_bin
    env = {**env, "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n", "FAKE_SLEEP": "1"}
    proc = subprocess.Popen(
        ["bash", str(LAUNCH / "slurm.sbatch"), CONFIG],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 30
        while not list(record.glob("started.*")) and time.time() < deadline:
            time.sleep(0.1)
        assert list(record.glob("started.*")), "the stand-in deepspeed never started"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "forwarding to the ranks" in err
    assert list(record.glob("term.*")), "SIGTERM did not reach the launched process"
    assert proc.returncode == 0


@pytest.mark.parametrize(
    "lines, bad_line",
    [
        (["node0 slots=1", "node1 8"], "node1 8"),  # DeepSpeed: ValueError traceback from its runner
        (["node0 slots=1", "node1 slots=8 gpu"], "node1 slots=8 gpu"),  # DeepSpeed: accepted, rank 0 waits silently
        (["node0 slots=1", "node1 slots=8x"], "node1 slots=8x"),
        (["node0 slots=1", "node0 slots=2"], "node0 slots=2"),  # the same host twice
        (["node0 slots=0"], "node0 slots=0"),
    ],
)
def test_multi_node_refuses_a_malformed_hostfile_naming_the_line(fake_bin, tmp_path, lines, bad_line):
    env, record = fake_bin
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# nodes\n\n" + "\n".join(lines) + "\n")
    result = run("multi_node.sh", [str(hostfile), CONFIG], env)
    assert result.returncode == 2, result.stderr
    number = 3 + lines.index(bad_line)
    assert f"{hostfile}:{number}: {bad_line!r}" in result.stderr and "'HOST slots=N'" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not list(record.iterdir())  # deepspeed was never started


def test_multi_node_accepts_what_deepspeed_accepts_and_names_the_nodes(fake_bin, tmp_path):
    env, record = fake_bin
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\n\n  node0 slots=2\t# the first one\nnode1\tslots=2\n\n")
    result = run("multi_node.sh", [str(hostfile), CONFIG], {**env, "NODE_RANK": "1", "MASTER_ADDR": "node0"})
    assert result.returncode == 0, result.stderr
    assert "2 nodes, 4 ranks: node0 (NODE_RANK=0, 2 slots), node1 (NODE_RANK=1, 2 slots)" in result.stderr
    assert recorded(record)[-3:] == ["--module", "tapetrain.train", CONFIG]

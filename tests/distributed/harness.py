"""Runs real training processes (one process, or the deepspeed launcher with N CPU ranks over gloo)."""

from __future__ import annotations

import collections
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEEPSPEED = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or "deepspeed"


# Sockets that keep the last ports free_port() handed out bound (see there); older ones are long done with.
_HELD: collections.deque[socket.socket] = collections.deque(maxlen=64)


def free_port() -> int:
    """A port the OS picked (bind to port 0), kept bound by this process while a launch uses it: the socket has
    SO_REUSEADDR and does not listen, so the rank-0 rendezvous (TCPStore binds with SO_REUSEADDR) can still listen on
    it, while no other port-0 pick on the machine (another test, another job) is given it. Adding a random offset to
    a free port, as this did, could land on a busy one."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    _HELD.append(sock)  # the oldest reservation closes when the deque drops it
    return sock.getsockname()[1]


def write_config(path: Path, data_dir: Path, out_dir: Path, **sections) -> Path:
    """A tiny TAPE run: seq 64, global batch 8, fp32 — seconds per step on 2 CPU cores."""
    cfg = {
        "run": {"out_dir": str(out_dir), "seed": 3},
        "model": {"preset": "tiny", "pe": "tape", "max_seq_len": 64},
        "data": {"train": str(data_dir), "seq_len": 64},
        "train": {
            "steps": 6,
            "micro_batch_size": 2,
            "global_batch_size": 8,
            "save_interval": 3,
            "log_interval": 1,
            "keep_last": 0,
        },
        "optim": {"lr": 3e-3, "warmup_steps": 1, "schedule": "cosine", "weight_decay": 0.1},
        "deepspeed": {"zero_stage": 2, "precision": "fp32"},
        "logging": {"tensorboard": False},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(cfg))
    return path


def env(extra: dict | None = None) -> dict:
    """The launch's environment; `extra` on top (TAPETRAIN_FLOAT8_EMULATE, which only a test that asks gets)."""
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    # TRITON_INTERPRET: the kernel test modules set it in this process at import (CPU runs of the Triton kernel);
    # a run inherits it only where a test asks for it, else `model.attn_backend=triton` would pass on a CPU.
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TRITON_INTERPRET",
                "TAPETRAIN_FLOAT8_EMULATE"):
        e.pop(key, None)
    return {**e, **(extra or {})}


def single_cmd(config: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "tapetrain.train", str(config), *overrides]


def launcher_cmd(config: Path, ranks: int, *overrides: str) -> list[str]:
    port = free_port()
    return [
        DEEPSPEED,
        "--num_gpus",
        str(ranks),
        "--master_port",
        str(port),
        "--module",
        "tapetrain.train",
        str(config),
        *overrides,
    ]


def run(cmd: list[str], timeout: int = 600, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=env(extra_env), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def attempt(cmd: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """Run a command expected to fail (or not); stdout and stderr together in .stdout."""
    return subprocess.run(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)


def script_launcher_cmd(script: Path, ranks: int, *args: str) -> list[str]:
    """`deepspeed --num_gpus N script.py ARGS` (each rank runs `python -u script.py --local_rank=R ARGS`)."""
    return [DEEPSPEED, "--num_gpus", str(ranks), "--master_port", str(free_port()),
            str(script), *args]


def files(run_dir: Path) -> dict[str, bytes]:
    """Every file under a run directory (but the lock file, which each start rewrites) -> its bytes."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".tapetrain.lock"}

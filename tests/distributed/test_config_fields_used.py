"""Every documented config key does something: a key that validates but is never read is a silent no-op."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from harness import run

pytestmark = pytest.mark.slow


def test_every_config_field_is_read(shard_dir, tmp_path):
    """How it is decided, and why this cannot pass by accident (details in field_read_probe.py): every config
    dataclass records attribute reads while real training runs (every optional path on, a resume, a LoRA run)
    and every positional encoding and model switch trains a step, all in one process. Reads made while the
    config is validated, serialised or copied do not count, so a key that is only checked and saved (as
    logging.console_interval and logging.peak_tflops were) is reported. A static scan of the source would be
    fooled by common names (`name`, `steps`, `path` are read all over the code for other objects)."""
    out = tmp_path / "reads.json"
    work = tmp_path / "work"
    work.mkdir()
    probe = Path(__file__).parent / "field_read_probe.py"
    run([sys.executable, str(probe), str(shard_dir), str(shard_dir.parent / "tok.model"), str(work), str(out)])
    result = json.loads(out.read_text())
    assert {"optim.lr", "model.pe", "logging.peak_tflops", "data.train[i].path"} <= set(result["read"])  # it records
    assert result["unread"] == [], f"config keys that nothing reads: {result['unread']}"

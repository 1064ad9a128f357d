"""What a user of the `deepspeed` launcher sees: one clean message for a user error (config, data, resume refusal),
printed once, a non-zero exit, no traceback; and val_loss that does not depend on the number of ranks.

Real launcher, 2 CPU ranks over gloo. Each test failed before its fix: a config error was printed by every rank
(before the process group existed, no rank could tell the others), and validation read eval_steps micro batches
per rank, so 2 ranks evaluated twice the samples of 1 rank.
"""

from __future__ import annotations

import pytest
from harness import attempt, launcher_cmd, single_cmd, write_config

pytestmark = pytest.mark.slow

MESSAGE = "unknown key 'train.stepz'"


def test_user_errors_print_one_message_and_fail_every_rank(tmp_path, small_shard_dir):
    cfg = write_config(tmp_path / "c.yaml", small_shard_dir, tmp_path / "run")
    bad = tmp_path / "bad.yaml"
    bad.write_text(cfg.read_text().replace("  steps:", "  stepz:"))

    launched = attempt(launcher_cmd(bad, 2))
    assert launched.returncode != 0, launched.stdout[-3000:]
    assert launched.stdout.count(MESSAGE) == 1, launched.stdout[-3000:]
    assert "did you mean 'train.steps'" in launched.stdout
    assert "Traceback" not in launched.stdout
    assert "terminate called" not in launched.stdout  # gloo's threads torn down before exit (1 in 5 runs aborted)
    assert not (tmp_path / "run").exists()

    single = attempt(single_cmd(bad))
    assert single.returncode == 1 and single.stdout.count(MESSAGE) == 1 and "Traceback" not in single.stdout

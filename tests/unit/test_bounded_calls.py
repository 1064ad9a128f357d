"""Issue #40: lm-eval's RULER generators can loop forever, catching every exception and printing a line per try
(a job filled its disk). tapetrain.eval.bounded runs such a call with a wall-clock limit (one error line, exit 1)
and its prints capped; tested here on a loop of the same shape in a real process."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

LOOP = """
from tapetrain.eval.bounded import bounded
with bounded(1.5, "tapetrain eval ruler: error: lm-eval did not finish", 4000):
    while True:
        try:
            print("reduces chain length for not enough noises")
            raise AssertionError
        except:  # noqa: E722 - lm-eval's generators catch everything, a limit raised as an exception included
            pass
"""


def test_an_endless_foreign_loop_ends_with_one_error_line_and_bounded_output():
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", LOOP], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and time.monotonic() - started < 30
    assert proc.stderr.strip().splitlines()[-1] == "tapetrain eval ruler: error: lm-eval did not finish"
    assert len(proc.stdout) < 4100 and "[output cut at 4000 characters]" in proc.stdout


def test_the_lm_eval_install_hint_is_the_clone_install():
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("lm-eval is installed: no hint to show")
    from tapetrain.errors import MissingPackageError
    from tapetrain.eval.ruler import require_lm_eval

    with pytest.raises(MissingPackageError, match=r'pip install -e "\.\[lm-eval\]" \(from a clone of tapetrain\)'):
        require_lm_eval()

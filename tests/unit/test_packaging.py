"""Packaging metadata as setuptools (the version in this environment) builds it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_metadata_builds_without_the_license_deprecation_banner(tmp_path: Path) -> None:
    """`project.license` as a table printed setuptools' deprecation banner twice per install."""
    code = ("import sys, warnings; warnings.simplefilter('always'); from setuptools import build_meta; "
            "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "project.license" not in proc.stderr and "Deprecat" not in proc.stderr, proc.stderr[-3000:]
    metadata = (tmp_path / proc.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata

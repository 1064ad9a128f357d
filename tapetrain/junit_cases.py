"""The test cases of a GPU campaign's junit XML files, each test once with its newest result (tools/gpu_summary.py's
tables and --last-failed, and the kernel record of tapetrain.bench.campaign_record). Standard library only:
gpu_summary.py runs with whatever Python the GPU machine has, before anything is installed.

A campaign's first call writes gpu-tests*.xml. A later call that ran its failures again after a fix (on the same
or a fresh machine, `pytest ... --junitxml=OUT/gpu-tests-rerun.xml`) writes gpu-tests-rerun*.xml: those outcomes
replace the same tests' earlier ones, and the tests it did not run keep their first result."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterable
from pathlib import Path

RERUN = "gpu-tests-rerun"


def newest_cases(xml_paths: Iterable[Path]) -> list[ET.Element]:
    """Every <testcase> of the files, a rerun's replacing the same test's earlier one (in first-seen order)."""
    ordered = sorted(xml_paths, key=lambda path: path.name.startswith(RERUN))  # stable: reruns last
    cases: dict[str, ET.Element] = {}
    for path in ordered:
        for case in ET.parse(path).getroot().iter("testcase"):
            cases[f"{case.get('classname', '')}::{case.get('name', '')}"] = case
    return list(cases.values())

"""The GPU campaign's side of the kernel record (tapetrain.model.kernel_record): a campaign record from
the junit XML of the gpu-marked tests, the attention bake-off's timings added to it, and merging it into the
committed record."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from tapetrain.bench.report import write_json_atomic
from tapetrain.junit_cases import newest_cases
from tapetrain.model import kernel_record
from tapetrain.model.kernel_record import KernelKey


def _outcome(case: ET.Element) -> str:
    if case.find("failure") is not None or case.find("error") is not None:
        return "failed"
    if case.find("skipped") is not None:
        return "skipped"
    return "passed"


def _claims(case: ET.Element) -> Iterable[dict]:
    for prop in case.iter("property"):
        if prop.get("name") == "verifies":
            yield json.loads(prop.get("value", "{}"))


def record_from_junit(xml_paths: Iterable[Path], *, device: str, capability: str, date: str, versions: dict,
                      source: str = "") -> dict:
    """One campaign: every path some test claims (`verifies` properties), passed when at least one claiming test
    passed and none failed. Skipped tests verify nothing. Each path lists its tests and their outcomes."""
    tests: dict[KernelKey, list[tuple[str, str]]] = {}
    for case in newest_cases(xml_paths):  # a rerun's result replaces the first (gpu-tests-rerun*.xml)
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = _outcome(case)
        for claim in _claims(case):
            dtypes = claim.pop("dtypes", None) or [claim.pop("dtype", "bf16")]
            for dt in dtypes:
                path = KernelKey(capability=capability, dtype=dt, **claim)
                tests.setdefault(path, []).append((name, outcome))
    paths = []
    for path, results in sorted(tests.items(), key=lambda item: repr(item[0])):
        outcomes = {outcome for _, outcome in results}
        if outcomes == {"skipped"}:
            continue  # never ran (e.g. flash-attn not installed): not a result either way
        entry = {k: v for k, v in asdict(path).items() if k != "capability"}
        entry["passed"] = "failed" not in outcomes and "passed" in outcomes
        entry["tests"] = [f"{name}: {outcome}" for name, outcome in results]
        paths.append(entry)
    return {"device": device, "capability": capability, "date": date, "versions": versions, "source": source,
            "paths": paths}


TIMING_KEY = ("kind", "backend", "dtype", "e", "docs", "gqa", "head_dim", "seq_len")


def timings_from_bakeoff(result: dict) -> list[dict]:
    """The timing entries of one bake-off JSON (tapetrain.bench.bakeoff): every case it tried, `exact` False where
    its output or a gradient missed the fp32 reference or it failed to run (those have no time)."""
    out = []
    for row in result.get("results", ()):
        entry = {"kind": "attention", "backend": row["backend"], "dtype": result["dtype"], "e": row["e"],
                 "docs": row["docs"], "gqa": row["gqa"], "head_dim": row["head_dim"], "seq_len": row["seq_len"],
                 "exact": bool(row.get("exact")) and "error" not in row}
        if entry["exact"]:
            entry.update(fwd_bwd_ms=row["fwd_bwd_ms"], fwd_bwd_tflops=row["fwd_bwd_tflops"])
        out.append(entry)
    return out


def add_timings(campaign: dict, bakeoffs: Iterable[dict]) -> dict:
    """`campaign` with the bake-offs' timings (a later entry for the same case replaces an earlier one: a follow-up
    call's results complete the first call's)."""
    by_key = {tuple(t[k] for k in TIMING_KEY): t for t in campaign.get("timings", ())}
    for result in bakeoffs:
        for entry in timings_from_bakeoff(result):
            by_key[tuple(entry[k] for k in TIMING_KEY)] = entry
    return {**campaign, "timings": [by_key[k] for k in sorted(by_key, key=repr)]}


def merge_campaign(record_file: Path, campaign: dict) -> dict:
    """The record with `campaign` added (replacing one of the same device and date), written atomically."""
    record = json.loads(record_file.read_text()) if record_file.exists() else {"schema": 1, "campaigns": []}
    kept = [c for c in record["campaigns"] if (c["device"], c["date"]) != (campaign["device"], campaign["date"])]
    record["campaigns"] = sorted([*kept, campaign], key=lambda c: (c["date"], c["device"]))
    write_json_atomic(record_file, record)
    kernel_record.clear_cache()
    return record

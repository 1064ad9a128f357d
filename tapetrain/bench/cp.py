"""`cp` mode: context parallelism (ring attention) on CPU ranks over gloo, measured as the `sp` mode measures
Ulysses (tapetrain.bench.sp): the N ranks launched form one ring, each holding two opposite chunks of every
sequence; step time and bytes saved for backward per rank at 1 and N, alternated step by step."""

from __future__ import annotations

import argparse
from typing import Any

from tapetrain.bench import sp
from tapetrain.bench.header import report_header

HELP = "context parallelism (ring attention) on CPU ranks: 1 vs a ring of N, tokens/s and memory per rank"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sp.add_arguments(p)


def header(device: str) -> dict[str, Any]:
    """The report's header (the sp module summarises both modes)."""
    return report_header("cp", device)

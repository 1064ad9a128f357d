"""Progress output: a tqdm bar on a terminal, plain timed lines in a redirected log (`make demo > demo.log` used to
become one huge line of carriage returns); every progress bar of the package goes through tapetrain.progress."""

from __future__ import annotations

import ast
import io
from pathlib import Path

from tqdm import tqdm

from tapetrain.progress import progress

PACKAGE = Path(__file__).resolve().parents[2] / "tapetrain"


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_redirected_stream_gets_plain_lines_every_interval() -> None:
    log, clock = io.StringIO(), Clock()
    bar = progress(total=1000, desc="prepare", unit="doc", stream=log, interval=10.0, clock=clock)
    for _ in range(10):  # 100 docs per second for 10 s: one line after 10 s, not one per update
        clock.now += 1.0
        bar.update(100)
        bar.set_postfix_str("1.2M tok/s")
    bar.close()
    text = log.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == 2, lines  # the 10-second line and the closing one
    assert lines[0].startswith("prepare: 1,000/1,000 doc (100%)") and "100 doc/s" in lines[0]
    assert "1.2M tok/s" in lines[0]
    assert lines[1].startswith("prepare: done, 1,000 doc in 10s")


def test_plain_lines_say_the_eta_and_iterate() -> None:
    log, clock = io.StringIO(), Clock()
    seen = []
    for item in progress(range(4), desc="passkey", unit="prompt", stream=log, interval=5.0, clock=clock):
        clock.now += 5.0
        seen.append(item)
    assert seen == [0, 1, 2, 3]
    first = log.getvalue().splitlines()[0]
    # after the first item (5 s, 1 of 4 done at 0.2 prompt/s): 15 s to go
    assert first.startswith("passkey: 1/4 prompt (25%), 0.2 prompt/s, ETA 15s"), first


def test_a_terminal_gets_tqdm_and_disabled_bars_are_silent() -> None:
    assert isinstance(progress(total=3, desc="x", stream=Terminal()), tqdm)
    log = io.StringIO()
    bar = progress(total=3, desc="x", stream=log, disable=True)
    bar.update(3)
    bar.close()
    assert log.getvalue() == ""


def test_every_progress_bar_of_the_package_goes_through_the_progress_module() -> None:
    users = []
    for file in sorted(PACKAGE.rglob("*.py")):
        if file == PACKAGE / "progress.py":
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "tqdm" or n.startswith("tqdm.") for n in names):
                users.append(str(file.relative_to(PACKAGE.parent)))
    assert not users, "use tapetrain.progress.progress instead of tqdm in:\n" + "\n".join(sorted(set(users)))

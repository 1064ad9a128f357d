"""The `tapetrain` front door: one grammar, help on every option, old spellings as aliases, exit codes.

In-process (`tapetrain.cli.main`), so the checks cost parser construction, not interpreter start-ups."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from tapetrain.cli import COMMANDS, build_parser, main

REPO = Path(__file__).resolve().parents[2]

NEW_SPELLINGS = ["data prepare", "data verify", "data tokenizer", "data arith", "data scrolls", "train", "eval ppl",
                 "eval passkey", "eval arith", "eval scrolls", "eval ruler", "compare", "export hf"]
# old spelling (one release of grace) -> its replacement
OLD_SPELLINGS = {
    "prepare": "data prepare",
    "verify": "data verify",
    "tokenizer train": "data tokenizer",
    "arith data": "data arith",
    "scrolls data": "data scrolls",
    "eval-ppl": "eval ppl",
    "eval-passkey": "eval passkey",
    "eval-arith": "eval arith",
    "eval-scrolls": "eval scrolls",
    "export-hf": "export hf",
}


def subcommand_parsers(parser: argparse.ArgumentParser, prefix: str = ""):
    """(spelling, parser) of every leaf subcommand, walking nested subparsers."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        yield prefix.strip(), parser
    for group in groups:
        for name, sub in group.choices.items():
            yield from subcommand_parsers(sub, f"{prefix} {name}")


def test_every_option_of_every_subcommand_has_help() -> None:
    """A newcomer met --vocab-size, --val-fraction, --workers and --text-key with no word of help."""
    missing = [f"tapetrain {name}: {action.option_strings or action.dest}"
               for name, parser in subcommand_parsers(build_parser())
               for action in parser._actions
               if not isinstance(action, argparse._HelpAction) and action.help != argparse.SUPPRESS
               and not (action.help or "").strip()]
    assert not missing, "options without help text:\n" + "\n".join(missing)


def test_help_lists_one_grammar(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for spelling in NEW_SPELLINGS:
        assert f"tapetrain {spelling} " in text, spelling
    for old in OLD_SPELLINGS:
        assert f"tapetrain {old} " not in text, f"the old spelling {old!r} is listed"
    assert sorted(name for name, _ in subcommand_parsers(build_parser())) == sorted(NEW_SPELLINGS)


@pytest.mark.parametrize("old", list(OLD_SPELLINGS))
def test_old_spelling_reaches_its_replacement_and_names_it(old: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*old.split(), "--help"])
    assert exit_info.value.code == 0
    captured = capsys.readouterr()
    new = OLD_SPELLINGS[old]
    assert captured.out.startswith(f"usage: tapetrain {new} "), captured.out[:200]
    assert f"`tapetrain {old}` is deprecated" in captured.err and f"use `tapetrain {new}`" in captured.err


def test_old_spelling_runs_the_job(tmp_path: Path, capsys) -> None:
    """Not only the help: an old spelling runs the same job as its replacement."""
    sizes = ["--max-digits", "2", "--eval-max-digits", "2", "--train-examples", "50", "--eval-per-cell", "1"]
    assert main(["arith", "data", "--out", str(tmp_path / "old"), *sizes]) == 0
    assert main(["data", "arith", "--out", str(tmp_path / "new"), *sizes]) == 0
    old, new = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("old", "new"))
    assert old["splits"] == new["splits"]
    assert "use `tapetrain data arith`" in capsys.readouterr().err


def test_a_user_error_is_one_line_and_exit_1(tmp_path: Path, capsys) -> None:
    code = main(["export", "hf", str(tmp_path / "no_such_run"), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback" not in err and "bug" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("tapetrain export hf: error: ") and "does not exist" in lines[0]


def test_an_unexpected_error_shows_its_traceback_and_says_it_is_a_bug(tmp_path: Path, monkeypatch, capsys) -> None:
    """A RuntimeError from a bug used to print as 'error: ...' with exit 2, hiding where it came from."""
    import tapetrain.data.arith as arith

    def broken(*args, **kwargs):
        raise RuntimeError("an internal invariant does not hold")

    monkeypatch.setattr(arith, "write_arith_data", broken)
    code = main(["data", "arith", "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert code == 70
    assert "Traceback (most recent call last)" in err and "in broken" in err
    assert "RuntimeError: an internal invariant does not hold" in err
    assert "this is a bug in tapetrain" in err.splitlines()[-1]


def test_train_takes_the_launcher_rank_and_overrides_after_options(capsys) -> None:
    """`python -m tapetrain.train --local_rank=N CONFIG KEY=VALUE` (the deepspeed launcher) and overrides that
    follow an option (`tapetrain train CONFIG --print-config train.steps=7`)."""
    from tapetrain.train.__main__ import main as module_main

    config = str(REPO / "configs" / "tiny-cpu.yaml")
    assert module_main(["--local_rank=0", config, "--print-config", "train.steps=7", "run.seed=3"]) == 0
    out = capsys.readouterr().out
    assert "steps: 7" in out and "seed: 3" in out and "(7 steps)" in out
    assert main(["train", config, "--print-config", "--world-size", "2", "train.steps=9"]) == 0
    out = capsys.readouterr().out
    assert "(9 steps)" in out and "ranks: 2" in out


@pytest.mark.parametrize("rank", [["--local_rank=1"], ["--local-rank=1"], ["--local_rank", "1"], ["--local-rank", "1"]])
def test_the_launcher_rank_is_accepted_anywhere_by_every_command(rank, capsys) -> None:
    """Issue #40: the deepspeed launcher puts --local_rank=N before the subcommand (`--module tapetrain.cli`)."""
    config = str(REPO / "configs" / "tiny-cpu.yaml")
    assert main([*rank, "train", config, "--print-config", "train.steps=7"]) == 0
    assert main(["train", *rank, config, "--print-config"]) == 0
    assert main(["train", config, "--print-config", *rank]) == 0
    capsys.readouterr()
    for command in COMMANDS:  # every command's help parses with the rank before, inside and after it
        words = command.name.split()
        for argv in ([*rank, *words, "--help"], [*words, *rank, "--help"]):
            with pytest.raises(SystemExit) as stop:
                main(argv)
            assert stop.value.code == 0, argv
    capsys.readouterr()


@pytest.mark.parametrize(("script", "command"), [("tools/convert_to_hf.py", "export hf"),
                                                 ("tools/eval_ppl.py", "eval ppl"),
                                                 ("tools/eval_passkey.py", "eval passkey")])
def test_tool_scripts_are_shims_over_the_cli(script: str, command: str, capsys) -> None:
    proc = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with pytest.raises(SystemExit):
        main([*command.split(), "--help"])
    same = capsys.readouterr().out  # the command's own help, under the script's name
    assert proc.stdout.startswith(f"usage: {script} ")
    assert proc.stdout.split("\n\n", 1)[1] == same.split("\n\n", 1)[1]


def test_scrolls_task_choices_are_the_tasks() -> None:
    from tapetrain.data.scrolls import TASKS, ScrollsTask

    assert sorted(typing.get_args(ScrollsTask)) == sorted(TASKS)


# Each command's output options (dir or file) and the least command line that reaches its function: no input named
# here exists, so a command that checked its outputs only after reading its inputs (or after the whole evaluation)
# fails on something else, and a command that checked them late would have done work first.
OUTPUTS = {
    "data tokenizer": ({"--out": "file"}, ["--input", "in.txt", "--vocab-size", "100"]),
    "data prepare": ({"--out": "dir"}, ["--input", "in.txt", "--tokenizer", "tok.model"]),
    "data arith": ({"--out": "dir"}, []),
    "data scrolls": ({"--out": "dir"}, ["--task", "qasper", "--input", "in.jsonl", "--tokenizer", "tok.model"]),
    "eval ppl": ({"--out": "file", "--plot": "file"}, ["model", "--data", "in.bin"]),
    "eval passkey": ({"--out": "file", "--plot": "file"}, ["model"]),
    "eval arith": ({"--out": "file", "--plot": "file"}, ["model", "--data", "arith"]),
    "eval scrolls": ({"--out": "file"}, ["model", "--task", "qasper", "--data", "in.jsonl"]),
    "eval ruler": ({"--out": "file", "--plot": "file"}, ["model", "--lengths", "1024"]),
    "export hf": ({"--out": "dir"}, ["run"]),
    "compare": ({"--out": "dir"}, ["model"]),
}


def test_every_command_that_writes_declares_its_outputs() -> None:
    from tapetrain.cli import COMMANDS

    for command in COMMANDS:
        declared = {f"--{name.replace('_', '-')}": kind for name, kind in command.outputs.items()}
        expected = OUTPUTS.get(command.name, ({}, []))[0]
        if command.name != "train":  # train's run.out_dir is a config key, checked at start (test_safe_runs)
            assert declared == expected, command.name


@pytest.mark.parametrize("bad", ["under_a_file", "wrong_kind"])
@pytest.mark.parametrize("command, option", [(c, o) for c, (opts, _) in OUTPUTS.items() for o in opts])
def test_output_paths_are_checked_before_any_work(command: str, option: str, bad: str, tmp_path: Path,
                                                  monkeypatch, capsys) -> None:
    """`eval ppl --out file/x.json` failed with a traceback after the whole evaluation, `export hf --out file/sub`
    with a traceback; every output of every command is now checked first, in one line naming option and path."""
    monkeypatch.chdir(tmp_path)
    kind = OUTPUTS[command][0][option]
    (tmp_path / "a_file").write_text("not a directory")
    (tmp_path / "a_dir").mkdir()
    if bad == "under_a_file":
        path, expected = tmp_path / "a_file" / "sub" / "x.json", f"{tmp_path / 'a_file'} is a file, so no directory"
    elif kind == "dir":
        path, expected = tmp_path / "a_file", "is a file, not a directory"
    else:
        path, expected = tmp_path / "a_dir", "is a directory; name a file"
    others = [arg for o, k in OUTPUTS[command][0].items() if o != option
              for arg in (o, str(tmp_path / f"ok{o}" / ("x" if k == "dir" else "x.json")))]
    code = main([*command.split(), *OUTPUTS[command][1], *others, option, str(path)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"{option} {path}: " in err and expected in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir", "a_file"]  # nothing created

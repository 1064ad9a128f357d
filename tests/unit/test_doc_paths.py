"""What README.md and docs/*.md tell a user to run exists: every config they name (configs/*.yaml, brace lists and
globs included), every tools/ script, every `tapetrain ...` command (a known command; in a code block, also its
options, parsed by the command's own parser), and every `--print-config` example in a code block runs."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from tapetrain.cli import COMMANDS, GROUPS, command_parser, main

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.M | re.S)
CONFIG_PATH = re.compile(r"configs/[\w.{},*<>-]*\.yaml")
TOOL_PATH = re.compile(r"tools/[\w./-]*\w")
# `tapetrain`, or a launcher running its modules: `--module tapetrain.cli`, `-m tapetrain.train`
PROGRAM = re.compile(r"(?:^|(?<=[\s(`$]))(?:tapetrain|(?:-m|--module) tapetrain\.(cli|train))\s")
SHELL_END = {"|", "||", "&&", ";", ">", ">>", "2>&1", "&"}


def code_lines(text: str) -> list[str]:
    """The lines of the fenced code blocks, continuation lines (`\\`) joined."""
    return [line for block in FENCE.findall(text) for line in block.replace("\\\n", " ").splitlines()[1:-1]]


def code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", FENCE.sub("", text))


def expand(pattern: str) -> list[str]:
    """configs/a-{x,y}.yaml -> [configs/a-x.yaml, configs/a-y.yaml]; a <placeholder> becomes a glob."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match:
        return [p for choice in match.group(1).split(",")
                for p in expand(pattern[:match.start()] + choice + pattern[match.end():])]
    return [re.sub(r"<[^>]*>", "*", pattern)]


def missing_paths(text: str, regex: re.Pattern) -> list[str]:
    missing = []
    for mention in sorted(set(regex.findall(text))):
        for path in expand(mention):
            if not (any(REPO.glob(path)) if "*" in path else (REPO / path).exists()):
                missing.append(mention if path == mention else f"{mention} ({path})")
    return missing


def command_words(line: str) -> list[tuple[list[str], str]]:
    """(the words after `tapetrain`, the rest of the line) of every tapetrain command in a line."""
    found = []
    for match in PROGRAM.finditer(line + " "):
        words = ["train"] if match.group(1) == "train" else []
        rest = line[match.end():]
        while len(words) < 2 and (word := re.match(r"([a-z][a-z0-9|/-]*)(?:\s+|$)", rest)):
            words.append(word.group(1))
            rest = rest[word.end():]
        found.append((words, rest))
    return found


def unknown_command(words: list[str], spellings: set[str]) -> str | None:
    """Why `tapetrain WORDS` names no command (None when it does). a|b and a/b list alternatives."""
    if not words:
        return None
    for first in re.split(r"[|/]", words[0]):
        if first in GROUPS:
            if len(words) < 2:
                continue
            bad = [w for w in re.split(r"[|/]", words[1]) if f"{first} {w}" not in spellings]
            if bad:
                return f"tapetrain {first} {'/'.join(bad)}"
        elif first not in spellings and not any(s.startswith(first + " ") and s.split()[1] == w
                                                for s in spellings for w in words[1:2]):
            return f"tapetrain {' '.join(words)}"
    return None


def command_problems(page: Path) -> list[str]:
    """Unknown commands anywhere in the page; in its code blocks also options the command's parser refuses."""
    text = page.read_text()
    current = {c.name: c for c in COMMANDS}
    every_spelling = set(current) | {c.old for c in COMMANDS if c.old}
    problems = []
    for span in code_spans(text):
        for words, _ in command_words(span):
            if (why := unknown_command(words, every_spelling)) is not None:
                problems.append(f"`{span}`: no command {why}")
    for line in code_lines(text):
        for words, rest in command_words(line):
            why = unknown_command(words, set(current))
            if why is not None:
                problems.append(f"{line.strip()}: no command {why}")
                continue
            name = " ".join(words)
            if name not in current:
                continue
            args = []
            for token in shlex.split(rest, comments=True):
                if token in SHELL_END:
                    break
                args.append(token)
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
                command_parser(current[name], "tapetrain").parse_intermixed_args(args)  # as main()
                continue
            problems.append(f"{line.strip()}: {err.getvalue().strip().splitlines()[-1]}")
    return problems


def needs_downloaded_weights(config: str) -> bool:
    """Whether a shipped config starts from a checkpoint that must be downloaded first (model.init_from)."""
    from tapetrain.config.yaml_io import read_with_bases

    path = REPO / config
    return path.is_file() and bool((read_with_bases(str(path))[0].get("model") or {}).get("init_from"))


def print_config_commands() -> list[tuple[str, list[str]]]:
    """(page, argv) of every `tapetrain train ... --print-config` in a code block, but those of configs that start
    from downloaded weights."""
    found = []
    for page in PAGES:
        for line in code_lines(page.read_text()):
            for words, rest in command_words(line):
                argv = shlex.split(rest, comments=True)
                if words == ["train"] and "--print-config" in argv and not needs_downloaded_weights(argv[0]):
                    found.append((page.relative_to(REPO).as_posix(), ["train", *argv]))
    return found


def test_every_config_and_tool_named_in_the_docs_exists():
    missing = [f"{page.relative_to(REPO)}: {path}" for page in PAGES for regex in (CONFIG_PATH, TOOL_PATH)
               for path in missing_paths(page.read_text(), regex)]
    assert not missing, "README.md and docs/ name files that do not exist:\n" + "\n".join(missing)


def test_every_tapetrain_command_in_the_docs_is_known_and_parses():
    problems = [f"{page.relative_to(REPO)}: {p}" for page in PAGES for p in command_problems(page)]
    assert not problems, "README.md and docs/ show commands tapetrain does not take:\n" + "\n".join(problems)


@pytest.mark.parametrize(("page", "argv"), print_config_commands(), ids=lambda v: v if isinstance(v, str) else v[1])
def test_every_print_config_example_runs(page, argv, capsys):
    """A --print-config example is what a user runs first on a config: it must name a config that ships and work
    as written (it reads no data and needs no downloaded weights)."""
    assert main(argv) == 0, f"{page}: `tapetrain {shlex.join(argv)}` failed (the log above says why)"


def test_the_checks_find_what_is_wrong(tmp_path):
    """The checks above could pass by finding nothing: here they must see a renamed config, a missing tool, an
    unknown command, a misspelt option, and accept what is right."""
    page = tmp_path / "page.md"
    page.write_text(
        "Train with `configs/c4_155m_tape.yaml` or configs/paper-155m-{tape,rope}.yaml, configs/scrolls-<task>.yaml; "
        "run `tools/nothing.py` and tools/benchmark.py; `tapetrain eval ppl|passkey`, `tapetrain eval blue`, "
        "`tapetrain prepare` (old spelling), `tapetrain COMMAND --help`.\n"
        "```bash\n"
        "tapetrain data prepare --input c.jsonl --tokenizer t.model \\\n    --out D   # comment\n"
        "tapetrain export hf runs/x --out hf/x --dtpye bf16\n"
        "tapetrain prepare --out D\n"
        "deepspeed --num_gpus 2 --module tapetrain.train configs/tiny-cpu.yaml --print-config\n"
        "```\n")
    text = page.read_text()
    assert missing_paths(text, CONFIG_PATH) == ["configs/c4_155m_tape.yaml"]
    assert missing_paths(text, TOOL_PATH) == ["tools/nothing.py"]
    problems = command_problems(page)
    assert len(problems) == 3, problems
    assert "no command tapetrain eval blue" in problems[0]
    assert "unrecognized arguments: --dtpye bf16" in problems[1]
    assert problems[2].startswith("tapetrain prepare --out D: no command")
    assert len(print_config_commands()) >= 2

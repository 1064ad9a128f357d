import json
import sysconfig
from pathlib import Path

import pytest


def write_stdlib_corpus(path: Path, files: slice, max_chars: int | None = None) -> Path:
    """A JSONL corpus of the standard library's own .py files: real text present on every machine with Python."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    with path.open("w") as f:
        for source in sorted(stdlib.glob("*.py"))[files]:
            text = source.read_text(encoding="utf-8", errors="replace")
            f.write(json.dumps({"text": text[:max_chars]}) + "\n")
    return path


@pytest.fixture(scope="session")
def shard_dir(tmp_path_factory):
    """A real sentencepiece tokenizer (vocab 512 = the tiny preset) and prepared shards with a val split."""
    from tapetrain.data.prepare import prepare
    from tapetrain.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("shards")
    write_stdlib_corpus(root / "corpus.jsonl", slice(0, 40))
    train_tokenizer([str(root / "corpus.jsonl")], 512, str(root / "tok.model"))
    prepare([str(root / "corpus.jsonl")], str(root / "tok.model"), str(root / "data"), val_fraction=0.05)
    return root / "data"


@pytest.fixture(scope="session")
def small_shard_dir(shard_dir, tmp_path_factory):
    """About 40 training windows of 64 tokens (same tokenizer as shard_dir): a few steps read it more than once."""
    from tapetrain.data.prepare import prepare

    root = tmp_path_factory.mktemp("small")
    write_stdlib_corpus(root / "corpus.jsonl", slice(0, 3), max_chars=1800)
    prepare([str(root / "corpus.jsonl")], str(shard_dir.parent / "tok.model"), str(root / "data"), progress=False)
    return root / "data"


@pytest.fixture(scope="session")
def other_tokenizer_dir(shard_dir, tmp_path_factory):
    """Shards of the same text by another tokenizer with the same vocabulary size (512)."""
    from tapetrain.data.prepare import prepare
    from tapetrain.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("othertok")
    write_stdlib_corpus(root / "corpus.jsonl", slice(40, 60))
    train_tokenizer([str(root / "corpus.jsonl")], 512, str(root / "other.model"))
    prepare([str(shard_dir.parent / "corpus.jsonl")], str(root / "other.model"), str(root / "data"), progress=False)
    return root / "data"


@pytest.fixture(scope="session")
def two_checkpoints(tmp_path_factory, small_shard_dir) -> Path:
    """2 ranks, ZeRO-2, 4 steps: checkpoints at steps 2 and 4, in `run`; the launcher's output (stdout and stderr
    together) in launch.log beside it. One launch for test_damaged_checkpoints (which damages copies of it) and
    test_background_hashing (which reads it); no test changes it."""
    from harness import attempt, launcher_cmd, write_config

    root = tmp_path_factory.mktemp("two")
    cfg = write_config(root / "c.yaml", small_shard_dir, root / "run", train={"steps": 4, "save_interval": 2})
    proc = attempt(launcher_cmd(cfg, 2))
    (root / "launch.log").write_text(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return root / "run"


@pytest.fixture(scope="session")
def short_docs(shard_dir, tmp_path_factory):
    """Documents of 3 stdlib source lines (tens of tokens each), with shard_dir's tokenizer."""
    from tapetrain.data.prepare import prepare

    root = tmp_path_factory.mktemp("short")
    lines = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text().splitlines()
    docs = ["\n".join(lines[i : i + 3]) for i in range(0, len(lines), 3) if "".join(lines[i : i + 3]).strip()]
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare([str(root / "corpus.jsonl")], str(shard_dir.parent / "tok.model"), str(root / "data"), progress=False)
    return root / "data"

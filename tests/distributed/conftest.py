import json
import sysconfig
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def shard_dir(tmp_path_factory):
    """A real sentencepiece tokenizer (vocab 512 = the tiny preset) and prepared shards with a val split."""
    from tapetrain.data.prepare import prepare
    from tapetrain.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("shards")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    with (root / "corpus.jsonl").open("w") as f:
        for path in sorted(stdlib.glob("*.py"))[:40]:  # real text present on every machine with Python
            f.write(json.dumps({"text": path.read_text(encoding="utf-8", errors="replace")}) + "\n")
    train_tokenizer([str(root / "corpus.jsonl")], 512, str(root / "tok.model"))
    prepare([str(root / "corpus.jsonl")], str(root / "tok.model"), str(root / "data"), val_fraction=0.05)
    return root / "data"


@pytest.fixture(scope="session")
def small_shard_dir(shard_dir, tmp_path_factory):
    """About 40 training windows of 64 tokens (same tokenizer as shard_dir): a few steps read it more than once."""
    from tapetrain.data.prepare import prepare

    root = tmp_path_factory.mktemp("small")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    with (root / "corpus.jsonl").open("w") as f:
        for path in sorted(stdlib.glob("*.py"))[:3]:
            f.write(json.dumps({"text": path.read_text(encoding="utf-8", errors="replace")[:1800]}) + "\n")
    prepare([str(root / "corpus.jsonl")], str(shard_dir.parent / "tok.model"), str(root / "data"), progress=False)
    return root / "data"


@pytest.fixture(scope="session")
def other_tokenizer_dir(shard_dir, tmp_path_factory):
    """Shards of the same text by another tokenizer with the same vocabulary size (512)."""
    from tapetrain.data.prepare import prepare
    from tapetrain.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("othertok")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    with (root / "corpus.jsonl").open("w") as f:
        for path in sorted(stdlib.glob("*.py"))[40:60]:
            f.write(json.dumps({"text": path.read_text(encoding="utf-8", errors="replace")}) + "\n")
    train_tokenizer([str(root / "corpus.jsonl")], 512, str(root / "other.model"))
    prepare([str(shard_dir.parent / "corpus.jsonl")], str(root / "other.model"), str(root / "data"), progress=False)
    return root / "data"

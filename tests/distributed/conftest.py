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

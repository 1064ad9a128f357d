"""Which tokenizer wrote a prepared dataset, and checks that every source of a run used the same one.

Token ids only mean something together with the tokenizer that produced them: two tokenizers with the same vocab
size give the same shapes and train "fine" on garbage. `tapetrain data prepare` records the tokenizer's path and sha256
in manifest.json; these helpers compare those records across the sources of a mixture, the validation data and
the tokenizer file a config or model names.
"""

from __future__ import annotations

import os

from tapetrain.data import examples
from tapetrain.data.errors import DataError
from tapetrain.data.format import file_sha256, load_manifest


def manifest_tokenizer(path: str) -> dict | None:
    """{'path': ..., 'sha256': ...} recorded by prepare (or by an example store: data arith/scrolls, which keeps
    its tokenizer.model inside) in `path`/manifest.json, or None if it recorded none."""
    if examples.is_example_dir(path):
        tok = dict(examples.read_manifest(path).get("tokenizer") or {})
        tok.setdefault("path", examples.tokenizer_of(path))
    else:
        tok = load_manifest(path).get("tokenizer")
    return tok if isinstance(tok, dict) and tok.get("sha256") else None


def common_tokenizer(paths: list[str], tokenizer_file: str | None = None, what: str = "data.tokenizer") -> str | None:
    """The sha256 every dataset in `paths` was tokenized with (checked against `tokenizer_file` if given; `what`
    says where that file came from: data.tokenizer, or e.g. model.init_from's tokenizer).

    Raises DataError naming each source and its tokenizer when they disagree, or when `tokenizer_file` is missing
    or differs. Returns None when no dataset recorded a tokenizer (and no file was given).
    """
    recorded = {p: manifest_tokenizer(p) for p in paths}
    known = {p: t for p, t in recorded.items() if t}
    shas = {t["sha256"] for t in known.values()}
    if len(shas) > 1:
        listing = "; ".join(f"{p}: sha256 {t['sha256'][:12]}… ({t.get('path', '?')})" for p, t in known.items())
        raise DataError(f"the data sources were tokenized with different tokenizers ({listing}): their token ids "
                        "mean different things. Prepare every source (and the validation data) with the same "
                        "tokenizer")
    sha = next(iter(shas)) if shas else None
    if tokenizer_file:
        from tapetrain.data.tokenizer import resolve_tokenizer_file

        if os.path.isdir(tokenizer_file):  # a model directory: its tokenizer file
            tokenizer_file = resolve_tokenizer_file(tokenizer_file)
        if not os.path.isfile(tokenizer_file):
            raise DataError(f"{what}={tokenizer_file} does not exist; point it at the tokenizer file the shards "
                            f"were prepared with{_hint(known)}, or set it to null")
        file_sha = file_sha256(tokenizer_file)
        if sha is not None and file_sha != sha:
            given = f"{what}={tokenizer_file}" if what == "data.tokenizer" else what
            raise DataError(f"{given} (sha256 {file_sha[:12]}…) is not the tokenizer the data was prepared with "
                            f"(sha256 {sha[:12]}…{_hint(known)}); point data.tokenizer at the data's tokenizer, or "
                            f"re-run `tapetrain data prepare --tokenizer {tokenizer_file}`")
        sha = file_sha
    return sha


def _hint(known: dict) -> str:
    paths = sorted({t.get("path") for t in known.values() if t.get("path")})
    return f", recorded as {paths[0]}" if len(paths) == 1 else ""

"""Tokenizers: `open_tokenizer(path)` gives one interface over two kinds, and sentencepiece training.

- sentencepiece: any .model file (ours, Llama-2's tokenizer.model) through `Tokenizer`;
- Hugging Face: a tokenizer.json (Llama-3, Qwen, Mistral) or a model directory holding one, through
  `tapetrain.data.hf_tokenizer.HFTokenizer`.

Both have path, checksum (sha256 of `path`), files (what a run directory or export copies), vocab_size,
bos_id/eos_id/pad_id (-1 = none), encode, encode_batch and decode.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence

import sentencepiece as spm

from tapetrain import atomic_io
from tapetrain.data.errors import DataError
from tapetrain.data.format import file_sha256
from tapetrain.data.sources import SourceStats, iter_documents

# sentencepiece silently drops training lines longer than this (bytes); long documents are split on newlines.
_MAX_SENTENCE_BYTES = 1 << 16


SENTENCEPIECE_FILE = "tokenizer.model"


def resolve_tokenizer_file(path: str) -> str:
    """The tokenizer file `path` names: itself, or in a model directory its tokenizer.model (sentencepiece, when
    the model ships one: Llama-2, Mistral, and tapetrain's exports of a sentencepiece run) or tokenizer.json."""
    from tapetrain.data.hf_tokenizer import TOKENIZER_JSON

    if os.path.isdir(path):
        for name in (SENTENCEPIECE_FILE, TOKENIZER_JSON):
            if os.path.isfile(os.path.join(path, name)):
                return os.path.join(path, name)
        raise DataError(f"tokenizer directory {path} holds neither {SENTENCEPIECE_FILE} nor {TOKENIZER_JSON}; pass "
                        "a model directory that has one, or the tokenizer file itself")
    if not os.path.isfile(path):
        raise DataError(f"tokenizer {path} does not exist; pass a sentencepiece .model, a Hugging Face "
                        "tokenizer.json or a model directory holding one (train a sentencepiece model with "
                        "`tapetrain data tokenizer --input ... --vocab-size N --out tok.model`)")
    return path


def tokenizer_in(directory: str) -> str | None:
    """The tokenizer file of a model directory (an export, a Hugging Face checkpoint), or None."""
    try:
        return resolve_tokenizer_file(directory) if os.path.isdir(directory) else None
    except DataError:
        return None


def is_hf_tokenizer_file(path: str) -> bool:
    return path.endswith(".json")


def open_tokenizer(path: str, eos_token: str | None = None):
    """A sentencepiece `Tokenizer` or an `HFTokenizer` for `path` (a .model, a tokenizer.json, a model dir).
    `eos_token` (--eos-token) names the EOS of a tokenizer.json whose config files name none."""
    path = resolve_tokenizer_file(path)
    if is_hf_tokenizer_file(path):
        from tapetrain.data.hf_tokenizer import HFTokenizer

        return HFTokenizer(path, eos_token)
    tok = Tokenizer(path)
    if eos_token is not None and tok.piece(tok.eos_id) != eos_token:
        raise DataError(f"--eos-token {eos_token!r}: the sentencepiece model {path} has its own EOS "
                        f"({tok.piece(tok.eos_id)!r}); drop --eos-token")
    return tok


def write_copy(tok, directory: str) -> str:
    """Copy a tokenizer's files into `directory` (with the config that names an EOS given on the command line);
    returns the copy of its tokenizer file."""
    import json

    os.makedirs(directory, exist_ok=True)
    for path in tok.files:
        shutil.copyfile(path, os.path.join(directory, os.path.basename(path)))
    side = getattr(tok, "side_config", lambda: None)()
    if side is not None:
        atomic_io.write_text(os.path.join(directory, "tokenizer_config.json"), json.dumps(side, indent=2) + "\n")
    return os.path.join(directory, os.path.basename(tok.path))


class Tokenizer:
    """Wraps `sentencepiece.SentencePieceProcessor`; ids never include BOS/EOS unless the caller adds them."""

    kind = "sentencepiece"

    def __init__(self, path: str):
        path = resolve_tokenizer_file(path)
        self.path = os.path.abspath(path)
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(self.path)
        except (OSError, RuntimeError) as err:
            raise DataError(
                f"{path} is not a sentencepiece model ({err}); pass a .model file written by sentencepiece "
                "(e.g. by `tapetrain data tokenizer`, or Llama-2's tokenizer.model), or a Hugging Face tokenizer.json"
            ) from err
        self.checksum = file_sha256(self.path)

    @property
    def files(self) -> list[str]:
        return [self.path]

    @property
    def vocab_size(self) -> int:
        return self._sp.GetPieceSize()

    def piece(self, token_id: int) -> str | None:
        return self._sp.id_to_piece(token_id) if token_id >= 0 else None

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()  # -1 when the model has none

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()  # -1 when the model has none (Llama-2's and ours)

    def encode(self, text: str) -> list[int]:
        return self._sp.Encode(text, out_type=int)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Batch encode; num_threads=1 keeps one core per prepare worker."""
        return self._sp.Encode(list(texts), out_type=int, num_threads=num_threads)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.Decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size})"


def train_tokenizer(
    inputs: list[str],
    vocab_size: int,
    out: str,
    text_key: str = "text",
    max_sentences: int | None = None,
) -> str:
    """Train a BPE sentencepiece model on the documents of `inputs` (same readers as prepare); return `out`.

    Llama-style ids: unk=0, bos=1, eos=2, no pad; byte_fallback so any UTF-8 text round-trips; identity
    normalization and no whitespace collapsing so decode(encode(text)) == text. Documents are written one line
    per text line to a temp file (sentencepiece trains on lines). `max_sentences` caps the lines sentencepiece
    samples (input_sentence_size, shuffled). The .model is written next to `out` and renamed into place.
    """
    if vocab_size < 260:
        raise DataError(f"--vocab-size {vocab_size} is too small: byte_fallback needs 256 byte pieces + 3 "
                        "specials; use at least 260 (e.g. 32000)")
    out = os.path.abspath(out)
    out_dir = os.path.dirname(out)
    os.makedirs(out_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".tok-train-", dir=out_dir)  # same filesystem -> os.replace is atomic
    try:
        corpus = os.path.join(work, "corpus.txt")
        stats = SourceStats()
        with open(corpus, "w", encoding="utf-8") as f:
            for doc in iter_documents(inputs, text_key=text_key, stats=stats):
                for line in doc.text.splitlines():
                    if line.strip():
                        f.write(line + "\n")
        options = dict(
            input=corpus,
            model_prefix=os.path.join(work, "tok"),
            vocab_size=vocab_size,
            model_type="bpe",
            byte_fallback=True,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            max_sentence_length=_MAX_SENTENCE_BYTES,
            num_threads=max(1, min(16, os.cpu_count() or 1)),
            minloglevel=1,
        )
        if max_sentences:
            options.update(input_sentence_size=max_sentences, shuffle_input_sentence=True)
        try:
            spm.SentencePieceTrainer.Train(**options)
        except RuntimeError as err:
            raise DataError(f"sentencepiece training failed: {err}; if the vocabulary is too large for the "
                            "corpus, lower --vocab-size or add more text") from err
        atomic_io.publish_file(os.path.join(work, "tok.model"), out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out

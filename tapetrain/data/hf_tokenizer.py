"""Hugging Face tokenizers (a `tokenizer.json`, e.g. Llama-3's or Qwen's byte-level BPE) behind tapetrain's
tokenizer interface (path, checksum, vocab_size, bos/eos/pad ids, encode, encode_batch, decode).

The special tokens come from the tokenizer's own config files next to tokenizer.json: tokenizer_config.json
(bos_token, eos_token, pad_token, add_bos_token), else special_tokens_map.json, else config.json's
bos/eos_token_id. A model whose config names no BOS (Qwen) or sets add_bos_token: false has bos_id -1, so prompts
and documents start without one, as that model was trained. A bare tokenizer.json (as the `tokenizers` library
trains one) names no EOS: the user names it (`--eos-token`), and `side_config()` is the tokenizer_config.json that
makes a copy of it complete.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from tapetrain.data.errors import DataError
from tapetrain.data.format import file_sha256

TOKENIZER_JSON = "tokenizer.json"
# The files of a Hugging Face tokenizer that a run directory / export keeps next to tokenizer.json.
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as err:
        raise DataError(f"{path} is not valid JSON ({err}); repair it or remove it") from err
    return value if isinstance(value, dict) else {}


def _token_text(value) -> str | None:
    """A special token as the config files write it: a string, or an AddedToken dict with 'content'."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HFTokenizer:
    """A `tokenizers.Tokenizer` from tokenizer.json; ids never include BOS/EOS unless the caller adds them."""

    kind = "huggingface"

    def __init__(self, path: str, eos_token: str | None = None):
        import tokenizers

        self.path = os.path.abspath(path)
        self.directory = os.path.dirname(self.path)
        try:
            self._tok = tokenizers.Tokenizer.from_file(self.path)
        except Exception as err:  # noqa: BLE001 - tokenizers raises plain Exception on a bad file
            raise DataError(f"{path} is not a Hugging Face tokenizer.json ({err}); pass the tokenizer.json of a "
                            "model (or its directory), or a sentencepiece .model") from err
        self.checksum = file_sha256(self.path)
        self.bos_id, self.eos_id, self.pad_id = self._special_ids()
        self.eos_named = eos_token is not None and self.eos_id < 0  # given on the command line, not by its configs
        if eos_token is not None:
            self.eos_id = self._named_eos(eos_token)

    def _named_eos(self, eos_token: str) -> int:
        """The id of the EOS token the user named, checked against the vocabulary and the tokenizer's own configs."""
        found = self._tok.token_to_id(eos_token)
        if found is None:
            raise DataError(f"--eos-token {eos_token!r} is not a token of {self.path}; name one of its special "
                            "tokens (e.g. '</s>' or '<|endoftext|>': see added_tokens in tokenizer.json)")
        if self.eos_id >= 0 and found != self.eos_id:
            raise DataError(f"--eos-token {eos_token!r} (id {found}) is not the EOS the tokenizer's config files name "
                            f"({self.piece(self.eos_id)!r}, id {self.eos_id}); drop --eos-token")
        return found

    def side_config(self) -> dict | None:
        """The tokenizer_config.json a copy of this tokenizer needs for the EOS named on the command line: its own
        config (if any) plus that eos_token; None when its own files name the EOS."""
        if not self.eos_named:
            return None
        return {**_read_json(os.path.join(self.directory, "tokenizer_config.json")),
                "eos_token": self.piece(self.eos_id)}

    def _special_ids(self) -> tuple[int, int, int]:
        config = _read_json(os.path.join(self.directory, "tokenizer_config.json"))
        names = {**_read_json(os.path.join(self.directory, "special_tokens_map.json")), **config}
        model = _read_json(os.path.join(self.directory, "config.json"))

        def lookup(name: str) -> int:
            text = _token_text(names.get(name))
            if text is not None:
                found = self._tok.token_to_id(text)
                if found is None:
                    raise DataError(f"{self.directory}: {name} {text!r} is not in {self.path}; fix the tokenizer's "
                                    "config files")
                return found
            if name in names:  # written as null: the model has none (Qwen's bos_token)
                return -1
            value = model.get(f"{name}_id")
            return value if isinstance(value, int) else -1

        bos = lookup("bos_token") if config.get("add_bos_token", True) is not False else -1
        return bos, lookup("eos_token"), lookup("pad_token")

    @property
    def files(self) -> list[str]:
        """tokenizer.json and the config files beside it that give its special tokens."""
        side = [os.path.join(self.directory, n) for n in SIDE_FILES]
        return [self.path, *(p for p in side if os.path.isfile(p))]

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Batch encode; num_threads=1 keeps to one core (one per prepare worker, as with sentencepiece): the
        library's batch call would spread over every core by itself."""
        if num_threads == 1:
            return [self._tok.encode(t, add_special_tokens=False).ids for t in texts]
        return [e.ids for e in self._tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def piece(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id) if token_id >= 0 else None

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"

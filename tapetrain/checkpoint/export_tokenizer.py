"""The tokenizer of a Hugging Face export, in the form `AutoTokenizer.from_pretrained(EXPORT)` loads.

- sentencepiece .model: copied as tokenizer.model, plus a LlamaTokenizer tokenizer_config.json and the
  tokenizer.json transformers converts it to;
- Hugging Face tokenizer.json: copied byte for byte (its sha256 is what the shards recorded) with its
  tokenizer_config.json / special_tokens_map.json; a tokenizer_config.json is written when there is none.

Either way probe texts must encode to the same ids through transformers as through tapetrain; the export records
which file is tapetrain's tokenizer (`file` in tapetrain_export.json's tokenizer entry).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from tapetrain.errors import MissingInputError

log = logging.getLogger("tapetrain.checkpoint")

# transformers' tokenizer must encode these exactly as tapetrain's.
TOKENIZER_PROBES = (
    "The grass is green. The sky is blue. The pass key is 43121. Remember it.",
    "Hello, world!\nNumbers 0123456789 and punctuation: (a) [b] {c}; e.g. 3.14 -- done.",
)
HF_FILES = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json")
# Loads tokenizer.json as it is; a model's own class (Qwen2Tokenizer, ...) may rebuild its pre-tokenizer instead.
GENERIC_CLASS = "PreTrainedTokenizerFast"


def _open(tokenizer: str | None):
    from tapetrain.data.errors import DataError
    from tapetrain.data.tokenizer import open_tokenizer

    if not tokenizer:
        return None
    if not os.path.exists(tokenizer):
        raise MissingInputError(f"tokenizer {tokenizer} does not exist; pass --tokenizer PATH (the run's "
                                "sentencepiece .model, tokenizer.json or model directory)")
    try:
        return open_tokenizer(tokenizer)
    except DataError as err:
        raise MissingInputError(f"export tokenizer: {err}") from err


def special_token_ids(tokenizer: str | None) -> tuple[int | None, int | None]:
    tok = _open(tokenizer) if tokenizer and os.path.exists(tokenizer) else None
    if tok is None:
        return None, None
    return (tok.bos_id if tok.bos_id >= 0 else None), (tok.eos_id if tok.eos_id >= 0 else None)


def _mismatches(out_dir: Path, tok) -> tuple[list[str], object]:
    from transformers import AutoTokenizer

    # trust_remote_code: the directory holds our own just-written modeling code (config.json auto_map)
    hf_tok = AutoTokenizer.from_pretrained(str(out_dir), trust_remote_code=True)
    bad = [t for t in TOKENIZER_PROBES if hf_tok(t, add_special_tokens=False)["input_ids"] != tok.encode(t)]
    return bad, hf_tok


def write_tokenizer(tokenizer: str | None, out_dir: Path, max_seq_len: int) -> dict:
    """Write the tokenizer files into `out_dir`; returns the export's tokenizer entry (status loadable,
    copied-only or none)."""
    if not tokenizer:
        return {"status": "none", "reason": "no tokenizer: the run config has no data.tokenizer and none was given"}
    tok = _open(tokenizer)
    if tok.kind == "sentencepiece":
        return _write_sentencepiece(tok, out_dir, max_seq_len)
    return _write_hf(tok, out_dir, max_seq_len)


def _entry(tok, status: str, file: str, **extra) -> dict:
    return {"status": status, "kind": tok.kind, "source": tok.path, "sha256": tok.checksum, "file": file, **extra}


def _write_hf(tok, out_dir: Path, max_seq_len: int) -> dict:
    for path in tok.files:
        shutil.copyfile(path, out_dir / os.path.basename(path))
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {
        "tokenizer_class": GENERIC_CLASS, "bos_token": tok.piece(tok.bos_id), "eos_token": tok.piece(tok.eos_id),
        "pad_token": tok.piece(tok.pad_id), "clean_up_tokenization_spaces": False}
    config.setdefault("model_max_length", max_seq_len)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    failure = None
    for attempt in range(2):
        try:
            bad, hf_tok = _mismatches(out_dir, tok)
        except Exception as err:  # noqa: BLE001 - any failure means: not loadable as declared
            bad, failure = None, f"{type(err).__name__}: {err}"
        else:
            if not bad:
                return _entry(tok, "loadable", "tokenizer.json", **{"class": type(hf_tok).__name__})
            failure = f"encodes {len(bad)} probe text(s) differently"
        if attempt == 0 and config.get("tokenizer_class") != GENERIC_CLASS:
            log.info("tokenizer: transformers' %s does not reproduce %s (%s); exporting it as %s",
                     config.get("tokenizer_class"), tok.path, failure, GENERIC_CLASS)
            config["tokenizer_class"] = GENERIC_CLASS
            config_path.write_text(json.dumps(config, indent=2) + "\n")
        else:
            break
    log.warning("tokenizer: transformers cannot reproduce %s (%s); tokenizer.json is exported for tapetrain only",
                tok.path, failure)
    return _entry(tok, "copied-only", "tokenizer.json", reason=failure)


def _write_sentencepiece(tok, out_dir: Path, max_seq_len: int) -> dict:
    """transformers 5 loads a sentencepiece model as a tokenizers-backed LlamaTokenizer (BPE + byte fallback).
    If it cannot reproduce it, only tokenizer.model is kept (status 'copied-only'). Known difference: text
    *starting* with a space (sentencepiece adds a second '▁')."""
    shutil.copyfile(tok.path, out_dir / "tokenizer.model")
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "unk_token": tok.piece(tok._sp.unk_id()),
        "bos_token": tok.piece(tok.bos_id),
        "eos_token": tok.piece(tok.eos_id),
        "add_bos_token": tok.bos_id >= 0,
        "add_eos_token": False,
        "add_prefix_space": True,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_seq_len,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    try:
        from transformers import AutoTokenizer

        hf_tok = AutoTokenizer.from_pretrained(str(out_dir), trust_remote_code=True)
        hf_tok.save_pretrained(str(out_dir))  # adds tokenizer.json: later loads need no conversion
        mismatches = [t for t in TOKENIZER_PROBES if hf_tok(t, add_special_tokens=False)["input_ids"] != tok.encode(t)]
    except Exception as err:  # noqa: BLE001 - any failure means: not loadable, keep the .model only
        mismatches, failure = None, f"{type(err).__name__}: {err}"
    else:
        failure = None if not mismatches else f"encodes {len(mismatches)} probe text(s) differently"
    if failure:
        for name in HF_FILES:
            (out_dir / name).unlink(missing_ok=True)
        log.warning("tokenizer: transformers cannot reproduce %s (%s); only tokenizer.model was exported",
                    tok.path, failure)
        return _entry(tok, "copied-only", "tokenizer.model", reason=failure)
    return _entry(tok, "loadable", "tokenizer.model", **{"class": type(hf_tok).__name__})

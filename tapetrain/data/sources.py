"""Read text documents, with (file, line) provenance, from local files or a streamed Hugging Face dataset.

Supported inputs (globs are expanded and sorted, so the document order is deterministic):
  *.jsonl, *.jsonl.zst  one JSON object per line, text under `text_key`
  *.json                a JSON list of objects, or JSON lines
  *.txt                 the whole file is one document
  *.json.gz, *.jsonl.gz, *.txt.gz   the same, gzip-compressed (C4 ships as c4-*.json.gz JSON lines)
  *.parquet             column `text_key`
  hf:NAME[:CONFIG][:SPLIT]  `datasets.load_dataset(NAME, CONFIG, split=SPLIT, streaming=True)`; SPLIT defaults
                        to "train"; NAME may also be a local directory of data files.

Bad records (malformed JSON, missing/non-string text, non-UTF-8 bytes, a file without documents) raise
`DataError` naming file and line, unless `skip_bad=True`: then they are counted in `SourceStats`.
Empty or whitespace-only documents are always dropped silently (common in real corpora, e.g. wikitext) and
counted in `SourceStats.empty`; a file without any non-empty document (an empty .txt as much as an empty
.jsonl) is a bad record. A glob matching nothing, an unknown extension, or an input yielding no document at all
always raises.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from tapetrain.data.errors import DataError

SKIP_HINT = "fix the input or pass --skip-bad (skip_bad=True) to skip bad records"
SUFFIXES = (".jsonl", ".jsonl.zst", ".json", ".txt", ".parquet", ".jsonl.gz", ".json.gz", ".txt.gz")
_GZIP_ERRORS = (OSError, EOFError, zlib.error)  # gzip.BadGzipFile is an OSError
_JSON_WS = " \t\r\n"


class Document(NamedTuple):
    text: str
    source: str  # file path, or "hf:NAME..." for a Hugging Face dataset
    line: int  # 1-based line in the file (row number for parquet and hf)


@dataclass
class SourceStats:
    """Counts of what the readers dropped; `examples` keeps the first few bad-record messages."""

    documents: int = 0
    skipped: int = 0
    empty: int = 0
    examples: list[str] = field(default_factory=list)

    def bad(self, message: str, skip_bad: bool) -> None:
        if not skip_bad:
            raise DataError(message)
        self.skipped += 1
        if len(self.examples) < 5:
            self.examples.append(message)

    def summary(self) -> str:
        text = (f"read {self.documents} documents, dropped {self.empty} empty, "
                f"skipped {self.skipped} bad records")
        if self.examples:
            text += " (first: " + " | ".join(self.examples) + ")"
        return text


class HFSpec(NamedTuple):
    name: str
    config: str | None
    split: str


def parse_hf_spec(spec: str) -> HFSpec:
    """'hf:NAME[:CONFIG][:SPLIT]' -> HFSpec; two fields mean NAME:CONFIG (split 'train')."""
    if not spec.startswith("hf:"):
        raise DataError(f"{spec!r} is not an hf: spec; write it as hf:NAME[:CONFIG][:SPLIT]")
    parts = spec[3:].split(":")
    if not parts[0] or len(parts) > 3 or any(not p for p in parts):
        raise DataError(
            f"malformed Hugging Face spec {spec!r}; write it as hf:NAME[:CONFIG][:SPLIT], "
            "e.g. hf:wikitext:wikitext-103-raw-v1:train"
        )
    config = parts[1] if len(parts) > 1 else None
    split = parts[2] if len(parts) > 2 else "train"
    return HFSpec(parts[0], config, split)


def expand_inputs(inputs: str | Iterable[str]) -> list[str]:
    """Expand globs (sorted per pattern, pattern order kept); hf: specs pass through unchanged."""
    patterns = [inputs] if isinstance(inputs, str) else list(inputs)
    if not patterns:
        raise DataError("no input given; pass --input with at least one file glob or hf:NAME spec")
    out: list[str] = []
    for pattern in patterns:
        if pattern.startswith("hf:"):
            parse_hf_spec(pattern)  # validate early
            out.append(pattern)
            continue
        found = glob.glob(os.path.expanduser(pattern), recursive=True)
        matches = sorted(p for p in found if os.path.isfile(p))
        if not matches:
            raise DataError(f"input glob {pattern!r} matches no file; check the path (cwd is {os.getcwd()})")
        for path in matches:
            _reader_for(path)  # reject unknown extensions before any work is done
        out.extend(matches)
    return out


def iter_documents(
    inputs: str | Iterable[str],
    text_key: str = "text",
    skip_bad: bool = False,
    stats: SourceStats | None = None,
) -> Iterator[Document]:
    """Yield every non-empty document of `inputs` in order; raises DataError if there is none at all."""
    stats = stats if stats is not None else SourceStats()
    patterns = [inputs] if isinstance(inputs, str) else list(inputs)
    for source in expand_inputs(patterns):
        documents_before, skipped_before = stats.documents, stats.skipped
        if source.startswith("hf:"):
            records = _read_hf(source, text_key, stats, skip_bad)
        else:
            records = _reader_for(source)(source, text_key, stats, skip_bad)
        for doc in records:
            if doc.text.strip():
                stats.documents += 1
                yield doc
            else:
                stats.empty += 1
        if stats.documents == documents_before and stats.skipped == skipped_before:
            stats.bad(f"{source}: contains no documents (empty file, or only empty texts?); remove it from --input",
                      skip_bad)
    if stats.documents == 0:
        raise DataError(f"inputs {patterns} yielded no non-empty document ({stats.summary()}); "
                        "check --input and --text-key")


# ---------------------------------------------------------------------------------------------- readers
def _reader_for(path: str):
    if path.endswith(".jsonl.zst"):
        return _read_jsonl_zst
    gzipped = {".jsonl.gz": _read_jsonl_gz, ".json.gz": _read_json_gz, ".txt.gz": _read_txt_gz}
    for suffix, reader in gzipped.items():
        if path.endswith(suffix):
            return reader
    ext = os.path.splitext(path)[1]
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".txt": _read_txt, ".parquet": _read_parquet}
    if ext not in readers:
        raise DataError(f"input file {path} has unsupported extension {ext!r}; supported: "
                        f"{', '.join(SUFFIXES)}")
    return readers[ext]


def _text_of(record: object, text_key: str, where: str, stats: SourceStats, skip_bad: bool) -> str | None:
    if not isinstance(record, dict):
        stats.bad(f"{where}: expected a JSON object, got {type(record).__name__}; {SKIP_HINT}", skip_bad)
        return None
    if text_key not in record:
        keys = ", ".join(sorted(map(str, record))[:10])
        stats.bad(f"{where}: missing key {text_key!r} (keys: {keys}); pass --text-key or {SKIP_HINT}",
                  skip_bad)
        return None
    text = record[text_key]
    if not isinstance(text, str):
        stats.bad(f"{where}: {text_key!r} is {type(text).__name__}, not a string; {SKIP_HINT}", skip_bad)
        return None
    return text


def _iter_json_lines(path: str, lines: Iterable[bytes], text_key: str, stats: SourceStats, skip_bad: bool):
    for lineno, raw in enumerate(lines, start=1):
        where = f"{path}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            stats.bad(f"{where}: invalid UTF-8 at byte {err.start} of the line; re-encode the file as UTF-8 "
                      f"or {SKIP_HINT}", skip_bad)
            continue
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            stats.bad(f"{where}: malformed JSON ({err.msg} at column {err.colno}); {SKIP_HINT}", skip_bad)
            continue
        text = _text_of(record, text_key, where, stats, skip_bad)
        if text is not None:
            yield Document(text, path, lineno)


def _read_jsonl(path: str, text_key: str, stats: SourceStats, skip_bad: bool) -> Iterator[Document]:
    with open(path, "rb") as f:
        yield from _iter_json_lines(path, f, text_key, stats, skip_bad)


def _read_jsonl_zst(path: str, text_key: str, stats: SourceStats, skip_bad: bool) -> Iterator[Document]:
    import zstandard

    with open(path, "rb") as raw:
        # Stream lines without decompressing the whole file; files may hold several zstd frames.
        reader = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
        try:
            yield from _iter_json_lines(path, reader, text_key, stats, skip_bad)
        except zstandard.ZstdError as err:
            stats.bad(f"{path}: corrupt zstd stream ({err}); re-compress the file or {SKIP_HINT}", skip_bad)


def _gzip_bad(path: str, err: Exception, stats: SourceStats, skip_bad: bool) -> None:
    stats.bad(f"{path}: corrupt or truncated gzip ({err}); re-download or re-compress the file or {SKIP_HINT}",
              skip_bad)


def _read_jsonl_gz(path: str, text_key: str, stats: SourceStats, skip_bad: bool) -> Iterator[Document]:
    with gzip.open(path, "rb") as lines:  # streamed: C4's files are ~300 MB uncompressed each
        try:
            yield from _iter_json_lines(path, lines, text_key, stats, skip_bad)
        except _GZIP_ERRORS as err:
            _gzip_bad(path, err, stats, skip_bad)


def _read_json_gz(path: str, text_key: str, stats: SourceStats, skip_bad: bool) -> Iterator[Document]:
    """JSON lines (C4) are streamed; a JSON list is decompressed whole, as an uncompressed .json is read whole."""
    try:
        with gzip.open(path, "rb") as f:
            head = f.read(4096).lstrip(_JSON_WS.encode())
    except _GZIP_ERRORS as err:
        _gzip_bad(path, err, stats, skip_bad)
        return
    if not head.startswith(b"["):
        yield from _read_jsonl_gz(path, text_key, stats, skip_bad)
        return
    text = _decode_file(path, stats, skip_bad)
    if text is not None:
        yield from _json_text_documents(path, text, text_key, stats, skip_bad)


def _read_txt_gz(path: str, text_key: str, stats: SourceStats, skip_bad: bool) -> Iterator[Document]:
    yield from _read_txt(path, text_key, stats, skip_bad)


def _decode_file(path: str, stats: SourceStats, skip_bad: bool) -> str | None:
    """The whole file as text (gunzipped for *.gz); None after reporting undecodable bytes."""
    try:
        with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
            data = f.read()
    except _GZIP_ERRORS as err:
        if not path.endswith(".gz"):
            raise
        _gzip_bad(path, err, stats, skip_bad)
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        stats.bad(f"{path}:{line}: invalid UTF-8 (byte offset {err.start}); re-encode the file as UTF-8 "
                  f"or {SKIP_HINT}", skip_bad)
        return None


def _read_txt(path: str, text_key: str, stats: SourceStats, skip_bad: bool) -> Iterator[Document]:
    text = _decode_file(path, stats, skip_bad)
    if text is not None:
        yield Document(text, path, 1)


def _read_json(path: str, text_key: str, stats: SourceStats, skip_bad: bool) -> Iterator[Document]:
    text = _decode_file(path, stats, skip_bad)
    if text is not None:
        yield from _json_text_documents(path, text, text_key, stats, skip_bad)


def _json_text_documents(path: str, text: str, text_key: str, stats: SourceStats, skip_bad: bool):
    """A .json file's text: a JSON list of objects, or JSON lines."""
    start = len(text) - len(text.lstrip(_JSON_WS))
    if not text[start:start + 1] == "[":  # not a list: JSON lines
        yield from _iter_json_lines(path, text.encode("utf-8").splitlines(), text_key, stats, skip_bad)
        return
    # Decode the list element by element so every record keeps its line number.
    decoder = json.JSONDecoder()
    pos, line, counted = start + 1, 1, 0

    def skip_ws(i: int) -> int:
        while i < len(text) and text[i] in _JSON_WS:
            i += 1
        return i

    pos = skip_ws(pos)
    if text[pos:pos + 1] == "]":
        return
    while True:
        line += text.count("\n", counted, pos)
        counted = pos
        try:
            record, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            stats.bad(f"{path}:{err.lineno}: malformed JSON ({err.msg} at column {err.colno}); the rest of "
                      f"the file is unreadable; {SKIP_HINT}", skip_bad)
            return
        value = _text_of(record, text_key, f"{path}:{line}", stats, skip_bad)
        if value is not None:
            yield Document(value, path, line)
        pos = skip_ws(end)
        if text[pos:pos + 1] == ",":
            pos = skip_ws(pos + 1)
        elif text[pos:pos + 1] == "]":
            return
        else:
            bad_line = line + text.count("\n", counted, pos)
            stats.bad(f"{path}:{bad_line}: malformed JSON list (expected ',' or ']'); the rest of the file "
                      f"is unreadable; {SKIP_HINT}", skip_bad)
            return


def _read_parquet(path: str, text_key: str, stats: SourceStats, skip_bad: bool) -> Iterator[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pfile = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        stats.bad(f"{path}: not a readable parquet file ({err}); {SKIP_HINT}", skip_bad)
        return
    names = pfile.schema_arrow.names
    if text_key not in names:
        raise DataError(f"{path}: no column {text_key!r} (columns: {', '.join(names)}); pass --text-key")
    row = 0
    for batch in pfile.iter_batches(batch_size=1024, columns=[text_key]):
        for value in batch.column(0).to_pylist():
            row += 1
            if not isinstance(value, str):
                stats.bad(f"{path}:row {row}: {text_key!r} is {type(value).__name__}, not a string; "
                          f"{SKIP_HINT}", skip_bad)
                continue
            yield Document(value, path, row)


def _read_hf(spec: str, text_key: str, stats: SourceStats, skip_bad: bool) -> Iterator[Document]:
    import datasets

    name, config, split = parse_hf_spec(spec)
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as err:  # datasets raises many types (FileNotFoundError, ValueError, HTTP errors, ...)
        raise DataError(f"cannot load {spec} ({type(err).__name__}: {err}); check NAME/CONFIG/SPLIT and "
                        "network access (or set HF_DATASETS_OFFLINE=1 with a cached copy)") from err
    for row, record in enumerate(ds, start=1):
        text = _text_of(record, text_key, f"{spec}:row {row}", stats, skip_bad)
        if text is not None:
            yield Document(text, spec, row)

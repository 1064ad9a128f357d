"""Corpus readers: every input format, hf: specs, and bad-input errors naming file and line."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from tapetrain.data.errors import DataError
from tapetrain.data.sources import SourceStats, expand_inputs, iter_documents, parse_hf_spec

DOCS = ["first doc\nwith two lines", "zweites Dokument äöü", "third 😀"]


def texts(inputs, **kw) -> list[str]:
    return [d.text for d in iter_documents(inputs, **kw)]


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


@pytest.fixture
def corpus_files(tmp_path):
    records = [{"text": t, "id": i} for i, t in enumerate(DOCS)]
    files = {"jsonl": write_jsonl(tmp_path / "a.jsonl", records)}
    zpath = tmp_path / "b.jsonl.zst"
    raw = "".join(json.dumps(r) + "\n" for r in records).encode()
    cut = raw.index(b"\n") + 1  # two zstd frames, as written by appending/concatenating compressors
    zc = zstandard.ZstdCompressor()
    zpath.write_bytes(zc.compress(raw[:cut]) + zc.compress(raw[cut:]))
    files["zst"] = str(zpath)
    (tmp_path / "list.json").write_text(json.dumps(records, indent=2), encoding="utf-8")
    files["json_list"] = str(tmp_path / "list.json")
    files["json_lines"] = write_jsonl(tmp_path / "lines.json", records)
    for i, t in enumerate(DOCS):
        (tmp_path / f"t{i}.txt").write_text(t, encoding="utf-8")
    files["txt"] = str(tmp_path / "t*.txt")
    pq.write_table(pa.table({"text": DOCS, "n": [1, 2, 3]}), tmp_path / "p.parquet", row_group_size=2)
    files["parquet"] = str(tmp_path / "p.parquet")
    # C4 ships as c4-train.00000-of-01024.json.gz: gzipped JSON lines (records also carry timestamp and url).
    lines = "".join(json.dumps({"text": t, "timestamp": "2019-04-25T12:57:54Z", "url": "u"}) + "\n" for t in DOCS)
    (tmp_path / "c4-train.00000-of-01024.json.gz").write_bytes(gzip.compress(lines.encode()))
    files["json_gz"] = str(tmp_path / "c4-train.*.json.gz")
    (tmp_path / "g.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    files["jsonl_gz"] = str(tmp_path / "g.jsonl.gz")
    for i, t in enumerate(DOCS):
        (tmp_path / f"z{i}.txt.gz").write_bytes(gzip.compress(t.encode()))
    files["txt_gz"] = str(tmp_path / "z*.txt.gz")
    return files


@pytest.mark.parametrize("kind", ["jsonl", "zst", "json_list", "json_lines", "txt", "parquet", "json_gz",
                                  "jsonl_gz", "txt_gz"])
def test_every_format_reads_all_documents(corpus_files, kind):
    assert texts([corpus_files[kind]]) == DOCS


def test_json_list_keeps_line_numbers(corpus_files):
    lines = [d.line for d in iter_documents([corpus_files["json_list"]])]
    assert lines == [2, 6, 10]  # json.dumps(indent=2): "[" then 4 lines per object


def test_globs_are_sorted_and_concatenated(corpus_files):
    assert texts([corpus_files["txt"], corpus_files["jsonl"]]) == DOCS + DOCS


def test_hf_spec_parsing():
    assert parse_hf_spec("hf:wikitext") == ("wikitext", None, "train")
    assert parse_hf_spec("hf:wikitext:wikitext-2-raw-v1") == ("wikitext", "wikitext-2-raw-v1", "train")
    assert parse_hf_spec("hf:wikitext:wikitext-2-raw-v1:test") == ("wikitext", "wikitext-2-raw-v1", "test")
    for bad in ["hf:", "hf:a::b", "hf:a:b:c:d"]:
        with pytest.raises(DataError, match="hf:NAME"):
            parse_hf_spec(bad)


def test_hf_streams_a_local_dataset_directory(tmp_path, monkeypatch):
    # A local directory is a valid load_dataset NAME: this exercises the real streaming path offline.
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    (tmp_path / "ds").mkdir()
    write_jsonl(tmp_path / "ds" / "train.jsonl", [{"text": t} for t in DOCS])
    docs = list(iter_documents([f"hf:{tmp_path / 'ds'}"]))
    assert [d.text for d in docs] == DOCS
    assert docs[1].line == 2 and docs[1].source.startswith("hf:")


def test_glob_matching_nothing(tmp_path):
    with pytest.raises(DataError, match=r"matches no file"):
        expand_inputs([str(tmp_path / "nope*.jsonl")])


def test_unsupported_extension(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"unsupported extension '.csv'.*supported: .jsonl"):
        expand_inputs([str(tmp_path / "x.csv")])


@pytest.fixture
def bad_jsonl(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        b'{"text": "ok one"}\n'
        b'{"text": "broken\n'  # line 2: malformed JSON
        b'{"body": "no text key"}\n'  # line 3: missing key
        b'{"text": "bad \xff byte"}\n'  # line 4: invalid UTF-8
        b'{"text": 5}\n'  # line 5: not a string
        b"\n"
        b'{"text": "ok two"}\n'
    )
    return str(path)


@pytest.mark.parametrize("line,record,pattern", [
    (2, b'{"text": "broken', "malformed JSON"),
    (3, b'{"body": "no text key"}', "missing key 'text'"),
    (4, b'{"text": "bad \xff byte"}', "invalid UTF-8"),
    (5, b'{"text": 5}', "'text' is int, not a string"),
    (2, b'["not", "an object"]', "expected a JSON object"),
])
def test_bad_record_names_file_and_line(tmp_path, line, record, pattern):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"text": "ok"}\n' * (line - 1) + record + b"\n")
    with pytest.raises(DataError, match=rf"x\.jsonl:{line}: {pattern}.*--skip-bad"):
        texts([str(path)])


def test_skip_bad_counts_bad_records(bad_jsonl):
    stats = SourceStats()
    assert texts([bad_jsonl], skip_bad=True, stats=stats) == ["ok one", "ok two"]
    assert stats.skipped == 4 and stats.documents == 2
    assert f"{bad_jsonl}:2" in stats.examples[0]


def test_non_utf8_txt_names_line(tmp_path):
    (tmp_path / "x.txt").write_bytes(b"line one\nline two \xc3\x28\n")
    with pytest.raises(DataError, match=r"x\.txt:2: invalid UTF-8"):
        texts([str(tmp_path / "x.txt")])


def test_malformed_json_list_names_line(tmp_path):
    (tmp_path / "x.json").write_text('[\n{"text": "a"},\n{"text": "b",,}\n]')
    with pytest.raises(DataError, match=r"x\.json:3: malformed JSON"):
        texts([str(tmp_path / "x.json")])


def test_parquet_missing_column(tmp_path):
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"no column 'text' \(columns: body\); pass --text-key"):
        texts([str(tmp_path / "p.parquet")])


def test_empty_input(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.jsonl: contains no documents"):
        texts([str(tmp_path / "empty.jsonl")])
    stats = SourceStats()
    with pytest.raises(DataError, match="yielded no non-empty document"):
        texts([str(tmp_path / "empty.jsonl")], skip_bad=True, stats=stats)
    assert stats.skipped == 1


def test_gzip_keeps_line_numbers_and_names_corrupt_files(corpus_files, tmp_path):
    assert [d.line for d in iter_documents([corpus_files["json_gz"]])] == [1, 2, 3]
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(b'{"text": "ok"}\n{"text": 1}\n'))
    with pytest.raises(DataError, match=r"bad\.jsonl\.gz:2: 'text' is int"):
        texts([str(tmp_path / "bad.jsonl.gz")])
    (tmp_path / "cut.json.gz").write_bytes(gzip.compress(b'{"text": "x"}\n' * 50)[:30])
    with pytest.raises(DataError, match=r"cut\.json\.gz: corrupt or truncated gzip"):
        texts([str(tmp_path / "cut.json.gz")])


def test_empty_files_fail_alike_in_every_format(tmp_path):
    """An empty .txt used to be dropped silently while an empty .jsonl was an error."""
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.txt").write_text("  \n\n")
    (tmp_path / "real.txt").write_text("real text")
    for name in ("empty.txt", "blank.txt"):
        with pytest.raises(DataError, match=rf"{name}: contains no documents"):
            texts([str(tmp_path / name), str(tmp_path / "real.txt")])
    stats = SourceStats()
    assert texts([str(tmp_path / "*.txt")], skip_bad=True, stats=stats) == ["real text"]
    assert stats.skipped == 2


def test_empty_documents_are_dropped_and_counted(tmp_path):
    path = write_jsonl(tmp_path / "e.jsonl", [{"text": ""}, {"text": "real"}, {"text": "  \n"}])
    stats = SourceStats()
    assert texts([path], stats=stats) == ["real"]
    assert stats.empty == 2

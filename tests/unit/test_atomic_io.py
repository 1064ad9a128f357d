"""The guarantee of tapetrain.atomic_io: temp file next to the target, fsync of file then directory, the project's
file mode, the temp removed and the target untouched on any failure."""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

import pytest

from tapetrain import atomic_io


@pytest.fixture
def umask_027():
    old = os.umask(0o027)  # not the usual 022, so a chmod to a hard-coded 0644 would show
    yield
    os.umask(old)


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_writes_bytes_text_json_with_the_umask_mode(tmp_path, umask_027):
    atomic_io.write_bytes(tmp_path / "a.bin", b"\x00\x01")
    atomic_io.write_text(tmp_path / "b.txt", "héllo")
    atomic_io.write_json(tmp_path / "c.json", {"x": [1, 2]}, indent=1)
    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "b.txt").read_text(encoding="utf-8") == "héllo"
    assert (tmp_path / "c.json").read_text() == '{\n "x": [\n  1,\n  2\n ]\n}\n'
    assert {stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()} == {0o640}
    assert leftovers(tmp_path) == []


def test_json_options_keep_each_callers_bytes(tmp_path):
    atomic_io.write_json(tmp_path / "a.json", {"k": 1}, indent=None, newline=False)
    assert (tmp_path / "a.json").read_text() == '{"k": 1}'
    with pytest.raises(ValueError):
        atomic_io.write_json(tmp_path / "b.json", {"k": math.nan}, allow_nan=False)
    assert not (tmp_path / "b.json").exists()
    assert leftovers(tmp_path) == []


def test_failed_json_leaves_target_untouched_and_no_temp(tmp_path):
    target = tmp_path / "r.json"
    target.write_text("old")
    with pytest.raises(TypeError):
        atomic_io.write_json(target, {"x": object()})
    assert target.read_text() == "old"
    assert leftovers(tmp_path) == []


def test_failing_callback_removes_its_temp(tmp_path):
    target = tmp_path / "model.pt"
    target.write_bytes(b"old")
    seen: list[Path] = []

    def half_write(tmp: Path) -> None:
        seen.append(tmp)
        tmp.write_bytes(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_io.write_via(target, half_write)
    assert seen[0].parent == tmp_path and seen[0].name.startswith(".model.pt.") and seen[0].name.endswith(".tmp")
    assert not seen[0].exists()
    assert target.read_bytes() == b"old"
    assert leftovers(tmp_path) == []


def test_failed_rename_removes_the_temp(tmp_path):
    target = tmp_path / "d"
    target.mkdir()  # a directory cannot be replaced by a file
    with pytest.raises(OSError):
        atomic_io.write_text(target, "x")
    assert target.is_dir() and leftovers(tmp_path) == []


def test_fsyncs_the_file_then_the_directory(tmp_path, monkeypatch):
    calls: list[str] = []
    real = os.fsync

    def record(fd: int) -> None:
        calls.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else str(fd))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    atomic_io.write_text(tmp_path / "f.txt", "x")
    assert len(calls) == 2
    if os.path.exists("/proc/self/fd"):
        assert Path(calls[0]).parent == tmp_path and Path(calls[0]).name.endswith(".tmp")  # before the rename
        assert Path(calls[1]) == tmp_path


def test_figure_and_parents(tmp_path, umask_027):
    class Fig:
        def savefig(self, path, **kw):
            assert kw == {"format": "png", "dpi": 120, "bbox_inches": "tight"}
            Path(path).write_bytes(b"PNG")

    out = atomic_io.save_figure(Fig(), tmp_path / "sub" / "f.png")
    assert out.read_bytes() == b"PNG" and stat.S_IMODE(out.stat().st_mode) == 0o640


def test_publish_dir_swaps_and_removes_the_old(tmp_path):
    final, tmp = tmp_path / "out", tmp_path / ".out.tmp"
    final.mkdir()
    (final / "old.txt").write_text("old")
    tmp.mkdir()
    (tmp / "new.txt").write_text("new")
    assert atomic_io.publish_dir(tmp, final) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in final.iterdir()] == ["new.txt"]


def test_publish_dir_can_hand_back_the_old(tmp_path):
    final, tmp = tmp_path / "out", tmp_path / ".out.tmp"
    final.mkdir()
    (final / "keep.txt").write_text("mine")
    tmp.mkdir()
    aside = atomic_io.publish_dir(tmp, final, tmp_path / ".out.old", remove_aside=False)
    assert aside == tmp_path / ".out.old" and (aside / "keep.txt").read_text() == "mine"

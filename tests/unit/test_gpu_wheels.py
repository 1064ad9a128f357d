"""tools/gpu_wheels.py: the GPU machine's wheel set in parts that each fit one device call, rejoined and installed
there part by part. Real (small) wheels built here, the real pip; a wheel larger than a part is cut and rejoined
byte for byte (sha256), a damaged chunk is refused."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import gpu_wheels  # noqa: E402

sys.path.pop(0)


def _wheel(directory: Path, name: str, payload: bytes, package: str | None = None) -> Path:
    """A valid pure-Python wheel whose package (`name`, or the path `package`) holds `payload` (as hex)."""
    files = {f"{package or name}/__init__.py": f"DATA = bytes.fromhex({payload.hex()!r})\n".encode(),
             f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
             f"{name}-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                            b"Tag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
              f"{len(data)}" for path, data in files.items()]
    files[f"{name}-1.0.dist-info/RECORD"] = ("\n".join([*record, f"{name}-1.0.dist-info/RECORD,,"]) + "\n").encode()
    path = directory / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:  # stored: the size is the payload's
        for member, data in files.items():
            z.writestr(member, data)
    return path


def test_parts_fit_and_install_part_by_part_byte_for_byte(tmp_path):
    wheels = tmp_path / "gpu-wheels"
    wheels.mkdir()
    rng = random.Random(0)
    big = bytes(rng.getrandbits(8) for _ in range(150_000))  # ~300 KB as hex: cut into chunks
    originals = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                 for p in (_wheel(wheels, "bigpkg", big), _wheel(wheels, "small_a", b"a" * 20_000),
                           _wheel(wheels, "small_b", b"b" * 30_000))}
    max_mib = 0.125
    parts = gpu_wheels.split(wheels, max_mib)
    assert len(parts) >= 3 and not list(wheels.glob("*.whl"))  # the parts are the set now
    for part in parts:
        payload = sum(f.stat().st_size for f in part.iterdir() if f.name != "manifest.json")
        assert payload <= max_mib * 2**20, (part, payload)
    manifest = json.loads((parts[0] / "manifest.json").read_text())
    assert len(manifest["wheels"]["bigpkg-1.0-py3-none-any.whl"]["chunks"]) > 1
    assert {n: w["sha256"] for n, w in manifest["wheels"].items()} == originals

    site, stage = tmp_path / "site", tmp_path / "stage"
    big_parts = {c["part"] for c in manifest["wheels"]["bigpkg-1.0-py3-none-any.whl"]["chunks"]}
    codes = [gpu_wheels.install(part, site, stage, sys.executable) for part in parts]  # one device call each
    assert codes[-1] == 0 and all(code == gpu_wheels.WAITING for code in codes[:-1])
    assert not (site / "bigpkg").exists() or max(big_parts) <= len(parts)
    rejoined = stage / "bigpkg-1.0-py3-none-any.whl"
    assert hashlib.sha256(rejoined.read_bytes()).hexdigest() == originals[rejoined.name]
    probe = subprocess.run([sys.executable, "-c", "import bigpkg, small_a, small_b; print(bigpkg.DATA.hex())"],
                           env=dict(os.environ, PYTHONPATH=str(site)), capture_output=True, text=True, check=True)
    assert bytes.fromhex(probe.stdout.strip()) == big
    assert gpu_wheels.install(parts[-1], site, stage, sys.executable) == 0  # again: nothing left to do


def test_a_damaged_chunk_is_refused_and_nothing_is_installed(tmp_path, capsys):
    wheels = tmp_path / "gpu-wheels"
    wheels.mkdir()
    _wheel(wheels, "bigpkg", bytes(range(256)) * 600)
    parts = gpu_wheels.split(wheels, 0.125)
    chunk = next(p for part in parts for p in part.iterdir() if ".chunk-" in p.name)
    chunk.write_bytes(b"\0" + chunk.read_bytes()[1:])  # one byte changed on the way
    codes = [gpu_wheels.install(part, tmp_path / "site", tmp_path / "stage", sys.executable) for part in parts]
    assert codes[-1] == 1 and "is not the manifest's" in capsys.readouterr().err
    assert not (tmp_path / "stage" / "bigpkg-1.0-py3-none-any.whl").exists() and not (tmp_path / "site").exists()


def test_the_first_part_alone_installs_the_named_wheels(tmp_path):
    """`split --first`: the wheels everything but flash-attn-4 needs travel in part-1 alone, so the first device call
    can run the campaign while the large wheel's chunks follow in later calls."""
    wheels = tmp_path / "gpu-wheels"
    wheels.mkdir()
    rng = random.Random(1)
    _wheel(wheels, "bigpkg", bytes(rng.getrandbits(8) for _ in range(150_000)))
    _wheel(wheels, "small_a", b"a" * 20_000)
    _wheel(wheels, "small_b", b"b" * 30_000)
    parts = gpu_wheels.split(wheels, 0.125, first=["small-a", "Small_B"])  # names as pip spells them
    assert sorted(f.name for f in parts[0].iterdir()) == ["manifest.json", "small_a-1.0-py3-none-any.whl",
                                                          "small_b-1.0-py3-none-any.whl"]
    site, stage = tmp_path / "site", tmp_path / "stage"
    assert gpu_wheels.install(parts[0], site, stage, sys.executable) == gpu_wheels.WAITING  # bigpkg still to come
    env = dict(os.environ, PYTHONPATH=str(site))
    probe = subprocess.run([sys.executable, "-c", "import small_a, small_b"], env=env, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    codes = [gpu_wheels.install(part, site, stage, sys.executable) for part in parts[1:]]
    assert codes[-1] == 0 and (site / "bigpkg").is_dir()


def test_first_names_that_match_no_wheel_or_overflow_a_part_are_refused(tmp_path):
    wheels = tmp_path / "gpu-wheels"
    wheels.mkdir()
    _wheel(wheels, "small_a", b"a" * 20_000)
    _wheel(wheels, "small_b", b"b" * 30_000)
    with pytest.raises(SystemExit, match="no wheel for: nosuch"):
        gpu_wheels.split(wheels, 0.125, first=["nosuch"])
    with pytest.raises(SystemExit, match="do not fit one part"):
        gpu_wheels.split(wheels, 0.08, first=["small_a", "small_b"])
    assert len(list(wheels.glob("*.whl"))) == 2  # refused before anything moved


def test_wheels_sharing_a_top_level_directory_keep_each_others_files_across_parts(tmp_path):
    """CuTe DSL's wheels all install under nvidia_cutlass_dsl/: pip --target --upgrade replaces a top-level directory
    that exists, so installing the wheels of a later part on their own deleted an earlier part's files there (on the
    H200: `No module named 'cutlass.cute'`). Each install puts every complete wheel in at once."""
    wheels = tmp_path / "gpu-wheels"
    wheels.mkdir()
    _wheel(wheels, "shared_a", b"a" * 40_000, package="shared/a")  # 80 KB as hex: one part each
    _wheel(wheels, "shared_b", b"b" * 40_000, package="shared/b")
    parts = gpu_wheels.split(wheels, 0.125)
    assert len(parts) == 2
    site, stage = tmp_path / "site", tmp_path / "stage"
    codes = [gpu_wheels.install(part, site, stage, sys.executable) for part in parts]
    assert codes == [gpu_wheels.WAITING, 0]
    assert (site / "shared" / "a" / "__init__.py").exists() and (site / "shared" / "b" / "__init__.py").exists()

"""The locks in requirements/ (what `make setup` and `make test` install, hash-checked) against pyproject.toml: every
dependency of record is locked at a version its range allows, every locked package has a pin and hashes, each
lock's dependencies are in it (as far as the installed packages' metadata shows), and the three locks agree."""

from __future__ import annotations

import importlib.util
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+, as the locks are
REPO = Path(__file__).resolve().parents[2]
LOCKS = REPO / "requirements"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# The lock's Python: pip-compile resolved the markers for it (its header says which).
ENVIRONMENT = {**default_environment(), "python_version": "3.11", "python_full_version": "3.11.7",
               "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}  # fmt: skip


def _lockfile_module():
    spec = importlib.util.spec_from_file_location("lockfile", REPO / "tools" / "lockfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lockfile = _lockfile_module()


def locked(name: str) -> dict[str, tuple[Version, set[str]]]:
    """canonical name -> (pinned version, its sha256 hashes)."""
    return {canonicalize_name(key): (Version(version), {h.split()[0] for h in text.split("--hash=sha256:")[1:]})
            for key, (version, text) in lockfile.entries((LOCKS / name).read_text()).items()}


def of_record(*extras: str) -> list[Requirement]:
    """pyproject's dependencies, the given extras' and the build system's, for the lock's platform."""
    project = PYPROJECT["project"]
    specs = [*project["dependencies"], *PYPROJECT["build-system"]["requires"]]
    for extra in extras:
        specs += project["optional-dependencies"][extra]
    reqs = [Requirement(s) for s in specs]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(ENVIRONMENT)]


LOCK_EXTRAS = {"dev.lock": ("dev",), "lm-eval.lock": ("dev", "lm-eval")}


@pytest.mark.parametrize("lock", sorted(LOCK_EXTRAS))
def test_every_dependency_of_record_is_locked_within_its_range(lock):
    pins = locked(lock)
    missing = [str(r) for r in of_record(*LOCK_EXTRAS[lock]) if canonicalize_name(r.name) not in pins]
    assert not missing, f"{lock} lacks {missing}: run `make lock`"
    outside = [f"{r} (locked {pins[canonicalize_name(r.name)][0]})" for r in of_record(*LOCK_EXTRAS[lock])
               if not r.specifier.contains(pins[canonicalize_name(r.name)][0], prereleases=True)]
    assert not outside, f"{lock} pins versions pyproject.toml does not allow: {outside}: run `make lock`"


@pytest.mark.parametrize("lock", ["build.lock", "dev.lock", "lm-eval.lock"])
def test_every_locked_package_is_pinned_with_hashes(lock):
    text = (LOCKS / lock).read_text()
    pins = locked(lock)
    assert pins and all(hashes for _, hashes in pins.values()), [n for n, (_, h) in pins.items() if not h]
    assert all(len(h) == 64 for _, hashes in pins.values() for h in hashes)
    requirement_lines = [line for line in text.splitlines() if line and not line.startswith((" ", "#"))]
    assert len(requirement_lines) == len(pins), "a line of the lock is not a name==version pin"
    assert "-e " not in text and "--index-url" not in text and "--find-links" not in text


def test_the_locks_agree():
    """build.lock (installed first) and lm-eval.lock (installed last) pin what dev.lock pins, with its hashes."""
    build, dev, lm_eval = locked("build.lock"), locked("dev.lock"), locked("lm-eval.lock")
    assert {n: build[n] for n in build} == {n: dev[n] for n in build}
    assert {n: dev[n] for n in dev} == {n: lm_eval[n] for n in dev}
    assert {"torch", "pip", "setuptools"} <= build.keys() and "deepspeed" not in build


def test_each_lock_holds_its_dependencies():
    """From pyproject's requirements down: each requirement (with its extras) of a locked package, as that package's
    installed metadata states it, is locked at a version it allows. A package installed at another version than the
    lock's (a venv not made from it, e.g. `make test-latest`'s) or not installed is not looked into."""
    pins = locked("lm-eval.lock")
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(r, r.extras) for r in of_record("dev", "lm-eval")]
    problems, looked_into = [], 0
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if (name, frozenset(extras)) in seen:
            continue
        seen.add((name, frozenset(extras)))
        if name not in pins or not req.specifier.contains(pins[name][0], prereleases=True):
            problems.append(f"{req} (locked: {pins.get(name, ('none',))[0]})")
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue
        if Version(dist.version) != pins[name][0]:
            continue
        looked_into += 1
        for spec in dist.requires or []:
            sub = Requirement(spec)
            if sub.marker is None or any(sub.marker.evaluate({**ENVIRONMENT, "extra": e}) for e in {"", *extras}):
                todo.append((sub, sub.extras))
    assert not problems, f"requirements the lock does not satisfy: {problems}: run `make lock`"
    if looked_into == 0:
        pytest.skip("none of the locked packages is installed at its locked version here")

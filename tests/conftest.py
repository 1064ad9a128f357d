import collections
import json
import os
import sys

import pytest
import torch

# Keep CPU tests deterministic and cheap on the 2-core CI machine: the cores shared by the xdist workers.
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))


def _import_triton_for_the_interpreter() -> None:
    """Without CUDA the kernel tests run Triton's CPU interpreter, which needs TRITON_INTERPRET=1 when triton is
    first imported (triton 3.9 builds tl.zeros & co. with @triton.jit at import). Test modules collected earlier
    import triton through transformers, so import it here, first, in interpreter mode; the variable itself is put
    back so no other test or subprocess sees it (CPU runs keep choosing SDPA)."""
    if torch.cuda.is_available() or "triton" in sys.modules:
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = before


_import_triton_for_the_interpreter()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_rank_variables_left_behind():
    """A test that initialises DeepSpeed in the pytest process must not leave RANK/WORLD_SIZE/MASTER_PORT in
    os.environ: every later subprocess (a tool, a training run) would inherit them, take itself for a rank of this
    process's group and fail to bind its port (EADDRINUSE) far from the test that caused it."""
    before = {key: os.environ.get(key) for key in RANK_VARIABLES}
    yield
    after = {key: os.environ.get(key) for key in RANK_VARIABLES}
    changed = {key: value for key, value in after.items() if value != before[key]}
    for key, value in before.items():  # restore, so one leak fails one test and not every later one
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    # LOCAL_RANK alone is harmless (DeepSpeed's engine reads it; a lone process sets it to 0)
    changed.pop("LOCAL_RANK", None)
    assert not changed, f"this test left rank variables in os.environ: {changed}"


@pytest.fixture
def verifies(request):
    """`verifies(kind=..., backend=..., dtypes=[...], e=..., docs=..., gqa=...)` inside a test: the GPU path this
    parametrization verifies (the `verifies` mark, for claims that depend on the parameters)."""

    def claim(**kwargs) -> None:
        request.node.user_properties.append(("verifies", json.dumps(kwargs, sort_keys=True)))

    return claim


# `make test` runs on two pytest-xdist workers (-n 2 --dist loadfile) with the scheduler below: a module is one unit
# of work (its module fixtures are built once), modules that share an expensive session fixture are one unit (the
# worker that runs them builds it once), and the units go out heaviest first, so that the last ones, which one worker
# finishes while the other may be idle, are short. (xdist's own --dist loadgroup does not work with pytest 9: it
# renames item._nodeid, which pytest 9 no longer reads.)
SHARED_UNITS = {  # module -> its unit, for the modules that share a session fixture of tests/distributed/conftest.py
    "tests/distributed/test_damaged_checkpoints.py": "two_checkpoints",
    "tests/distributed/test_background_hashing.py": "two_checkpoints",
}
SHARED_SESSION_FIXTURES = ("two_checkpoints",)  # a 2-rank launch
SLOW_WEIGHT, TEST_WEIGHT = 20.0, 0.5  # rough seconds per test: slow-marked (a launch or end to end), other
# Unit modules far above TEST_WEIGHT a test (rough seconds on 2 cores, from --durations): they go out among the
# slow ones, not last.
HEAVY_UNITS = {
    "tests/unit/test_memory_model.py": 140.0,  # DeepSpeed engines of a 155M model
    "tests/unit/test_document_mask.py": 75.0,  # compiled FlexAttention
    "tests/unit/test_benchmark_tool.py": 90.0,  # tools/benchmark.py end to end
    "tests/unit/test_float8.py": 30.0,  # torchao's import (~5 s), its emulation, one compiled MLP
    "tests/unit/test_hf_generation.py": 50.0,
    "tests/unit/test_kernel_tape_attention.py": 40.0,  # the Triton interpreter
    "tests/unit/test_document_mask_triton.py": 30.0,
}


def _unit(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return SHARED_UNITS.get(module, module)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: the suite still runs without it
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class UnitScheduling(LoadFileScheduling):
        """loadfile, with the units of _unit(), in the order the workers collected them (heaviest first)."""

        def __init__(self, config, log=None) -> None:
            super().__init__(config, log)
            config.option.loadscopereorder = False  # xdist's reorder: by number of tests, not by weight

        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return UnitScheduling(config, log)


def _heaviest_units_first(items: list[pytest.Item]) -> None:
    weights: collections.Counter[str] = collections.Counter()
    for item in items:
        used = [name for name in SHARED_SESSION_FIXTURES if name in getattr(item, "fixturenames", ())]
        if used and _unit(item.nodeid) != used[0]:
            raise pytest.UsageError(f"{item.nodeid} uses {used[0]}: add its module to SHARED_UNITS in {__file__}")
        weights[_unit(item.nodeid)] += SLOW_WEIGHT if item.get_closest_marker("slow") else TEST_WEIGHT
    for unit in weights.keys() & HEAVY_UNITS.keys():
        weights[unit] = HEAVY_UNITS[unit]
    items.sort(key=lambda item: (-weights[_unit(item.nodeid)], _unit(item.nodeid)))  # stable within a unit


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller schedules in the order collected
        _heaviest_units_first(items)
    for item in items:
        # What a gpu-marked test verifies reaches the junit XML as a property; the GPU campaign turns it into the
        # kernel record that `auto` consults (tapetrain/model/kernel_record.py, tools/kernel_record.py).
        for mark in item.iter_markers("verifies"):
            if mark.kwargs:  # a bare mark only selects the test for the campaign; its claims come from the fixture
                item.user_properties.append(("verifies", json.dumps(mark.kwargs, sort_keys=True)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

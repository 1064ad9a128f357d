"""`model.compile: true` (torch.compile per decoder layer) under a real DeepSpeed engine on CPU (inductor):
the same losses as eager, for TAPE and RoPE; refused with ZeRO-3. The four trainings run in one process
(run_cases_worker.py): the imports and DeepSpeed's first engine are paid once."""

import json
import sys
from pathlib import Path

import pytest
from harness import losses, run, write_config

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("run_cases_worker.py")
PES = ("tape", "rope")


@pytest.fixture(scope="module")
def compile_runs(tmp_path_factory, shard_dir) -> Path:
    root = tmp_path_factory.mktemp("compile")
    cfg = write_config(root / "c.yaml", shard_dir, root / "unused", train={"steps": 5, "save_interval": 5})
    cases = [{"config": str(cfg), "overrides": [f"run.out_dir={root / f'{pe}-{compiled}'}", f"model.pe={pe}",
                                                f"model.compile={str(compiled).lower()}"]}
             for pe in PES for compiled in (False, True)]
    (root / "cases.json").write_text(json.dumps(cases))
    run([sys.executable, str(WORKER), str(root / "cases.json")], timeout=1200)
    return root


@pytest.mark.parametrize("pe", PES)
def test_compiled_layers_train_like_eager(compile_runs, pe):
    eager, compiled = (losses(compile_runs / f"{pe}-{c}") for c in (False, True))
    assert "compile: true" in (compile_runs / f"{pe}-True" / "config.yaml").read_text()
    assert sorted(compiled) == list(range(1, 6))
    for step, loss in eager.items():
        assert abs(compiled[step] - loss) <= 1e-5, (step, loss, compiled[step])


def test_compile_with_zero3_is_refused(tmp_path, shard_dir):
    from tapetrain.config.run_config import load_run_config
    from tapetrain.errors import ConfigError

    cfg = write_config(tmp_path / "c.yaml", shard_dir, tmp_path / "run", model={"compile": True},
                       deepspeed={"zero_stage": 3})  # fmt: skip
    with pytest.raises(ConfigError, match="model.compile.*zero_stage=3|zero_stage=3.*model.compile"):
        load_run_config(str(cfg))

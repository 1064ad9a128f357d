"""`model.compile: true` (torch.compile per decoder layer) under a real DeepSpeed engine on CPU (inductor):
the same losses as eager, for TAPE and RoPE; refused with ZeRO-3."""

import pytest
from harness import losses, run, single_cmd, write_config

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("pe", ["tape", "rope"])
def test_compiled_layers_train_like_eager(tmp_path, shard_dir, pe):
    curves = {}
    for compiled in (False, True):
        out = tmp_path / f"run-{compiled}"
        cfg = write_config(
            tmp_path / f"{compiled}.yaml", shard_dir, out,
            model={"pe": pe, "compile": compiled}, train={"steps": 5, "save_interval": 5},
        )  # fmt: skip
        run(single_cmd(cfg), timeout=900)
        curves[compiled] = losses(out)
    assert sorted(curves[True]) == list(range(1, 6))
    for step, loss in curves[False].items():
        assert abs(curves[True][step] - loss) <= 1e-5, (step, loss, curves[True][step])


def test_compile_with_zero3_is_refused(tmp_path, shard_dir):
    from tapetrain.config.run_config import load_run_config
    from tapetrain.errors import ConfigError

    cfg = write_config(tmp_path / "c.yaml", shard_dir, tmp_path / "run", model={"compile": True},
                       deepspeed={"zero_stage": 3})  # fmt: skip
    with pytest.raises(ConfigError, match="model.compile.*zero_stage=3|zero_stage=3.*model.compile"):
        load_run_config(str(cfg))

"""The whole road for every supported family (tests/tiny_families.py: Llama-3.x with llama3 RoPE and tied
embeddings, Qwen2.5 with q/k/v biases and YaRN, Qwen3 with q/k RMSNorm, its own head_dim and dynamic NTK, Mistral
with an unused sliding window; all GQA, random, built from config):

    import -> TAPE retrofit equals transformers at step 0 -> 3 DeepSpeed steps on 2 ranks (ZeRO-3, ZeRO-2 for the
    tied model) for the RoPE twin and the TAPE retrofit, the RoPE settings taken from the checkpoint -> export ->
    the twin reloads as its own transformers class with its rope_parameters, TAPE through the remote code ->
    logits equal tapetrain's (fp32, <= 1e-5) -> cached generation equals uncached, in transformers and tapetrain.

All eight runs train in one launch (families_worker.py), one after another in the same two processes.
"""

import os
import subprocess
from pathlib import Path

import pytest
import torch
from harness import REPO, env, losses, script_launcher_cmd, write_config
from tiny_families import FAMILIES, FAMILY_OF, tiny_hf_model

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("families_worker.py")
VOCAB = 512  # the shard_dir tokenizer's
STAGE = {"llama3": 2, "qwen2": 3, "qwen3": 3, "mistral": 3}  # ZeRO-3 builds tied models like ZeRO-2 (model_init)
TOL = 1e-5


@pytest.fixture(scope="module")
def families(tmp_path_factory, shard_dir):
    """{family: (transformers model, its directory, {pe: run directory})}, all runs trained by one launch."""
    root = tmp_path_factory.mktemp("families")
    found, configs = {}, []
    for name in FAMILIES:
        hf = tiny_hf_model(name, vocab_size=VOCAB)
        hf.save_pretrained(root / name / "hf")
        runs = {}
        for pe in ("rope", "tape"):
            runs[pe] = root / name / pe
            configs.append(str(write_config(
                root / f"{name}-{pe}.yaml", shard_dir, runs[pe],
                model={"init_from": str(root / name / "hf"), "pe": pe},  # RoPE settings: the checkpoint's
                train={"steps": 3, "save_interval": 3, "micro_batch_size": 2, "global_batch_size": 4},
                deepspeed={"zero_stage": STAGE[name], "precision": "fp32"},
                optim={"lr": 1e-3, "warmup_steps": 1, "weight_decay": 0.0},
            )))
        found[name] = (hf, root / name / "hf", runs)
    run_env = {**env(), "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = script_launcher_cmd(WORKER, 2, *configs)
    proc = subprocess.run(cmd, cwd=REPO, env=run_env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    return found


def test_retrofit_at_step_0_is_the_checkpoint(families, tmp_path, shard_dir):
    """TAPE built as training builds it (the run config names no RoPE: the checkpoint's theta and scaling are
    used) computes exactly what the transformers model computes, past the RoPE scalings' L₀ = 32."""
    from tapetrain.config import load_run_config
    from tapetrain.distributed import DistEnv
    from tapetrain.train.model_init import build_model, resolve_model_config

    env_one = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(5))
    for name, (hf, hf_dir, _) in families.items():
        path = write_config(tmp_path / f"{name}.yaml", shard_dir, tmp_path / name, model={"init_from": str(hf_dir)})
        cfg = load_run_config(str(path))
        model_config = resolve_model_config(cfg)
        assert model_config.family == FAMILY_OF[name] and model_config.pe == "tape"
        model = build_model(cfg, model_config, env_one, {}).eval()
        with torch.no_grad():
            diff = (model(tokens).logits - hf(tokens).logits).abs().max().item()
        assert diff <= TOL, (name, diff)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_trained_export_reloads_equal_and_generates_with_the_cache(families, name, tmp_path):
    from transformers import AutoModelForCausalLM

    from tapetrain.checkpoint.hf_export import export_hf
    from tapetrain.checkpoint.hf_keys import from_hf_key
    from tapetrain.checkpoint.run_loader import load_run_model

    hf, _, runs = families[name]
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(6))
    prompt = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(7))
    original = {from_hf_key(k): v for k, v in hf.state_dict().items() if from_hf_key(k)}
    for pe, run in runs.items():
        assert sorted(losses(run)) == [1, 2, 3], (name, pe)
        model, info = load_run_model(str(run))
        assert info["trainer_state"]["world_size"] == 2 and model.cfg.family == FAMILY_OF[name]
        assert model.cfg.rope_parameters["rope_theta"] == hf.config.rope_parameters["rope_theta"]
        trained = model.state_dict()
        assert any(not torch.equal(trained[k], v) for k, v in original.items()), (name, pe)  # it trained
        if pe == "tape":
            assert any("tape_mlp.down_proj" in k and t.abs().sum() > 0 for k, t in trained.items())
        out = tmp_path / f"{name}-{pe}"
        result = export_hf(str(run), str(out))
        assert result["verification"]["passed"]
        reloaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=pe != "rope", dtype=torch.float32)
        reloaded.eval()
        if pe == "rope":  # the family's own class, with the checkpoint's RoPE scaling
            assert type(reloaded) is type(hf) and reloaded.config.rope_parameters == hf.config.rope_parameters
        else:
            assert type(reloaded).__name__ == "TapetrainForCausalLM" and reloaded.config.pe == "tape"
        with torch.no_grad():
            diff = (model(tokens).logits - reloaded(input_ids=tokens, use_cache=False).logits).abs().max().item()
        assert diff <= TOL, (name, pe, diff)
        # 10 + 12 tokens stay within every L₀ here (32), where cached decoding equals a full forward
        cached = reloaded.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True)
        assert torch.equal(cached, reloaded.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False))
        assert torch.equal(cached, model.generate(prompt, 12)) and torch.equal(cached, model.generate(
            prompt, 12, use_cache=False))

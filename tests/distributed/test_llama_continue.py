"""Continuing a (tiny, random) Hugging Face Llama with TAPE retrofitted or LoRA: real launcher runs, ZeRO-3."""

import json
import sys

import pytest
import torch
from harness import launcher_cmd, losses, run, write_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    out = tmp_path_factory.mktemp("llama") / "tiny-llama"
    model.save_pretrained(out, max_shard_size="100KB")  # sharded safetensors with an index
    assert (out / "model.safetensors.index.json").exists()
    return out, model


def test_retrofit_identity_through_the_training_builder(tiny_llama, tmp_path, shard_dir):
    """Step 0 of a TAPE retrofit (built as training builds it, ZeRO-2 path) reproduces Llama's logits."""
    from tapetrain.config import load_run_config
    from tapetrain.distributed import DistEnv
    from tapetrain.train.model_init import build_model, resolve_model_config

    hf_dir, hf_model = tiny_llama
    cfg_path = write_config(tmp_path / "c.yaml", shard_dir, tmp_path / "run", model={"init_from": str(hf_dir)})
    cfg = load_run_config(str(cfg_path))
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    model = build_model(cfg, resolve_model_config(cfg), env, {}).eval()
    assert model.cfg.pe == "tape" and model.cfg.n_kv_heads == 2
    tokens = torch.randint(0, 512, (2, 40))
    with torch.no_grad():
        diff = (model(tokens).logits - hf_model(tokens).logits).abs().max().item()
    assert diff < 1e-4, diff


def test_zero3_tape_peft_changes_only_selected_parameters(tiny_llama, tmp_path, shard_dir):
    from tapetrain.checkpoint.run_loader import load_run_model

    hf_dir, hf_model = tiny_llama
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "z3.yaml", shard_dir, out, model={"init_from": str(hf_dir)},
                       deepspeed={"zero_stage": 3}, train={"steps": 3, "save_interval": 3,
                                                           "trainable": "tape+embed+norm"})
    proc = run(launcher_cmd(cfg, 2))
    assert "taking" not in proc.stderr or "config.json" in proc.stderr
    assert sorted(losses(out)) == [1, 2, 3]
    model, info = load_run_model(str(out))
    assert info["trainer_state"]["world_size"] == 2
    trained = model.state_dict()
    from tapetrain.checkpoint.hf_keys import from_hf_key

    original = {from_hf_key(k): v for k, v in hf_model.state_dict().items() if from_hf_key(k)}
    changed = {name for name, value in original.items() if not torch.equal(trained[name], value)}
    frozen = {n for n in original if "embed" not in n and "norm" not in n}
    assert not (changed & frozen), f"frozen parameters changed: {sorted(changed & frozen)}"
    assert "embed.weight" in changed
    assert any("tape_mlp.down_proj" in n and t.abs().sum() > 0 for n, t in trained.items())  # TAPE trained


def test_lora_run_from_llama_merges_on_export(tiny_llama, tmp_path, shard_dir):
    from transformers import LlamaForCausalLM

    from tapetrain.checkpoint.run_loader import load_run_model

    hf_dir, hf_model = tiny_llama
    out = tmp_path / "run"
    cfg = write_config(
        tmp_path / "lora.yaml", shard_dir, out, model={"init_from": str(hf_dir), "pe": "rope"},
        train={"steps": 3, "save_interval": 3, "trainable": "lora",
               "lora": {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}},
        optim={"lr": 3e-2},
    )
    run(launcher_cmd(cfg, 2))
    export = tmp_path / "hf"
    run([sys.executable, "-m", "tapetrain.cli", "export", "hf", str(out), "--out", str(export)])
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "llama" and "auto_map" not in config  # plain Llama, LoRA merged
    exported = LlamaForCausalLM.from_pretrained(export).eval()
    names = dict(exported.named_parameters())
    q = "model.layers.0.self_attn.q_proj.weight"
    k = "model.layers.0.self_attn.k_proj.weight"
    original = dict(hf_model.named_parameters())
    assert not torch.equal(names[q], original[q])  # the merged adapter moved q_proj
    assert torch.equal(names[k], original[k])  # k_proj had no adapter and was frozen
    model, _ = load_run_model(str(out))
    tokens = torch.randint(0, 512, (1, 32))
    with torch.no_grad():
        assert (model(tokens).logits - exported(tokens).logits).abs().max() < 1e-4

"""Hugging Face Llama -> tapetrain import: logit parity (MHA/GQA, single/sharded), TAPE retrofit identity, errors,
and the key table in both directions."""

import json

import pytest
import torch
from model_helpers import build

from tapetrain.checkpoint.hf_import import load_hf_llama
from tapetrain.checkpoint.hf_keys import from_hf_key, from_hf_state_dict, to_hf_key, to_hf_state_dict

VOCAB = 101


def tiny_llama(kv_heads: int, **config):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.15,
        **config,
    )
    return LlamaForCausalLM(cfg).eval()


def max_diff(tapetrain_model, hf_model, ids) -> float:
    with torch.no_grad():
        return float((tapetrain_model(ids).logits - hf_model(ids).logits).abs().max())


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_import_matches_llama_and_tape_retrofit(tmp_path, kv_heads):
    hf = tiny_llama(kv_heads)
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    hf.save_pretrained(single, safe_serialization=True)
    hf.save_pretrained(sharded, safe_serialization=True, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, VOCAB, (2, 48))
    for directory in (single, sharded):
        rope = load_hf_llama(str(directory), pe="rope")
        assert rope.cfg.kv_heads == kv_heads
        assert max_diff(rope, hf, ids) <= 1e-4
        # TAPE retrofit: W_A = W_down = 0 at import, so TAPE computes exactly the Llama model.
        tape = load_hf_llama(str(directory), pe="tape")
        assert tape.tape_params() > 0
        assert max_diff(tape, hf, ids) <= 1e-4


def test_import_linear_rope_scaling_tied_bin_and_overrides(tmp_path):
    hf = tiny_llama(2, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
                    tie_word_embeddings=True)
    hf.save_pretrained(tmp_path, safe_serialization=False)  # pytorch_model.bin
    model = load_hf_llama(str(tmp_path), pe="tape", max_seq_len=128, tape_head_mix="gain")
    assert model.cfg.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}  # = pi_factor 2
    assert model.cfg.max_seq_len == 128
    assert model.cfg.tie_embeddings and model.lm_head.weight is model.embed.weight
    assert max_diff(model, hf, torch.randint(0, VOCAB, (1, 40))) <= 1e-4


def test_import_errors_list_keys(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = tiny_llama(4)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    weights = load_file(tmp_path / "model.safetensors")
    weights.pop("model.layers.1.mlp.up_proj.weight")
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing .*layers\.1\.mlp\.up_proj\.weight.*unexpected .*q_norm"):
        load_hf_llama(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_llama(str(tmp_path / "nowhere"))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_parameters": {"rope_type": "llama3"}}))
    with pytest.raises(ValueError, match="Llama config.json: rope_parameters: rope_type llama3 needs factor"):
        load_hf_llama(str(tmp_path))


@pytest.mark.parametrize("pe", ["tape", "fire", "rope"])
def test_key_table_round_trip(pe):
    state = build(pe).state_dict()
    hf_state = to_hf_state_dict(state)
    assert from_hf_state_dict(hf_state).keys() == state.keys()
    if pe == "rope":
        from transformers import LlamaConfig, LlamaForCausalLM

        llama = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        assert set(hf_state) == set(llama.state_dict())
    assert to_hf_key("layers.3.attn.tape_mix.weight") == "model.layers.3.self_attn.tape_mix.weight"
    assert from_hf_key("model.layers.11.mlp.gate_proj.weight") == "layers.11.mlp.gate_proj.weight"
    with pytest.raises(ValueError, match="layers.0.attn.rotary.bogus"):
        to_hf_state_dict({"layers.0.attn.rotary.bogus": 0})

"""Import and export of every supported transformers family and RoPE scaling, against transformers itself (fp32).

Each family (tests/tiny_families.py: Llama-3.x, Qwen2.5, Qwen3, Mistral, all with GQA) imports with logits equal to
transformers' (RoPE twin and TAPE retrofit); every RoPE scaling type imports and exports through LlamaForCausalLM,
the RoPE twin reloading as that class with its rope_parameters and TAPE through the remote code; cached decoding
with the length-dependent types behaves as transformers'; configs tapetrain cannot compute are refused by name.
The full import -> retrofit -> DeepSpeed training -> export round trip per family is
tests/distributed/test_model_families.py.
"""

import json

import pytest
import torch
from model_helpers import SCALING_THETA, SCALINGS, build, randomize_tape
from tiny_families import FAMILIES, FAMILY_OF, VOCAB, tiny_hf_model

from tapetrain.checkpoint.hf_export import export_model
from tapetrain.checkpoint.hf_import import config_from_hf, load_hf_llama

TOL = 1e-5  # fp32 logits of size ~1-5
LONG = 48  # tokens: past every L₀ used here (16, 32)


def logits_diff(ours, theirs, ids) -> float:
    with torch.no_grad():
        return float((ours(ids).logits - theirs(input_ids=ids, use_cache=False).logits).abs().max())


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory):
    hf = tiny_hf_model(request.param)
    out = tmp_path_factory.mktemp(request.param) / "hf"
    hf.save_pretrained(out)
    return request.param, out, hf


def test_family_imports_as_transformers_computes_it(family_dir):
    name, path, hf = family_dir
    ids = torch.randint(0, VOCAB, (2, LONG), generator=torch.Generator().manual_seed(1))
    rope = load_hf_llama(str(path), pe="rope")
    assert rope.cfg.family == FAMILY_OF[name] and rope.cfg.kv_heads == 2
    assert rope.cfg.head_dim == getattr(hf.config, "head_dim", 16)  # Qwen2Config has none: hidden / heads
    expected = hf.config.rope_parameters
    assert {k: v for k, v in rope.cfg.rope_parameters.items() if k != "original_max_position_embeddings"} == {
        k: v for k, v in expected.items() if k not in ("original_max_position_embeddings", "partial_rotary_factor")}
    assert logits_diff(rope, hf, ids) <= TOL
    tape = load_hf_llama(str(path), pe="tape")  # retrofit: W_A = W_down = 0
    assert tape.tape_params() > 0 and logits_diff(tape, hf, ids) <= TOL
    if name == "qwen2":
        assert rope.layers[0].attn.k_proj.bias is not None and rope.layers[0].attn.o_proj.bias is None
    if name == "qwen3":
        assert rope.cfg.head_size == 32 and rope.layers[1].attn.q_norm is not None


def test_family_exports_rope_twin_as_its_class_and_tape_with_remote_code(family_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    name, path, hf = family_dir
    ids = torch.randint(0, VOCAB, (2, LONG), generator=torch.Generator().manual_seed(2))
    rope = load_hf_llama(str(path), pe="rope")
    result = export_model(rope, str(tmp_path / "rope"))
    config = json.loads((tmp_path / "rope" / "config.json").read_text())
    assert result["architecture"] == type(hf).__name__ and "auto_map" not in config
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "rope", dtype=torch.float32).eval()
    assert type(reloaded) is type(hf)
    assert reloaded.config.rope_parameters == hf.config.rope_parameters
    assert logits_diff(rope, reloaded, ids) <= TOL
    tape = load_hf_llama(str(path), pe="tape")
    randomize_tape(tape)  # trained-like TAPE weights: the remote code must compute them too
    export_model(tape, str(tmp_path / "tape"))
    remote = AutoModelForCausalLM.from_pretrained(tmp_path / "tape", trust_remote_code=True).eval()
    assert remote.config.family == FAMILY_OF[name] and logits_diff(tape, remote, ids) <= TOL


def scaled_llama(kind: str):
    params = dict(SCALINGS[kind] or {"rope_type": "default"})
    max_positions = params.pop("original_max_position_embeddings") if kind == "dynamic" else 128
    return tiny_hf_model("llama3", max_position_embeddings=max_positions,
                         rope_parameters={**params, "rope_theta": SCALING_THETA}, tie_word_embeddings=False)


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_every_scaling_round_trips_through_llama(kind, tmp_path):
    """Import (RoPE and TAPE) -> logits equal past L₀ -> export: the twin reloads as LlamaForCausalLM with the same
    rope_parameters, TAPE through the remote code; both equal tapetrain past L₀."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    hf = scaled_llama(kind)
    hf.save_pretrained(tmp_path / "src")
    ids = torch.randint(0, VOCAB, (2, LONG), generator=torch.Generator().manual_seed(3))
    rope = load_hf_llama(str(tmp_path / "src"), pe="rope")
    assert logits_diff(rope, hf, ids) <= TOL
    export_model(rope, str(tmp_path / "rope"))
    twin = LlamaForCausalLM.from_pretrained(tmp_path / "rope").eval()
    assert twin.config.rope_parameters == hf.config.rope_parameters
    assert twin.config.max_position_embeddings == hf.config.max_position_embeddings or kind != "dynamic"
    assert logits_diff(rope, twin, ids) <= TOL
    tape = load_hf_llama(str(tmp_path / "src"), pe="tape")
    assert logits_diff(tape, hf, ids) <= TOL
    randomize_tape(tape)
    export_model(tape, str(tmp_path / "tape"))
    remote = AutoModelForCausalLM.from_pretrained(tmp_path / "tape", trust_remote_code=True).eval()
    assert logits_diff(tape, remote, ids) <= TOL


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_cached_decoding_past_the_original_length_is_transformers(kind, tmp_path):
    """Length-dependent scalings: each cached step uses the frequencies of the length so far, cached keys keep
    theirs. tapetrain (RoPE, and TAPE's remote code) steps exactly as transformers does; past L₀ that differs
    from a full forward over the same tokens (whose frequencies are those of its whole length), in transformers as
    here; up to L₀ tokens the frequencies are fixed and the two agree."""
    from transformers import AutoModelForCausalLM

    hf = scaled_llama(kind)
    hf.save_pretrained(tmp_path / "src")
    rope = load_hf_llama(str(tmp_path / "src"), pe="rope")
    tape = load_hf_llama(str(tmp_path / "src"), pe="tape")
    randomize_tape(tape)
    export_model(tape, str(tmp_path / "tape"))
    remote = AutoModelForCausalLM.from_pretrained(tmp_path / "tape", trust_remote_code=True).eval()
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(4))
    prompt = 8

    def stepwise(model, hf_style: bool) -> torch.Tensor:
        """Logits of tokens prompt..39, computed one cached step at a time after a prompt forward."""
        from tapetrain.model import KVCache

        cache = None if hf_style else KVCache(model.cfg.n_layers)
        steps = []
        with torch.no_grad():
            for end in range(prompt, ids.shape[1] + 1):
                chunk = ids[:, :end] if end == prompt else ids[:, end - 1:end]
                if hf_style:
                    out = model(input_ids=chunk, past_key_values=cache, use_cache=True)
                    cache = out.past_key_values
                else:
                    out = model(chunk, cache=cache)
                steps.append(out.logits[:, -1])
        return torch.stack(steps, dim=1)

    original = SCALINGS[kind]["original_max_position_embeddings"]
    with torch.no_grad():
        full = rope(ids).logits[:, prompt - 1:]
        within = rope(ids[:, :original]).logits[:, prompt - 1:]  # a forward of L₀ tokens: unscaled frequencies
    cached = stepwise(rope, hf_style=False)
    torch.testing.assert_close(cached, stepwise(hf, hf_style=True), rtol=0, atol=TOL)
    torch.testing.assert_close(stepwise(tape, hf_style=False), stepwise(remote, hf_style=True), rtol=0, atol=TOL)
    torch.testing.assert_close(cached[:, : original - prompt + 1], within, rtol=0, atol=TOL)
    assert (cached[:, -1] - full[:, -1]).abs().max() > 1e-3


@pytest.mark.parametrize("pe, kind", [("randpe", "yarn"), ("xpos", "yarn"), ("randpe", "dynamic"),
                                      ("xpos", "dynamic")])
def test_randpe_and_xpos_rotate_by_the_scaling_here_and_in_the_export(pe, kind, tmp_path):
    """The other rotary encodings take the same frequencies and temperature, in tapetrain and in the remote code."""
    from transformers import AutoModelForCausalLM

    model = build(pe, n_kv_heads=2, rope_theta=SCALING_THETA, rope_scaling=SCALINGS[kind])
    export_model(model, str(tmp_path / pe))
    remote = AutoModelForCausalLM.from_pretrained(tmp_path / pe, trust_remote_code=True).eval()
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(5))

    def seeded(fn):  # randpe draws its positions at evaluation: the same seed, the same draw
        torch.manual_seed(0)
        with torch.no_grad():
            return fn()

    ours = seeded(lambda: model(ids).logits)
    torch.testing.assert_close(seeded(lambda: remote(input_ids=ids, use_cache=False).logits), ours, rtol=0, atol=TOL)
    plain = build(pe, n_kv_heads=2, rope_theta=SCALING_THETA)  # the same weights, no scaling
    assert (seeded(lambda: plain(ids).logits) - ours).abs().max() > 1e-3


def test_transformers_4_spelling_is_read_as_transformers_5_reads_it(tmp_path):
    """config.json as 4.x wrote it: rope_scaling with 'type', rope_theta beside it (Qwen2.5's YaRN recipe)."""
    from transformers import AutoModelForCausalLM

    hf = tiny_hf_model("qwen2")
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters")
    config.update(rope_theta=1e6, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    (tmp_path / "config.json").write_text(json.dumps(config))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ours = load_hf_llama(str(tmp_path), pe="tape")
    assert ours.cfg.rope_parameters == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                        "rope_theta": 1e6}
    ids = torch.randint(0, VOCAB, (2, LONG))
    assert logits_diff(ours, theirs, ids) <= TOL


def base_config(name: str = "llama3", **changes) -> dict:
    config = tiny_hf_model(name).config.to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("config, message", [
    (base_config("qwen2", model_type="qwen2_moe", num_experts=8), "mixture-of-experts layers (num_experts=8)"),
    (base_config("mistral", model_type="mixtral", num_local_experts=8), "mixture-of-experts layers (num_local"),
    (base_config(model_type="deepseek_v3", kv_lora_rank=512), "multi-head latent attention (kv_lora_rank=512)"),
    (base_config(model_type="gemma2"), "model_type 'gemma2' config.json: this model family is not supported"),
    (base_config("mistral", sliding_window=64), "Mistral config.json: sliding_window=64 is shorter than the length"),
    (base_config("qwen2", use_sliding_window=True, sliding_window=64, layer_types=None, max_window_layers=1),
     "Qwen2 config.json: sliding_window=64"),  # layers from max_window_layers on slide, as transformers decides
    (base_config("qwen3", use_sliding_window=True, sliding_window=64,
                 layer_types=["full_attention", "sliding_attention"]), "Qwen3 config.json: sliding_window=64"),
    (base_config(partial_rotary_factor=0.5), "Llama config.json: partial_rotary_factor=0.5"),
    (base_config(attention_bias=True), "Llama config.json: attention_bias=True is not supported"),
    (base_config("qwen3", attention_bias=True), "Qwen3 config.json: attention_bias=True"),
    (base_config(hidden_act="gelu"), "hidden_act='gelu'"),
    (base_config("qwen2", intermediate_size=None), "Qwen2 config.json: has no 'intermediate_size'"),
    (base_config(rope_parameters={"full_attention": {"rope_type": "default"}, "sliding_attention": {}}),
     "gives each layer type its own RoPE"),
    (base_config(rope_parameters={"rope_type": "proportional", "rope_theta": 1e4}), "rope_type 'proportional'"),
    (base_config(rope_parameters=None, rope_scaling={"type": "llama3", "factor": 8.0}, max_position_embeddings=64),
     "Llama config.json: rope_scaling: rope_type llama3 needs low_freq_factor, high_freq_factor"),
])
def test_unsupported_configs_are_refused_by_family_and_field(config, message):
    with pytest.raises(ValueError) as err:
        config_from_hf(config, pe="tape", **({"max_seq_len": 128} if "sliding" in message else {}))
    assert not isinstance(err.value, KeyError)
    assert message in str(err.value), str(err.value)


def test_sliding_window_at_least_the_length_is_accepted():
    config = base_config("mistral", sliding_window=64, max_position_embeddings=4096)
    assert config_from_hf(config).max_seq_len == 64  # the default length stays inside the window
    assert config_from_hf(config, max_seq_len=48).max_seq_len == 48
    qwen = base_config("qwen2", use_sliding_window=False, sliding_window=16)  # Qwen2.5 ships it switched off
    assert config_from_hf(qwen).max_seq_len == 128
    listed = base_config("qwen2", use_sliding_window=True, sliding_window=16, layer_types=["full_attention"] * 2)
    assert config_from_hf(listed).max_seq_len == 128  # no layer slides (transformers reads layer_types alike)


def test_run_takes_the_checkpoints_rope_unless_it_sets_its_own(tmp_path, caplog):
    """model.init_from with a Llama-3 checkpoint: a run config silent on RoPE continues with the checkpoint's theta
    and llama3 scaling; one that sets rope_scaling replaces it (logged); {rope_type: default} drops it."""
    from tapetrain.config import load_run_config
    from tapetrain.train.model_init import resolve_model_config

    tiny_hf_model("llama3").save_pretrained(tmp_path / "llama3")

    def resolved(model: str):
        path = tmp_path / "run.yaml"
        path.write_text(f"model: {{init_from: {tmp_path / 'llama3'}, pe: tape, max_seq_len: 64, {model}}}\n"
                        "data: {train: shards}\ndeepspeed: {precision: fp32}\n")
        return resolve_model_config(load_run_config(str(path)))

    inherited = resolved("n_layers: 2")
    assert inherited.rope_parameters == {**FAMILIES["llama3"][2]["rope_parameters"]}
    assert inherited.tie_embeddings and inherited.n_kv_heads == 2
    yarn = resolved("rope_scaling: {rope_type: yarn, factor: 2, original_max_position_embeddings: 32}")
    assert yarn.rope_parameters == {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32,
                                    "rope_theta": 500000.0}
    assert "replaces the checkpoint's" in caplog.text
    assert resolved("rope_scaling: {rope_type: default}").rope_parameters == {"rope_type": "default",
                                                                              "rope_theta": 500000.0}
    assert resolved("pi_factor: 2.0").rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}

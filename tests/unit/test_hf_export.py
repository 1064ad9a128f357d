"""Export to Hugging Face format: real DeepSpeed checkpoint -> `export hf` -> transformers reload.

RoPE must come back as a plain LlamaForCausalLM (no remote code), TAPE and the other PEs through the exported
remote code; logits match tapetrain (fp32, <= 1e-4) and cached generation equals uncached and tapetrain's.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from model_helpers import build, randomize_tape
from test_hf_runs import make_run, train_tiny_tokenizer

from tapetrain.checkpoint import hf_export
from tapetrain.checkpoint.hf_export import export_hf, export_model
from tapetrain.checkpoint.run_loader import load_run_model
from tapetrain.cli import main

ATOL = 1e-4


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tok.model")


@pytest.fixture(scope="module")
def tape_export(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("tape")
    run = make_run(root / "run", "tape", stage=3, tokenizer=tokenizer)
    result = export_hf(str(run), str(root / "hf_tape"))
    return run, root / "hf_tape", result


@pytest.fixture(scope="module")
def rope_export(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("rope")
    run = make_run(root / "run", "rope", stage=2, tokenizer=tokenizer, pi_factor=2.0, tie_embeddings=True)
    result = export_hf(str(run), str(root / "hf_rope"))
    return run, root / "hf_rope", result


def logits_diff(ours, theirs, ids) -> float:
    with torch.no_grad():  # seeded alike: randpe draws its positions at evaluation, in the same order in both
        torch.manual_seed(0)
        mine = ours(ids).logits
        torch.manual_seed(0)
        return float((mine - theirs(input_ids=ids, use_cache=False).logits).abs().max())


def assert_generation_parity(ours, theirs, vocab: int) -> None:
    prompt = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(3))
    cached = theirs.generate(prompt, max_new_tokens=20, do_sample=False, use_cache=True)
    assert torch.equal(cached, ours.generate(prompt, 20))
    torch.manual_seed(0)
    uncached = theirs.generate(prompt, max_new_tokens=20, do_sample=False, use_cache=False)
    torch.manual_seed(0)
    assert torch.equal(uncached, ours.generate(prompt, 20, use_cache=False))
    if not (ours.cfg.pe == "randpe" and ours.cfg.randpe_sample_at_eval):  # randpe samples without a cache only
        assert torch.equal(cached, uncached)


def test_tape_export_loads_with_remote_code(tape_export):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, out, result = tape_export
    assert result["verification"]["passed"] and result["verification"]["max_abs_diff"] <= ATOL
    assert result["remote_code"] and result["step"] == 1
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "tapetrain" and config["pe"] == "tape"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_tapetrain.TapetrainForCausalLM"
    for name in ("modeling_tapetrain.py", "configuration_tapetrain.py", "model.safetensors", "generation_config.json",
                 "tokenizer.model", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert not (out.parent / "hf_tape.tmp").exists()
    ours, _ = load_run_model(str(run))
    theirs = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(theirs).__name__ == "TapetrainForCausalLM"
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 100))
    diff = logits_diff(ours, theirs, ids)
    print(f"tape export: max |Δlogits| = {diff:.3g}")
    assert diff <= ATOL
    assert_generation_parity(ours, theirs, ours.cfg.vocab_size)
    # The tokenizer loads in transformers and encodes like sentencepiece.
    import sentencepiece as spm

    assert result["tokenizer"]["status"] == "loadable"
    hf_tok = AutoTokenizer.from_pretrained(out)
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    text = "The pass key is 40213. Remember it. What is the pass key?"
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == sp.encode(text)


def test_export_needs_no_document_mask(tape_export):
    """A model trained with data.document_mask sees one document per sequence after export: the export's logits on
    a single document equal the training model's forward with that document's ids (no masking in the export)."""
    from transformers import AutoModelForCausalLM

    run, out, _ = tape_export
    ours, _ = load_run_model(str(run))
    theirs = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        masked = ours(ids, doc_ids=torch.zeros(2, 40, dtype=torch.int32)).logits
        exported = theirs(input_ids=ids, use_cache=False).logits
    assert float((masked - exported).abs().max()) <= ATOL


def test_rope_export_is_plain_llama(rope_export):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    run, out, result = rope_export
    assert not result["remote_code"] and result["verification"]["max_abs_diff"] <= ATOL
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and "auto_map" not in config
    assert config["rope_parameters"]["rope_type"] == "linear" and config["rope_parameters"]["factor"] == 2.0
    assert config["tie_word_embeddings"] is True
    assert not any(name.endswith(".py") for name in os.listdir(out))
    ours, _ = load_run_model(str(run))
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()  # no trust_remote_code
    assert isinstance(theirs, LlamaForCausalLM)
    diff = logits_diff(ours, theirs, torch.randint(0, ours.cfg.vocab_size, (2, 100)))
    print(f"rope export: max |Δlogits| = {diff:.3g}")
    assert diff <= ATOL
    assert_generation_parity(ours, theirs, ours.cfg.vocab_size)


def test_export_loads_where_tapetrain_is_absent(tape_export, tmp_path):
    run, out, _ = tape_export
    prompt = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(5))
    torch.save(prompt, tmp_path / "prompt.pt")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["tapetrain"] = None  # any import of tapetrain now fails
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)
        prompt = torch.load({str(tmp_path / "prompt.pt")!r})
        torch.save(model.generate(prompt, max_new_tokens=8, do_sample=False), {str(tmp_path / "gen.pt")!r})
    """)
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}  # a fresh copy of the remote code
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=tmp_path, timeout=300)
    ours, _ = load_run_model(str(run))
    assert torch.equal(torch.load(tmp_path / "gen.pt"), ours.generate(prompt, 8))


@pytest.mark.parametrize("pe", ["nope", "alibi", "randpe", "xpos", "fire"])
def test_baseline_pe_exports(tmp_path, pe):
    from transformers import AutoModelForCausalLM

    model = build(pe, n_kv_heads=2)
    with torch.no_grad():  # move FIRE's learned scalars off their init so the test sees them
        for name, param in model.named_parameters():
            if name.startswith("pe."):
                param.add_(torch.randn_like(param) * 0.3)
    result = export_model(model, str(tmp_path / pe))
    assert result["verification"]["max_abs_diff"] <= ATOL
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / pe, trust_remote_code=True).eval()
    assert logits_diff(model, theirs, torch.randint(0, 512, (2, 150))) <= ATOL  # beyond max_seq_len too
    assert_generation_parity(model, theirs, 512)


def test_bf16_sharded_export(tmp_path):
    from safetensors import safe_open

    model = build("tape")
    randomize_tape(model)
    result = export_model(model, str(tmp_path / "hf"), dtype="bf16", max_shard_size="30KB")
    files = result["weight_files"]
    assert len(files) > 2 and files[-1] == "model.safetensors.index.json"
    index = json.loads((tmp_path / "hf" / files[-1]).read_text())
    assert set(index["weight_map"].values()) == set(files[:-1])
    with safe_open(str(tmp_path / "hf" / files[0]), framework="pt") as f:
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())
    check = result["verification"]
    print(f"bf16 export: max |Δlogits| = {check['max_abs_diff']:.3g} vs {check['reference']}")
    assert check["passed"] and check["max_abs_diff"] <= ATOL


def test_failed_verification_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_export, "VERIFY_TOLERANCE", -1.0)  # no export can pass
    out = tmp_path / "hf"
    with pytest.raises(RuntimeError, match="VERIFICATION FAILED"):
        export_model(build("rope"), str(out))
    assert not out.exists() and not (tmp_path / "hf.tmp").exists()


def test_cli_export_and_existing_output(rope_export, tmp_path, capsys):
    run, _, _ = rope_export
    out = tmp_path / "cli"
    argv = ["export", "hf", str(run), "--out", str(out), "--dtype", "fp16", "--step", "1"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    # A short summary (it used to print the whole ~60-line result JSON; that is in tapetrain_export.json)
    assert len(printed.strip().splitlines()) <= 3, printed
    assert f"exported {run} step 1 to {out}" in printed and "verified: max |Δlogits|" in printed
    assert "tapetrain_export.json" in printed
    assert json.loads((out / "tapetrain_export.json").read_text())["verification"]["passed"]
    assert main(argv) == 1 and "--overwrite" in capsys.readouterr().err
    assert main(["export", "hf", str(run), "--out", str(out), "--overwrite", "--no-verify"]) == 0
    assert json.loads((out / "tapetrain_export.json").read_text())["dtype"] == "fp32"
    assert main(["export", "hf", str(run), "--out", str(out), "--step", "7"]) == 1
    assert "available steps: 1" in capsys.readouterr().err


def test_overwrite_refuses_a_directory_that_is_not_an_export(tmp_path):
    """--overwrite used to delete whatever OUT was; now only an earlier export (or an empty directory)."""
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("not an export")
    with pytest.raises(ValueError, match="not a tapetrain export"):
        export_model(build("rope"), str(out), overwrite=True, verify=False)
    assert (out / "notes.txt").read_text() == "not an export" and not (tmp_path / "precious.tmp").exists()
    (out / "notes.txt").unlink()
    export_model(build("rope"), str(out), overwrite=True, verify=False)  # empty: fine
    export_model(build("rope"), str(out), overwrite=True, verify=False)  # an earlier export: replaced
    assert (out / "tapetrain_export.json").is_file()


def test_left_padded_batch_generation(tape_export):
    """attention_mask padding: a left-padded row generates what it generates alone (TAPE is shift-invariant)."""
    from transformers import AutoModelForCausalLM

    _, out, _ = tape_export
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ids = torch.randint(3, 512, (2, 10), generator=torch.Generator().manual_seed(4))
    batch = ids.clone()
    batch[1, :4] = 0
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    both = model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    alone = [model.generate(ids[:1], max_new_tokens=8, do_sample=False),
             model.generate(ids[1:, 4:], max_new_tokens=8, do_sample=False)]
    assert torch.equal(both[0, 10:], alone[0][0, 10:]) and torch.equal(both[1, 10:], alone[1][0, 6:])


def test_lora_run_exports_merged(tmp_path):
    from safetensors import safe_open

    run = make_run(tmp_path / "run", "tape", lora={"r": 2, "alpha": 4, "targets": ["q_proj", "o_proj"]})
    result = export_hf(str(run), str(tmp_path / "hf"))
    assert result["lora_merged"] == 4 and result["verification"]["passed"]
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert not [k for k in f.keys() if "lora" in k or "base_layer" in k]


@pytest.mark.parametrize("kind", ["tape", "rope"])
def test_the_closing_hint_loads_model_and_tokenizer_without_a_prompt(tape_export, rope_export, kind, monkeypatch):
    """`export hf` ends with how to load the export: every call it shows runs as written, and none stops at
    transformers' "Do you wish to run the custom code? [y/N]" (a remote-code export's AutoTokenizer reads
    config.json's auto_map too, so it needs trust_remote_code=True as well: in a fresh process
    `AutoTokenizer.from_pretrained(OUT)` of a TAPE export asks)."""
    import builtins
    import re

    import transformers

    from tapetrain.checkpoint.commands import export_summary

    run, out, result = tape_export if kind == "tape" else rope_export
    calls = re.findall(r"Auto\w+\.from_pretrained\(OUT[^)]*\)", export_summary(str(run), result))
    assert [c.split(".")[0] for c in calls] == ["AutoModelForCausalLM", "AutoTokenizer"], calls

    def prompted(*_):
        raise AssertionError("transformers asked whether to run the custom code")

    monkeypatch.setattr(builtins, "input", prompted)
    for call in calls:
        names = {"OUT": str(out), "AutoModelForCausalLM": transformers.AutoModelForCausalLM,
                 "AutoTokenizer": transformers.AutoTokenizer}
        loaded = eval(call, names)  # noqa: S307 - the hint, run as a user would
        assert loaded is not None
    # transformers remembers remote code it was once allowed to run, so in this process (other tests load the
    # export) the calls above may not ask either way: the flag must be on every call of a remote-code export.
    assert all(("trust_remote_code=True" in call) == result["remote_code"] for call in calls), calls

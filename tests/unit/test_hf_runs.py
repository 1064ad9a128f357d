"""Reading trained runs: real DeepSpeed checkpoints (ZeRO 0/2/3) -> run_loader, step selection, LoRA merge.

Also the helpers the other test_hf_* / test_eval_* modules use to make run directories.
"""

import json
from pathlib import Path

import pytest
import torch
import yaml
from model_helpers import build, randomize_tape

from tapetrain.checkpoint.run_loader import load_run_model, merge_lora
from tapetrain.distributed import init_distributed
from tapetrain.errors import InputError

DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}}


def init_deepspeed_single_process() -> None:
    """One process as rank 0 of 1 (without it DeepSpeed tries MPI discovery), by the library's own lone-process
    path: it leaves no RANK/WORLD_SIZE/MASTER_PORT in os.environ for later subprocesses to inherit."""
    init_distributed()


def save_step(engine, run_dir: Path, model, step: int, complete: bool = True) -> None:
    """One checkpoint in the trainer's layout: a DeepSpeed tag + model_config.json + trainer_state.json (last)."""
    tag = f"step_{step:08d}"
    engine.save_checkpoint(str(run_dir / "checkpoints"), tag=tag, save_latest=False)
    ckpt = run_dir / "checkpoints" / tag
    (ckpt / "model_config.json").write_text(json.dumps(model.cfg.to_dict()))
    if complete:
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": step, "tokens": 16 * step, "data": {}}))


def make_run(
    run_dir: Path,
    pe: str = "tape",
    stage: int = 0,
    steps: tuple[int, ...] = (1,),
    tokenizer: str | None = None,
    lora: dict | None = None,
    seed: int = 0,
    bf16: bool = False,
    **overrides,
) -> Path:
    """A run directory whose checkpoints are real DeepSpeed saves of a tiny model after one optimizer step each.

    TAPE weights are randomised (non-zero) first so every parity check exercises the position updates.
    `lora` = {r, alpha, targets}: LoRA adapters injected with peft (B randomised), saved unmerged.
    """
    import deepspeed

    init_deepspeed_single_process()
    model = build(pe, seed=seed, **overrides).train()
    if pe == "tape":
        randomize_tape(model, seed=seed + 1)
    if lora:
        from peft import LoraConfig, inject_adapter_in_model

        model = inject_adapter_in_model(
            LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], target_modules=lora["targets"]), model
        )
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.1)
    run_dir.mkdir(parents=True, exist_ok=True)
    config = {"model": model.cfg.to_dict(), "data": {"tokenizer": tokenizer}, "train": {}}
    if lora:
        config["train"]["lora"] = lora
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    params = [p for p in model.parameters() if p.requires_grad]
    ds_config = {**DS_CONFIG, "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-3), config=ds_config)
    gen = torch.Generator().manual_seed(seed)
    for step in steps:
        ids = torch.randint(0, model.cfg.vocab_size, (1, 16), generator=gen)
        engine.backward(engine(ids, labels=ids).loss)
        engine.step()
        save_step(engine, run_dir, model, step)
    engine.destroy()
    return run_dir


def trained_state(run_dir: Path, step: int) -> dict:
    """Reference weights straight from the stage-0 checkpoint file."""
    path = run_dir / "checkpoints" / f"step_{step:08d}" / "mp_rank_00_model_states.pt"
    return torch.load(path, map_location="cpu", weights_only=False)["module"]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_load_run_model_every_zero_stage(tmp_path, stage):
    run = make_run(tmp_path / f"run{stage}", "tape", stage=stage)
    model, info = load_run_model(str(run))
    assert info["step"] == 1 and info["source"] == ("module" if stage == 0 else "zero")
    # Stages 0/2 also store the full fp32 weights in mp_rank_00_model_states.pt; ZeRO-3 only partitions, so its
    # reference is a stage-0 save of the same training.
    if stage in (0, 2):
        reference = trained_state(run, 1)
        for name, tensor in model.state_dict().items():
            assert torch.allclose(tensor, reference[name].float(), atol=1e-6), name
    else:
        # A separate stage-0 training is only equal up to rounding: ZeRO-3 reduces gradients through its own
        # partitioned buffers, and Adam's first step (≈ lr·g/(|g| + eps)) turns a rounding difference in a gradient
        # element near zero into an update difference of a few 1e-6 (seen: 1 element in 11264). Loading is what is
        # under test: every tensor must agree to 1e-5 and all but a handful of elements to 1e-6.
        reference = load_run_model(str(make_run(tmp_path / "ref", "tape", stage=0)))[0].state_dict()
        for name, tensor in model.state_dict().items():
            diff = (tensor - reference[name].float()).abs()
            assert float(diff.max()) < 1e-5 and int((diff > 1e-6).sum()) <= 2, (name, float(diff.max()))
    assert any(float(p.abs().max()) > 0 for n, p in model.named_parameters() if "tape_mix" in n)


def test_bf16_zero_run_loads_fp32_master_weights(tmp_path):
    run = make_run(tmp_path / "run", "rope", stage=2, bf16=True)
    model, info = load_run_model(str(run))
    module = trained_state(run, 1)  # the bf16 copy the engine computed with
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == torch.float32 and module[name].dtype == torch.bfloat16
        assert torch.allclose(tensor, module[name].float(), rtol=1e-2, atol=1e-3)
    weight = model.state_dict()["layers.0.attn.q_proj.weight"]
    assert not torch.equal(weight, weight.bfloat16().float())  # masters carry more than bf16 precision


def test_step_selection_and_errors(tmp_path):
    run = make_run(tmp_path / "run", "rope", steps=(1, 2))
    (run / "checkpoints" / "step_00000003").mkdir()  # an interrupted save: no trainer_state.json
    assert load_run_model(str(run))[1]["step"] == 2  # newest *complete* checkpoint
    assert load_run_model(str(run), step=1)[1]["step"] == 1
    assert load_run_model(str(run / "checkpoints" / "step_00000001"))[1]["step"] == 1
    with pytest.raises(FileNotFoundError, match="available steps: 1, 2"):
        load_run_model(str(run), step=3)
    with pytest.raises(FileNotFoundError, match="incomplete"):
        load_run_model(str(run / "checkpoints" / "step_00000003"))
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_run_model(str(empty))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_run_model(str(tmp_path / "nope"))


def test_merge_lora_hand_made_state_dict():
    gen = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(shape, generator=gen) for shape in ((6, 5), (2, 5), (6, 2)))
    state = {
        "layers.0.attn.q_proj.base_layer.weight": w,
        "layers.0.attn.q_proj.lora_A.default.weight": a,
        "layers.0.attn.q_proj.lora_B.default.weight": b,
        "layers.0.attn.k_proj.weight": w.clone(),
        "layers.0.attn.k_proj.lora_A": a,  # bare-parameter style (no adapter name)
        "layers.0.attn.k_proj.lora_B": b,
        "embed.weight": torch.ones(3, 5),
    }
    merged, count = merge_lora(state, alpha=8, r=2)
    assert count == 2
    assert sorted(merged) == ["embed.weight", "layers.0.attn.k_proj.weight", "layers.0.attn.q_proj.weight"]
    for key in ("layers.0.attn.q_proj.weight", "layers.0.attn.k_proj.weight"):
        assert torch.allclose(merged[key], w + (8 / 2) * b @ a)
    with pytest.raises(ValueError, match="train.lora.alpha"):
        merge_lora(state)
    with pytest.raises(ValueError, match="rank 2"):
        merge_lora(state, alpha=8, r=4)
    assert merge_lora({"embed.weight": w}, alpha=None) == ({"embed.weight": w}, 0)


def test_lora_run_is_merged_on_load(tmp_path):
    lora = {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}
    run = make_run(tmp_path / "lora", "tape", lora=lora)
    model, info = load_run_model(str(run))
    assert info["lora_merged"] == 2 * model.cfg.n_layers
    # Reference: the saved base weights plus the adapters, computed by peft itself.
    from peft import LoraConfig, inject_adapter_in_model

    reference = inject_adapter_in_model(
        LoraConfig(r=4, lora_alpha=8, target_modules=lora["targets"]), build("tape")
    )
    reference.load_state_dict(trained_state(run, 1))
    ids = torch.randint(0, model.cfg.vocab_size, (2, 24))
    with torch.no_grad():
        diff = (model(ids).logits - reference.eval()(ids).logits).abs().max()
    assert diff < 1e-4  # merged (W + sBA)x vs unmerged Wx + sBAx: fp32 rounding only


def train_tiny_tokenizer(path: Path) -> str:
    """A 512-piece sentencepiece BPE model (the tiny models' vocab) trained on the passkey texts and some more."""
    import random

    from tapetrain.data.tokenizer import train_tokenizer
    from tapetrain.eval.passkey import FILLER, QUESTION, TASK, key_line

    rng = random.Random(0)
    lines = [TASK, FILLER, QUESTION] * 50 + [key_line(rng.randint(1, 50000)) for _ in range(200)]
    lines += ["Hello, world!\nNumbers 0123456789 and punctuation: (a) [b] {c}; e.g. 3.14 -- done."] * 20
    corpus = path.with_suffix(".txt")
    corpus.write_text("\n".join(lines))
    return train_tokenizer([str(corpus)], 512, str(path))


def passkey_run_and_export(root: Path) -> tuple[Path, Path, str]:
    """A tiny TAPE run directory on the passkey tokenizer, its Hugging Face export and the tokenizer path."""
    from tapetrain.checkpoint.hf_export import export_hf

    tokenizer = train_tiny_tokenizer(root / "tok.model")
    run = make_run(root / "run", "tape", tokenizer=tokenizer)
    export_hf(str(run), str(root / "hf"))
    return run, root / "hf", tokenizer


def test_a_damaged_checkpoint_is_refused_by_name_before_loading(tmp_path):
    """Export and evaluation read the newest complete checkpoint; they used to trust it without its manifest: a
    flipped byte in the weights was exported silently, a truncated file failed deep inside torch.load."""
    from tapetrain.checkpoint import manifest

    run = make_run(tmp_path / "run", "rope", steps=(1, 2))
    for step in (1, 2):
        ckpt = run / "checkpoints" / f"step_{step:08d}"
        manifest.write_manifest(ckpt, manifest.describe(ckpt, manifest.checkpoint_files(ckpt)))
    weights = run / "checkpoints" / "step_00000002" / "mp_rank_00_model_states.pt"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"step_00000002/mp_rank_00_model_states.pt has xxh3_64 checksum .*--step 1"):
        load_run_model(str(run))
    with pytest.raises(InputError, match="mp_rank_00_model_states.pt has xxh3_64 checksum"):
        load_run_model(str(run / "checkpoints" / "step_00000002"))
    assert load_run_model(str(run), step=1)[1]["step"] == 1  # the intact one still loads
    weights.write_bytes(bytes(data[:100]))
    with pytest.raises(InputError, match="has 100 bytes, the manifest lists"):
        load_run_model(str(run))

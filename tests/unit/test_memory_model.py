"""The memory model's activation term against the bytes autograd really saves (exact, via saved_tensors_hooks)."""

import pytest
import torch

from tapetrain.model import Transformer, preset_config
from tapetrain.train.memory import (
    attention_path,
    estimate_memory,
    exchange_bytes,
    head_saved_bytes,
    layer_activation_bytes,
    loss_bytes,
    measure_layer_saved_bytes,
    measure_saved_activation_bytes,
)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("pe", ["rope", "tape"])
@pytest.mark.parametrize("backend", ["chunked", "plain"])
def test_activation_estimate_within_1_percent_of_measurement(pe, backend):
    """Every layer on the path CPU SDPA takes (attention_path): TAPE's layers that carry E its math path, which
    keeps the softmax weights; layer 0, whose E^(0) needs no gradient, keeps no q, k or E for its rotations. What
    is left is rope's cos and sin, counted once per layer, which the layers share."""
    cfg = preset_config("tiny", pe=pe, n_layers=3, n_kv_heads=4, attn_backend="sdpa", loss_backend=backend)
    model = Transformer(cfg)
    b, s = 2, 96
    measured = measure_saved_activation_bytes(model, torch.randint(0, cfg.vocab_size, (b, s + 1)))
    layers = 0
    for i in range(cfg.n_layers):
        updates = cfg.updates_tape_state(i)
        path = attention_path("sdpa", "cpu", s, carries_e=updates and cfg.tape_attn_update)
        layers += layer_activation_bytes(cfg, b, s, 4, updates, attention=path, first_layer=i == 0)
    estimated = layers + head_saved_bytes(cfg, b, s, 4, fused=backend != "plain")
    assert abs(estimated / measured - 1) < 0.01, (estimated, measured)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiled", [0, 4])
@pytest.mark.parametrize("layer", [0, 1])
def test_triton_layer_saved_bytes_within_4_percent(monkeypatch, layer, tiled, dtype):
    """A TAPE layer through the Triton kernel (without CUDA in Triton's CPU interpreter), GQA (2 kv heads of 4):
    the kernel keeps q̃, k̃, V with its own kv heads, A·V and A·E as two token-major tensors (o_proj and W_A read
    them in place) and its logsumexp, where SDPA keeps [V ‖ E], [A·V ‖ A·E] and o_proj's copy. Layer 1's E needs
    a gradient, so its rotations keep q, k and E too; layer 0's E^(0) does not. bf16: each RMSNorm keeps its input
    upcast to fp32. Exact to the byte today."""
    if DEV.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton itself was imported for it (tests/conftest.py)
    pytest.importorskip("triton")
    cfg = preset_config("tiny", pe="tape", n_layers=3, attn_backend="triton", tiled_mlp=tiled)
    model = Transformer(cfg).to(DEV, dtype)
    b, s = 2, 64
    ids = torch.randint(0, cfg.vocab_size, (b, s), device=DEV)
    measured = measure_layer_saved_bytes(model, ids, layer)
    predicted = layer_activation_bytes(cfg, b, s, dtype.itemsize, cfg.updates_tape_state(layer), tiled_mlp=tiled,
                                       attention="triton", first_layer=layer == 0)  # fmt: skip
    assert abs(predicted / measured - 1) < 0.04, (predicted, measured)


@pytest.mark.parametrize("head_mix", ["full", "gain"])
@pytest.mark.parametrize("tiled", [0, 4])
@pytest.mark.parametrize("layer", [0, 1])
def test_fused_updates_layer_saved_bytes_exact(monkeypatch, layer, tiled, head_mix):
    """model.tape_fused_updates=true (the kernels in Triton's CPU interpreter without CUDA), GQA (2 kv heads of 4),
    attention through the Triton kernel: the rotation keeps k with its 2 heads (eager: expanded to 4), the head mix
    keeps A·E itself (eager 'full': a copy for its matmul) and the MLP update neither W_up·E nor the gated product.
    The estimate is exact to the byte, and below eager's by what those three save."""
    if DEV.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")

    cfg = preset_config("tiny", pe="tape", n_layers=3, attn_backend="triton", tiled_mlp=tiled,
                        tape_head_mix=head_mix, tape_fused_updates=True)
    torch.manual_seed(0)
    model = Transformer(cfg).to(DEV)
    b, s = 2, 40
    ids = torch.randint(0, cfg.vocab_size, (b, s), device=DEV)
    measured = measure_layer_saved_bytes(model, ids, layer)
    kwargs = dict(tiled_mlp=tiled, attention="triton", first_layer=layer == 0)
    predicted = layer_activation_bytes(cfg, b, s, 4, cfg.updates_tape_state(layer), **kwargs)
    assert predicted == measured, (predicted, measured)
    eager = layer_activation_bytes(cfg, b, s, 4, cfg.updates_tape_state(layer), fused_updates=False, **kwargs)
    h, hk, d, i = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.tape_dim
    saved = (h - hk) * d * (layer > 0) + h * d * (head_mix == "full") + (i + 2 * i * d) * (tiled <= 1)
    assert eager - predicted == b * s * saved * 4


def test_zero_stages_shard_what_they_should():
    cfg = preset_config("llama2-7b", pe="rope", max_seq_len=8192)
    common = dict(seq_len=8192, micro_batch=1, world_size=8, trainable_params=6_738_415_616,
                  total_params=6_738_415_616, activation_checkpointing=True)
    z2 = estimate_memory(cfg, zero_stage=2, **common)
    z3 = estimate_memory(cfg, zero_stage=3, **common)
    off = estimate_memory(cfg, zero_stage=3, offload_optimizer=True, offload_params=True, **common)
    assert z3.weights_gb == pytest.approx(z2.weights_gb / 8)
    assert z2.optimizer_gb == pytest.approx(12 * 6_738_415_616 / 8 / 2**30)
    assert off.optimizer_gb == 0 and off.weights_gb == 0 and off.host_offload_gb > 0
    assert z3.total_gpu_gb < 80  # Llama-2-7B full fine-tuning at 8K fits 8×A100-80GB with ZeRO-3 + checkpointing


def test_fused_loss_column_for_llama2_7b_at_8k():
    """The logits column: 2.44 GiB for the plain path (bf16, 8192 tokens, V = 32000) and about 1 GiB fused (dW's
    fp32 accumulator and one 256 MiB chunk dominate); estimate_memory uses the fused figure unless told not to."""
    cfg = preset_config("llama2-7b", pe="tape", max_seq_len=8192)
    plain, fused = loss_bytes(cfg, 1, 8192, fused=False), loss_bytes(cfg, 1, 8192)
    assert plain / 2**30 == pytest.approx(2.44, abs=0.01)
    assert fused / 2**30 == pytest.approx(1.05, abs=0.01) and fused < plain / 2
    common = dict(seq_len=8192, micro_batch=1, world_size=8, zero_stage=3, trainable_params=10**9,
                  total_params=7 * 10**9, activation_checkpointing=True)
    assert estimate_memory(cfg, **common).logits_gb == pytest.approx(fused / 2**30)
    assert estimate_memory(cfg, fused_loss=False, **common).logits_gb == pytest.approx(plain / 2**30)
    # The fused term does not grow with the vocabulary × tokens product: 4× the tokens adds only dh
    assert loss_bytes(cfg, 4, 8192) - fused == 3 * 8192 * 4096 * 2
    # A frozen LM head (TAPE PEFT) keeps no dW: dh plus one chunk's logits and their bf16 copy
    chunk = 2**28 // (4 * 32000)
    assert loss_bytes(cfg, 1, 8192, head_trainable=False) == 8192 * 4096 * 2 + chunk * 32000 * 6


def test_sequence_parallel_and_tiled_mlp_in_the_estimate():
    """N ranks per sequence: activations and the loss of T/N tokens per GPU (plus one layer's all-to-all buffers);
    ZeRO states unchanged. The tiled MLP lowers activations; SP 8 at 32K costs what SP 1 at 4K costs, plus the
    exchange."""
    cfg = preset_config("llama2-7b", pe="tape", max_seq_len=32768)
    common = dict(micro_batch=1, world_size=8, zero_stage=2, trainable_params=10**8, total_params=6_738_415_616,
                  activation_checkpointing=True)
    sp8 = estimate_memory(cfg, seq_len=32768, sequence_parallel=8, **common)
    one = estimate_memory(cfg, seq_len=4096, **common)
    assert sp8.weights_gb == one.weights_gb and sp8.logits_gb == one.logits_gb
    extra = exchange_bytes(cfg, 1, 32768, 8) / 2**30
    assert extra > 0 and sp8.activations_gb == pytest.approx(one.activations_gb + extra)
    tiled = estimate_memory(cfg, seq_len=32768, sequence_parallel=8, tiled_mlp=4, **common)
    assert tiled.activations_gb < sp8.activations_gb
    # without checkpointing every layer drops its MLP intermediates: far more than one chunk's recompute adds
    off = dict(common, activation_checkpointing=False)
    plain, tiled = (estimate_memory(cfg, seq_len=8192, tiled_mlp=t, **off).activations_gb for t in (0, 8))
    assert plain - tiled > 0.4 * plain


def live_tensor_bytes(before: set[int] | None = None) -> dict[int, int]:
    """{storage address: bytes} of every live CPU tensor reachable by the garbage collector, minus `before`."""
    import gc

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
                address = storage.data_ptr()
            except RuntimeError:  # fake/functional tensors an earlier torch.compile left behind: no real storage
                continue
            if before is None or address not in before:
                seen[address] = storage.nbytes()
    return seen


SMALLER_VOCAB = {"paper-155m": {"vocab_size": 8192}}  # 32000 made the bf16 cases ~25 s each on 2 CPU cores


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage,overlap", [(1, False), (2, False), (2, True), (3, None)])
@pytest.mark.parametrize("preset,bucket", [("tiny", 50_000), ("paper-155m", 2_000_000)])
def test_deepspeed_engine_memory_within_10_percent(preset, bucket, stage, overlap, precision):
    """Parameters, gradients, optimizer states and ZeRO's buffers of a real one-rank DeepSpeed 0.19.8 engine on
    CPU, against estimate_memory (no CUDA context): live tensor bytes sampled after the forward (activations),
    when the LM head's gradient is produced (first in backward), when the embedding's is (last: buckets and
    gradient partitions), after backward and when the optimizer steps (the fp32 master partition's gradient), on
    the second step (Adam's moments exist). A 155M-shaped model (d_model 768) cut to 2 layers and an 8K vocabulary:
    its 6.3M-parameter embedding and LM head still span three 2M-element buckets."""
    import gc
    import logging

    import deepspeed

    from tapetrain.distributed import init_distributed
    from tapetrain.train.memory import GiB, ZeroBuffers, parameter_counts

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    init_distributed()
    gc.collect()
    before = set(live_tensor_bytes())
    cfg = preset_config(preset, pe="tape", n_layers=2, max_seq_len=64, **SMALLER_VOCAB.get(preset, {}))
    torch.manual_seed(0)
    model = Transformer(cfg)
    zero = {"stage": stage, "reduce_bucket_size": bucket, "contiguous_gradients": True,
            "stage3_prefetch_bucket_size": bucket // 2, "stage3_max_live_parameters": bucket}  # fmt: skip
    if overlap is not None:
        zero["overlap_comm"] = overlap
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"}, "gradient_clipping": 1.0})  # fmt: skip
    ids = torch.randint(0, cfg.vocab_size, (1, 33), generator=torch.Generator().manual_seed(0))
    samples: list[int] = []

    def sample(*_args) -> None:
        samples.append(sum(live_tensor_bytes(before).values()))

    for step in range(2):
        if step == 1:
            hooks = [model.lm_head.weight.register_hook(lambda grad: sample()),
                     model.embed.weight.register_hook(lambda grad: sample()), optimizer.register_step_pre_hook(sample)]
        loss = engine(ids[:, :-1], labels=ids[:, 1:]).loss
        if step == 1:
            sample()  # the forward's saved activations, before backward frees them
        engine.backward(loss)
        del loss
        if step == 1:
            sample()  # after backward: ZeRO-1 reduces the gradients only now
        engine.step()
    for hook in hooks:
        hook.remove()
    engine.destroy()
    counts = parameter_counts(cfg, "all")
    est = estimate_memory(
        cfg, seq_len=32, micro_batch=1, world_size=1, zero_stage=stage, trainable_params=counts.trainable,
        total_params=counts.total, activation_checkpointing=False, precision=precision,
        buffers=ZeroBuffers(reduce_bucket_size=bucket, overlap_comm=overlap, stage3_prefetch_bucket_size=bucket // 2,
                            stage3_max_live_parameters=bucket),
        largest_trainable=counts.largest_trainable, context_gib=0,
    )  # fmt: skip
    assert len(samples) == 5
    assert abs(est.total_gpu_gb * GiB / max(samples) - 1) < 0.10, (est, [s / 2**20 for s in samples])


def test_print_config_and_the_memory_tool_give_the_same_estimate(capsys):
    """They once disagreed for the 8K recipe (20.34 vs 19.73 GiB: --print-config took the frozen LM head for
    trained), and --print-config called an fp32 run's weights 16-bit (its estimate then half the real size)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    from tapetrain.cli import main

    repo = Path(__file__).resolve().parents[2]
    args = ["train", str(repo / "configs" / "llama2-7b-8k-tape.yaml"), "--print-config", "--world-size", "8",
            "model.init_from=null", "model.preset=llama2-7b", "model.max_seq_len=8192"]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    total = float(re.search(r"memory estimate per GPU .*total ([\d.]+) GiB", printed)[1])
    assert "bf16 weights, fp32 master and Adam" in printed
    tool = subprocess.run([sys.executable, str(repo / "tools" / "memory_estimate.py"), "--preset", "llama2-7b",
                           "--pe", "tape", "--seq-len", "8192", "--world-size", "8", "--overlap-comm"],
                          capture_output=True, text=True, timeout=120, check=True).stdout  # fmt: skip
    row = next(line for line in tool.splitlines() if line.startswith("| train=tape+embed+norm ZeRO-2 ckpt=on |"))
    assert float(row.split("|")[-4]) == pytest.approx(total, abs=0.01)
    assert main(["train", str(repo / "configs" / "demo-tape.yaml"), "--print-config"]) == 0
    assert "fp32 weights and Adam" in capsys.readouterr().out


@pytest.mark.parametrize(("pe", "dtype", "recipe"), [("tape", torch.bfloat16, "rowwise"),
                                                     ("rope", torch.float32, "tensorwise")])
def test_float8_layer_saved_bytes_exact(pe, dtype, recipe):
    """train.float8 in torchao's emulation: a converted projection saves its high-precision input and (a view of)
    its weight, as nn.Linear does, and redoes the FP8 casts in backward, so the float8 term is zero: the layer's
    prediction is the measurement, to the byte."""
    pytest.importorskip("torchao")
    from tapetrain.train.float8 import convert_model_to_float8

    cfg = preset_config("tiny", pe=pe, n_layers=3, attn_backend="sdpa")
    torch.manual_seed(0)
    model = Transformer(cfg).to(dtype)
    assert len(convert_model_to_float8(model, recipe, emulate=True).converted) == 21
    assert type(model.layers[1].mlp.down_proj).__name__ == "Float8Linear"
    b, s = 2, 64
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    for layer in (0, 1):
        updates = cfg.updates_tape_state(layer)
        path = attention_path("sdpa", "cpu", s, carries_e=updates and cfg.tape_attn_update)
        predicted = layer_activation_bytes(cfg, b, s, dtype.itemsize, updates, attention=path, first_layer=layer == 0)
        assert measure_layer_saved_bytes(model, ids, layer) == predicted > 0

"""Ring attention (tapetrain/parallel/ring.py, context.py) on 2 CPU ranks over gloo against one process, fp32.

One spawn of two processes runs every case (the process start and the imports are paid once):
  * the op: causal, with packed documents (one spans the ranks' chunks), GQA keys, [V ‖ E] values twice as wide,
    a bias that takes a gradient (FIRE's way) and xPos's decay in several query blocks; forward and the gradients
    of q, k, values and bias within 1e-5 of eager attention on the whole sequence;
  * the model: R = 2 ring shard against the unsharded model for all seven encodings, with and without packed
    documents, GQA and MHA: loss and every parameter's gradient (the two ranks' shares summed) within 1e-5;
  * memory: at R = 2 each rank saves at most 0.55 of what one rank saves for backward at 2048 tokens.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tapetrain.model.attention import eager_attention
from tapetrain.model.documents import DocumentMask, document_positions
from tapetrain.model.sequence_shard import AttentionInputs
from tapetrain.model.xpos import XposDecay, decayed_attention, xpos_zeta
from tapetrain.parallel.ring import ring_tokens
from tests.unit.model_helpers import assert_reference_grads_nonzero, build, randomize_fire, randomize_tape

TOL = 1e-5
LENGTH = 32  # 4 chunks of 8 tokens: rank 0 holds tokens 0-7 and 24-31, rank 1 tokens 8-23
PES = ("tape", "rope", "nope", "alibi", "randpe", "xpos", "fire")
MODEL_CASES = [(pe, docs, kv) for pe in PES for docs in (False, True) for kv in (2, 4)]
MODEL_CASES.append(("rope", True, 1))  # MQA: one key head travels around the ring as it is
OP_CASES = ["causal", "documents-gqa-e", "bias-grad", "xpos-blocks", "not-causal", "tiled"]
SAVED_LENGTH = 2048  # the saved-bytes check's sequence
TILED_ROWS = 3  # "tiled": the documents-gqa-e and bias-grad inputs with the queries in tiles of 3 rows


def test_ring_tokens_are_two_opposite_chunks():
    assert ring_tokens(0, 2, 16).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert ring_tokens(1, 2, 16).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    held = torch.cat([ring_tokens(r, 4, 64) for r in range(4)])
    assert sorted(held.tolist()) == list(range(64))


def _doc_ids() -> torch.Tensor:
    # documents 0-4, 5-19 (spans both ranks' chunks), 20-31
    ids = torch.zeros(2, LENGTH, dtype=torch.long)
    ids[:, 5:] = 1
    ids[:, 20:] = 2
    ids[1, 12:] += 5  # the second row splits differently: 0-4, 5-11, 12-19, 20-31
    return ids


def _op_inputs(case: str) -> dict:
    """The whole sequences' inputs of one op case, the same on every process (seeded)."""
    gen = torch.Generator().manual_seed(OP_CASES.index(case))
    b, h, d = 2, 4, 8
    wide = case in ("documents-gqa-e", "tiled")
    hk = 2 if wide else 4
    dv = 2 * d if wide else d  # [V ‖ E]
    q = torch.randn(b, h, LENGTH, d, generator=gen)
    k = torch.randn(b, hk, LENGTH, d, generator=gen)
    values = torch.randn(b, h if dv > d else hk, LENGTH, dv, generator=gen)
    bias = torch.randn(b, h, LENGTH, LENGTH, generator=gen) if case in ("bias-grad", "tiled") else None
    grad_out = torch.randn(b, h, LENGTH, dv, generator=gen)
    docs = DocumentMask.of(_doc_ids()) if wide else None
    decay = None
    if case == "xpos-blocks":
        positions = torch.arange(LENGTH, dtype=torch.float64).expand(b, LENGTH) + 3
        decay = XposDecay(xpos_zeta(d), 6.0, positions, positions)  # blocks of 6 queries
    return dict(q=q, k=k, values=values, bias=bias, grad_out=grad_out, docs=docs, decay=decay,
                causal=case != "not-causal")


def _reference_op(case: str) -> dict:
    x = _op_inputs(case)
    leaves = {name: x[name].clone().requires_grad_() for name in ("q", "k", "values", "bias") if x[name] is not None}

    def attend(q, k, v, e=None, *, causal, bias=None, docs=None):
        return eager_attention(q, k, v, e, causal=causal, bias=bias, docs=docs)

    args = (leaves["q"], leaves["k"], leaves["values"], None)
    kwargs = dict(causal=x["causal"], bias=leaves.get("bias"), docs=x["docs"])
    out, _ = decayed_attention(*args, x["decay"], attend, **kwargs) if x["decay"] else attend(*args, **kwargs)
    out.backward(x["grad_out"])
    return {"out": out.detach(), **{name: leaf.grad for name, leaf in leaves.items()}}


def _ring_op(case: str, ring) -> dict:
    from tapetrain.parallel import ring as ring_module

    default = ring_module.TILE_SCORES
    if case == "tiled":
        ring_module.TILE_SCORES = 2 * 4 * (LENGTH // 2) * TILED_ROWS  # B·h·keys of a block × rows
        assert ring_module.tile_rows(2, 4, LENGTH // 2, LENGTH // 2) == TILED_ROWS
    try:
        return _ring_op_run(case, ring, ring_module.ring_attention)
    finally:
        ring_module.TILE_SCORES = default


def _ring_op_run(case: str, ring, ring_attention) -> dict:
    x = _op_inputs(case)
    rows = ring_tokens(ring.rank, ring.size, LENGTH)
    leaves = {name: x[name][:, :, rows].clone().requires_grad_() for name in ("q", "k", "values")}
    if x["bias"] is not None:
        leaves["bias"] = x["bias"][:, :, rows].clone().requires_grad_()
    inputs = AttentionInputs(x["causal"], None, leaves.get("bias"), x["decay"], x["docs"])
    out = ring_attention(ring, leaves["q"], leaves["k"], leaves["values"], inputs)
    out.backward(x["grad_out"][:, :, rows])
    return {"rows": rows, "out": out.detach(), **{name: leaf.grad for name, leaf in leaves.items()}}


def _model(pe: str, kv: int):
    model = build(pe, n_kv_heads=kv, attn_backend="eager", fire_hidden=8).train()
    randomize_tape(model)
    if pe == "fire":
        torch.manual_seed(5)
        randomize_fire(model)
    return model


def _model_batch(docs: bool):
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 512, (2, LENGTH + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:], _doc_ids() if docs else None  # labels shifted before any slicing


def _model_grads(model, ids, labels, doc_ids) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    torch.manual_seed(7)  # RandPE's draw
    loss = model(ids, labels=labels, doc_ids=doc_ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _saved_bytes_one_and_two(shard) -> tuple[int, int]:
    """Bytes a TAPE training forward of SAVED_LENGTH tokens saves for backward on this rank: alone, and at R = 2."""
    from tapetrain.bench.sp import saved_bytes

    model = build("tape", max_seq_len=SAVED_LENGTH).train()
    ids = torch.randint(0, 512, (1, SAVED_LENGTH + 1), generator=torch.Generator().manual_seed(2))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    alone = saved_bytes(model, lambda: model(inputs, labels=labels).loss)
    model.shard_sequence(shard)
    mine = shard.tokens(SAVED_LENGTH)
    return alone, saved_bytes(model, lambda: model(inputs[:, mine], labels=labels[:, mine]).loss)


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    from tapetrain.parallel.context import RingShard
    from tapetrain.parallel.ring import Ring

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        ring = Ring(dist.group.WORLD, rank, 2)
        results = {"op": {case: _ring_op(case, ring) for case in OP_CASES}, "model": {}}
        shard = RingShard(dist.group.WORLD, rank, ring, None)
        for pe, docs, kv in MODEL_CASES:
            model = _model(pe, kv)
            model.shard_sequence(shard)
            ids, labels, doc_ids = _model_batch(docs)
            mine = shard.tokens(LENGTH)
            results["model"][(pe, docs, kv)] = _model_grads(model, ids[:, mine], labels[:, mine], doc_ids)
        results["saved"] = _saved_bytes_one_and_two(shard)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks():
    with tempfile.TemporaryDirectory() as out_dir:
        init_file = os.path.join(out_dir, "init")
        mp.spawn(_worker, args=(init_file, out_dir), nprocs=2, join=True)
        yield [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("case", OP_CASES)
def test_the_ring_op_equals_attention_on_the_whole_sequence(two_ranks, case: str):
    reference = _reference_op(case)
    for name in ("out", "q", "k", "values", "bias"):
        if name not in reference:
            continue
        assert bool((reference[name] != 0).any()), f"reference {name} is all zero"
        for result in two_ranks:
            rows = result["op"][case]["rows"]
            torch.testing.assert_close(result["op"][case][name], reference[name][:, :, rows], atol=TOL, rtol=TOL,
                                       msg=lambda m, n=name: f"{case} {n}: {m}")


@pytest.mark.parametrize(("pe", "docs", "kv"), MODEL_CASES)
def test_a_ring_of_two_equals_one_rank(two_ranks, pe: str, docs: bool, kv: int):
    model = _model(pe, kv)
    ids, labels, doc_ids = _model_batch(docs)
    loss, grads = _model_grads(model, ids, labels, doc_ids)
    assert_reference_grads_nonzero(grads, grads)
    for result in two_ranks:
        torch.testing.assert_close(result["model"][(pe, docs, kv)][0], loss, atol=TOL, rtol=TOL)
    shares = [result["model"][(pe, docs, kv)][1] for result in two_ranks]
    assert set(shares[0]) == set(grads) == set(shares[1])
    for name, grad in grads.items():
        torch.testing.assert_close(shares[0][name] + shares[1][name], grad, atol=TOL, rtol=TOL,
                                   msg=lambda m, n=name: f"{n}: {m}")




def test_document_positions_restart_across_the_ring_boundary():
    """The documents of the model cases span the ranks' chunks (the cases above test something)."""
    ids = _doc_ids()
    held = [set(ids[0, ring_tokens(r, 2, LENGTH)].tolist()) for r in range(2)]
    assert held[0] & held[1], "no document spans both ranks"
    assert document_positions(ids)[0, 8] == 3  # token 8 (rank 1) continues the document begun on rank 0


def test_a_ring_of_two_saves_about_half_the_bytes_per_rank(two_ranks):
    """Per rank, what a TAPE training forward of 2048 tokens saves for backward at R = 2 is at most 0.55 of one
    rank's (the `tiny` model, model.attn_backend=auto: SDPA on CPU alone, the ring's blocks at R = 2)."""
    for result in two_ranks:
        alone, ring = result["saved"]
        assert ring > 0 and ring <= 0.55 * alone, (ring, alone, ring / alone)

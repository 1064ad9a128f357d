"""Packed documents (data.document_mask): a packed batch computes exactly what its documents compute alone.

For every positional encoding and attention backend (eager, sdpa, flex; the Triton kernel runs in
tests/unit/test_document_mask_triton.py under the interpreter), a batch of packed documents with doc_ids gives the
logits, loss and gradients of the documents run one by one (fp32, 1e-5), and without doc_ids nothing changes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tapetrain.model import positions, randpe
from tapetrain.model.attention import attention, eager_attention, sdpa_attention
from tapetrain.model.documents import DocumentMask, document_positions
from tapetrain.model.randpe import draw_document_positions, draw_positions
from tests.unit.model_helpers import assert_reference_grads_nonzero, build, randomize_fire, randomize_tape

LAYOUTS = [[7, 12, 5], [10, 14]]  # two rows of 24 tokens: three documents, then two
PES = ["tape", "rope", "nope", "alibi", "xpos", "fire"]
BIAS_PES = {"alibi", "fire"}


def packed_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, labels, doc_ids) (2, 24) of the LAYOUTS."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 512, (2, 24), generator=gen)
    labels = torch.randint(0, 512, (2, 24), generator=gen)
    docs = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in LAYOUTS])
    return ids, labels, docs.to(torch.int32)


def make_model(pe: str, backend: str):
    extra = {"xpos_scale_base": 8.0} if pe == "xpos" else {}  # several xPos query blocks per row
    model = build(pe, attn_backend=backend, loss_backend="plain", **extra)
    if pe == "tape":
        randomize_tape(model)
    if pe == "fire":
        torch.manual_seed(3)
        randomize_fire(model)
    return model


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run_packed(model, ids, labels, docs, offset: int = 0):
    model.zero_grad()
    out = model(ids, labels=labels, doc_ids=docs, position_offset=offset)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), grads(model)


def run_separately(model, ids, labels, offset: int = 0):
    """Every document alone (B = 1): logits in packed order, the packed mean loss, and its gradient."""
    model.zero_grad()
    logits, total = [], 0.0
    n = ids.numel()
    for row, layout in enumerate(LAYOUTS):
        start = 0
        for length in layout:
            sl = slice(start, start + length)
            out = model(ids[row : row + 1, sl], labels=labels[row : row + 1, sl], position_offset=offset)
            loss_sum = out.loss * length  # the document's share of the packed mean
            (loss_sum / n).backward()
            total += float(loss_sum.detach())
            logits.append(out.logits.detach()[0])
            start += length
    by_row = torch.cat(logits).view(2, 24, -1)
    return by_row, torch.tensor(total / n, device=by_row.device), grads(model)


def assert_close_dicts(a: dict, b: dict, atol: float) -> None:
    """`a` the path under test, `b` the reference (whose every gradient must be non-zero: nothing compared 0 to 0)."""
    assert a.keys() == b.keys()
    assert_reference_grads_nonzero(b, list(b))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("pe", PES)
def test_packed_documents_equal_separate_runs(pe: str, backend: str):
    model = make_model(pe, backend).train()
    ids, labels, docs = packed_batch()
    offset = 5 if pe in ("tape", "rope", "xpos") else 0  # the position offset applies per document too
    logits, loss, g = run_packed(model, ids, labels, docs, offset)
    ref_logits, ref_loss, ref_g = run_separately(model, ids, labels, offset)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)
    assert_close_dicts(g, ref_g, atol=1e-5)


@pytest.mark.parametrize("length,with_e", [(24, True), (200, True), (256, False)])  # each compile takes seconds
def test_compiled_flex_is_exact_at_lengths_off_the_block_grid(length: int, with_e: bool):
    """Compiled FlexAttention on CPU (torch 2.13) returned wrong rows, even NaN, when T was not a multiple of its
    128-token block on some CPUs (seen on an AMD EPYC: error 1.3 at T = 24); the backend pads to the grid there."""
    from tapetrain.model.flex import flex_document_attention

    lengths = [length // 3, length // 4, length - length // 3 - length // 4]
    rows = (lengths, lengths[::-1])
    docs = torch.stack([torch.repeat_interleave(torch.arange(3), torch.tensor(row)) for row in rows])
    gen = torch.Generator().manual_seed(0)
    q, k, v, e = (torch.randn(2, 4, length, 16, generator=gen) for _ in range(4))
    k, v = k[:, :2], v[:, :2]  # GQA
    e = e if with_e else None
    got = flex_document_attention(q, k, v, e, docs=DocumentMask.of(docs))
    ref = eager_attention(q, k, v, e, docs=DocumentMask.of(docs))
    for a, b in zip(got, ref, strict=True):
        if b is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pe", [p for p in PES if p not in BIAS_PES])
def test_flex_forward_equals_separate_runs(pe: str):
    """FlexAttention (compiled) on CPU: forward only (torch has no CPU backward for it); "auto" picks it for
    forwards without gradients. Gradients through flex are GPU territory (tests/gpu)."""
    model = make_model(pe, "flex")
    ids, labels, docs = packed_batch()
    with torch.no_grad():
        out = model(ids, labels=labels, doc_ids=docs)
    ref = []
    with torch.no_grad():
        for row, layout in enumerate(LAYOUTS):
            start = 0
            for length in layout:
                ref.append(model(ids[row : row + 1, start : start + length]).logits[0])
                start += length
    torch.testing.assert_close(out.logits, torch.cat(ref).view(2, 24, -1), atol=1e-5, rtol=0)
    from tapetrain.errors import ConfigError
    from tapetrain.model.execution_plan import resolve_plan

    with pytest.raises(ConfigError, match="no backward on CPU"):  # a training run's plan refuses it at start
        resolve_plan(model.cfg, torch.device("cpu"), torch.float32, documents=True)


@pytest.mark.parametrize("pe", PES)
def test_without_doc_ids_nothing_changes(pe: str):
    """No doc_ids: the forward is today's. One document spanning the row: the eager mask is today's causal mask,
    so the result is bit for bit the same."""
    model = make_model(pe, "eager")
    ids, labels, _ = packed_batch()
    plain = model(ids, labels=labels)
    one_doc = model(ids, labels=labels, doc_ids=torch.zeros_like(ids, dtype=torch.int32))
    assert torch.equal(plain.logits, one_doc.logits) and torch.equal(plain.loss, one_doc.loss)


def test_positions_restart_per_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2], [4, 4, 4, 4, 5, 5]])
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]


def test_attention_backends_agree_with_the_mask():
    gen = torch.Generator().manual_seed(0)
    q, k, v, e = (torch.randn(2, 4, 24, 8, generator=gen) for _ in range(4))
    k, v = k[:, :2], v[:, :2]  # GQA
    _, _, docs = packed_batch()
    mask = DocumentMask.of(docs)
    ref = eager_attention(q, k, v, e, docs=mask)
    for backend in ("sdpa", "flex"):
        out = attention(q, k, v, e, docs=mask, backend=backend)
        torch.testing.assert_close(out[0], ref[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(out[1], ref[1], atol=1e-6, rtol=0)
    # with a bias (alibi/fire): -inf outside the documents, the bias inside
    bias = torch.randn(2, 4, 24, 24, generator=gen)
    torch.testing.assert_close(
        sdpa_attention(q, k, v, None, bias=bias, docs=mask)[0],
        eager_attention(q, k, v, None, bias=bias, docs=mask)[0],
        atol=1e-6,
        rtol=0,
    )


def test_randpe_draws_per_document_as_if_alone():
    """Row by row, document by document, each document's draw is the one it makes alone from the same RNG state."""
    _, _, docs = packed_batch()
    torch.manual_seed(11)
    packed = draw_document_positions(docs, 64)
    torch.manual_seed(11)
    alone = [draw_positions(n, 64, torch.device("cpu")) for row in LAYOUTS for n in row]
    assert torch.equal(packed.flatten(), torch.cat(alone))
    assert not torch.equal(packed, document_positions(docs))  # really random, restarting per document


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_randpe_one_draw_packed_equals_separate_runs(backend: str):
    """randpe_per_layer=false: the documents consume the RNG in order, one draw each, as the separate runs do."""
    model = build("randpe", attn_backend=backend, loss_backend="plain", randpe_per_layer=False).train()
    ids, labels, docs = packed_batch()
    torch.manual_seed(5)
    logits, loss, g = run_packed(model, ids, labels, docs)
    torch.manual_seed(5)
    ref_logits, ref_loss, ref_g = run_separately(model, ids, labels)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)
    assert_close_dicts(g, ref_g, atol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_randpe_per_layer_packed_equals_separate_runs(backend: str, monkeypatch):
    """randpe_per_layer (the default): each layer draws for every document in turn. The separate runs replay the
    packed run's draws (document k, layer l), since alone a document draws layer after layer instead."""
    model = build("randpe", attn_backend=backend, loss_backend="plain").train()
    ids, labels, docs = packed_batch()
    drawn: list[torch.Tensor] = []

    def record(length, limit, device):
        drawn.append(draw_positions(length, limit, device))
        return drawn[-1]

    monkeypatch.setattr(randpe, "draw_positions", record)
    logits, loss, g = run_packed(model, ids, labels, docs)
    n_docs, n_layers = sum(map(len, LAYOUTS)), model.cfg.n_layers
    assert len(drawn) == n_docs * n_layers
    replay = iter([drawn[layer * n_docs + doc] for doc in range(n_docs) for layer in range(n_layers)])
    monkeypatch.setattr(positions, "draw_positions", lambda length, limit, device: next(replay))
    ref_logits, ref_loss, ref_g = run_separately(model, ids, labels)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)
    assert_close_dicts(g, ref_g, atol=1e-5)


def test_single_document_loss_matches_unmasked_reference():
    """A row that is one document: the mask changes nothing (sdpa's boolean mask vs its is_causal path)."""
    model = make_model("tape", "sdpa")
    ids, labels, _ = packed_batch()
    a = model(ids, labels=labels).logits
    b = model(ids, labels=labels, doc_ids=torch.zeros(2, 24, dtype=torch.int32)).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert F.cross_entropy(a.flatten(0, 1), labels.flatten()).isfinite()


def test_auto_backend_with_documents_on_cpu():
    """Measured on CPU (docs/document-masking.md): compiled flex for forwards without gradients, SDPA to train
    (flex has no CPU backward) and with a bias. The execution plan holds all three for every layer."""
    from tapetrain.model import preset_config
    from tapetrain.model.execution_plan import resolve_plan

    cpu, f32 = torch.device("cpu"), torch.float32
    (tape,) = {layer.attention for layer in resolve_plan(preset_config("tiny", pe="tape"), cpu, f32).layers}
    assert (tape.plain, tape.documents, tape.documents_no_grad) == ("sdpa", "sdpa", "flex")
    assert tape.backend(has_docs=True, grad=False) == "flex" and tape.backend(has_docs=True, grad=True) == "sdpa"
    (alibi,) = {layer.attention for layer in resolve_plan(preset_config("tiny", pe="alibi"), cpu, f32).layers}
    assert (alibi.plain, alibi.documents, alibi.documents_no_grad) == ("sdpa", "sdpa", "sdpa")  # a bias: SDPA


class OneRankShard:
    """The SequenceShard protocol for a group of one rank: the sharded forward's code path, no processes."""

    rank, size = 0, 1

    def attend(self, local_attention, q, k, values):
        return local_attention(q, k, values)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().clone()

    def same(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().clone()


@pytest.mark.parametrize("per_layer", [True, False])
def test_randpe_documents_through_the_sharded_forward(per_layer: bool):
    """Sequence parallelism draws the documents' positions the same way (one rank's group: the same numbers)."""
    model = build("randpe", attn_backend="sdpa", loss_backend="plain", randpe_per_layer=per_layer).train()
    ids, labels, docs = packed_batch()
    torch.manual_seed(9)
    plain = model(ids, labels=labels, doc_ids=docs).loss
    model.shard_sequence(OneRankShard())
    torch.manual_seed(9)
    sharded = model(ids, labels=labels, doc_ids=docs).loss
    torch.testing.assert_close(sharded, plain, atol=1e-6, rtol=0)

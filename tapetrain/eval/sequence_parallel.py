"""The eval tools under sequence parallelism (`eval ppl` / `eval passkey --sequence-parallel N`).

Ranks form groups of N consecutive ranks (tapetrain.parallel: ParallelLayout, init_sequence_parallel, which adopts
the eval tools' process group). The work items (windows, prompt batches) are split over the W/N groups
(EvalRanks.share); the N ranks of a group evaluate the same items, each holding the contiguous slice
[r·T/N, (r+1)·T/N) of every sequence, and only attention crosses the group (Ulysses). So a model trained at 8K can
be scored at 32K with each rank holding 32K/N tokens.

    check_sequence_parallel   every refusal, before the groups are built or weights are read, each naming its fix
    start_sequence_parallel   the groups (collective) and the ranks' new share of the work
    sharded_logits            logits of the last positions of whole sequences: this rank's part of them
    sharded_greedy            greedy decoding: one sharded forward of the whole sequence per new token

Perplexity: each rank scores the predictions its slice holds; the per-window NLL sums are summed over all ranks
(all_reduce_sum), which adds the group's partial sums, so the result is one process's.

Generation has no KV cache here: a cache would need the whole sequence's keys and values on every rank. Each new
token recomputes the whole sequence, right-padded to a multiple of N (causal attention keeps the padding out of
every real position), and only the rank holding the last real position computes a row of logits; the group sums
that row (the other ranks contribute zeros) so every rank picks the same token. A passkey answer is a few tokens,
so this costs a few forwards of the prompt.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F

from tapetrain.distributed import EvalRanks
from tapetrain.errors import InputError
from tapetrain.model.sequence_shard import SequenceShard, local_tokens


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _launch_problem(n: int, world: int) -> str | None:
    if world == 1:
        return (
            f"--sequence-parallel {n} needs a launch of {n} ranks (or a multiple of {n}); start it with "
            f"`torchrun --nproc-per-node {n} -m tapetrain.cli eval ...` or `deepspeed --num_gpus {n} --module "
            "tapetrain.cli eval ...`, or drop --sequence-parallel"
        )
    if world % n:
        return (
            f"--sequence-parallel {n} does not divide the {world} ranks of this launch (groups of N ranks share "
            f"each sequence); launch a multiple of {n} ranks, or use --sequence-parallel "
            f"{' or '.join(map(str, _divisors(world)))}"
        )
    return None


def _length_problem(n: int, lengths: list[int]) -> str | None:
    bad = [length for length in lengths if length % n]
    if not bad:
        return None
    from tapetrain.config.checks import nearest_multiples

    fixes = ", ".join(f"{length} -> {nearest_multiples(length, n)[0]}" for length in bad)
    return (
        f"--lengths {','.join(map(str, bad))}: with --sequence-parallel {n} every length must be a multiple of "
        f"{n} (each rank holds length / N tokens); use the nearest multiples ({fixes})"
    )


def check_sequence_parallel(
    n: int, model_path: str, step: int | None = None, lengths: list[int] | None = None, generation: bool = False
) -> None:
    """Refuse what sequence parallelism `n` cannot run, before any process group or weights (every rank alike):
    a lone process, a world size that N does not divide, a Hugging Face export, n_heads not a multiple of N,
    `lengths` (perplexity windows) not multiples of N, and for `generation` a model that is not causal (the right
    padding would be attended) or RandPE drawing positions at evaluation (the draw would see the padding)."""
    if n == 1:
        return
    if n < 1:
        raise InputError(f"--sequence-parallel must be >= 1 (1: off), got {n}")
    problem = _launch_problem(n, int(os.environ.get("WORLD_SIZE", "1")))
    if problem:
        raise InputError(problem)
    from tapetrain.checkpoint.run_loader import is_run_or_checkpoint, read_run_model_config

    if not os.path.isdir(model_path):
        return  # loading names the missing model
    if not is_run_or_checkpoint(model_path):
        raise InputError(
            f"--sequence-parallel {n} needs a run directory, but {model_path} is a Hugging Face export: "
            "transformers runs it on whole sequences and cannot split one over ranks; pass the run "
            "directory it was exported from, or drop --sequence-parallel"
        )
    cfg = read_run_model_config(model_path, step)
    if cfg.n_heads % n:
        fits = [d for d in _divisors(cfg.n_heads) if int(os.environ.get("WORLD_SIZE", "1")) % d == 0]
        raise InputError(
            f"--sequence-parallel {n} does not divide the model's {cfg.n_heads} attention heads (each "
            f"rank of a group attends with n_heads / N whole heads); use --sequence-parallel "
            f"{' or '.join(map(str, fits))}"
        )
    problem = _length_problem(n, lengths or [])
    if problem:
        raise InputError(problem)
    if generation and not cfg.causal:
        raise InputError(
            f"--sequence-parallel {n} decodes right-padded sequences, which only causal attention "
            "keeps out of the real tokens, and this model is not causal; drop --sequence-parallel"
        )
    if generation and cfg.pe == "randpe" and cfg.randpe_sample_at_eval:
        raise InputError(
            f"--sequence-parallel {n} decodes right-padded sequences, and this RandPE model draws its "
            "positions at evaluation (model.randpe_sample_at_eval) over the padded length, so its "
            "answers would differ from one process's; drop --sequence-parallel"
        )


def start_sequence_parallel(ranks: EvalRanks, n: int) -> tuple[EvalRanks, SequenceShard | None]:
    """(the ranks with their share of the work over W/N groups, this rank's shard), or (ranks, None) for N = 1.
    Collective: every rank calls it (DeepSpeed's parallel_state_sp builds the groups)."""
    if n == 1:
        return ranks, None
    from tapetrain.parallel.layout import ParallelLayout
    from tapetrain.parallel.ulysses import init_sequence_parallel

    sp = init_sequence_parallel(ParallelLayout(ranks.world_size, n), ranks)
    assert sp is not None
    return dataclasses.replace(ranks, sequence_parallel=n), sp.shard


def sharded_logits(
    module: torch.nn.Module, shard: SequenceShard, ids: torch.Tensor, keep: int, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, int]:
    """ids (B, L) whole sequences (L a multiple of N) -> (logits (B, k, V), first): this rank's part of the last
    `keep` positions, positions first .. first + k − 1 (k = 0 on a rank that holds none)."""
    mine = local_tokens(shard, ids.shape[1])
    logits = module(ids[:, mine], positions=positions, logits_to_keep=keep).logits  # (B, k, V)
    return logits, mine.stop - logits.shape[1]


def last_logits(module: torch.nn.Module, shard: SequenceShard, ids: torch.Tensor) -> torch.Tensor:
    """ids (B, T) real tokens -> fp32 logits at position T − 1 (B, V), the same on every rank of the group.

    The sequence is right-padded to P, a multiple of N: causal attention keeps the padding out of every real
    position. The padding repeats position T − 1, so the span of positions (what length-dependent RoPE scaling,
    dynamic and longrope, reads) stays the real tokens'."""
    b, t = ids.shape
    padded = -(-t // shard.size) * shard.size
    whole = F.pad(ids, (0, padded - t))  # (B, P), pad id 0
    positions = torch.arange(padded, device=ids.device, dtype=torch.float64).clamp(max=t - 1)  # (P,)
    logits, first = sharded_logits(module, shard, whole, padded - t + 1, positions)  # kept: positions T−1 .. P−1
    row = torch.zeros(b, logits.shape[-1], dtype=torch.float32, device=logits.device)  # (B, V)
    if first == t - 1 and logits.shape[1]:  # this rank holds position T − 1
        row = logits[:, 0].float()
    return shard.sum(row)  # the holder's row plus zeros: exactly its row


@torch.no_grad()
def sharded_greedy(module: torch.nn.Module, shard: SequenceShard, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """ids (B, T) prompts of real tokens -> (B, new_tokens) greedy ids (plain argmax, as Transformer.generate),
    one sharded forward of the whole sequence per token."""
    out = ids
    for _ in range(new_tokens):
        next_id = last_logits(module, shard, out).argmax(dim=-1)  # (B,)
        out = torch.cat([out, next_id[:, None]], dim=1)
    return out[:, ids.shape[1] :]

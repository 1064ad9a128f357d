"""The eval tools under sequence parallelism (`eval ppl` / `eval passkey --sequence-parallel U --context-parallel R`).

Ranks form groups of N = R × U consecutive ranks (tapetrain.parallel: ParallelLayout, init_sequence_parallel, which
adopts the eval tools' process group). The work items (windows, prompt batches) are split over the W/N groups
(EvalRanks.share); the N ranks of a group evaluate the same items, each holding T/N tokens of every sequence, and
only attention crosses the group. Ulysses alone (R = 1): rank r holds the contiguous slice [r·T/N, (r+1)·T/N). With a
ring (R > 1, tapetrain.parallel.context): ring rank ρ holds chunks ρ and 2R−1−ρ of the sequence's 2R chunks, split
over its U Ulysses ranks, exactly as in training. So a model trained at 8K can be scored at 32K with each rank
holding 32K/N tokens.

    SequenceSplit             (U, R): the flags in messages, the multiple every length must be
    check_sequence_parallel   every refusal, before the groups are built or weights are read, each naming its fix
    start_sequence_parallel   the groups (collective) and the ranks' new share of the work
    sharded_logits            logits of the last positions of whole sequences: this rank's part of them, with their
                              global positions
    sharded_greedy            greedy decoding: one sharded forward of the whole sequence per new token

Perplexity: each rank scores the predictions its tokens hold (a ring rank's two chunks); the per-window NLL sums are
summed over all ranks (all_reduce_sum), which adds the group's partial sums, so the result is one process's.

Generation has no KV cache here: a cache would need the whole sequence's keys and values on every rank. Each new
token recomputes the whole sequence, right-padded to a multiple of N (2N with a ring; causal attention keeps the
padding out of every real position), and only the rank holding the last real position computes a row of logits;
the group sums that row (the other ranks contribute zeros) so every rank picks the same token. A passkey answer is a
few tokens, so this costs a few forwards of the prompt.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tapetrain.distributed import EvalRanks
from tapetrain.errors import InputError
from tapetrain.model.sequence_shard import SequenceShard, kept_tokens, local_tokens


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class SequenceSplit:
    """How the ranks share a sequence: Ulysses U (--sequence-parallel) inside each of a ring's R (--context-parallel)
    groups; N = R × U consecutive ranks hold one sequence."""

    ulysses: int = 1
    ring: int = 1

    @property
    def ranks(self) -> int:
        return self.ulysses * self.ring

    @property
    def flags(self) -> str:
        """The setting in the user's words, for messages."""
        if self.ring == 1:
            return f"--sequence-parallel {self.ulysses}"
        return f"--context-parallel {self.ring}" + (f" --sequence-parallel {self.ulysses}" if self.ulysses > 1 else "")

    @property
    def length_multiple(self) -> int:
        """Sequence lengths must be multiples of this: U for Ulysses (T/U tokens a rank), 2·R·U for a ring (2R chunks,
        each split over U ranks)."""
        return self.ulysses if self.ring == 1 else 2 * self.ring * self.ulysses


def _launch_problem(split: SequenceSplit, world: int) -> str | None:
    n = split.ranks
    if world == 1:
        return (
            f"{split.flags} needs a launch of {n} ranks (or a multiple of {n}); start it with "
            f"`torchrun --nproc-per-node {n} -m tapetrain.cli eval ...` or `deepspeed --num_gpus {n} --module "
            f"tapetrain.cli eval ...`, or drop {split.flags}"
        )
    if world % n:
        fix = (f"use --sequence-parallel {' or '.join(map(str, _divisors(world)))}" if split.ring == 1 else
               f"lower --context-parallel so that R × U divides {world}")
        return (
            f"{split.flags} does not divide the {world} ranks of this launch (groups of {n} ranks share "
            f"each sequence); launch a multiple of {n} ranks, or {fix}"
        )
    return None


def _length_problem(split: SequenceSplit, lengths: list[int]) -> str | None:
    multiple = split.length_multiple
    bad = [length for length in lengths if length % multiple]
    if not bad:
        return None
    from tapetrain.config.checks import nearest_multiples

    fixes = ", ".join(f"{length} -> {nearest_multiples(length, multiple)[0]}" for length in bad)
    held = ("each rank holds length / N tokens" if split.ring == 1 else
            f"the ring cuts each window into {2 * split.ring} chunks, each split over {split.ulysses} rank(s)")
    return (
        f"--lengths {','.join(map(str, bad))}: with {split.flags} every length must be a multiple of "
        f"{multiple} ({held}); use the nearest multiples ({fixes})"
    )


def check_sequence_parallel(
    n: int, model_path: str, step: int | None = None, lengths: list[int] | None = None, generation: bool = False,
    context_parallel: int = 1,
) -> None:
    """Refuse what sequence parallelism `n` (Ulysses) inside a ring of `context_parallel` cannot run, before any
    process group or weights (every rank alike): a lone process, a world size that R × U does not divide, a Hugging
    Face export, n_heads not a multiple of U (a ring splits no heads), `lengths` (perplexity windows) not multiples
    of U (of 2·R·U with a ring), and for `generation` a model that is not causal (the right padding would be
    attended) or RandPE drawing positions at evaluation (the draw would see the padding)."""
    if n < 1:
        raise InputError(f"--sequence-parallel must be >= 1 (1: off), got {n}")
    if context_parallel < 1:
        raise InputError(f"--context-parallel must be >= 1 (1: off), got {context_parallel}")
    split = SequenceSplit(n, context_parallel)
    if split.ranks == 1:
        return
    problem = _launch_problem(split, int(os.environ.get("WORLD_SIZE", "1")))
    if problem:
        raise InputError(problem)
    from tapetrain.checkpoint.run_loader import is_run_or_checkpoint, read_run_model_config

    if not os.path.isdir(model_path):
        return  # loading names the missing model
    if not is_run_or_checkpoint(model_path):
        raise InputError(
            f"{split.flags} needs a run directory, but {model_path} is a Hugging Face export: "
            "transformers runs it on whole sequences and cannot split one over ranks; pass the run "
            f"directory it was exported from, or drop {split.flags}"
        )
    cfg = read_run_model_config(model_path, step)
    if cfg.n_heads % n:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        fits = [d for d in _divisors(cfg.n_heads) if world % (d * context_parallel) == 0]
        raise InputError(
            f"--sequence-parallel {n} does not divide the model's {cfg.n_heads} attention heads (each "
            f"rank of a group attends with n_heads / N whole heads); use --sequence-parallel "
            f"{' or '.join(map(str, fits))}"
        )
    problem = _length_problem(split, lengths or [])
    if problem:
        raise InputError(problem)
    if generation and not cfg.causal:
        raise InputError(
            f"{split.flags} decodes right-padded sequences, which only causal attention "
            f"keeps out of the real tokens, and this model is not causal; drop {split.flags}"
        )
    if generation and cfg.pe == "randpe" and cfg.randpe_sample_at_eval:
        raise InputError(
            f"{split.flags} decodes right-padded sequences, and this RandPE model draws its "
            "positions at evaluation (model.randpe_sample_at_eval) over the padded length, so its "
            f"answers would differ from one process's; drop {split.flags}"
        )


def start_sequence_parallel(
    ranks: EvalRanks, n: int, context_parallel: int = 1
) -> tuple[EvalRanks, SequenceShard | None]:
    """(the ranks with their share of the work over W/N groups, this rank's shard), or (ranks, None) for N = 1
    (N = context_parallel × n). Collective: every rank calls it (DeepSpeed's parallel_state_sp builds the groups;
    with a ring, tapetrain.parallel.context its rings and Ulysses groups)."""
    if n * context_parallel == 1:
        return ranks, None
    from tapetrain.parallel.layout import ParallelLayout
    from tapetrain.parallel.ulysses import init_sequence_parallel

    sp = init_sequence_parallel(ParallelLayout(ranks.world_size, n, context_parallel), ranks)
    assert sp is not None
    return dataclasses.replace(ranks, sequence_parallel=n, context_parallel=context_parallel), sp.shard


def sharded_logits(
    module: torch.nn.Module, shard: SequenceShard, ids: torch.Tensor, keep: int, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (B, L) whole sequences (L a multiple of the split's length_multiple) -> (logits (B, k, V), their global
    positions (k,) int64): this rank's part of the last `keep` positions (k = 0 on a rank that holds none; a ring
    rank's are in two runs, one per chunk)."""
    length = ids.shape[1]
    held = torch.arange(length, device=ids.device)[local_tokens(shard, length)]  # (L/N,) this rank's positions
    logits = module(ids[:, held], positions=positions, logits_to_keep=keep).logits  # (B, k, V)
    kept = held[kept_tokens(shard, held.shape[0], keep)]  # (k,)
    assert kept.shape[0] == logits.shape[1], (kept.shape, logits.shape)
    return logits, kept


def last_logits(module: torch.nn.Module, shard: SequenceShard, ids: torch.Tensor) -> torch.Tensor:
    """ids (B, T) real tokens -> fp32 logits at position T − 1 (B, V), the same on every rank of the group.

    The sequence is right-padded to P, a multiple of the split's length multiple (N, or 2N for a ring): causal
    attention keeps the padding out of every real position. The padding repeats position T − 1, so the span of
    positions (what length-dependent RoPE scaling, dynamic and longrope, reads) stays the real tokens'."""
    b, t = ids.shape
    multiple = 2 * shard.size if getattr(shard, "ring", None) is not None else shard.size
    padded = -(-t // multiple) * multiple
    whole = F.pad(ids, (0, padded - t))  # (B, P), pad id 0
    positions = torch.arange(padded, device=ids.device, dtype=torch.float64).clamp(max=t - 1)  # (P,)
    logits, held = sharded_logits(module, shard, whole, padded - t + 1, positions)  # kept: among T−1 .. P−1
    row = torch.zeros(b, logits.shape[-1], dtype=torch.float32, device=logits.device)  # (B, V)
    last = torch.nonzero(held == t - 1).flatten()
    if last.numel():  # this rank holds position T − 1
        row = logits[:, int(last[0])].float()
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

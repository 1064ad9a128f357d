"""Passkey retrieval: find a number hidden in filler text. Three protocols:

  tape       the TAPE repository's eval_retrieval.py exactly (the TAPE paper's passkey figure; default)
  longlora   LongLoRA's passkey_retrivial.py exactly
             (both in tapetrain.eval.passkey_reference: one prompt string with newlines, the key at a random
             character offset of the filler, n_garbage characters per length point, seeds 0..trials−1, greedy
             decoding scored by token match)
  tapetrain  ours, an alternative that is *not* comparable with the papers: Prompt = [BOS] task · s_1 … s_k ·
             key line · s_k+1 … s_n · question, where the haystack s_1 … s_n cycles through the five filler
             sentences and every segment (each sentence too) is tokenized on its own and joined without
             separators, so the key's token position is exact and lies on a sentence boundary. n is the most
             sentences that fit in the target token length (--lengths). Without --depths k is uniform in [0, n];
             with --depths (the needle grid) k puts the key where its offset into the haystack is closest to
             depth × the haystack's tokens (0 = right after the task, 1 = right before the question), so the
             key's offset is depth × haystack within half a sentence. The pass key X is uniform in 1..50000 from a
             generator seeded by (seed, length, trial) (the same key at every depth of a trial); the task says
             "memorize it". The model greedily decodes as many tokens as the answer has (batched prompts of equal
             length, KV cache); exact match of the decoded text with X counts as correct. Prompt batches are
             split over ranks under torchrun/deepspeed and the records gathered, so every rank count gives the
             same records. With --sequence-parallel U (and/or --context-parallel R) each group of N = R × U ranks
             decodes the same batches, each rank holding T/N tokens of every prompt (a slice, or its part of a
             ring rank's two chunks), greedily without a KV cache (tapetrain.eval.sequence_parallel).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from tapetrain.atomic_io import write_json
from tapetrain.distributed import EvalRanks, init_eval_ranks
from tapetrain.errors import InputError
from tapetrain.eval import passkey_reference as ref
from tapetrain.eval.models import EvalModel, load_eval_model, seed_eval
from tapetrain.eval.report import format_passkey_table, plot_passkey
from tapetrain.eval.sequence_parallel import check_sequence_parallel, start_sequence_parallel
from tapetrain.progress import format_duration
from tapetrain.progress import progress as progress_bar

log = logging.getLogger("tapetrain.eval")

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.")
SENTENCES = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
FILLER = " ".join(SENTENCES)
KEY_LINE = "The pass key is {X}. Remember it. {X} is the pass key."
QUESTION = "What is the pass key? The pass key is"
MAX_PASS_KEY = 50000
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
PROTOCOLS = ("tape", "longlora", "tapetrain")
TAPETRAIN_TRIALS = 20
DEFAULT_BATCH_SIZE = 8


def key_line(pass_key: int) -> str:
    return KEY_LINE.replace("{X}", str(pass_key))


@dataclass
class PasskeyPrompt:
    ids: list[int]
    pass_key: int
    answer_ids: list[int]  # the tokens of str(pass_key): how many tokens to decode
    key_position: int  # token offset of the key line's first token in `ids`
    key_tokens: int  # token length of the key line
    haystack_start: int  # token offset of the first filler sentence (= the key's position at depth 0)
    haystack_tokens: int  # filler tokens in all (the key line excluded)
    sentences_before: int  # filler sentences before the key line (k of n)
    sentences_total: int

    @property
    def depth(self) -> float:
        """Where the key line sits in the haystack: 0 = right after the task, 1 = right before the question."""
        return (self.key_position - self.haystack_start) / self.haystack_tokens if self.haystack_tokens else 0.0


def trial_rng(seed: int, length: int, trial: int) -> np.random.Generator:
    return np.random.default_rng([seed, length, trial])


def check_depths(depths: list[float] | None) -> list[float] | None:
    if depths is None:
        return None
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad or not depths:
        raise InputError(f"--depths {','.join(map(str, depths))}: every depth must lie in [0, 1] (0 = the key right "
                         "after the task, 1 = right before the question), e.g. --depths 0,0.25,0.5,0.75,1")
    return sorted(set(depths))


def build_prompt(tokenizer, length: int, seed: int, trial: int, depth: float | None = None) -> PasskeyPrompt:
    """The prompt of (seed, length, trial): at most `length` tokens, as close to it as whole sentences allow; the
    key at a random sentence boundary, or at `depth` of the haystack (0..1)."""
    encode = tokenizer.encode
    bos = [tokenizer.bos_id] if tokenizer.bos_id >= 0 else []
    rng = trial_rng(seed, length, trial)
    pass_key = int(rng.integers(1, MAX_PASS_KEY + 1))
    task, key, question = encode(TASK), encode(key_line(pass_key)), encode(QUESTION)
    sentences = [encode(s) for s in SENTENCES]
    fixed = len(bos) + len(task) + len(key) + len(question)
    room = length - fixed  # tokens left for the haystack
    if room < max(len(s) for s in sentences):
        raise InputError(f"passkey length {length} is too short: the task, key line and question alone take "
                         f"{fixed} tokens with this tokenizer; use lengths >= "
                         f"{fixed + max(len(s) for s in sentences)}")
    offsets = [0]  # offsets[j] = haystack tokens of the first j sentences
    while offsets[-1] + len(sentences[(len(offsets) - 1) % len(sentences)]) <= room:
        offsets.append(offsets[-1] + len(sentences[(len(offsets) - 1) % len(sentences)]))
    n = len(offsets) - 1
    if depth is None:
        k = int(rng.integers(0, n + 1))
    else:
        target = depth * offsets[n]
        k = min(range(n + 1), key=lambda j: abs(offsets[j] - target))  # nearest boundary, the earlier on a tie
    haystack = [t for i in range(n) for t in sentences[i % len(sentences)]]
    start = len(bos) + len(task)
    ids = bos + task + haystack[:offsets[k]] + key + haystack[offsets[k]:] + question
    return PasskeyPrompt(ids, pass_key, encode(str(pass_key)), start + offsets[k], len(key), start, offsets[n], k, n)


class PromptClock:
    """The job's size before it starts, one progress bar over this rank's prompts (weighted by prompt tokens, so
    that its rate and ETA hold as the prompts grow), and one ETA line once the first length point is done."""

    def __init__(self, prompt_tokens: int, prompts: int, what: str, show: bool = True):
        self.prompts, self.done = prompts, 0
        if show:
            log.info("passkey: %d prompts (%s), about %s prompt tokens; the time left is estimated after the first "
                     "length", prompts, what, f"{prompt_tokens:,}")
        self.bar = progress_bar(total=prompt_tokens, desc="passkey", unit="tok", unit_scale=True, disable=not show)
        self.start = time.perf_counter()
        self.eta_said = not show

    def prompt_done(self, tokens: int, prompts: int = 1) -> None:
        self.bar.update(tokens)
        self.done += prompts

    def length_done(self) -> None:
        if self.eta_said or self.done == self.prompts:
            return
        self.eta_said = True
        elapsed = time.perf_counter() - self.start
        rate = self.bar.n / elapsed
        log.info("passkey: %d of %d prompts in %s; ETA %s at the measured %.0f prompt tokens/s (longer prompts may "
                 "run slower per token)", self.done, self.prompts, format_duration(elapsed),
                 format_duration((self.bar.total - self.bar.n) / rate), rate)

    def close(self) -> None:
        self.bar.close()


@dataclass
class PromptItem:
    length: int
    depth: float | None  # the cell's depth (needle grid), None for a random depth
    trial: int
    prompt: PasskeyPrompt


def prompt_batches(items: list[PromptItem], batch_size: int) -> list[list[int]]:
    """Indices of `items` in batches of prompts of equal token length (no padding), length point by length point.
    The batches depend on the items only, never on the rank count, so every rank layout decodes the same batches
    (the same numbers, to the last bit)."""
    batches: list[list[int]] = []
    for length in sorted({item.length for item in items}):
        by_size: dict[int, list[int]] = defaultdict(list)
        for i, item in enumerate(items):
            if item.length == length:
                by_size[len(item.prompt.ids)].append(i)
        for size in sorted(by_size):
            group = by_size[size]
            batches += [group[j:j + batch_size] for j in range(0, len(group), batch_size)]
    return batches


def decode_batch(model: EvalModel, tokenizer, items: list[PromptItem]) -> list[dict]:
    """Greedy answers of equal-length prompts, decoded together (each row judged on its own answer's length)."""
    ids = torch.tensor([item.prompt.ids for item in items])  # (B, T)
    new = model.greedy_rows(ids, max(len(item.prompt.answer_ids) for item in items))  # (B, new)
    records = []
    for item, row in zip(items, new.tolist(), strict=True):
        prompt = item.prompt
        generated = tokenizer.decode(row[:len(prompt.answer_ids)])
        records.append({
            "trial": item.trial,
            "target_depth": item.depth,
            "pass_key": prompt.pass_key,
            "key_position": prompt.key_position,
            "key_tokens": prompt.key_tokens,
            "depth": round(prompt.depth, 4),
            "prompt_tokens": len(prompt.ids),
            "generated": generated,
            "correct": generated.strip() == str(prompt.pass_key),
        })
    return records


def summarize_cells(records: list[dict], length: int, depths: list[float]) -> list[dict]:
    """{length, depth, accuracy, correct, n} per depth of one length."""
    cells = []
    for depth in depths:
        hits = [r["correct"] for r in records if r["target_depth"] == depth]
        cells.append({"length": length, "depth": depth, "accuracy": sum(hits) / len(hits), "correct": sum(hits),
                      "n": len(hits)})
    return cells


def evaluate_passkey(
    model: EvalModel, tokenizer, lengths: list[int], trials: int = 20, seed: int = 0,
    depths: list[float] | None = None, batch_size: int = DEFAULT_BATCH_SIZE, ranks: EvalRanks | None = None,
) -> tuple[list[dict], list[dict] | None]:
    """(results, cells). One result per length: {length, accuracy, correct, trials, prompt_tokens, records: [per
    prompt]}; with `depths` (the needle grid) each length has trials prompts per depth and `cells` lists
    {length, depth, accuracy, correct, n} for every (length, depth) (None without depths)."""
    ranks = ranks or EvalRanks()
    if trials < 1:
        raise InputError(f"--trials must be >= 1, got {trials}")
    if batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {batch_size}")
    depths = check_depths(depths)
    for length in lengths:
        if model.max_seq_len and length > model.max_seq_len and ranks.is_main:
            log.warning("passkey length %d > the model's training context %d: evaluating extrapolation", length,
                        model.max_seq_len)
    items = [PromptItem(length, depth, trial, build_prompt(tokenizer, length, seed, trial, depth))
             for length in lengths for depth in (depths or [None]) for trial in range(trials)]
    batches = prompt_batches(items, batch_size)
    mine = ranks.share(len(batches))
    grid = f" x {len(depths)} depths" if depths else ""
    clock = PromptClock(sum(len(items[i].prompt.ids) for b in mine for i in batches[b]),
                        sum(len(batches[b]) for b in mine),
                        f"{len(lengths)} lengths{grid} x {trials} trials, lengths {min(lengths)}..{max(lengths)} "
                        "tokens" + (f", this rank's share of {len(items)}" if ranks.world_size > 1 else ""),
                        show=ranks.is_main)
    local: dict[int, dict] = {}
    for position, b in enumerate(mine):
        batch = [items[i] for i in batches[b]]
        for i, record in zip(batches[b], decode_batch(model, tokenizer, batch), strict=True):
            local[i] = record
        clock.prompt_done(sum(len(item.prompt.ids) for item in batch), len(batch))
        if position + 1 == len(mine) or items[batches[mine[position + 1]][0]].length != batch[0].length:
            clock.length_done()
    clock.close()
    records = ranks.gather(local)
    results, cells = [], [] if depths else None
    for length in lengths:
        mine_records = [records[i] for i, item in enumerate(items) if item.length == length]
        correct = sum(r["correct"] for r in mine_records)
        sizes = [r["prompt_tokens"] for r in mine_records]
        if min(sizes) < length and ranks.is_main:  # whole sentences: say that the length is met from below
            log.info("passkey@%d: prompts of %d-%d tokens (the haystack is whole sentences, so a prompt is the "
                     "longest that fits in %d)", length, min(sizes), max(sizes), length)
        results.append({"length": length, "accuracy": correct / len(mine_records), "correct": correct,
                        "trials": len(mine_records), "prompt_tokens": max(sizes), "records": mine_records})
        if depths:
            cells += summarize_cells(mine_records, length, depths)
    return results, cells


def evaluate_reference_passkey(
    model: EvalModel, tokenizer, protocol: str, max_tokens: int | None = None, interval: int = ref.INTERVAL,
    trials: int | None = None, ranks: EvalRanks | None = None,
) -> list[dict]:
    """The `protocol` script's trials (tapetrain.eval.passkey_reference), one result per length point:
    {length (floor of the mean prompt tokens), n_garbage, accuracy, correct, trials, records}. Trials are split
    over ranks (one prompt at a time, no cache, as the scripts decode)."""
    ranks = ranks or EvalRanks()
    settings = ref.REFERENCES[protocol]
    trials = settings.trials if trials is None else trials
    if trials < 1:
        raise InputError(f"--trials must be >= 1, got {trials}")
    schedule = ref.garbage_schedule(max_tokens or settings.max_tokens, interval)
    jobs = [(n_garbage, seed) for n_garbage in schedule for seed in range(trials)]
    mine = ranks.share(len(jobs))
    # ~3.75 filler characters per token: the schedule's own assumption (n_garbage = 3.75·tokens)
    clock = PromptClock(sum(int(jobs[j][0] / 3.75) for j in mine), len(mine),
                        f"{len(schedule)} lengths x {trials} trials, the {protocol} protocol, filler of "
                        f"{schedule[0]:,}..{schedule[-1]:,} characters", show=ranks.is_main)
    local: dict[int, dict] = {}
    for position, j in enumerate(mine):
        n_garbage, seed = jobs[j]
        trial = ref.reference_trial(n_garbage, seed)
        ids, answer = ref.reference_ids(tokenizer, trial)
        # The scripts generate with use_cache=False and no minimum length: an early EOS is simply a miss.
        generated = model.generate_greedy(torch.tensor([ids]), len(answer), use_cache=False,
                                          suppress_eos=False).tolist()
        local[j] = {
            "trial": seed,
            "seed": seed,
            "pass_key": trial.pass_key,
            "prefix_chars": trial.prefix_chars,
            "depth": round(trial.depth, 4),
            "prompt_tokens": len(ids),
            "answer_ids": answer,
            "generated_ids": generated,
            "generated": tokenizer.decode(generated),
            "correct": generated == answer,
        }
        clock.prompt_done(len(ids))
        if position + 1 == len(mine) or jobs[mine[position + 1]][0] != n_garbage:
            clock.length_done()
    clock.close()
    gathered = ranks.gather(local)
    results = []
    for n_garbage in schedule:
        records = [gathered[j] for j, job in enumerate(jobs) if job[0] == n_garbage]
        correct = sum(r["correct"] for r in records)
        length = sum(r["prompt_tokens"] for r in records) // trials  # the scripts' avg_tokens
        if model.max_seq_len and length > model.max_seq_len and ranks.is_main:
            log.warning("passkey length %d > the model's training context %d: evaluating extrapolation", length,
                        model.max_seq_len)
        results.append({"length": length, "n_garbage": n_garbage, "accuracy": correct / trials, "correct": correct,
                        "trials": trials, "prompt_tokens": max(r["prompt_tokens"] for r in records),
                        "records": records})
    return results


def resolve_passkey_args(protocol: str, lengths, seed, max_tokens, interval, depths=None, batch_size=None) -> None:
    """Each protocol's own knobs only: --lengths/--seed/--depths/--batch-size for tapetrain, --max-tokens/--interval
    for the references."""
    if protocol not in PROTOCOLS:
        raise InputError(f"unknown passkey protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
    if protocol == "tapetrain":
        for name, value in (("--max-tokens", max_tokens), ("--interval", interval)):
            if value is not None:
                raise InputError(f"{name} applies to the reference protocols (tape, longlora); --protocol "
                                 "tapetrain takes --lengths")
    else:
        for name, value in (("--lengths", lengths), ("--seed", seed), ("--depths", depths),
                            ("--batch-size", batch_size)):
            if value is not None:
                raise InputError(f"{name} applies to --protocol tapetrain; the {protocol} protocol sets its lengths "
                                 "with --max-tokens/--interval, seeds its trials 0..trials-1 and decodes one prompt "
                                 "at a time at a random depth, as its script")


def load_tokenizer(model: EvalModel, path: str | None):
    """The tokenizer `path` (a .model, tokenizer.json or model directory; default: the model's), checked against
    the model's vocabulary."""
    from tapetrain.data.tokenizer import open_tokenizer

    path = path or model.tokenizer
    if not path:
        raise InputError(f"no tokenizer for {model.name}: pass --tokenizer PATH (the sentencepiece .model, "
                         "tokenizer.json or model directory the model was trained with)")
    tok = open_tokenizer(path)
    if tok.vocab_size > model.vocab_size:
        raise InputError(f"tokenizer {path} has {tok.vocab_size} tokens but the model's vocab_size is "
                         f"{model.vocab_size}; pass the tokenizer the model was trained with")
    return tok


def passkey_report(
    model: EvalModel, tok, protocol: str, *, lengths: list[int] | None = None, trials: int | None = None,
    seed: int | None = None, depths: list[float] | None = None, batch_size: int | None = None,
    max_tokens: int | None = None, interval: int | None = None, ranks: EvalRanks | None = None,
) -> dict:
    """The result dict `eval passkey --out` writes (every rank returns it)."""
    ranks = ranks or EvalRanks()
    report = {"model": model.name, "model_kind": model.kind, "tokenizer": tok.path, "protocol": protocol,
              "dtype": model.dtype, "trained_context": model.max_seq_len}
    if protocol == "tapetrain":
        trials = TAPETRAIN_TRIALS if trials is None else trials
        seed = 0 if seed is None else seed
        depths = check_depths(depths)
        results, cells = evaluate_passkey(model, tok, sorted(set(lengths or DEFAULT_LENGTHS)), trials, seed, depths,
                                          batch_size or DEFAULT_BATCH_SIZE, ranks)
        texts = {"task": TASK, "filler": FILLER, "sentences": list(SENTENCES), "key_line": KEY_LINE,
                 "question": QUESTION}
        report.update(trials=trials, seed=seed, depths=depths, reference=None)
        if cells is not None:
            report["cells"] = cells
    else:
        settings = ref.REFERENCES[protocol]
        interval = interval or ref.INTERVAL
        max_tokens = max_tokens or settings.max_tokens
        results = evaluate_reference_passkey(model, tok, protocol, max_tokens, interval, trials, ranks)
        texts = {"task": ref.TASK, "filler": ref.FILLER, "key_line": ref.KEY_LINE,
                 "question": ref.QUESTION, "separator": "\n"}
        report.update(trials=results[0]["trials"], seed=None, reference=settings.script, max_tokens=max_tokens,
                      interval=interval)
    report.update(world_size=ranks.world_size, sequence_parallel=ranks.sequence_parallel,
                  context_parallel=ranks.context_parallel, results=results, prompt_texts=texts)
    return report


def run_eval_passkey(
    model_path: str,
    lengths: list[int] | None = None,
    *,
    protocol: Literal["tape", "longlora", "tapetrain"] = "tape",
    trials: int | None = None,
    seed: int | None = None,
    depths: list[float] | None = None,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    interval: int | None = None,
    tokenizer: str | None = None,
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
    step: int | None = None,
    out: str | None = None,
    plot: str | None = None,
    sequence_parallel: int = 1,
    context_parallel: int = 1,
) -> dict:
    """Passkey retrieval across context lengths: a pass key hidden in filler text, then asked for.

    The `tapetrain eval passkey` job (the TAPE repository's or LongLoRA's protocol, or ours with an optional
    needle grid over depths): load, run every length, write JSON/PNG and print a table (rank 0; prompts split
    over ranks under torchrun/deepspeed).

    Args:
        model_path: Hugging Face export directory or run directory
        lengths: tapetrain protocol: prompt lengths in tokens (default 1024,2048,4096,8192)
        protocol: tape = the TAPE repository's eval_retrieval.py, the TAPE paper's passkey figure (20 trials,
            --max-tokens 8192); longlora = LongLoRA's passkey_retrivial.py (10 trials, --max-tokens 32000); both:
            filler of int(3.75*i*interval//1024*1024) characters at length point i, seeds 0..trials-1, token
            match. tapetrain = ours (target token --lengths, key on sentence boundaries, --depths for a needle
            grid; not comparable with the papers)
        trials: trials per length, or per (length, depth) cell with --depths (default: 20 for tape and
            tapetrain, 10 for longlora)
        seed: tapetrain protocol: seed of keys and positions (default 0)
        depths: tapetrain protocol: the needle grid, key depths in [0, 1] (0 = right after the task, 1 = right
            before the question), e.g. 0,0.25,0.5,0.75,1; JSON cells per (length, depth) and a heatmap --plot
        batch_size: tapetrain protocol: equal-length prompts decoded together (default 8)
        max_tokens: tape/longlora: the scripts' --max_tokens (length points = max_tokens // interval)
        interval: tape/longlora: the scripts' --interval (default 1000)
        tokenizer: a sentencepiece .model, a tokenizer.json or a model directory (default: the model's)
        dtype: compute dtype (the references ran fp16)
        step: run directories: checkpoint step (default newest)
        out: result JSON
        plot: PNG of accuracy vs length (with --depths: the heatmap of accuracy per length and depth)
        sequence_parallel: ranks that share each prompt (DeepSpeed-Ulysses), each holding 1/N of its tokens, for
            prompts one GPU cannot hold; greedy decoding then recomputes the whole prompt per answer token (no KV
            cache); needs a run directory and a launch of a multiple of N ranks (torchrun/deepspeed); the answers
            equal one process's
        context_parallel: a ring of R groups that share each prompt (ring attention, past one node), each rank
            holding two opposite chunks of it (split over --sequence-parallel U inside each group: R × U ranks a
            prompt); decoding as with --sequence-parallel, the prompt right-padded to a multiple of 2·R·U
    """
    resolve_passkey_args(protocol, lengths, seed, max_tokens, interval, depths, batch_size)
    check_sequence_parallel(sequence_parallel, model_path, step, generation=True, context_parallel=context_parallel)
    ranks = init_eval_ranks()
    try:
        ranks, shard = start_sequence_parallel(ranks, sequence_parallel, context_parallel)
        # Uncompiled under sequence parallelism: training refuses the all-to-all (and the ring) in compiled layers.
        model = load_eval_model(model_path, dtype, step, compile=False if shard else None)
        model.shard_sequence(shard)
        seed_eval()
        tok = load_tokenizer(model, tokenizer)
        report = passkey_report(model, tok, protocol, lengths=lengths, trials=trials, seed=seed, depths=depths,
                                batch_size=batch_size, max_tokens=max_tokens, interval=interval, ranks=ranks)
    finally:
        ranks.close()
    if ranks.is_main:
        print(format_passkey_table(report))
        if out:
            write_json(out, report, parents=True)
        if plot:
            if report.get("cells"):
                from tapetrain.eval.needle_plots import plot_needle_heatmaps

                plot_needle_heatmaps([report], plot)
            else:
                plot_passkey([report], plot)
    return report

"""Passkey retrieval: find a number hidden in filler text. Three protocols:

  tape       the TAPE repository's eval_retrieval.py exactly (the TAPE paper's passkey figure; default)
  longlora   LongLoRA's passkey_retrivial.py exactly
             (both in tapetrain.eval.passkey_reference: one prompt string with newlines, the key at a random
             character offset of the filler, n_garbage characters per length point, seeds 0..trials−1, greedy
             decoding scored by token match)
  tapetrain  ours, an alternative that is *not* comparable with the papers: Prompt = [BOS] task · filler × k ·
             key line · filler × (n − k) · question, each segment tokenized on its own and joined without
             separators (so the key's token position is exact and lies on a sentence boundary), with n filler
             repetitions filling a target token length (--lengths) and k uniform in [0, n]; the task says
             "memorize it". The pass key X is uniform in 1..50000; both come from a generator seeded by (seed,
             length, trial). The model greedily decodes as many tokens as the answer has; exact match of the
             decoded text with X counts as correct.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from tapetrain.errors import InputError
from tapetrain.eval import passkey_reference as ref
from tapetrain.eval.models import EvalModel, load_eval_model, seed_eval
from tapetrain.eval.report import format_passkey_table, plot_passkey, write_json_atomic
from tapetrain.progress import format_duration
from tapetrain.progress import progress as progress_bar

log = logging.getLogger("tapetrain.eval")

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEY_LINE = "The pass key is {X}. Remember it. {X} is the pass key."
QUESTION = "What is the pass key? The pass key is"
MAX_PASS_KEY = 50000
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
PROTOCOLS = ("tape", "longlora", "tapetrain")
TAPETRAIN_TRIALS = 20


def key_line(pass_key: int) -> str:
    return KEY_LINE.replace("{X}", str(pass_key))


@dataclass
class PasskeyPrompt:
    ids: list[int]
    pass_key: int
    answer_ids: list[int]  # the tokens of str(pass_key): how many tokens to decode
    key_position: int  # token offset of the key line's first token in `ids`
    key_tokens: int  # token length of the key line
    filler_before: int  # filler repetitions before the key line (k of n)
    filler_total: int

    @property
    def depth(self) -> float:
        """Relative position of the key line in the prompt (0 = start, 1 = end)."""
        return self.key_position / len(self.ids)


def trial_rng(seed: int, length: int, trial: int) -> np.random.Generator:
    return np.random.default_rng([seed, length, trial])


def build_prompt(tokenizer, length: int, seed: int, trial: int) -> PasskeyPrompt:
    """The prompt of (seed, length, trial): at most `length` tokens, as close to it as whole fillers allow."""
    encode = tokenizer.encode
    bos = [tokenizer.bos_id] if tokenizer.bos_id >= 0 else []
    rng = trial_rng(seed, length, trial)
    pass_key = int(rng.integers(1, MAX_PASS_KEY + 1))
    task, filler, key, question = encode(TASK), encode(FILLER), encode(key_line(pass_key)), encode(QUESTION)
    fixed = len(bos) + len(task) + len(key) + len(question)
    if fixed > length:
        raise InputError(f"passkey length {length} is too short: the task, key line and question alone take "
                         f"{fixed} tokens with this tokenizer; use lengths >= {fixed + len(filler)}")
    total = (length - fixed) // len(filler)
    before = int(rng.integers(0, total + 1))
    ids = bos + task + filler * before + key + filler * (total - before) + question
    return PasskeyPrompt(ids, pass_key, encode(str(pass_key)), len(bos) + len(task) + before * len(filler),
                         len(key), before, total)


class PromptClock:
    """The job's size before it starts, one progress bar over all prompts (weighted by prompt tokens, so that its
    rate and ETA hold as the prompts grow), and one ETA line once the first length point is done."""

    def __init__(self, tokens_per_length: list[int], trials: int, what: str):
        self.prompts, self.done = len(tokens_per_length) * trials, 0
        total = sum(tokens_per_length) * trials
        log.info("passkey: %d prompts (%d lengths x %d trials, %s), about %s prompt tokens; the time left is "
                 "estimated after the first length", self.prompts, len(tokens_per_length), trials, what, f"{total:,}")
        self.bar = progress_bar(total=total, desc="passkey", unit="tok", unit_scale=True)
        self.start = time.perf_counter()
        self.eta_said = False

    def prompt_done(self, tokens: int) -> None:
        self.bar.update(tokens)
        self.done += 1

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


def evaluate_passkey(model: EvalModel, tokenizer, lengths: list[int], trials: int = 20, seed: int = 0) -> list[dict]:
    """One result per length: {length, accuracy, correct, trials, prompt_tokens, records: [per trial]}."""
    if trials < 1:
        raise InputError(f"--trials must be >= 1, got {trials}")
    results = []
    clock = PromptClock(lengths, trials, f"lengths {min(lengths)}..{max(lengths)} tokens")
    for length in lengths:
        if model.max_seq_len and length > model.max_seq_len:
            log.warning("passkey length %d > the model's training context %d: evaluating extrapolation", length,
                        model.max_seq_len)
        records = []
        for trial in range(trials):
            prompt = build_prompt(tokenizer, length, seed, trial)
            new = model.generate_greedy(torch.tensor([prompt.ids]), len(prompt.answer_ids))
            generated = tokenizer.decode(new.tolist())
            records.append({
                "trial": trial,
                "pass_key": prompt.pass_key,
                "key_position": prompt.key_position,
                "key_tokens": prompt.key_tokens,
                "depth": round(prompt.depth, 4),
                "prompt_tokens": len(prompt.ids),
                "generated": generated,
                "correct": generated.strip() == str(prompt.pass_key),
            })
            clock.prompt_done(length)
        clock.length_done()
        correct = sum(r["correct"] for r in records)
        sizes = [r["prompt_tokens"] for r in records]
        if min(sizes) < length:  # the filler comes in whole sentences: say that the length is met from below
            log.info("passkey@%d: prompts of %d-%d tokens (the filler is whole sentences of %d tokens, so a prompt "
                     "is the longest that fits in %d)", length, min(sizes), max(sizes),
                     len(tokenizer.encode(FILLER)), length)
        results.append({"length": length, "accuracy": correct / trials, "correct": correct, "trials": trials,
                        "prompt_tokens": max(sizes), "records": records})
    clock.close()
    return results


def evaluate_reference_passkey(
    model: EvalModel, tokenizer, protocol: str, max_tokens: int | None = None, interval: int = ref.INTERVAL,
    trials: int | None = None,
) -> list[dict]:
    """The `protocol` script's trials (tapetrain.eval.passkey_reference), one result per length point:
    {length (floor of the mean prompt tokens), n_garbage, accuracy, correct, trials, records}."""
    settings = ref.REFERENCES[protocol]
    trials = settings.trials if trials is None else trials
    if trials < 1:
        raise InputError(f"--trials must be >= 1, got {trials}")
    results = []
    schedule = ref.garbage_schedule(max_tokens or settings.max_tokens, interval)
    # ~3.75 filler characters per token: the schedule's own assumption (n_garbage = 3.75·tokens)
    clock = PromptClock([int(n / 3.75) for n in schedule], trials, f"the {protocol} protocol, filler of "
                        f"{schedule[0]:,}..{schedule[-1]:,} characters")
    for n_garbage in schedule:
        records = []
        for seed in range(trials):
            trial = ref.reference_trial(n_garbage, seed)
            ids, answer = ref.reference_ids(tokenizer, trial)
            # The scripts generate with use_cache=False and no minimum length: an early EOS is simply a miss.
            new = model.generate_greedy(torch.tensor([ids]), len(answer), use_cache=False, suppress_eos=False)
            generated = new.tolist()
            records.append({
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
            })
            clock.prompt_done(len(ids))
        clock.length_done()
        correct = sum(r["correct"] for r in records)
        length = sum(r["prompt_tokens"] for r in records) // trials  # the scripts' avg_tokens
        if model.max_seq_len and length > model.max_seq_len:
            log.warning("passkey length %d > the model's training context %d: evaluating extrapolation", length,
                        model.max_seq_len)
        results.append({"length": length, "n_garbage": n_garbage, "accuracy": correct / trials, "correct": correct,
                        "trials": trials, "prompt_tokens": max(r["prompt_tokens"] for r in records),
                        "records": records})
    clock.close()
    return results


def resolve_passkey_args(protocol: str, lengths, seed, max_tokens, interval) -> None:
    """Each protocol's own knobs only: --lengths/--seed for tapetrain, --max-tokens/--interval for the references."""
    if protocol not in PROTOCOLS:
        raise InputError(f"unknown passkey protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
    if protocol == "tapetrain":
        for name, value in (("--max-tokens", max_tokens), ("--interval", interval)):
            if value is not None:
                raise InputError(f"{name} applies to the reference protocols (tape, longlora); --protocol "
                                 "tapetrain takes --lengths")
    else:
        for name, value in (("--lengths", lengths), ("--seed", seed)):
            if value is not None:
                raise InputError(f"{name} applies to --protocol tapetrain; the {protocol} protocol sets its lengths "
                                 "with --max-tokens/--interval and seeds its trials 0..trials-1, as its script")


def run_eval_passkey(
    model_path: str,
    lengths: list[int] | None = None,
    *,
    protocol: Literal["tape", "longlora", "tapetrain"] = "tape",
    trials: int | None = None,
    seed: int | None = None,
    max_tokens: int | None = None,
    interval: int | None = None,
    tokenizer: str | None = None,
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
    step: int | None = None,
    out: str | None = None,
    plot: str | None = None,
) -> dict:
    """Passkey retrieval across context lengths: a pass key hidden in filler text, then asked for.

    The `tapetrain eval passkey` job (the TAPE repository's or LongLoRA's protocol, or ours): load, run every
    length, write JSON/PNG and print a table.

    Args:
        model_path: Hugging Face export directory or run directory
        lengths: tapetrain protocol: prompt lengths in tokens (default 1024,2048,4096,8192)
        protocol: tape = the TAPE repository's eval_retrieval.py, the TAPE paper's passkey figure (20 trials,
            --max-tokens 8192); longlora = LongLoRA's passkey_retrivial.py (10 trials, --max-tokens 32000); both:
            filler of int(3.75*i*interval//1024*1024) characters at length point i, seeds 0..trials-1, token
            match. tapetrain = ours (target token --lengths, key on sentence boundaries; not comparable with the
            papers)
        trials: trials per length (default: 20 for tape and tapetrain, 10 for longlora)
        seed: tapetrain protocol: seed of keys and positions (default 0)
        max_tokens: tape/longlora: the scripts' --max_tokens (length points = max_tokens // interval)
        interval: tape/longlora: the scripts' --interval (default 1000)
        tokenizer: sentencepiece .model (default: the model's)
        dtype: compute dtype (the references ran fp16)
        step: run directories: checkpoint step (default newest)
        out: result JSON
        plot: PNG of accuracy vs length
    """
    from tapetrain.data.tokenizer import Tokenizer

    resolve_passkey_args(protocol, lengths, seed, max_tokens, interval)
    model = load_eval_model(model_path, dtype, step)
    seed_eval()
    path = tokenizer or model.tokenizer
    if not path:
        raise InputError(f"no tokenizer for {model_path}: pass --tokenizer PATH (the sentencepiece .model the model "
                         "was trained with)")
    tok = Tokenizer(path)
    if tok.vocab_size > model.vocab_size:
        raise InputError(f"tokenizer {path} has {tok.vocab_size} tokens but the model's vocab_size is "
                         f"{model.vocab_size}; pass the tokenizer the model was trained with")
    report = {"model": model.name, "model_kind": model.kind, "tokenizer": tok.path, "protocol": protocol,
              "dtype": dtype, "trained_context": model.max_seq_len}
    if protocol == "tapetrain":
        trials = TAPETRAIN_TRIALS if trials is None else trials
        seed = 0 if seed is None else seed
        results = evaluate_passkey(model, tok, sorted(set(lengths or DEFAULT_LENGTHS)), trials, seed)
        texts = {"task": TASK, "filler": FILLER, "key_line": KEY_LINE, "question": QUESTION}
        report.update(trials=trials, seed=seed, reference=None)
    else:
        settings = ref.REFERENCES[protocol]
        interval = interval or ref.INTERVAL
        max_tokens = max_tokens or settings.max_tokens
        results = evaluate_reference_passkey(model, tok, protocol, max_tokens, interval, trials)
        texts = {"task": ref.TASK, "filler": ref.FILLER, "key_line": ref.KEY_LINE,
                 "question": ref.QUESTION, "separator": "\n"}
        report.update(trials=results[0]["trials"], seed=None, reference=settings.script, max_tokens=max_tokens,
                      interval=interval)
    report.update(results=results, prompt_texts=texts)
    print(format_passkey_table(report))
    if out:
        write_json_atomic(out, report)
    if plot:
        plot_passkey([report], plot)
    return report

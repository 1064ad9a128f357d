"""Passkey retrieval (the LongLoRA / landmark-attention protocol): find a number hidden in filler text.

Prompt = [BOS] task · filler × k · key line · filler × (n − k) · question, each segment tokenized on its own
(so the key's token position is exact), with n filler repetitions filling the target length and k uniform in
[0, n]. The pass key X is uniform in 1..50000; both are drawn from a generator seeded by (seed, length, trial),
so every trial is reproducible. The model greedily decodes as many tokens as the answer has; exact match of the
decoded text with X counts as correct.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from tapetrain.eval.models import EvalModel, load_eval_model
from tapetrain.eval.report import format_passkey_table, plot_passkey, write_json_atomic

log = logging.getLogger("tapetrain.eval")

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEY_LINE = "The pass key is {X}. Remember it. {X} is the pass key."
QUESTION = "What is the pass key? The pass key is"
MAX_PASS_KEY = 50000
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)


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
        raise ValueError(f"passkey length {length} is too short: the task, key line and question alone take "
                         f"{fixed} tokens with this tokenizer; use lengths >= {fixed + len(filler)}")
    total = (length - fixed) // len(filler)
    before = int(rng.integers(0, total + 1))
    ids = bos + task + filler * before + key + filler * (total - before) + question
    return PasskeyPrompt(ids, pass_key, encode(str(pass_key)), len(bos) + len(task) + before * len(filler),
                         len(key), before, total)


def evaluate_passkey(model: EvalModel, tokenizer, lengths: list[int], trials: int = 20, seed: int = 0) -> list[dict]:
    """One result per length: {length, accuracy, correct, trials, prompt_tokens, records: [per trial]}."""
    if trials < 1:
        raise ValueError(f"--trials must be >= 1, got {trials}")
    results = []
    for length in lengths:
        if model.max_seq_len and length > model.max_seq_len:
            log.warning("passkey length %d > the model's training context %d: evaluating extrapolation", length,
                        model.max_seq_len)
        records = []
        for trial in tqdm(range(trials), desc=f"passkey@{length}", unit="trial", dynamic_ncols=True):
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
        correct = sum(r["correct"] for r in records)
        results.append({"length": length, "accuracy": correct / trials, "correct": correct, "trials": trials,
                        "prompt_tokens": max(r["prompt_tokens"] for r in records), "records": records})
    return results


def run_eval_passkey(
    model_path: str,
    lengths: list[int] | None = None,
    *,
    trials: int = 20,
    seed: int = 0,
    tokenizer: str | None = None,
    dtype: str = "fp32",
    step: int | None = None,
    out: str | None = None,
    plot: str | None = None,
) -> dict:
    """The `tapetrain eval-passkey` job: load, run every length, write JSON/PNG and print a table."""
    from tapetrain.data.tokenizer import Tokenizer

    lengths = sorted(set(lengths or DEFAULT_LENGTHS))
    model = load_eval_model(model_path, dtype, step)
    path = tokenizer or model.tokenizer
    if not path:
        raise ValueError(f"no tokenizer for {model_path}: pass --tokenizer PATH (the sentencepiece .model the model "
                         "was trained with)")
    tok = Tokenizer(path)
    if tok.vocab_size > model.vocab_size:
        raise ValueError(f"tokenizer {path} has {tok.vocab_size} tokens but the model's vocab_size is "
                         f"{model.vocab_size}; pass the tokenizer the model was trained with")
    results = evaluate_passkey(model, tok, lengths, trials, seed)
    report = {"model": model.name, "model_kind": model.kind, "tokenizer": tok.path, "trials": trials, "seed": seed,
              "dtype": dtype, "trained_context": model.max_seq_len, "results": results,
              "prompt_texts": {"task": TASK, "filler": FILLER, "key_line": KEY_LINE, "question": QUESTION}}
    print(format_passkey_table(report))
    if out:
        write_json_atomic(out, report)
    if plot:
        plot_passkey([report], plot)
    return report


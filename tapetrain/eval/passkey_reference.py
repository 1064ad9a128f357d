"""The passkey prompts of LongLoRA's passkey_retrivial.py and the TAPE repository's eval_retrieval.py, exactly.

Both scripts (one derived from the other; the landmark-attention / long_llama prompt) build a trial from a filler
character budget n_garbage and a seed:

    rng = numpy's legacy RandomState(seed)                        (np.random.seed(seed) in the scripts)
    prefix_chars = rng.randint(0, n_garbage)                       (high exclusive: 0 .. n_garbage − 1)
    filler = " ".join([FILLER] * 5000)
    prefix, suffix = filler[:prefix_chars], filler[:n_garbage − prefix_chars]   (both cut from the start)
    pass_key = rng.randint(1, 50000)                               (1 .. 49999)
    prompt = "\\n".join([TASK, prefix, KEY_LINE(pass_key), suffix, QUESTION])

tokenized whole, with BOS (Llama's tokenizer), the answer being the tokens of str(pass_key) without BOS. Length
point i (0-based) of `max_tokens // interval` uses n_garbage = int(3.75·(i + 1)·interval // 1024·1024) characters
and trials seeded 0 .. trials − 1 (the same seeds at every length). A trial is correct when the greedy
continuation of len(answer) tokens equals the answer tokens; a length is reported at the floor of its trials' mean
prompt length. The scripts differ only in their defaults: LongLoRA 10 trials up to 32000 tokens, the TAPE
repository 20 trials, run to 8192 tokens in its README (the TAPE paper's passkey figure).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tapetrain.errors import InputError

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = "What is the pass key? The pass key is"
KEY_LINE = "The pass key is {X}. Remember it. {X} is the pass key."
FILLER_REPEATS = 5000  # the scripts' garbage_inf: 450K characters, enough for max_tokens ~100K
INTERVAL = 1000


@dataclass(frozen=True)
class ReferenceSettings:
    """One reference script's defaults: trials per length and the largest length (`--max_tokens`)."""

    script: str
    trials: int
    max_tokens: int


REFERENCES = {
    "tape": ReferenceSettings("TAPE repository eval_retrieval.py (README: --max_tokens 8192 --interval 1000)", 20,
                              8192),
    "longlora": ReferenceSettings("LongLoRA passkey_retrivial.py (argparse defaults)", 10, 32000),
}


def key_line(pass_key: int) -> str:
    return KEY_LINE.replace("{X}", str(pass_key))


def garbage_schedule(max_tokens: int, interval: int = INTERVAL) -> list[int]:
    """Filler characters of each length point: int(3.75·(i+1)·interval // 1024·1024), i < max_tokens // interval."""
    if interval < 1 or max_tokens < interval:
        raise InputError(f"--max-tokens {max_tokens} and --interval {interval} give no length point; the "
                         "references use --interval 1000 with --max-tokens a multiple of it (8192 or 32000)")
    schedule = [int(3.75 * (i + 1) * interval // 1024 * 1024) for i in range(max_tokens // interval)]
    if schedule[0] == 0:
        raise InputError(f"--interval {interval} is too small: its first length point has no filler "
                         "(3.75·interval < 1024 characters); use --interval >= 274")
    if schedule[-1] > len(FILLER) * FILLER_REPEATS:
        raise InputError(f"--max-tokens {max_tokens} needs {schedule[-1]} filler characters, more than the "
                         f"references' {FILLER_REPEATS} filler repeats hold; lower --max-tokens")
    return schedule


@dataclass
class ReferenceTrial:
    text: str
    pass_key: int
    n_garbage: int
    prefix_chars: int  # filler characters before the key line

    @property
    def answer(self) -> str:
        return str(self.pass_key)

    @property
    def depth(self) -> float:
        """Where the key line sits in the filler (0 = right after the task, 1 = right before the question)."""
        return self.prefix_chars / self.n_garbage


def reference_trial(n_garbage: int, seed: int) -> ReferenceTrial:
    """The prompt text of one trial, as generate_prompt_landmark(n_garbage, seed) writes it."""
    rng = np.random.RandomState(seed)  # the scripts reseed numpy's global legacy generator: the same stream
    prefix_chars = int(rng.randint(0, n_garbage))
    filler = " ".join([FILLER] * FILLER_REPEATS)
    pass_key = int(rng.randint(1, 50000))
    lines = [TASK, filler[:prefix_chars], key_line(pass_key), filler[:n_garbage - prefix_chars], QUESTION]
    return ReferenceTrial("\n".join(lines), pass_key, n_garbage, prefix_chars)


def reference_ids(tokenizer, trial: ReferenceTrial) -> tuple[list[int], list[int]]:
    """(prompt ids with BOS, answer ids without BOS): what Llama's tokenizer gives the scripts."""
    bos = [tokenizer.bos_id] if tokenizer.bos_id >= 0 else []
    return bos + tokenizer.encode(trial.text), tokenizer.encode(trial.answer)

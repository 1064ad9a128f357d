"""RULER (Hsieh et al. 2024) through lm-evaluation-harness: its own `ruler` tasks, run on a Hugging Face export.

lm-eval generates every task's data itself, sized with the export's tokenizer to each length in
`max_seq_lengths`, then greedily decodes each task's answer budget. tapetrain only drives it: one harness call
per length (so that every length's samples are its own first `samples`), the per-sample scores kept for
confidence intervals, and a check that each length leaves room for the task (lm-eval's generators of three tasks
loop forever when even their smallest prompt does not fit).

What the tasks need besides the tokenizer (lm-eval 0.4.13):

  offline       niah_single_1, niah_multikey_2, niah_multikey_3 (a repeated sentence or the needle sentence as
                haystack), ruler_vt, ruler_cwe, ruler_fwe: generated locally (wonderwords' word lists ship
                with the package)
  essay         niah_single_2, niah_single_3, niah_multikey_1, niah_multiquery, niah_multivalue: the Hugging
                Face dataset baber/paul_graham_essays (cached by `datasets`) and nltk's punkt_tab (sentence
                splitting; lm-eval tries to download it when it is imported and goes on without it)
  qa            ruler_qa_squad, ruler_qa_hotpot: SQuAD v2 dev and HotpotQA dev JSON, fetched with `requests` on every
                run (no cache): these need the network at run time

docs/evaluation.md ("RULER") says how to pre-cache the essay tasks' files and run offline.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Literal

from tapetrain.errors import InputError, MissingInputError, MissingPackageError
from tapetrain.eval.bounded import bounded

log = logging.getLogger("tapetrain.eval")

OFFLINE_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")
ESSAY_TASKS = ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multiquery", "niah_multivalue")
QA_TASKS = ("ruler_qa_squad", "ruler_qa_hotpot")
TASKS = OFFLINE_TASKS + ESSAY_TASKS + QA_TASKS
DEFAULT_SAMPLES = 100  # per task and length; RULER itself generates 500
HF_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
INSTALL = 'pip install -e ".[lm-eval]" (from a clone of tapetrain)'  # how tapetrain is installed (README)
VT_ICL_LENGTH = 500  # lm-eval sizes ruler_vt's in-context example to this many tokens, whatever the task's length
VT_ANSWER = 30  # ruler_vt's answer budget (tokens_to_generate), counted by its generator in every length
DEFAULT_TIME_LIMIT_MIN = 120.0  # per length: lm-eval's generators loop forever on inputs they cannot size
OUTPUT_LIMIT_BYTES = 1 << 20  # lm-eval's prints per length (its generators print a line per try)


def require_lm_eval():
    try:
        import lm_eval
        from lm_eval.tasks.ruler import common_utils  # noqa: F401 - the ruler tasks' own module
    except ImportError as err:
        raise MissingPackageError(f"RULER runs through lm-evaluation-harness, which is not installed ({err}); "
                                  f"{INSTALL} installs it with its RULER dependencies (nltk, wonderwords)") from err
    return lm_eval


GROUPS = {"ruler": TASKS, "offline": OFFLINE_TASKS, "essay": ESSAY_TASKS, "qa": QA_TASKS}


def resolve_tasks(tasks: list[str] | None) -> list[str]:
    """The tasks to run, checked (default: the offline ones); the group names ruler (all 13), offline, essay and
    qa stand for their tasks."""
    if not tasks:
        return list(OFFLINE_TASKS)
    chosen: list[str] = []
    for name in tasks:
        for task in GROUPS.get(name, (name,)):
            if task not in TASKS:
                raise InputError(f"unknown RULER task {task!r}; choose from {', '.join(TASKS)}, or the groups "
                                 f"{', '.join(GROUPS)} (the default is offline: {', '.join(OFFLINE_TASKS)})")
            if task not in chosen:
                chosen.append(task)
    return chosen


def _vt_tokens(tokenizer, noises: int, icl: bool, draws: int = 8) -> int:
    """The most tokens (prompt + answer) among `draws` of lm-eval's own ruler_vt prompts with `noises` noise lines
    (random variable names tokenize to different lengths); the global RNGs are left as they were."""
    import random

    import numpy as np
    from lm_eval.tasks.ruler import vt_utils

    state = random.getstate(), np.random.get_state()
    random.seed(0)
    np.random.seed(0)
    try:
        longest = 0
        for _ in range(draws):
            text, answer = vt_utils.generate_input_output(noises, 1, 4, is_icl=icl)
            longest = max(longest, len(tokenizer(text + " " + " ".join(answer)).input_ids))
        return longest
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])


def impossible_tasks(tokenizer, tasks: list[str]) -> dict[str, int]:
    """Tasks that no length can run with this tokenizer -> the tokens they would need. ruler_vt: lm-eval sizes its
    in-context example to VT_ICL_LENGTH tokens, starting from 5 noise lines; when that smallest example (plus the
    answer budget) is longer, its generator retries forever, printing a line per try."""
    if "ruler_vt" not in tasks:
        return {}
    icl = _vt_tokens(tokenizer, 5, icl=True) + VT_ANSWER
    return {"ruler_vt": icl} if icl > VT_ICL_LENGTH else {}


def minimum_lengths(tokenizer, tasks: list[str]) -> dict[str, int]:
    """A conservative shortest max_seq_length per task with this tokenizer (prompt template + the smallest
    haystack lm-eval's generator settles on + the task's answer budget + an in-context example)."""
    from lm_eval.tasks.ruler import cwe_utils, fwe_utils, niah_utils

    def count(text: str) -> int:
        return len(tokenizer(text).input_ids)

    needle = "One of the special magic numbers for abundant-example is: 1234567. "
    words = " ".join(f"{i}. adjective" for i in range(1, 71))  # cwe's shortest list: 10 words x 6 + 10
    niah = count(niah_utils.TEMPLATE) + 4 * count(needle) + 128 + 32
    minimum = {
        "ruler_cwe": count(cwe_utils.TEMPLATE) + count(words) + 120,
        "ruler_fwe": 2 * count(fwe_utils.TEMPLATE) + 50 + 200,
    }
    if "ruler_vt" in tasks:
        # the task's first try has 10 noise lines (below that its generator retries forever), next to an
        # in-context example of at most VT_ICL_LENGTH tokens
        minimum["ruler_vt"] = _vt_tokens(tokenizer, 10, icl=False) + VT_ANSWER + VT_ICL_LENGTH
    return {task: minimum.get(task, niah) for task in tasks}


def check_lengths(tokenizer, tasks: list[str], lengths: list[int]) -> None:
    impossible = impossible_tasks(tokenizer, tasks)
    for task, need in impossible.items():
        others = " ".join(t for t in tasks if t != task) or "niah_single_1"
        raise InputError(f"RULER task {task} cannot run with this tokenizer at any length: lm-eval sizes its "
                         f"in-context example to {VT_ICL_LENGTH} tokens, and with this tokenizer the smallest one "
                         f"needs {need} tokens (lm-eval's generator would retry forever); leave it out: --tasks "
                         f"{others}")
    short = {task: need for task, need in minimum_lengths(tokenizer, tasks).items() if min(lengths) < need}
    if short:
        worst = max(short.values())
        raise InputError(f"RULER length {min(lengths)} is too short for {', '.join(sorted(short))} with this "
                         f"tokenizer (their prompt template, smallest haystack, in-context example and answer budget "
                         f"need about {worst} tokens; lm-eval's generators never finish below that): use lengths >= "
                         f"{worst} or leave those tasks out")


def check_export(path: str) -> None:
    if not os.path.isdir(path):
        raise MissingInputError(f"model {path} does not exist; RULER runs on a Hugging Face export (tapetrain "
                                "export hf RUN --out DIR)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise InputError(f"{path} is not a Hugging Face model directory (no config.json): RULER runs through "
                         "lm-eval's `hf` model, so export a run first with `tapetrain export hf RUN --out DIR`")
    if not any(os.path.isfile(os.path.join(path, n)) for n in ("tokenizer.json", "tokenizer_config.json")):
        raise InputError(f"{path} has no Hugging Face tokenizer (tokenizer.json / tokenizer_config.json), which "
                         "RULER needs to size its prompts; re-export with the run's tokenizer (tapetrain export hf "
                         "--tokenizer TOK, a sentencepiece .model, a tokenizer.json or a model directory)")


def sample_record(sample: dict, task: str, length: int, keep_prompts: bool) -> dict:
    """One lm-eval logged sample -> {task, length, doc_id, score, target, generated, prompt_tokens[, prompt,
    max_new_tokens]}; score is RULER's string match for this length (lm-eval logs it under the length's name)."""
    context, gen_kwargs = sample["arguments"][0]
    record = {
        "task": task,
        "length": length,
        "doc_id": sample["doc_id"],
        "score": float(sample[str(length)]),
        "target": sample["doc"]["outputs"],
        "generated": sample["resps"][0][0],
        "prompt_tokens": sample["doc"]["length"],  # RULER's count: prompt + the answer budget
    }
    if keep_prompts:
        record.update(prompt=context, max_new_tokens=gen_kwargs["max_gen_toks"])
    return record


def summarize(records: list[dict], lengths: list[int], tasks: list[str]) -> list[dict]:
    """{length, score (mean over tasks of each task's mean), by_task, n} per length."""
    results = []
    for length in lengths:
        by_task = {}
        for task in tasks:
            scores = [r["score"] for r in records if r["length"] == length and r["task"] == task]
            by_task[task] = sum(scores) / len(scores)
        n = sum(r["length"] == length for r in records)
        results.append({"length": length, "score": sum(by_task.values()) / len(by_task), "by_task": by_task, "n": n})
    return results


def evaluate_ruler(
    export_dir: str, lengths: list[int], tasks: list[str] | None = None, samples: int = DEFAULT_SAMPLES, *,
    batch_size: int = 1, dtype: str = "fp32", seed: int = 0, max_new_tokens: int | None = None,
    keep_prompts: bool = False, device: str | None = None, time_limit_min: float = DEFAULT_TIME_LIMIT_MIN,
) -> dict:
    """Run lm-eval's RULER `tasks` on `export_dir` at every length; the result dict `eval ruler --out` writes:
    {model, tasks, samples, seed, dtype, lm_eval, results: summarize(), records: [per sample]}."""
    lm_eval = require_lm_eval()
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    from tapetrain.distributed import group_world_size, local_device, under_launcher

    check_export(export_dir)
    if under_launcher() or group_world_size() > 1:
        raise InputError("RULER runs in one process (lm-eval's `hf` model spreads a model over GPUs itself); "
                         "run it without torchrun/deepspeed")
    tasks = resolve_tasks(tasks)
    lengths = sorted(set(lengths))
    if samples < 1:
        raise InputError(f"--samples must be >= 1, got {samples}")
    if not time_limit_min > 0:
        raise InputError(f"--time-limit-min must be > 0, got {time_limit_min}")
    tokenizer = AutoTokenizer.from_pretrained(export_dir, trust_remote_code=True)
    check_lengths(tokenizer, tasks, lengths)
    needs_network = [t for t in tasks if t in QA_TASKS]
    if needs_network:
        log.warning("ruler: %s download their data on every run (lm-eval has no offline mode for them)",
                    ", ".join(needs_network))
    device = device or str(local_device())
    lm = HFLM(pretrained=export_dir, trust_remote_code=True, max_length=max(lengths), dtype=HF_DTYPES[dtype],
              device=device, batch_size=batch_size)
    ruler_dir = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "ruler")
    gen_kwargs = {"max_gen_toks": max_new_tokens} if max_new_tokens else None
    records: list[dict] = []
    for length in lengths:
        start = time.perf_counter()
        log.info("ruler@%d: %d tasks x %d samples on %s", length, len(tasks), samples, export_dir)
        # Only lm-eval's ruler folder is indexed (seconds instead of the whole task tree); its metadata sizes the
        # tasks to this one length and names the tokenizer.
        manager = TaskManager(include_path=ruler_dir, include_defaults=False,
                              metadata={"max_seq_lengths": [length], "pretrained": export_dir})
        late = (f"tapetrain eval ruler: error: lm-eval did not finish length {length} within --time-limit-min="
                f"{time_limit_min:g} ({', '.join(tasks)}, {samples} samples); raise --time-limit-min if it was only "
                "slow, or leave out the task whose data generation does not finish (its log lines above)")
        with bounded(60 * time_limit_min, late, OUTPUT_LIMIT_BYTES):
            out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=samples,
                                          log_samples=True, gen_kwargs=gen_kwargs, bootstrap_iters=0,
                                          random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                          fewshot_random_seed=seed)
        for task in tasks:
            records += [sample_record(s, task, length, keep_prompts) for s in out["samples"][task]]
        log.info("ruler@%d: done in %.0f s", length, time.perf_counter() - start)
    import json

    with open(os.path.join(export_dir, "config.json")) as f:
        trained = json.load(f).get("max_position_embeddings")
    return {"model": export_dir, "trained_context": trained, "tasks": tasks, "samples": samples, "seed": seed,
            "dtype": dtype, "max_new_tokens": max_new_tokens, "lm_eval": lm_eval.__version__,
            "results": summarize(records, lengths, tasks), "records": records}


def format_ruler_table(report: dict) -> str:
    lines = [f"RULER (lm-eval {report['lm_eval']}) of {report['model']}: {len(report['tasks'])} tasks x "
             f"{report['samples']} samples per length",
             f"{'length':>8} {'score':>7}  " + " ".join(f"{t:>15}" for t in report["tasks"])]
    for r in report["results"]:
        lines.append(f"{r['length']:>8} {100 * r['score']:>6.1f}%  "
                     + " ".join(f"{100 * r['by_task'][t]:>14.1f}%" for t in report["tasks"]))
    return "\n".join(lines)


def run_eval_ruler(
    model_path: str,
    lengths: list[int],
    *,
    tasks: list[str] | None = None,
    samples: int = DEFAULT_SAMPLES,
    batch_size: int = 1,
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
    seed: int = 0,
    max_new_tokens: int | None = None,
    out: str | None = None,
    plot: str | None = None,
    time_limit_min: float = DEFAULT_TIME_LIMIT_MIN,
) -> dict:
    """RULER's synthetic long-context tasks through lm-evaluation-harness on a Hugging Face export.

    lm-eval generates each task's prompts with the export's tokenizer at every length and decodes greedily;
    tapetrain collects the per-sample scores (mean over tasks per length). Needs `pip install -e ".[lm-eval]"` in a
    clone of tapetrain.

    Args:
        model_path: Hugging Face export directory (tapetrain export hf; RoPE models export as plain Llama)
        lengths: lm-eval's max_seq_lengths, e.g. 4096,8192
        tasks: RULER tasks or groups: offline (the default: niah_single_1 niah_multikey_2 niah_multikey_3 ruler_vt
            ruler_cwe ruler_fwe), essay (5 tasks on Paul Graham's essays, need cached files), qa (2, need the
            network), ruler (all 13); see docs/evaluation.md
        samples: samples per task and length (RULER generates 500)
        batch_size: lm-eval's batch size (prompts of a task are left-padded to one length)
        dtype: compute dtype
        seed: lm-eval's seeds (python, numpy, torch): RULER's data generation and decoding
        max_new_tokens: cap every task's answer budget (smoke runs; default each task's own: niah 128, vt 30,
            cwe 120, fwe 50, qa 32)
        out: result JSON (per-length scores and every sample)
        plot: PNG of the RULER score vs length
        time_limit_min: minutes lm-eval may take per length (data generation and decoding); beyond it the job
            stops with exit status 1 (lm-eval's generators loop forever on prompts they cannot size)
    """
    report = evaluate_ruler(model_path, lengths, tasks, samples, batch_size=batch_size, dtype=dtype, seed=seed,
                            max_new_tokens=max_new_tokens, time_limit_min=time_limit_min)
    print(format_ruler_table(report))
    if out:
        from tapetrain.atomic_io import write_json

        write_json(out, report, parents=True)
    if plot:
        from tapetrain.eval.report import plot_ruler

        plot_ruler([report], plot)
    return report

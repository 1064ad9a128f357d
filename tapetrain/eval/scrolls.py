"""`tapetrain eval scrolls`: generate answers for a SCROLLS split and score them with SCROLLS' metrics.

Generation follows the TAPE paper's official evaluation: the prompt is built exactly as for fine-tuning
(tapetrain.data.scrolls.PromptBuilder); QA tasks decode greedily for at most 200 new tokens; summaries sample
(temperature 1) for at most 1000 new tokens, with top-k 3 (summ_screen_fd, qmsum) or top-p 1 with transformers'
default top-k 50 (gov_report, where the official code passed only top_p); earlier revisions of the official script
decoded summaries greedily too. Decoding stops at EOS and uses the KV cache. Each example's sampling is seeded by
(--seed, its index), so results repeat. Ids are split among ranks under torchrun / the deepspeed launcher and the
predictions gathered. `--predictions PRED.json` ({id: text}) skips the model and scores the given predictions.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Literal

import torch

from tapetrain.atomic_io import write_json
from tapetrain.data.scrolls import TASKS, PromptBuilder, ScrollsTask, iter_records, references_by_id
from tapetrain.distributed import EvalRanks, init_eval_ranks
from tapetrain.errors import InputError, MissingInputError
from tapetrain.eval.decoding import GREEDY, Sampling, generate
from tapetrain.eval.models import EvalModel, load_eval_model
from tapetrain.eval.scrolls_metrics import TASK_METRIC, score
from tapetrain.progress import progress as progress_bar

log = logging.getLogger("tapetrain.eval")

SAMPLING = {
    "gov_report": Sampling(temperature=1.0, top_k=50, top_p=1.0),
    "summ_screen_fd": Sampling(temperature=1.0, top_k=3),
    "qmsum": Sampling(temperature=1.0, top_k=3),
}


def sampling_for(task: str) -> Sampling:
    return SAMPLING.get(task, GREEDY)


def generate_predictions(model: EvalModel, tokenizer, task: str, inputs: dict[str, str], *, seq_len: int = 8192,
                         max_answer_tokens: int | None = None, seed: int = 0,
                         ranks: EvalRanks | None = None) -> dict[str, str]:
    """{id: generated text} for this rank's share of `inputs` (ids in order, every world_size-th one)."""
    ranks = ranks or EvalRanks()
    builder = PromptBuilder(task, tokenizer, seq_len, max_answer_tokens)
    sampling = sampling_for(task)
    ids = list(inputs)
    mine = ranks.share(len(ids))
    out: dict[str, str] = {}
    new_tokens, start = 0, time.perf_counter()
    bar = progress_bar(mine, desc=f"eval scrolls {task}", unit="example", disable=not ranks.is_main)
    for index in bar:
        prompt, _ = builder.prompt(inputs[ids[index]])
        torch.manual_seed(seed * 1_000_003 + index)  # transformers samples from the global generator
        generator = torch.Generator(device=model.device).manual_seed(seed * 1_000_003 + index)
        cont = generate(model, torch.tensor([prompt]), builder.max_answer, tokenizer.eos_id, sampling, generator)[0]
        out[ids[index]] = tokenizer.decode(cont.tokens)
        new_tokens += len(cont.tokens)
        bar.set_postfix_str(f"{new_tokens / (time.perf_counter() - start):.1f} new tok/s", refresh=False)
    return out


def read_predictions(path: str) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as f:
            predictions = json.load(f)
    except FileNotFoundError as err:
        raise MissingInputError(f"--predictions {path} does not exist") from err
    except json.JSONDecodeError as err:
        raise InputError(f"--predictions {path} is not JSON ({err}); write {{\"id\": \"prediction\", ...}}") from err
    if not isinstance(predictions, dict):
        raise InputError(f"--predictions {path} must hold a JSON object mapping ids to predicted text")
    return predictions


def format_scrolls_line(report: dict) -> str:
    """One console line; the scores are percentages (scrolls_metrics), printed with their sign."""
    parts = [f"{k} {v:.2f}%" for k, v in report["scores"].items() if isinstance(v, float) and k != "scrolls_score"]
    return (f"SCROLLS {report['task']} ({report['num_predicted']} ids) of {report['model']}: "
            f"{report['scores']['scrolls_score_key']} = {report['scores']['scrolls_score']:.2f}% ({', '.join(parts)})")


def run_eval_scrolls(model_path: str, task: ScrollsTask, data: str, out: str, *, predictions: str | None = None,
                     tokenizer: str | None = None, seq_len: int = 8192, max_answer_tokens: int | None = None,
                     max_examples: int | None = None, seed: int = 0, dtype: Literal["fp32", "bf16"] = "fp32",
                     step: int | None = None) -> dict:
    """SCROLLS generation and scoring (EM, F1, ROUGE).

    Generates answers for SCROLLS records as the TAPE paper's code did (greedy QA, sampled summaries) and scores
    them with SCROLLS' metrics; or scores --predictions. Runs on several ranks under torchrun/deepspeed.

    Args:
        model_path: run directory or Hugging Face export (not loaded with --predictions)
        task: the SCROLLS task
        data: SCROLLS records with outputs (the validation split): .jsonl/.json/.parquet or
            hf:tau/scrolls:NAME:validation
        out: result JSON: scores, settings and every prediction
        predictions: score these predictions (a JSON file {id: text}) instead of generating
        tokenizer: a sentencepiece .model, a tokenizer.json or a model directory (default: the model's)
        seq_len: prompt + answer budget, as in fine-tuning
        max_answer_tokens: new tokens at most (default: 200 for QA, 1000 for summaries)
        max_examples: evaluate the first N ids only
        seed: sampling seed of the summary tasks
        dtype: compute dtype
        step: run directories: checkpoint step (default newest)
    """
    from tapetrain.data.tokenizer import open_tokenizer

    if task not in TASKS:
        raise InputError(f"unknown SCROLLS task {task!r}; choose one of {', '.join(sorted(TASKS))}")
    inputs, references = references_by_id(list(iter_records(data)))
    if max_examples is not None:
        keep = list(inputs)[:max_examples]
        inputs, references = {i: inputs[i] for i in keep}, {i: references[i] for i in keep}
    start = time.perf_counter()
    ranks = EvalRanks()
    if predictions:
        predicted = read_predictions(predictions)
        settings: dict = {"source": predictions}
        name = model_path
    else:
        ranks = init_eval_ranks()
        try:
            model = load_eval_model(model_path, dtype, step)
            path = tokenizer or model.tokenizer
            if not path:
                raise InputError(f"no tokenizer for {model_path}: pass --tokenizer PATH (the sentencepiece "
                                 ".model, tokenizer.json or model directory the model was trained with)")
            tok = open_tokenizer(path)
            local = generate_predictions(model, tok, task, inputs, seq_len=seq_len,
                                         max_answer_tokens=max_answer_tokens, seed=seed, ranks=ranks)
            predicted = ranks.gather(local)
        finally:
            ranks.close()
        sampling = sampling_for(task)
        settings = {"greedy": sampling.greedy, "temperature": sampling.temperature, "top_k": sampling.top_k,
                    "top_p": sampling.top_p, "seq_len": seq_len,
                    "max_new_tokens": PromptBuilder(task, tok, seq_len, max_answer_tokens).max_answer,
                    "seed": seed, "tokenizer": tok.path, "kv_cache": True}
        name = model.name
    scores = score(task, predicted, references)
    report = {"model": name, "task": task, "metric": TASK_METRIC[task], "data": data, "generation": settings,
              "num_predicted": scores["num_predicted"], "scores": scores, "world_size": ranks.world_size,
              "seconds": round(time.perf_counter() - start, 2), "predictions": predicted}
    if ranks.is_main:
        print(format_scrolls_line(report))
        write_json(out, report, parents=True)
    return report

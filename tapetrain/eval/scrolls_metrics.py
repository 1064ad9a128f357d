"""SCROLLS' metrics (Shaham et al. 2022), as its official scorer defines them, on {id: prediction} and
{id: [references]} maps.

  exact_match  QuALITY, ContractNLI  1 if the normalised prediction equals a normalised reference
  f1           Qasper, NarrativeQA    token F1 of the normalised texts (SQuAD style, bag of words)
  rouge        GovReport, SummScreenFD, QMSum  ROUGE-1/2/L F-measures (the `rouge-score` package, no stemming)
               and their geometric mean, the task's SCROLLS score

Normalisation for EM and F1 is SQuAD's: lower case, drop punctuation, drop the articles a/an/the, collapse
whitespace. With several references, each prediction takes its best score per metric (max over references;
for ROUGE each of R-1, R-2, R-L separately). Scores are averaged over ids and reported in percent; the ROUGE
geometric mean is taken of the three averages, as the official scorer does.
"""

from __future__ import annotations

import functools
import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence

from tapetrain.errors import InputError, MissingPackageError

TASK_METRIC = {
    "quality": "exact_match",
    "contract_nli": "exact_match",
    "qasper": "f1",
    "narrative_qa": "f1",
    "gov_report": "rouge",
    "summ_screen_fd": "rouge",
    "qmsum": "rouge",
}
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def token_f1(prediction: str, reference: str) -> float:
    """Harmonic mean of bag-of-words precision and recall of the normalised texts (0 without overlap)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def rouge_scores(prediction: str, reference: str) -> dict[str, float]:
    """{rouge1, rouge2, rougeL}: F-measures in [0, 1] (rouge-score's tokenizer: lower case, alphanumeric runs)."""
    scores = _rouge_scorer().score(reference, prediction)
    return {name: scores[name].fmeasure for name in ROUGE_TYPES}


@functools.cache
def _rouge_scorer():
    try:
        from rouge_score import rouge_scorer
    except ImportError as err:
        raise MissingPackageError("SCROLLS' summary tasks are scored with the `rouge-score` package, which is not "
                                  "installed; run: pip install 'tapetrain[scrolls]' (or pip install rouge-score)"
                                  ) from err

    return rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=False)


def check_ids(predictions: Mapping[str, str], references: Mapping[str, Sequence[str]]) -> None:
    """The official scorer's format checks: a prediction for every id and none for unknown ids, all strings."""
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in predictions.items()):
        raise InputError("predictions must map id strings to prediction strings, e.g. {\"id1\": \"text\"}")
    missing = sorted(set(references) - set(predictions))
    extra = sorted(set(predictions) - set(references))
    if missing or extra:
        raise InputError(f"predictions and references disagree on ids: {len(missing)} missing (e.g. {missing[:3]}), "
                         f"{len(extra)} unknown (e.g. {extra[:3]}); predict every id of the data file and no other")


def score(task: str, predictions: Mapping[str, str], references: Mapping[str, Sequence[str]]) -> dict:
    """The task's metric over all ids: {metric keys in percent, scrolls_score, num_predicted}."""
    if task not in TASK_METRIC:
        raise InputError(f"unknown SCROLLS task {task!r}; choose one of {', '.join(sorted(TASK_METRIC))}")
    check_ids(predictions, references)
    if not references:
        raise InputError("no references to score against; the data file holds no example")
    ids = sorted(references)
    metric = TASK_METRIC[task]
    if metric == "rouge":
        best = {name: [] for name in ROUGE_TYPES}
        for i in ids:
            per_ref = [rouge_scores(predictions[i], ref) for ref in references[i]]
            for name in ROUGE_TYPES:
                best[name].append(max(s[name] for s in per_ref))
        result = {f"rouge/{name}": 100 * sum(v) / len(v) for name, v in best.items()}
        result["rouge/geometric_mean"] = (result["rouge/rouge1"] * result["rouge/rouge2"]
                                          * result["rouge/rougeL"]) ** (1 / 3)
        key = "rouge/geometric_mean"
    else:
        fn = exact_match if metric == "exact_match" else token_f1
        result = {metric: 100 * sum(max(fn(predictions[i], ref) for ref in references[i]) for i in ids) / len(ids)}
        key = metric
    return {**result, "scrolls_score": result[key], "scrolls_score_key": key, "num_predicted": len(ids)}

"""The evaluations `tapetrain compare --suite` runs, one class each over the eval package's own functions (so a
compare result is exactly what `tapetrain eval ppl/passkey/ruler` writes for the same settings).

An evaluation says which settings make its result (the cache key), checks what it can before any model runs,
computes one model's result, and reads its numbers per length with a bootstrap interval. A new evaluation (arith,
scrolls) is one more class in SUITES.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tapetrain.compare.cache import SETTINGS_KEY
from tapetrain.errors import InputError
from tapetrain.eval.bootstrap import mean_interval, paired_mean_interval, paired_ppl_interval, ppl_interval

if TYPE_CHECKING:
    from tapetrain.compare.entries import ModelEntry
    from tapetrain.compare.models import ModelHandle
    from tapetrain.distributed import EvalRanks


@dataclass
class CompareOptions:
    lengths: list[int]
    seed: int = 0
    dtype: str = "fp32"
    resamples: int = 1000
    tokenizer: str | None = None  # for every model instead of its own (text data, needle prompts)
    # ppl
    data: str | None = None
    split: str | None = None
    max_tokens: int | None = None
    protocol: str = "nonoverlap"
    stride: int | None = None
    ppl_batch_size: int = 1
    # needle
    needle_lengths: list[int] | None = None  # default: lengths
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    trials: int = 10
    needle_batch_size: int = 8
    # ruler
    ruler_lengths: list[int] | None = None  # default: lengths
    ruler_tasks: list[str] | None = None
    ruler_samples: int = 100
    ruler_batch_size: int = 1
    ruler_max_new_tokens: int | None = None


def tokenizer_setting(options: CompareOptions) -> dict:
    """--tokenizer in a result's settings (by content, so a cached result is reused only with the same one)."""
    if not options.tokenizer:
        return {}
    from tapetrain.data.tokenizer import resolve_tokenizer_file
    from tapetrain.eval.models import _file_sha256

    return {"tokenizer_sha256": _file_sha256(resolve_tokenizer_file(options.tokenizer))}


@dataclass
class LengthValue:
    """One table cell: the point estimate at a length, its bootstrap interval and the sample it rests on."""

    length: int
    value: float
    low: float
    high: float
    n: int  # windows (ppl), prompts (needle) or samples (ruler)


def unpaired_settings(ref: dict, report: dict) -> str | None:
    """Why two results are not of the same data and protocol (their compare settings but the model), or None."""
    a, b = ({k: v for k, v in r.get(SETTINGS_KEY, {}).items() if k != "model"} for r in (ref, report))
    changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return f"computed with different {', '.join(changed)}" if changed else None


def at_length(report: dict, length: int) -> dict:
    (result,) = [r for r in report["results"] if r["length"] == length]
    return result


class Evaluation:
    name = ""
    title = ""
    better = "lower"  # or "higher"
    percent = False  # show as a percentage
    unit = ""  # what n counts
    needs_export = False

    def lengths(self, options: CompareOptions) -> list[int]:
        """The context lengths of this evaluation's table (--lengths unless the evaluation has its own)."""
        return options.lengths

    def settings(self, options: CompareOptions) -> dict:
        raise NotImplementedError

    def check(self, options: CompareOptions, entries: list[ModelEntry]) -> None:
        """Everything that can be checked before the first model runs."""

    def compute(self, handle: ModelHandle, options: CompareOptions, ranks: EvalRanks) -> dict:
        raise NotImplementedError

    def values(self, report: dict, options: CompareOptions) -> list[LengthValue]:
        raise NotImplementedError

    def describe(self, options: CompareOptions) -> str:
        """One line under the table: the protocol and what the interval resamples."""
        raise NotImplementedError

    def unpaired(self, ref: dict, report: dict, length: int) -> str | None:
        """Why `report` cannot be paired with `ref` at `length` (not the same windows/prompts), or None."""
        raise NotImplementedError

    def paired(self, ref: dict, report: dict, length: int, options: CompareOptions) -> LengthValue:
        """report − ref at `length` with its paired bootstrap interval (the same resampled windows/trials for both);
        only where unpaired() is None."""
        raise NotImplementedError


class Perplexity(Evaluation):
    name, title, better, unit = "ppl", "Perplexity", "lower", "windows"
    PROTOCOLS = ("nonoverlap", "sliding", "longlora")  # token-weighted: the bootstrap resamples windows

    def settings(self, options: CompareOptions) -> dict:
        from tapetrain.compare.models import data_identity

        return {"lengths": options.lengths, "data": data_identity(options.data), "split": options.split,
                "max_tokens": options.max_tokens, "protocol": options.protocol, "stride": options.stride,
                "dtype": options.dtype, **tokenizer_setting(options)}

    def check(self, options: CompareOptions, entries: list[ModelEntry]) -> None:
        from tapetrain.errors import MissingInputError
        from tapetrain.eval.ppl import resolve_protocol
        from tapetrain.eval.tokens import open_eval_tokens

        if not options.data:
            raise InputError("--suite ppl needs --data (a `tapetrain data prepare` directory, a flat .bin or text): "
                             "every model is scored on the same tokens")
        if not os.path.exists(options.data):
            raise MissingInputError(f"--data {options.data} does not exist; pass a `tapetrain data prepare` output "
                                    "directory, a flat .bin token file or a text file")
        if options.protocol not in self.PROTOCOLS:
            raise InputError(f"compare's ppl takes --protocol {', '.join(self.PROTOCOLS)} (token-weighted, so that "
                             f"windows can be resampled), not {options.protocol}; run `tapetrain eval ppl "
                             f"--protocol {options.protocol}` on its own")
        resolve_protocol(options.protocol, options.stride)
        if os.path.isdir(options.data) or options.data.endswith(".bin"):  # text is tokenized per model, later
            tokens = open_eval_tokens(options.data, split=options.split).limited(options.max_tokens)
            check_data_lengths(tokens, options, "every model")

    def compute(self, handle: ModelHandle, options: CompareOptions, ranks: EvalRanks) -> dict:
        from tapetrain.eval.ppl import open_model_tokens, ppl_report

        model = handle.model()
        tokens = open_model_tokens(model, options.data, tokenizer=options.tokenizer, split=options.split,
                                   max_tokens=options.max_tokens)
        check_data_lengths(tokens, options, handle.run.key)
        return ppl_report(model, tokens, options.lengths, options.protocol, stride=options.stride,
                          batch_size=options.ppl_batch_size, ranks=ranks, max_tokens=options.max_tokens)

    def values(self, report: dict, options: CompareOptions) -> list[LengthValue]:
        out = []
        for r in report["results"]:
            low, high = ppl_interval(r["window_nll"], r["window_tokens"], options.resamples, options.seed)
            out.append(LengthValue(r["length"], r["ppl"], low, high, r["windows"]))
        return out

    def describe(self, options: CompareOptions) -> str:
        return (f"Token-weighted perplexity ({options.protocol} windows) on `{options.data}`; lower is better. "
                f"[low, high]: 95% bootstrap interval over windows ({options.resamples} resamples, seed "
                f"{options.seed}).")

    def unpaired(self, ref: dict, report: dict, length: int) -> str | None:
        why = unpaired_settings(ref, report)
        if why:
            return why
        if (ref["data"], ref["data_tokens"]) != (report["data"], report["data_tokens"]):
            return f"scored {report['data_tokens']} tokens of {report['data']}, the reference {ref['data_tokens']} " \
                   f"of {ref['data']}"
        a, b = at_length(ref, length), at_length(report, length)
        if a["window_tokens"] != b["window_tokens"]:
            return f"not the same windows ({b['windows']} against the reference's {a['windows']})"
        return None

    def paired(self, ref: dict, report: dict, length: int, options: CompareOptions) -> LengthValue:
        a, b = at_length(ref, length), at_length(report, length)
        low, high = paired_ppl_interval(a["window_nll"], a["window_tokens"], b["window_nll"], b["window_tokens"],
                                        options.resamples, options.seed)
        return LengthValue(length, b["ppl"] - a["ppl"], low, high, b["windows"])


def check_data_lengths(tokens, options: CompareOptions, who: str) -> None:
    from tapetrain.eval.windows import tokens_needed

    too_long = [n for n in options.lengths if tokens_needed(n, options.protocol) > tokens.num_tokens]
    if too_long:
        fits = [n for n in options.lengths if n not in too_long]
        raise InputError(f"--lengths {','.join(map(str, too_long))} need more eval data than {tokens.description} "
                         f"holds for {who} ({tokens.num_tokens} tokens; length L needs at least "
                         f"{tokens_needed(min(too_long), options.protocol)} for one window at {min(too_long)}): "
                         + (f"drop them (--lengths {','.join(map(str, fits))}), " if fits else "")
                         + "use more data or raise --max-tokens")


class Needle(Evaluation):
    name, title, better, percent, unit = "needle", "Needle in a haystack (passkey grid)", "higher", True, "prompts"

    def lengths(self, options: CompareOptions) -> list[int]:
        return options.needle_lengths or options.lengths

    def settings(self, options: CompareOptions) -> dict:
        return {"lengths": self.lengths(options), "depths": options.depths, "trials": options.trials,
                "seed": options.seed, "dtype": options.dtype, "protocol": "tapetrain", **tokenizer_setting(options)}

    def check(self, options: CompareOptions, entries: list[ModelEntry]) -> None:
        from tapetrain.data.tokenizer import open_tokenizer
        from tapetrain.eval.passkey import build_prompt, check_depths

        check_depths(options.depths)
        if options.trials < 1:
            raise InputError(f"--trials must be >= 1, got {options.trials}")
        shortest = min(self.lengths(options))
        for path, label in {options.tokenizer or r.tokenizer(): r.key for e in entries for r in e.runs}.items():
            if path is None or not os.path.isfile(path):
                continue  # said when the model loads
            try:
                build_prompt(open_tokenizer(path), shortest, options.seed, 0, 0.0)
            except InputError as err:
                raise InputError(f"needle, {label}: {err} (--needle-lengths sets the needle grid's lengths apart "
                                 "from --lengths)") from err

    def compute(self, handle: ModelHandle, options: CompareOptions, ranks: EvalRanks) -> dict:
        from tapetrain.eval.passkey import load_tokenizer, passkey_report

        model = handle.model()
        tok = load_tokenizer(model, options.tokenizer)
        return passkey_report(model, tok, "tapetrain", lengths=self.lengths(options),
                              trials=options.trials, seed=options.seed, depths=options.depths,
                              batch_size=options.needle_batch_size, ranks=ranks)

    def values(self, report: dict, options: CompareOptions) -> list[LengthValue]:
        out = []
        for r in report["results"]:
            hits = [float(rec["correct"]) for rec in r["records"]]
            low, high = mean_interval(hits, options.resamples, options.seed)
            out.append(LengthValue(r["length"], r["accuracy"], low, high, len(hits)))
        return out

    def describe(self, options: CompareOptions) -> str:
        depths = ", ".join(f"{d:g}" for d in options.depths)
        return (f"Passkey accuracy (tapetrain protocol), the key at depths {depths} of the haystack, {options.trials} "
                f"trials per (length, depth), seed {options.seed}; each column is the mean over depths. [low, high]: "
                f"95% bootstrap interval over prompts ({options.resamples} resamples).")

    PROMPT = ("trial", "target_depth", "pass_key", "key_position", "prompt_tokens")  # what makes a prompt the same

    def unpaired(self, ref: dict, report: dict, length: int) -> str | None:
        why = unpaired_settings(ref, report)
        if why:
            return why
        prompts = [[[rec[k] for k in self.PROMPT] for rec in at_length(r, length)["records"]] for r in (ref, report)]
        return None if prompts[0] == prompts[1] else "not the same prompts (another tokenizer?)"

    def paired(self, ref: dict, report: dict, length: int, options: CompareOptions) -> LengthValue:
        a, b = at_length(ref, length), at_length(report, length)
        hits = [[float(rec["correct"]) for rec in r["records"]] for r in (a, b)]
        low, high = paired_mean_interval(hits[0], hits[1], options.resamples, options.seed)
        return LengthValue(length, b["accuracy"] - a["accuracy"], low, high, len(hits[1]))


class Ruler(Evaluation):
    name, title, better, percent, unit, needs_export = "ruler", "RULER (lm-evaluation-harness)", "higher", True, \
        "samples", True

    def lengths(self, options: CompareOptions) -> list[int]:
        return options.ruler_lengths or options.lengths

    def settings(self, options: CompareOptions) -> dict:
        from tapetrain.eval.ruler import require_lm_eval, resolve_tasks

        return {"lengths": self.lengths(options), "tasks": resolve_tasks(options.ruler_tasks),
                "samples": options.ruler_samples, "seed": options.seed, "dtype": options.dtype,
                "max_new_tokens": options.ruler_max_new_tokens, "lm_eval": require_lm_eval().__version__}

    def check(self, options: CompareOptions, entries: list[ModelEntry]) -> None:
        from tapetrain.distributed import under_launcher
        from tapetrain.eval.ruler import require_lm_eval, resolve_tasks

        require_lm_eval()
        resolve_tasks(options.ruler_tasks)
        if under_launcher():
            raise InputError("--suite ruler runs in one process (lm-eval); run compare without torchrun/deepspeed, "
                             "or leave ruler out of --suite")

    def compute(self, handle: ModelHandle, options: CompareOptions, ranks: EvalRanks) -> dict:
        from tapetrain.eval.ruler import evaluate_ruler

        return evaluate_ruler(handle.export_dir(), self.lengths(options), options.ruler_tasks, options.ruler_samples,
                              batch_size=options.ruler_batch_size, dtype=options.dtype, seed=options.seed,
                              max_new_tokens=options.ruler_max_new_tokens)

    def values(self, report: dict, options: CompareOptions) -> list[LengthValue]:
        out = []
        for r in report["results"]:
            records = [rec for rec in report["records"] if rec["length"] == r["length"]]
            low, high = mean_interval([rec["score"] for rec in records], options.resamples, options.seed,
                                      strata=[rec["task"] for rec in records])
            out.append(LengthValue(r["length"], r["score"], low, high, len(records)))
        return out

    def describe(self, options: CompareOptions) -> str:
        from tapetrain.eval.ruler import resolve_tasks

        tasks = resolve_tasks(options.ruler_tasks)
        cap = f", answers capped at {options.ruler_max_new_tokens} tokens" if options.ruler_max_new_tokens else ""
        return (f"Mean RULER score over {len(tasks)} tasks ({', '.join(tasks)}), {options.ruler_samples} samples per "
                f"task and length, lm-eval's generators seeded {options.seed}{cap}. [low, high]: 95% bootstrap "
                f"interval over samples, resampled within each task ({options.resamples} resamples).")

    @staticmethod
    def _records(report: dict, length: int) -> list[dict]:
        return [rec for rec in report["records"] if rec["length"] == length]

    def unpaired(self, ref: dict, report: dict, length: int) -> str | None:
        why = unpaired_settings(ref, report)
        if why:
            return why
        samples = [[(rec["task"], rec["doc_id"]) for rec in self._records(r, length)] for r in (ref, report)]
        return None if samples[0] == samples[1] else "not the same samples (task, doc_id)"

    def paired(self, ref: dict, report: dict, length: int, options: CompareOptions) -> LengthValue:
        a, b = self._records(ref, length), self._records(report, length)
        low, high = paired_mean_interval([rec["score"] for rec in a], [rec["score"] for rec in b],
                                         options.resamples, options.seed, strata=[rec["task"] for rec in b])
        return LengthValue(length, at_length(report, length)["score"] - at_length(ref, length)["score"], low, high,
                           len(b))


SUITES: dict[str, Evaluation] = {e.name: e for e in (Perplexity(), Needle(), Ruler())}
NOT_YET = {"arith": "tapetrain eval arith / tools/arith_compare.py", "scrolls": "tapetrain eval scrolls"}


def parse_suite(text: str) -> list[Evaluation]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise InputError(f"--suite {text!r} names no evaluation; choose from {', '.join(SUITES)}")
    for name in names:
        if name in NOT_YET:
            raise InputError(f"--suite {name} is not part of compare yet; run {NOT_YET[name]} on each model, and "
                             f"compare chooses from {', '.join(SUITES)}")
        if name not in SUITES:
            raise InputError(f"unknown evaluation {name!r} in --suite; choose from {', '.join(SUITES)} "
                             "(comma-separated, e.g. --suite ppl,needle)")
    return [SUITES[n] for n in dict.fromkeys(names)]

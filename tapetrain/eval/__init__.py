"""Evaluation: perplexity across context lengths (ppl), passkey retrieval and its needle grid (passkey,
needle_plots), RULER through lm-evaluation-harness (ruler), bootstrap intervals (bootstrap), reports and plots
(report).

Entry points: `tapetrain eval ppl|passkey|arith|scrolls|ruler` (the run_eval_* functions, in the table of
tapetrain.cli), tools/eval_*.py; `tapetrain compare` (tapetrain.compare) runs several of them over many models.
"""

"""Evaluation: perplexity across context lengths (ppl), passkey retrieval (passkey), reports and plots (report).

Entry points: `tapetrain eval ppl|passkey|arith|scrolls` (the run_eval_* functions, in the table of tapetrain.cli),
tools/eval_*.py.
"""

"""Evaluation: perplexity across context lengths (ppl), passkey retrieval (passkey), reports and plots (report).

Entry points: `tapetrain eval ppl`, `tapetrain eval passkey` (parsers in tapetrain.eval.cli), tools/eval_*.py.
"""

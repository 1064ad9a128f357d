"""Batched decoding with the KV cache for both kinds of EvalModel, stopping at EOS.

Every row of a batch must have the same prompt length (there is no left padding: the models take no attention
mask); callers group prompts by length. Rows that finish early are padded with EOS until every row has finished
or max_new_tokens is reached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tapetrain.eval.models import EvalModel


@dataclass
class Sampling:
    """How the next token is chosen: greedy when temperature is 0 (top_k/top_p ignored)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


GREEDY = Sampling()


@dataclass
class Continuation:
    tokens: list[int]  # the generated ids before the first EOS
    finished: bool  # whether an EOS was generated within the budget


@torch.no_grad()
def generate(model: EvalModel, prompts: torch.Tensor, max_new_tokens: int, eos_id: int,
             sampling: Sampling = GREEDY, generator: torch.Generator | None = None) -> list[Continuation]:
    """prompts (B, T) int64, all rows real tokens -> one Continuation per row."""
    if prompts.dim() != 2:
        raise ValueError(f"prompts must be (batch, length), got shape {tuple(prompts.shape)}")
    ids = prompts.to(model.device)
    if model.kind == "hf":
        kwargs = {"do_sample": not sampling.greedy}
        if not sampling.greedy:  # transformers defaults top_k to 50 when sampling; pass ours explicitly
            kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p or 1.0)
        out = model.module.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    use_cache=True, eos_token_id=eos_id, pad_token_id=eos_id, **kwargs)
    else:
        out = model.module.generate(ids, max_new_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
                                    top_p=sampling.top_p, eos_id=eos_id, use_cache=True, generator=generator)
    results = []
    for row in out[:, ids.shape[1]:].tolist():
        cut = row.index(eos_id) if eos_id in row else len(row)
        results.append(Continuation(row[:cut], cut < len(row)))
    return results

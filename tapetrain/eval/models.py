"""One interface over the two kinds of MODEL the eval tools take: a Hugging Face export or a run directory."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from tapetrain.distributed import local_device
from tapetrain.errors import InputError, MissingInputError
from tapetrain.model.sequence_shard import SequenceShard

log = logging.getLogger("tapetrain.eval")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EVAL_SEED = 2  # torch.manual_seed of LongLoRA's and the TAPE repository's eval scripts


def seed_eval() -> None:
    """Seed torch before an evaluation: RandPE draws its positions at evaluation too, so reruns agree."""
    torch.manual_seed(EVAL_SEED)


@dataclass
class EvalModel:
    """A causal LM ready for evaluation. `kind` is 'hf' (transformers model) or 'run' (tapetrain Transformer)."""

    module: torch.nn.Module
    kind: str
    name: str
    vocab_size: int
    max_seq_len: int
    tokenizer: str | None
    device: torch.device
    dtype: str
    tokenizer_sha256: str | None = None  # of the tokenizer the model was trained with, when known
    shard: SequenceShard | None = None  # sequence parallelism (run models): set by shard_sequence

    def shard_sequence(self, shard: SequenceShard | None) -> None:
        """Sequence parallelism from now on (tapetrain.eval.sequence_parallel): logits_span and greedy_rows take
        whole sequences and compute this rank's slice of each."""
        if shard is not None and self.kind != "run":
            raise InputError(f"sequence parallelism needs a run directory, not the Hugging Face model {self.name}")
        if self.kind == "run":
            self.module.shard_sequence(shard)
        self.shard = shard

    @torch.no_grad()
    def logits_span(self, ids: torch.Tensor, keep_last: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (B, L) -> (logits (B, k, V), their positions (k,) int64 on the model's device): the last keep_last
        positions (all without it), or under sequence parallelism this rank's part of them (k = 0 on a rank holding
        none; with a ring, its two chunks' parts)."""
        keep = keep_last or ids.shape[1]
        if self.shard is None:
            return self.logits(ids, keep), torch.arange(ids.shape[1] - keep, ids.shape[1], device=self.device)
        from tapetrain.eval.sequence_parallel import sharded_logits

        return sharded_logits(self.module, self.shard, ids.to(self.device), keep)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, keep_last: int | None = None) -> torch.Tensor:
        """ids (B, T) -> logits (B, T, V), or of the last `keep_last` positions only (B, keep_last, V)."""
        ids = ids.to(self.device)
        if self.kind == "hf":
            keep = keep_last or 0
            return self.module(input_ids=ids, use_cache=False, logits_to_keep=keep).logits
        return self.module(ids, logits_to_keep=keep_last or 0).logits

    @torch.no_grad()
    def greedy_rows(
        self, ids: torch.Tensor, new_tokens: int, use_cache: bool = True, suppress_eos: bool = True
    ) -> torch.Tensor:
        """ids (B, T), every row a real prompt (no padding) -> greedy continuations (B, new_tokens). A Hugging Face
        model never picks EOS (suppress_eos) or stops at it (suppress_eos=False: fewer columns when every row
        ended, shorter rows padded with id 0); a run model always decodes new_tokens plain argmax ids (under
        sequence parallelism without a KV cache, tapetrain.eval.sequence_parallel)."""
        ids = ids.to(self.device)
        if self.shard is not None:
            from tapetrain.eval.sequence_parallel import sharded_greedy

            return sharded_greedy(self.module, self.shard, ids, new_tokens).cpu()
        if self.kind == "hf":
            mask = torch.ones_like(ids)
            out = self.module.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                min_new_tokens=new_tokens if suppress_eos else 0, do_sample=False, num_beams=1,
                use_cache=use_cache, pad_token_id=0,
            )
        else:
            out = self.module.generate(ids, new_tokens, use_cache=use_cache)
        return out[:, ids.shape[1]:].cpu()

    def generate_greedy(
        self, ids: torch.Tensor, new_tokens: int, use_cache: bool = True, suppress_eos: bool = True
    ) -> torch.Tensor:
        """ids (1, T) -> the greedy continuation (at most new_tokens ids); see greedy_rows."""
        return self.greedy_rows(ids, new_tokens, use_cache, suppress_eos)[0]


def _tokenizer_in(directory: str) -> str | None:
    from tapetrain.data.tokenizer import tokenizer_in

    return tokenizer_in(directory)


def _file_sha256(path: str | None) -> str | None:
    if not path or not os.path.isfile(path):
        return None
    from tapetrain.data.format import file_sha256

    return file_sha256(path)


def load_eval_model(path: str, dtype: str = "fp32", step: int | None = None, device: torch.device | None = None,
                    compile: bool | None = None) -> EvalModel:
    """Load MODEL: a run/checkpoint directory (via run_loader, newest complete checkpoint or `step`) or a Hugging
    Face model directory (transformers; trust_remote_code for tapetrain's non-RoPE exports). `compile` replaces
    the run's model.compile (None keeps it)."""
    from tapetrain.checkpoint.run_loader import is_run_or_checkpoint, load_run_model
    from tapetrain.model.execution_plan import place_model

    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    device = device or local_device()
    if not os.path.isdir(path):
        raise MissingInputError(f"model {path} does not exist; pass a Hugging Face export directory (tapetrain "
                                "export hf) or a run directory")
    if is_run_or_checkpoint(path):
        model, info = load_run_model(path, step, compile=compile)
        model = place_model(model, device, DTYPES[dtype]).eval()  # and its execution plan there
        name = f"{path}@step{info['step']}"
        sha = info["trainer_state"].get("tokenizer_sha256") or _file_sha256(info["tokenizer"])
        return EvalModel(model, "run", name, model.cfg.vocab_size, model.cfg.max_seq_len, info["tokenizer"],
                         device, dtype, sha)
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise MissingInputError(f"{path} is neither a run directory (no checkpoints/) nor a Hugging Face model "
                                "(no config.json); pass a run directory or a `tapetrain export hf` output")
    if step is not None:
        raise InputError("--step applies to run directories only; a Hugging Face export holds one step")
    from transformers import AutoModelForCausalLM

    with open(config_path) as f:
        config = json.load(f)
    remote = "auto_map" in config  # tapetrain's non-RoPE exports ship their modeling code
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=remote, dtype=DTYPES[dtype])
    model = model.to(device).eval()
    tokenizer = _tokenizer_in(path)
    return EvalModel(model, "hf", path, int(config["vocab_size"]), int(config.get("max_position_embeddings", 0)),
                     tokenizer, device, dtype, _file_sha256(tokenizer))

"""Models, optimizer and timed optimizer steps shared by the train, engine and layer benchmarks."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tapetrain.bench.common import release_memory, synchronize
from tapetrain.bench.report import finite_or_none
from tapetrain.model import Transformer, estimate_mfu, preset_config
from tapetrain.progress import progress as progress_bar


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """["d_model=1024", "n_layers=24"] -> {"d_model": 1024, "n_layers": 24} (values parsed as YAML scalars)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE with a model config key, e.g. --set n_layers=24")
        out[key.strip()] = yaml.safe_load(value)
    return out


def build_model(
    preset: str,
    pe: str,
    seq_len: int,
    *,
    backend: str = "auto",
    activation_checkpointing: bool = False,
    overrides: dict[str, Any] | None = None,
    seed: int = 0,
) -> Transformer:
    """The preset with `pe` swapped in; the same seed gives every PE the same shared weights. `pe`, the backend and
    activation checkpointing have their own options: a `--set` of them would be silently replaced, so it is refused."""
    owned = {"pe": "--pe/--pe-list", "attn_backend": "--backend",
             "activation_checkpointing": "--activation-checkpointing"}
    clash = sorted(set(overrides or {}) & set(owned))
    if clash:
        raise ValueError(f"--set {', '.join(clash)}: set {' and '.join(owned[k] for k in clash)} instead (the mode's "
                         "own option decides it)")
    cfg = preset_config(
        preset,
        **{
            "max_seq_len": seq_len,  # the training context (randpe and friends derive their ranges from it)
            **(overrides or {}),
            "pe": pe,
            "attn_backend": backend,
            "activation_checkpointing": activation_checkpointing,
        },
    )
    torch.manual_seed(seed)
    return Transformer(cfg)


def adamw(params: Iterator[torch.nn.Parameter] | list[torch.Tensor], fused: bool = False) -> torch.optim.AdamW:
    """fused: torch's single-kernel AdamW (CUDA), as a tuned training loop would use."""
    return torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused or None)


class PlainOptimizer:
    """torch AdamW + global-norm clipping. For low-precision modules it keeps fp32 master weights (grads upcast,
    clipped and applied in fp32, weights copied back) — the arithmetic of DeepSpeed's bf16 engine."""

    def __init__(self, model: torch.nn.Module, clip: float = 1.0):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.clip = clip
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        self.master = [p.detach().float().clone() for p in self.params] if self.mixed else self.params
        self.opt = adamw(self.master, fused=all(p.is_cuda for p in self.params))

    def step(self) -> None:
        if self.mixed:
            for p, m in zip(self.params, self.master, strict=True):
                m.grad = p.grad.float() if p.grad is not None else None
                p.grad = None
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.master, self.clip, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.mixed:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master)


def random_batches(vocab_size: int, batch: int, seq_len: int, device: torch.device, n: int, seed: int) -> list:
    """`n` random (batch, seq_len + 1) token batches, made up front so the timed steps do no data work."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randint(vocab_size, (batch, seq_len + 1), generator=gen, device=device) for _ in range(n)]


@dataclass
class StepResult:
    """One timed run of a loop; `to_dict` is its JSON record (median step time, tokens/s, MFU, memory)."""

    step_times: list[float]
    tokens_per_step: int
    flops_per_token: float
    peak_flops: float
    params: int
    final_loss: float
    peak_mem_gb: float | None
    peak_mem_kind: str
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of_model(cls, model: Any, times: list[float], loss: float, batch: int, seq_len: int, peak_flops: float,
                 mem: Any) -> StepResult:
        """The record of `model` (a Transformer) trained on `batch` × `seq_len` tokens per step; `mem` a PeakMemory."""
        return cls(step_times=times, tokens_per_step=batch * seq_len, flops_per_token=model.flops_per_token(seq_len),
                   peak_flops=peak_flops, params=model.num_params(), final_loss=loss, peak_mem_gb=mem.gb,
                   peak_mem_kind=mem.kind)

    def to_dict(self) -> dict[str, Any]:
        step_s = statistics.median(self.step_times)
        tokens_per_s = self.tokens_per_step / step_s
        return {
            "tokens_per_s": tokens_per_s,
            "step_s": step_s,
            "step_time_s": step_s,  # the same median, under the name the GPU-check reports use
            "step_s_mean": statistics.fmean(self.step_times),
            "mfu": finite_or_none(estimate_mfu(self.flops_per_token, tokens_per_s, self.peak_flops)),
            "peak_mem_gb": self.peak_mem_gb,
            "peak_mem_kind": self.peak_mem_kind,
            "params": self.params,
            "flops_per_token": self.flops_per_token,
            "final_loss": self.final_loss,
            "step_times_s": self.step_times,
            **self.extra,
        }


def timed_steps(
    step: Callable[[torch.Tensor], torch.Tensor],
    batches: list[torch.Tensor],
    device: torch.device,
    warmup: int,
    steps: int,
    desc: str,
    progress: bool = True,
) -> tuple[list[float], float]:
    """Runs warmup + steps optimizer steps (`step(batch) -> loss`), synchronising around each one; returns
    (seconds of each timed step, last loss)."""
    times: list[float] = []
    loss = torch.tensor(math.nan)
    for i in progress_bar(range(warmup + steps), desc=desc, disable=not progress, leave=False):
        synchronize(device)
        t0 = time.perf_counter()
        loss = step(batches[i % len(batches)])
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, float(loss.detach().float())


def interleaved_steps(
    steps: dict[str, Callable[[torch.Tensor], Any]],
    batches: list[torch.Tensor],
    device: torch.device,
    rounds: int,
    progress: bool = True,
    first_round: int = 0,
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """`rounds` timed rounds, each running every variant's optimizer step once on the same batch, the order
    rotated by the round (counted from `first_round`) -> ({variant: seconds per round}, {variant: last loss}).
    Warm each variant up first."""
    from tapetrain.bench.pairs import rotated

    times: dict[str, list[float]] = {name: [] for name in steps}
    losses: dict[str, float] = {}
    for r in progress_bar(range(first_round, first_round + rounds), desc="rounds", unit="round",
                          disable=not progress or rounds == 1, leave=False):  # fmt: skip
        batch = batches[r % len(batches)]
        for name in rotated(list(steps), r):
            synchronize(device)
            t0 = time.perf_counter()
            loss = steps[name](batch)
            synchronize(device)
            times[name].append(time.perf_counter() - t0)
            losses[name] = float(loss)  # a 0-dim tensor or a float
    return times, losses


def steady_warmup(steps: dict[str, Callable[[torch.Tensor], Any]], batches: list[torch.Tensor],
                  device: torch.device, numerator: str, denominator: str, min_rounds: int,
                  max_rounds: int) -> dict[str, Any]:
    """Alternated warm-up rounds until the numerator/denominator step-time ratio is steady (pairs.warm_until_steady);
    returns its record, for the JSON."""
    from tapetrain.bench.pairs import warm_until_steady

    def one_round(r: int) -> tuple[float, float]:
        times, _ = interleaved_steps(steps, batches, device, 1, progress=False, first_round=r)
        return times[numerator][0], times[denominator][0]

    return warm_until_steady(one_round, min_rounds, max_rounds)


def plain_step(model: torch.nn.Module, opt: PlainOptimizer) -> Callable[[torch.Tensor], torch.Tensor]:
    """One optimizer step of the plain PyTorch loop: `step(ids) -> loss`, inputs ids[:, :-1], labels ids[:, 1:]."""

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        opt.step()
        return loss

    return step


def warm_up_process(device: torch.device, dtype: torch.dtype) -> None:
    """One throwaway training step of a tiny model: pays one-time costs (thread pools, kernel libraries, the CUDA
    context and cuBLAS workspace) before anything is timed or its memory measured, so the first PE measured is
    not penalised."""
    model = Transformer(preset_config("tiny", max_seq_len=16)).to(device=device, dtype=dtype)
    ids = torch.randint(model.cfg.vocab_size, (1, 17), device=device)
    plain_step(model, PlainOptimizer(model))(ids)
    synchronize(device)
    del model
    release_memory(device)

"""train.float8: FP8 matmuls in the attention and MLP projections, through torchao's float8 training.

torchao's `convert_to_float8_training` swaps chosen nn.Linear modules for its Float8Linear: the weight stays a
high-precision parameter (same name, same state-dict key, what checkpoints and exports hold), and every forward
and backward casts the matmul's operands to FP8 with scales computed from the tensors themselves (dynamic
scaling: no state, so a resume continues bit-identically). `rowwise` scales per row, `tensorwise` per tensor
(faster, a little less accurate); both are torchao's recipe names.

Which linears convert (`FILTER_RULE`): the attention and MLP projections whose in and out features are multiples
of 16 (what `torch._scaled_mm` requires). Never the embedding, the LM head (its loss is fused and its logits want
the precision), or TAPE's small head-axis products (W_A is no Linear; the MLP-side update's W_x, W_up, W_down
are contractions over a handful of heads where FP8 saves nothing and costs accuracy).

Real FP8 needs a GPU with FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell); anything else is
refused at start. The CPU runs float8 only through torchao's emulation (FP8 rounding, high-precision matmuls),
behind TAPETRAIN_FLOAT8_EMULATE=1: a switch for tests, never for speed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tapetrain.errors import ConfigError

log = logging.getLogger("tapetrain.train")

RECIPES = ("rowwise", "tensorwise")
SETTINGS = ("off", *RECIPES)
EMULATE_ENV = "TAPETRAIN_FLOAT8_EMULATE"  # "1": torchao's CPU emulation of FP8 (tests only)
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell
ALIGNMENT = 16  # torch._scaled_mm: both matrix dims multiples of 16
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
FILTER_RULE = ("the attention (q/k/v/o_proj) and MLP (gate/up/down_proj) projections whose in and out features are "
               f"multiples of {ALIGNMENT}; never the embedding, lm_head or TAPE's head-axis updates (W_A, tape_mlp)")
COMPILE_NOTE = "model.compile=true for speed: eager float8 runs its casts as separate kernels, slower than bf16"


@dataclass(frozen=True)
class Float8Conversion:
    """What `convert_model_to_float8` (or `plan_float8`) chose: module names, e.g. layers.0.attn.q_proj."""

    recipe: str
    converted: tuple[str, ...]
    skipped: tuple[str, ...]  # every other nn.Linear in the model

    def summary(self) -> str:
        """One line: the count converted and the skipped names, layers folded (`layers.*.tape_mlp.x_proj (15)`)."""
        return (f"{len(self.converted)} linear(s) in FP8 ({self.recipe}); skipped: "
                + (", ".join(folded_names(self.skipped)) or "none"))


def folded_names(names: tuple[str, ...]) -> list[str]:
    """Names with their layer index replaced by `*`, each pattern once with how many layers it covers."""
    counts: dict[str, int] = {}
    for name in names:
        pattern = re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.*.", name)
        counts[pattern] = counts.get(pattern, 0) + 1
    return [p if n == 1 else f"{p} ({n})" for p, n in counts.items()]


def emulation_requested() -> bool:
    """TAPETRAIN_FLOAT8_EMULATE=1: tests run float8 on the CPU through torchao's emulation."""
    return os.environ.get(EMULATE_ENV) == "1"


def torchao_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchao") is None


def float8_refusal(setting: str, device_type: str, capability: tuple[int, int] | None = None,
                   device_name: str = "", emulate: bool = False) -> str | None:
    """Why `setting` cannot run on this device (one line naming train.float8=off), or None. `capability`: the CUDA
    device's compute capability (None on a CPU)."""
    if setting not in SETTINGS:
        return f"train.float8={setting!r} is not a setting; choose one of {', '.join(SETTINGS)}"
    if setting == "off":
        return None
    if torchao_missing():
        return (f"train.float8={setting} needs torchao (pip install torchao, or the gpu extra: pip install "
                "'tapetrain[gpu]'); or set train.float8=off")
    if emulate:
        return None
    if device_type != "cuda":
        return (f"train.float8={setting} on {device_type}: FP8 matmuls need a GPU with FP8 tensor cores (compute "
                "capability 8.9+: Ada, Hopper, Blackwell); set train.float8=off")
    if capability is None or tuple(capability) < MIN_CAPABILITY:
        cap = ".".join(map(str, capability)) if capability else "unknown"
        return (f"train.float8={setting}: {device_name or 'this GPU'} (compute capability {cap}) has no FP8 tensor "
                "cores (8.9+: Ada, Hopper, Blackwell); set train.float8=off")
    return None


def resolve_float8(setting: str, device: torch.device, emulate: bool | None = None) -> str:
    """The recipe train.float8 runs on `device` ("off", "rowwise", "tensorwise"); raises ConfigError where it cannot
    run. `emulate`: torchao's emulation (None: TAPETRAIN_FLOAT8_EMULATE)."""
    emulate = emulation_requested() if emulate is None else emulate
    capability = name = None
    if device.type == "cuda" and setting != "off":
        capability, name = torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device)
    refusal = float8_refusal(setting, device.type, capability, name or "", emulate)
    if refusal:
        raise ConfigError(refusal)
    return setting


def is_convertible(module: nn.Module, name: str) -> bool:
    """`FILTER_RULE` for one module of a tapetrain Transformer, by its qualified name (`layers.3.mlp.up_proj`).
    Dimensions from in/out_features: under ZeRO-3 a weight's own shape is its (empty) partition."""
    if type(module) is not nn.Linear:  # LMHead, peft's LoRA wrappers and Float8Linear itself are subclasses
        return False
    parts = name.split(".")
    if len(parts) < 2:
        return False
    parent, leaf = parts[-2], parts[-1]
    projection = (parent == "attn" and leaf in ATTENTION_PROJECTIONS) or (parent == "mlp" and leaf in MLP_PROJECTIONS)
    return projection and module.in_features % ALIGNMENT == 0 and module.out_features % ALIGNMENT == 0


def plan_float8(model: nn.Module, recipe: str) -> Float8Conversion:
    """What `convert_model_to_float8` would convert, without torchao (--print-config; a meta-device model)."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    converted = tuple(name for name, m in linears if is_convertible(m, name))
    skipped = tuple(name for name, m in linears if name not in converted)
    return Float8Conversion(recipe, converted, skipped)


def _import_float8() -> tuple[Callable, type, type]:
    """torchao.float8's converter, config and module class (its import noise is filtered: tapetrain.import_noise)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    return convert_to_float8_training, Float8LinearConfig, Float8Linear


def convert_model_to_float8(model: nn.Module, recipe: str, emulate: bool = False) -> Float8Conversion:
    """Swap the model's convertible linears (`is_convertible`) for torchao's Float8Linear in place, with `recipe`;
    parameters and their names are unchanged. `emulate`: torchao's emulation (CPU tests)."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r}: one of {', '.join(RECIPES)}")
    convert, config_class, float8_linear = _import_float8()
    config = dataclasses.replace(config_class.from_recipe_name(recipe), emulate=emulate)
    plan = plan_float8(model, recipe)
    convert(model, config=config, module_filter_fn=lambda module, name: is_convertible(module, name))
    done = tuple(name for name, m in model.named_modules() if isinstance(m, float8_linear))
    if done != plan.converted:  # torchao's traversal must have seen exactly the modules the plan names
        raise RuntimeError(f"torchao converted {len(done)} linears, the plan named {len(plan.converted)}")
    return plan


def apply_float8(model: nn.Module, recipe: str) -> Float8Conversion | None:
    """The execution plan's float8 recipe (resolve_float8's answer) on a built model, before DeepSpeed wraps it:
    converts and logs what it did. None with "off"."""
    if recipe == "off":
        return None
    conversion = convert_model_to_float8(model, recipe, emulate=emulation_requested())
    log.info("train.float8=%s%s: %s", recipe, " (torchao's emulation: tests only)" if emulation_requested() else "",
             conversion.summary())
    return conversion


def plan_lines(setting: str, model: nn.Module, device: torch.device, compiled: bool) -> list[str]:
    """--print-config's lines: the rule, what it converts in this model, the refusal on this device if any."""
    if setting == "off":
        return ["float8 (train.float8=off): bf16/fp32 matmuls"]
    head = f"float8 (train.float8={setting}): "
    refusal = float8_refusal(setting, device.type, *(
        (torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device)) if device.type == "cuda"
        else (None, "")), emulate=emulation_requested())
    lines = [head + (f"refused ({refusal})" if refusal else "torchao Float8Linear"),
             f"  rule: {FILTER_RULE}",
             f"  this model: {plan_float8(model, setting).summary()}"]
    if not compiled:
        lines.append(f"  {COMPILE_NOTE}")
    return lines

"""Run configuration: YAML -> typed, validated RunConfig; the DeepSpeed JSON; the generated key reference."""

from tapetrain.config.deepspeed_config import build_deepspeed_config
from tapetrain.config.run_config import RunConfig, dump_run_config, load_run_config, save_resolved
from tapetrain.config.sections import (
    DataSection,
    DataSource,
    DeepSpeedSection,
    LoggingSection,
    ModelSection,
    OptimSection,
    ParallelSection,
    RunSection,
    TrainSection,
)

__all__ = [
    "DataSection",
    "DataSource",
    "DeepSpeedSection",
    "LoggingSection",
    "ModelSection",
    "OptimSection",
    "ParallelSection",
    "RunConfig",
    "RunSection",
    "TrainSection",
    "build_deepspeed_config",
    "dump_run_config",
    "load_run_config",
    "save_resolved",
]

"""Several training runs in one launch, one after another in the same processes (one process group):

    deepspeed --num_gpus N tests/distributed/families_worker.py CONFIG.yaml [CONFIG.yaml ...]

Each config trains exactly as `python -m tapetrain.train CONFIG.yaml` does (train_from_args); the exit status is the
worst of theirs. test_model_families.py uses it to train every model family's RoPE twin and TAPE retrofit under
DeepSpeed without paying a launcher start per run.
"""

from __future__ import annotations

import logging
import sys


def main(argv: list[str]) -> int:
    from tapetrain.train.run import leave_process_group, train_from_args

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    configs = [arg for arg in argv if not arg.startswith("--local_rank")]  # the launcher adds --local_rank=R
    codes = [train_from_args(path, []) for path in configs]
    leave_process_group()
    return max(codes, default=0)


if __name__ == "__main__":
    from tapetrain.distributed import end_rank_process

    end_rank_process(main(sys.argv[1:]))

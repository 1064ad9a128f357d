"""One rank of a real training whose rank 1 finds a checkpoint file gone when its background thread hashes it.

    deepspeed --num_gpus 2 vanishing_file_worker.py CONFIG STEP

Rank 1's hashing thread really deletes the first file of its share of the checkpoint of STEP (os.unlink on the
shared filesystem, as another process or a failing disk would) just before hashing it; nothing else is mocked.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from tapetrain.checkpoint import manifest
    from tapetrain.checkpoint.store import step_tag
    from tapetrain.train.run import train_from_args

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config, step = [a for a in argv if not a.startswith("--local_rank") and not a.startswith("--local-rank")]
    describe_strict = manifest.describe_strict

    def remove_then_describe(checkpoint: Path, names: list[str]) -> dict[str, dict]:
        if os.environ.get("RANK") == "1" and checkpoint.name == step_tag(int(step)) + ".tmp" and names:
            (checkpoint / names[0]).unlink()
            logging.getLogger("worker").warning("removed %s/%s before hashing it", checkpoint.name, names[0])
        return describe_strict(checkpoint, names)

    manifest.describe_strict = remove_then_describe
    return train_from_args(config, [])


if __name__ == "__main__":
    from tapetrain.distributed import end_rank_process

    end_rank_process(main(sys.argv[1:]))

"""Under torchrun: several `tapetrain eval ...` command lines in one launch (argv lists, JSON, in sys.argv[1]).

The worker makes the process group itself, so the sequence-parallel groups DeepSpeed builds on the first command
serve the later ones (the eval tools adopt a group they find and leave it open); each launch costs a start of
torch and DeepSpeed on every rank, which this pays once.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from tapetrain.cli import main
from tapetrain.distributed import end_rank_process

if __name__ == "__main__":
    dist.init_process_group("gloo")
    for argv in json.loads(Path(sys.argv[1]).read_text()):
        code = main(argv)
        if code:
            end_rank_process(code)
    end_rank_process(0)

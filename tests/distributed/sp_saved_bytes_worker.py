"""One rank of test_tiled_mlp_sp's memory check (2 CPU ranks over gloo, started by the deepspeed launcher).

Builds a small model (the same weights on both ranks), gives it the real Ulysses shard (SP 2) and measures the
bytes autograd saves in one layer's forward on this rank (memory.measure_layer_saved_bytes), untiled and tiled.
Rank 0 writes {pe: {tiled: [bytes of rank 0, rank 1]}} as JSON.

    deepspeed --num_gpus 2 tests/distributed/sp_saved_bytes_worker.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from tapetrain.distributed import end_rank_process, skip_cpu_shm_op_build
from tapetrain.model import Transformer, preset_config
from tapetrain.train.memory import measure_layer_saved_bytes

BATCH, SEQ = 2, 128  # whole sequences; each rank holds 64 tokens of each


def config(pe: str, tiled: int):
    return preset_config("tiny", pe=pe, n_kv_heads=4, attn_backend="sdpa", tiled_mlp=tiled)


def main(argv: list[str]) -> int:
    import deepspeed
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

    from tapetrain.parallel.ulysses import UlyssesShard

    skip_cpu_shm_op_build()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    mpu.initialize_sequence_parallel(2)
    shard = UlyssesShard(mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank(), 2)
    ids = torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    mine = ids[:, shard.rank * SEQ // 2 : (shard.rank + 1) * SEQ // 2]
    report: dict = {}
    for pe in ("rope", "tape"):
        for tiled in (0, 4):
            torch.manual_seed(0)
            model = Transformer(config(pe, tiled))
            saved = measure_layer_saved_bytes(model, mine, 0, shard)
            both = [None, None]
            dist.all_gather_object(both, saved)
            report.setdefault(pe, {})[str(tiled)] = both
    if dist.get_rank() == 0:
        with open(argv[0], "w") as f:
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    end_rank_process(main([a for a in sys.argv[1:] if not a.startswith("--local")]))

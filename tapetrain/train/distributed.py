"""Re-export of `tapetrain.distributed`, where the process-group helpers live so that checkpoint/ does not
import train/. Modules inside train/ may keep importing from here; code outside train/ imports the neutral module."""

from tapetrain.distributed import DistEnv, all_reduce_sum, barrier, free_port, init_distributed

__all__ = ["DistEnv", "all_reduce_sum", "barrier", "free_port", "init_distributed"]

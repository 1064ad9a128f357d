"""Process groups created without a timeout (as DeepSpeed creates its groups) get the configured one.

Run in a fresh interpreter: this process may already hold a default process group from another test (DeepSpeed
initialised in-process), and a second `init_process_group` is refused."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHECK = textwrap.dedent(
    """
    import sys
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from tapetrain.distributed import groups_default_to

    def timeout_of(group):
        return group._get_backend(torch.device("cpu")).options._timeout

    store = dist.FileStore(sys.argv[1], 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=17))
    assert timeout_of(dist.new_group([0])) == timedelta(minutes=30)  # torch's default, not the world group's
    groups_default_to(timedelta(seconds=17))
    assert timeout_of(dist.new_group([0])) == timedelta(seconds=17)
    assert timeout_of(dist.new_group(ranks=[0], timeout=timedelta(seconds=40))) == timedelta(seconds=40)
    dist.destroy_process_group()
    print("ok")
    """
)


def test_new_groups_default_to_the_configured_timeout(tmp_path):
    proc = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path / "store")], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]

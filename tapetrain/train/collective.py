"""Stopping together: a start-up or step check that fails on any rank stops every rank, and one rank says why.

Under a launcher a rank that raises alone leaves the others blocked in their next collective until a timeout;
`agree` turns a failure on one rank into the same exception on all of them, printed once (by the lowest failing
rank; the copies on the other ranks carry `reported_elsewhere`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tapetrain.data.errors import DataError
from tapetrain.errors import ConfigError, DiskSpaceError, RunDirLockedError, RunError
from tapetrain.train.distributed import DistEnv

# Failures whose message is the whole story (they name the problem and the fix): no traceback needed.
EXPECTED_ERRORS = (ConfigError, DataError, RunError)
_BY_NAME = {cls.__name__: cls for cls in (ConfigError, DataError, RunError, DiskSpaceError, RunDirLockedError)}


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def agree(env: DistEnv, check: Callable[[], None], *, on_main_only: bool = False) -> None:
    """Run `check` on every rank (or on rank 0 only); if it raised an expected error anywhere, raise on all ranks.

    Collective: every rank must call it at the same point.
    """
    error: BaseException | None = None
    if env.is_main or not on_main_only:
        try:
            check()
        except EXPECTED_ERRORS as err:
            error = err
    if _world_size() == 1:
        if error is not None:
            raise error
        return
    payload = None if error is None else (_kind(error), str(error))
    gathered: list = [None] * _world_size()
    torch.distributed.all_gather_object(gathered, payload)
    failed = [(rank, p) for rank, p in enumerate(gathered) if p is not None]
    if not failed:
        return
    first_rank, (kind, message) = failed[0]
    if error is not None and env.rank == first_rank:
        raise error  # the original, printed by this rank
    copy = _BY_NAME.get(kind, RunError)(f"rank {first_rank}: {message}" if first_rank else message)
    copy.reported_elsewhere = True  # type: ignore[attr-defined]
    raise copy


def _kind(error: BaseException) -> str:
    for cls in type(error).__mro__:
        if cls.__name__ in _BY_NAME:
            return cls.__name__
    return "RunError"

"""Every private torch.distributed call the agent makes, each behind a small named function with
the fallback its callers need: the one place to fix when torch changes.

torch keeps no promise about these (`distributed_c10d._world`, `_get_default_group`,
`_set_pg_timeout`, a group's `_get_backend`, `_get_sequence_number_for_group` and
`_enable_collectives_timing`, the Flight Recorder's `_dump_fr_trace` / `_dump_nccl_trace`, the
`ProcessGroup` and `Work` classes whose P2P methods the gloo timer wraps, `Work._source_rank`);
they are looked up when called, never cached, and torch is imported only then.
tests/test_agent_c10d.py fails on any such name anywhere else in agent/.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping
from typing import Any


def _c10d() -> Any:
    """`torch.distributed.distributed_c10d`, where the process groups are kept."""
    import torch.distributed as dist

    return dist.distributed_c10d


def process_groups() -> list[Any]:
    """Every process group of this process ([] before the default group exists)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return []
    return list(_c10d()._world.pg_map)


def group_names() -> Mapping[Any, str]:
    """Each process group's name, by group (torch's own live map; empty where torch keeps
    none)."""
    return getattr(_c10d()._world, "pg_names", {})


def default_group() -> Any:
    """The default process group; None before it exists."""
    c10d = _c10d()
    return c10d._get_default_group() if c10d.is_initialized() else None


def sequence_number(group: Any) -> int:
    """The sequence number of the last collective issued on `group` (None: the default)."""
    pg = group if group is not None else _c10d()._get_default_group()
    return pg._get_sequence_number_for_group()


def default_group_timeout_s() -> float | None:
    """The default group's timeout in seconds (its CUDA backend's, else its CPU one's); None
    outside a job or where it cannot be read."""
    try:
        import torch

        if not process_groups():
            return None
        pg = _c10d()._get_default_group()
        for device in ("cuda", "cpu"):
            try:
                backend = pg._get_backend(torch.device(device))
                return backend.options._timeout.total_seconds()
            except Exception:
                continue
    except Exception:
        pass
    return None


def set_timeouts(seconds: float) -> int:
    """Set the timeout of every process group (for its later operations); returns how many
    groups there are."""
    c10d = _c10d()
    groups = process_groups()
    for pg in groups:
        c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), pg)
    return len(groups)


def enable_backend_timing(pg: Any) -> bool:
    """Turn collective timing on in `pg`'s CUDA backend (NCCL's switch); False where it has no
    CUDA backend or the backend no such switch."""
    import torch

    try:
        backend = pg._get_backend(torch.device("cuda"))
    except Exception:
        return False
    if not hasattr(backend, "_enable_collectives_timing"):
        return False
    backend._enable_collectives_timing()
    return True


def enable_group_timing(pg: Any) -> None:
    """Turn collective timing on in the process group `pg` (raises where it cannot)."""
    pg._enable_collectives_timing()


def recorder_dumps() -> tuple[Callable[..., bytes] | None, Callable[..., bytes] | None]:
    """The Flight Recorder's dump functions this torch build has: the generic ring's (gloo,
    CPU) and NCCL's; None for either it lacks."""
    import torch._C._distributed_c10d as c10d

    return getattr(c10d, "_dump_fr_trace", None), getattr(c10d, "_dump_nccl_trace", None)


def p2p_classes() -> tuple[Any, Any]:
    """The classes whose methods every point-to-point operation goes through: `ProcessGroup`
    (`send`, `recv`, `recv_anysource`: torch's `isend`, `irecv`, `send`, `recv` and, on gloo,
    `batch_isend_irecv` call them) and `Work` (its `wait`)."""
    import torch._C._distributed_c10d as c10d

    return c10d.ProcessGroup, _c10d().Work


def source_rank(work: Any) -> int | None:
    """The group rank a completed receive-from-any-source got its data from; None where the
    work cannot say."""
    try:
        return int(work._source_rank())
    except Exception:
        return None


def group_ranks(name: str) -> list[int] | None:
    """The global ranks of the process group called `name` in this process, if known."""
    try:
        import torch.distributed as dist

        for pg, pg_name in list(group_names().items()):
            if pg_name == name:
                return list(dist.get_process_group_ranks(pg))
    except Exception:
        return None
    return None

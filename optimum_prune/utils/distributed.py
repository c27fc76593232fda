"""Data-parallel calibration on `torch.distributed` (gloo on CPU, nccl on GPU).

Launched by `torchrun` or `accelerate launch` (both set `RANK` / `WORLD_SIZE` / `MASTER_ADDR`), every rank runs the
same pruning code on its own share of the calibration samples (`local_samples`). The statistics every method
accumulates (`calibration.stats`) are summed across ranks the first time they are read, so every rank takes the
same decisions from the same global statistics and holds the same pruned model; only rank 0 writes files. Nothing
here is used in a single process (`world_size() == 1`): the code paths are then exactly the single-process ones.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from accelerate import PartialState

from .tensors import move_to

__all__ = [
    "init_from_env",
    "rank",
    "world_size",
    "is_main_process",
    "local_samples",
    "all_reduce_sum_",
    "all_gather_objects",
    "gather_chunks",
    "barrier",
    "broadcast_object",
    "broadcast_",
    "assign_ranks",
    "shutdown",
    "initialized",
]

logger = logging.getLogger(__name__)

# How long a rank waits for the others in a collective before failing (a rank that died: the launcher normally
# stops every rank at once; this bounds the wait when it does not). OPTIMUM_PRUNE_DIST_TIMEOUT overrides it.
DEFAULT_TIMEOUT_S = 1800


def _dist():
    return dist if dist.is_available() and dist.is_initialized() else None


def world_size() -> int:
    d = _dist()
    return d.get_world_size() if d is not None else 1


def rank() -> int:
    d = _dist()
    return d.get_rank() if d is not None else 0


def is_main_process() -> bool:
    return rank() == 0


_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")  # torchrun, MPI flavours


def init_from_env() -> bool:
    """Join the process group described by the launcher's environment, once: `torchrun`, `accelerate launch`
    (torchrun underneath on GPUs, `mpirun` for several CPU processes), or `mpirun`, through accelerate's
    `PartialState`. Returns whether this process is part of a group of several.

    The backend is nccl on GPUs (each rank on GPU `LOCAL_RANK`), gloo on CPU.
    """

    if _dist() is not None:
        return world_size() > 1
    if max(int(os.environ.get(k, "1")) for k in _SIZE_VARS) <= 1 or not dist.is_available():
        return False

    timeout = timedelta(seconds=float(os.environ.get("OPTIMUM_PRUNE_DIST_TIMEOUT", DEFAULT_TIMEOUT_S)))
    PartialState(timeout=timeout)
    if _dist() is None:
        raise RuntimeError(
            "Several processes were launched but no torch.distributed group could be joined; start them with "
            "`torchrun --nproc_per_node N ...` (or `accelerate launch` / `mpirun` with MASTER_ADDR and MASTER_PORT)."
        )
    logger.info("rank %d of %d joined the process group (%s)", rank(), world_size(), dist.get_backend())
    return world_size() > 1


def local_samples(input_ids: torch.Tensor) -> torch.Tensor:
    """This rank's calibration samples: a contiguous share of the rows (ranks in order, sizes differing by ≤ 1)."""
    n = world_size()
    if n == 1:
        return input_ids
    if input_ids.shape[0] < n:
        raise ValueError(
            f"{input_ids.shape[0]} calibration samples cannot be split over {n} processes: use at least {n} "
            "samples (num_samples) or fewer processes."
        )
    return torch.tensor_split(input_ids, n)[rank()]


def _comm_device(t: torch.Tensor) -> torch.device:
    d = _dist()
    if d is not None and d.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum_(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over the ranks, in place (a no-op in one process)."""
    d = _dist()
    if d is None or d.get_world_size() == 1:
        return t
    dev = _comm_device(t)
    buf = t if t.device == dev else t.to(dev)
    d.all_reduce(buf, op=d.ReduceOp.SUM)
    if buf is not t:
        t.copy_(buf)
    return t


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (`[obj]` in one process)."""
    d = _dist()
    if d is None or d.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * d.get_world_size()
    d.all_gather_object(out, obj)
    return out


def gather_chunks(chunks: list) -> list:
    """Every rank's list of per-chunk items (tensors, tuples of tensors, `None`), concatenated in rank order: the
    inputs of all calibration samples on every rank, for a method that needs them all (AMP's descent). Identity in
    one process."""
    if world_size() == 1:
        return chunks
    device = next((t.device for t in _tensors(chunks)), torch.device("cpu"))
    gathered = all_gather_objects(move_to(chunks, "cpu"))
    return [move_to(item, device) for part in gathered for item in part]


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank."""
    d = _dist()
    if d is None or d.get_world_size() == 1:
        return obj
    box = [obj]
    d.broadcast_object_list(box, src=src)
    return box[0]


def broadcast_(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank `src`'s values of `t` on every rank, in place (`t` has the same shape and dtype everywhere; a no-op in
    one process)."""
    d = _dist()
    if d is None or d.get_world_size() == 1:
        return t
    dev = _comm_device(t)
    buf = t.contiguous() if t.device == dev else t.to(dev)
    d.broadcast(buf, src=src)
    if buf is not t:
        t.copy_(buf)
    return t


def assign_ranks(costs: list[float]) -> list[int]:
    """The rank that does each of several independent jobs of the given `costs`: longest first, each to the least
    loaded rank (ties: the lowest rank), the same on every rank; all 0 in one process."""
    loads = [0.0] * world_size()
    owners = [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: -costs[k]):
        owners[k] = min(range(len(loads)), key=lambda r: loads[r])
        loads[owners[k]] += costs[k]
    return owners


def initialized() -> bool:
    return _dist() is not None


def shutdown() -> None:
    """Leave the process group (no-op when none)."""
    d = _dist()
    if d is not None:
        d.destroy_process_group()


def barrier() -> None:
    d = _dist()
    if d is not None and d.get_world_size() > 1:
        d.barrier()

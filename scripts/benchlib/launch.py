"""The process group and device of a benchmark process (``torchrun``, or a test's spawned process)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_distributed(device_type: str, local_rank: int | None = None) -> tuple[torch.device, bool]:
    """This process's device (``cuda``: GPU ``local_rank``, default ``$LOCAL_RANK``) and a process group
    over it (NCCL on GPUs, gloo on the CPU). Returns ``(device, owns_group)``: False when a group already
    existed (tests call a benchmark's ``main()`` inside their own), which :func:`finish` then keeps."""
    owns_group = not dist.is_initialized()
    if device_type == "cuda":
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        if owns_group:
            dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device(device_type)
        if owns_group:
            dist.init_process_group("gloo")
    return device, owns_group


def finish(owns_group: bool) -> None:
    """Tear down the process group :func:`init_distributed` created."""
    if owns_group:
        dist.destroy_process_group()


def solo_group() -> dist.ProcessGroup:
    """A process group of this rank alone (every rank takes part in creating every rank's)."""
    rank = dist.get_rank()
    return [dist.new_group([r]) for r in range(dist.get_world_size())][rank]


def free_memory(device: torch.device) -> None:
    """Drop unreachable Python objects and return the allocator's cached GPU blocks."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

"""Transfer-mode ablations of the attention loop, installed over ``PeerComm`` by the benchmarks.

``"overlap"`` is the library's behaviour. ``"serial"``: every batch of transfers completes before the
next compute starts. ``"compute_only"``: nothing is sent; every receive buffer is filled with random
values on the communication stream, where the transfer would have run (results are wrong; the time is
the schedule's compute alone). Kernel time depends on the data: the zeros of fresh memory draw less
power and run faster, so received buffers are never left as they were.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from lightseq_hf.parallel.comm import PeerComm, Pending, Transfers

TRANSFER_MODES = ("overlap", "serial", "compute_only")


@contextmanager
def transfer_mode(mode: str) -> Iterator[None]:
    """Every ``PeerComm`` (those the library caches included) posts its transfers in ``mode`` inside
    the block; the library's own ``post`` is back afterwards."""
    if mode not in TRANSFER_MODES:
        raise ValueError(f"unknown transfer mode {mode!r}; choose one of {', '.join(TRANSFER_MODES)}.")
    library_post = PeerComm.post

    def post(comm: PeerComm, transfers: Transfers) -> Pending:
        if mode == "compute_only":
            return fill_received(comm, transfers)
        pending = library_post(comm, transfers)
        if mode == "serial" and transfers:
            pending.wait()
        return pending

    if mode != "overlap":
        PeerComm.post = post
    try:
        yield
    finally:
        PeerComm.post = library_post


class ComputeOnlyComm(PeerComm):
    """A ``PeerComm`` in the compute-only mode for good (loops run one rank at a time, no peers)."""

    def post(self, transfers: Transfers) -> Pending:
        return fill_received(self, transfers)


def fill_received(comm: PeerComm, transfers: Transfers) -> Pending:
    """No transfer: each receive buffer gets values from a cached random pool, copied on the
    communication stream (the host's on the CPU) after the compute stream's work issued so far."""
    if not transfers:
        return Pending([])
    recvs = transfers.recvs
    if comm.stream is None:
        for _, t in recvs:
            t.copy_(_random_like(t))
        return Pending([])
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream())
    with torch.cuda.stream(comm.stream):
        comm.stream.wait_event(ready)
        for _, t in recvs:
            t.copy_(_random_like(t))
        done = torch.cuda.Event()
        done.record(comm.stream)
    return Pending([_StreamEvent(done)], [t for _, t in recvs])


class _StreamEvent:
    """A work handle whose ``wait()`` makes the current CUDA stream wait for an event."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


_random_pool: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def _random_like(t: torch.Tensor) -> torch.Tensor:
    """Standard-normal values shaped like ``t``, from a pool drawn once per device and dtype."""
    key = (str(t.device), t.dtype)
    pool = _random_pool.get(key)
    if pool is None or pool.numel() < t.numel():
        pool = torch.randn(t.numel(), dtype=t.dtype, device=t.device)
        _random_pool[key] = pool
    return pool[: t.numel()].view(t.shape)

"""Point-to-point transfers for the attention loop (gloo or NCCL).

On CUDA the transfers are issued from a dedicated communication stream that first
waits (through a CUDA event) for the compute stream's work issued so far; waiting on a
transfer makes the *compute stream* wait on it, so the host never blocks. On CPU
(gloo) the same calls run the transfers as ordinary asynchronous sends/receives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["PeerComm", "Pending", "Transfers"]


@dataclass
class Transfers:
    """Tensors to send and buffers to receive in one batch, keyed by peer (group rank)."""

    sends: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    recvs: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.sends or self.recvs)


class Pending:
    """Transfers in flight; ``wait()`` orders later compute after them (on CUDA: the current stream
    waits, the host does not)."""

    def __init__(self, works: list, keep: list | None = None) -> None:
        self._works = works
        self._keep = keep  # contiguous copies being sent: alive until the transfers complete

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []
        self._keep = None


class PeerComm:
    """Batched ``isend``/``irecv`` among the ranks of ``group``."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group = group
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._global = {}

    def _global_rank(self, peer: int) -> int:
        if peer not in self._global:
            self._global[peer] = dist.get_global_rank(self.group, peer) if self.group is not None else peer
        return self._global[peer]

    def post(self, transfers: Transfers) -> Pending:
        """Start the transfers; the sends read tensors as the compute stream left them."""
        if not transfers:
            return Pending([])
        for p, t in transfers.recvs:
            if not t.is_contiguous():
                raise ValueError(f"receive buffer from peer {p} is not contiguous; allocate it with "
                                 "empty_like")
        sends = [(p, t if t.is_contiguous() else t.contiguous()) for p, t in transfers.sends]
        ops = [dist.P2POp(dist.isend, t, self._global_rank(p), self.group) for p, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self._global_rank(p), self.group) for p, t in transfers.recvs]
        if self.stream is None:
            pending = Pending(dist.batch_isend_irecv(ops), [t for _, t in sends])
        else:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                works = dist.batch_isend_irecv(ops)
            pending = Pending(works, [t for _, t in sends])
        return pending

"""Notices once per launch: the library's information and warnings are printed by rank 0 only.

Every rank of a launch patches the same model with the same settings and runs the same configuration, so
what the library logs below ERROR (the attention switch, a warmup longer than the run, a parity check with
nothing to compare) is the same on every rank, and printed by each it repeats once per process.
:class:`RankZeroFilter`, on the ``lightseq_hf`` loggers, lets such records through on global rank 0
only (the process group's rank, else the launcher's ``RANK``); errors pass on every rank. What differs
between ranks (a failure, the rank that ran out of memory) is printed as each rank's own line, not
logged.
"""

from __future__ import annotations

import logging

from .parallel.groups import process_rank

__all__ = ["LOGGERS", "RankZeroFilter", "install_rank_zero_filter"]

#: the package's loggers (a filter on a logger does not see its children's records)
LOGGERS = ("lightseq_hf", "lightseq_hf.training")


class RankZeroFilter(logging.Filter):
    """Records below ERROR pass on global rank 0 only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or process_rank() == 0


def install_rank_zero_filter() -> None:
    """Put one :class:`RankZeroFilter` on each of :data:`LOGGERS` (idempotent)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RankZeroFilter) for f in logger.filters):
            logger.addFilter(RankZeroFilter())

"""The fine-tune's messages: the ``lightseq_hf`` logger, and the console handler the command line installs.

Training code reports through :data:`logger` (a child of ``lightseq_hf``, the patches' logger); nothing is
printed unless the application configures logging. :func:`install_console_handler` (called by
``lightseq-finetune``) prints every ``lightseq_hf`` record on stdout as ``[lightseq] <message>``, warnings
as ``[lightseq] warning: <message>``.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

__all__ = ["install_console_handler", "logger"]

logger = logging.getLogger("lightseq_hf.training")

_ROOT = "lightseq_hf"


class _ConsoleFormatter(logging.Formatter):
    """``[lightseq] <message>``; warnings and errors name their level."""

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        return f"[lightseq] {level}{record.getMessage()}"


class _ConsoleHandler(logging.StreamHandler):
    def __init__(self, stream: TextIO | None) -> None:
        super().__init__(stream)
        self._fixed_stream = stream is not None

    def emit(self, record: logging.LogRecord) -> None:
        if not self._fixed_stream:  # follow sys.stdout when it is replaced (pytest's capture, redirects)
            self.stream = sys.stdout
        super().emit(record)


def install_console_handler(stream: TextIO | None = None, level: int = logging.INFO) -> logging.Handler:
    """Print ``lightseq_hf`` records as ``[lightseq] ...`` lines on ``stream`` (default: stdout, as it is
    when each record is written). Installing again replaces the previous console handler."""
    root = logging.getLogger(_ROOT)
    for h in list(root.handlers):
        if isinstance(h, _ConsoleHandler):
            root.removeHandler(h)
    handler = _ConsoleHandler(stream)
    handler.setFormatter(_ConsoleFormatter())
    root.addHandler(handler)
    root.setLevel(level)
    return handler

"""The fine-tune's configuration error, in a module of its own: the config schema, the architecture checks
and the data readers all raise it, and none of them needs another to do so."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration problem; the message names the key."""

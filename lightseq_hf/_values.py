"""Small predicates on argument values, shared by the modules that check user input."""

from __future__ import annotations


def is_positive_int(value: object) -> bool:
    """True for an ``int`` of at least 1 (``bool`` excluded: ``True`` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1

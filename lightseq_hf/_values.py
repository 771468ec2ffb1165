"""Small predicates on argument values, shared by the modules that check user input."""

from __future__ import annotations

__all__ = ["check_group", "is_positive_int"]


def is_positive_int(value: object) -> bool:
    """True for an ``int`` of at least 1 (``bool`` excluded: ``True`` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_not_member(group: object) -> None:
    """ValueError when ``group`` is what ``torch.distributed.new_group`` returns on ranks outside the group
    (``GroupMember.NON_GROUP_MEMBER``, an int): the type check after it would only say "got int"."""
    import torch.distributed as dist

    if isinstance(group, int) and not isinstance(group, bool) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("group: this rank is not a member of the process group passed (new_group returns "
                         "GroupMember.NON_GROUP_MEMBER on the ranks it leaves out); call it only on the "
                         "group's own ranks.")


def check_group(group: object, name: str = "group", default: str = "all ranks") -> None:
    """ValueError unless ``group`` is a ``torch.distributed.ProcessGroup`` that holds this rank, or None
    (``default`` says what None means)."""
    import torch.distributed as dist

    _check_not_member(group)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"{name} must be a torch.distributed.ProcessGroup or None ({default}); got "
                         f"{type(group).__name__}.")

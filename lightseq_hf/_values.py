"""Small predicates on argument values, shared by the modules that check user input."""

from __future__ import annotations


def is_positive_int(value: object) -> bool:
    """True for an ``int`` of at least 1 (``bool`` excluded: ``True`` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_not_member(group: object) -> None:
    """ValueError when ``group`` is what ``torch.distributed.new_group`` returns on ranks outside the group
    (``GroupMember.NON_GROUP_MEMBER``, an int): the type check after it would only say "got int"."""
    import torch.distributed as dist

    if isinstance(group, int) and not isinstance(group, bool) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("group: this rank is not a member of the process group passed (new_group returns "
                         "GroupMember.NON_GROUP_MEMBER on the ranks it leaves out); call it only on the "
                         "group's own ranks.")

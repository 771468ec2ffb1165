"""Sequence parallelism: schedule (pure), communication, merge, the distributed attention."""

from .api import dist_flash_attn
from .groups import ParallelGroups, current_groups, init_sequence_parallel
from .merge import merge_into
from .schedule import SCHEDULES, Schedule, Task, build_schedule

__all__ = [
    "ParallelGroups",
    "SCHEDULES",
    "current_groups",
    "init_sequence_parallel",
    "Schedule",
    "Task",
    "build_schedule",
    "dist_flash_attn",
    "merge_into",
]

"""Sequence parallelism: schedule (pure), communication, merge, the distributed attention."""

from .api import dist_flash_attn
from .merge import merge_into
from .schedule import SCHEDULES, Schedule, Task, build_schedule

__all__ = ["SCHEDULES", "Schedule", "Task", "build_schedule", "dist_flash_attn", "merge_into"]

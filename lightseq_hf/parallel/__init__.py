"""Sequence parallelism: schedule (pure), communication, merge, the distributed attention."""

from .api import dist_flash_attn
from .groups import ParallelGroups, current_groups, init_sequence_parallel
from .merge import merge_into
from .schedule import SCHEDULES, Schedule, SpanTask, Task, build_schedule
from .segment_schedule import TileCost, build_segment_schedule
from .segments import Segments, segments_from_hf

__all__ = [
    "ParallelGroups",
    "SCHEDULES",
    "current_groups",
    "init_sequence_parallel",
    "Schedule",
    "Segments",
    "SpanTask",
    "Task",
    "TileCost",
    "build_schedule",
    "build_segment_schedule",
    "dist_flash_attn",
    "merge_into",
    "segments_from_hf",
]

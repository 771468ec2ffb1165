"""Sequence parallelism: schedule (pure), communication, merge, the distributed attention."""

import atexit

from .api import dist_flash_attn
from .failures import install_excepthook
from .groups import ParallelGroups, current_groups, init_sequence_parallel
from .merge import merge_into
from .schedule import SCHEDULES, Schedule, SpanTask, Task, build_schedule
from .segment_schedule import TileCost, build_segment_schedule
from .segments import Segments, segments_from_hf
from .teardown import release_at_exit

# Before the interpreter finalizes, while gloo's threads can still take the GIL (teardown's docstring).
atexit.register(release_at_exit)
# An uncaught exception on one rank is published for the others, who then name it (failures' docstring).
install_excepthook()

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

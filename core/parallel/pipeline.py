"""Pipeline parallelism over `torch.distributed.pipelining` (stages and schedules by name)."""

from __future__ import annotations

# name -> torch.distributed.pipelining schedule class name
SCHEDULES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
# Schedules that place two stages per rank in a V (rank r holds stages r and 2pp - 1 - r).
V_SCHEDULES = frozenset({"zbv", "dualpipev"})

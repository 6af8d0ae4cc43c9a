"""Clocks for timing decoding: wall time after the device has finished, and a
runner-cost clock that other processes on a shared CPU do not disturb."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch


def device_clock(device: torch.device) -> float:
    """``time.perf_counter()`` after the device's queued work has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def cost_clock(device: torch.device) -> Callable[[], float]:
    """The clock a runner's cost is measured with, by the library's cost probes (`auto`,
    `tree_size`) and the serving engine's planner alike. On CPU: CPU seconds, not wall time
    (on a shared machine a wall-clock interval of a few ms often includes another process's
    time slice, which is noise to a choice between plans; under a load of 14 on 2 cores,
    wall-clock minima of 7 runs made a 3-position forward look 1.6x a 1-position one): the
    calling thread's when torch runs single-threaded, else the whole process's. On an
    accelerator: `device_clock` (wall time after the device's queued work)."""
    if device.type != "cpu":
        return functools.partial(device_clock, device)
    return time.thread_time if torch.get_num_threads() == 1 else time.process_time

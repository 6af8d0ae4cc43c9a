"""Clocks for timing decoding: wall time after the device has finished, and a
runner-cost clock that other processes on a shared CPU do not disturb."""

from __future__ import annotations

import time

import torch


def device_clock(device: torch.device) -> float:
    """``time.perf_counter()`` after the device's queued work has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def cost_clock(device: torch.device):
    """The clock to time a runner's cost with (the fastest of several timings is kept): this
    thread's CPU time on a CPU running torch on one thread, so that other processes on a
    shared machine do not inflate one measurement against another (under a load of 14 on 2
    cores, wall-clock minima of 7 runs made a 3-position forward look 1.6x a 1-position
    one); otherwise `device_clock` (wall time after the device's queued work)."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return lambda: device_clock(device)

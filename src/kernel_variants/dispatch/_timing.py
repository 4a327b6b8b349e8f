"""One timing harness for every device.

The default method is the regression report's: 5 warm-up calls, then 5 windows of 100 calls;
the figure is the minimum over windows of the mean time per call. Device events time windows
on CUDA and Ascend (synchronised around each window); the CPU uses a monotonic clock.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TimingConfig:
    warmup: int = 5
    windows: int = 5
    iters: int = 100
    # A large CPU shape can take tens of ms per call; a window then runs fewer calls.
    window_budget_s: float | None = 0.25

    def __post_init__(self) -> None:
        for name in ("warmup", "windows", "iters"):
            if getattr(self, name) < (0 if name == "warmup" else 1):
                raise ValueError(f"{name}: expected a positive count, got {getattr(self, name)}")


@dataclass(frozen=True)
class Timing:
    """Microseconds per call: ``best`` is the minimum over windows of each window's mean."""

    best_us: float
    median_us: float
    spread: float  # (slowest window - fastest window) / fastest window
    windows: int
    iters: int  # calls per window actually used
    method: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "best_us": self.best_us, "median_us": self.median_us, "spread": self.spread,
            "windows": self.windows, "iters": self.iters, "method": self.method,
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def _clock(device: torch.device):
    """A (start, stop -> seconds) pair for timing one window on ``device``."""
    if device.type in ("cuda", "npu"):
        mod = torch.cuda if device.type == "cuda" else torch.npu
        start_ev, stop_ev = mod.Event(enable_timing=True), mod.Event(enable_timing=True)

        def start() -> None:
            start_ev.record()

        def stop() -> float:
            stop_ev.record()
            stop_ev.synchronize()
            return start_ev.elapsed_time(stop_ev) / 1e3

        return start, stop, "device events"
    t0 = [0.0]

    def start() -> None:
        t0[0] = time.perf_counter()

    def stop() -> float:
        return time.perf_counter() - t0[0]

    return start, stop, "perf_counter"


def measure(
    calls: Sequence[Callable[[], Any]],
    device: torch.device | str = "cpu",
    config: TimingConfig = TimingConfig(),
) -> Timing:
    """Time ``calls`` (one, or several over rotating input copies for a cold cache), cycling."""
    device = torch.device(device)
    if device.type in ("cuda", "npu") and device.index is not None:
        # Events record on the current device's stream: make that the device being measured.
        with getattr(torch, device.type).device(device):
            return _measure(calls, device, config)
    return _measure(calls, device, config)


def _measure(calls: Sequence[Callable[[], Any]], device: torch.device, config: TimingConfig) -> Timing:
    n = len(calls)
    if n == 0:
        raise ValueError("calls: expected at least one callable, got none")
    t = time.perf_counter()
    for i in range(max(config.warmup, 1)):
        calls[i % n]()
    _sync(device)
    per_call = (time.perf_counter() - t) / max(config.warmup, 1)
    iters = config.iters
    if config.window_budget_s is not None and per_call > 0:
        iters = max(1, min(iters, int(config.window_budget_s / per_call)))
    start, stop, method = _clock(device)
    means = []
    for _ in range(config.windows):
        _sync(device)
        start()
        for i in range(iters):
            calls[i % n]()
        means.append(stop() / iters * 1e6)
    best = min(means)
    return Timing(best, statistics.median(means), (max(means) - best) / best if best > 0 else 0.0,
                  config.windows, iters, method)

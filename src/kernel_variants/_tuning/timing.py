"""One timing harness for every device.

The figure is the regression report's: after warm-up calls, windows of calls, and the minimum
over windows of the mean time per call. Device events time windows on CUDA and Ascend
(synchronised around each window); the CPU uses a monotonic clock.

Calibration times the candidates of a shape **interleaved** (``measure_interleaved``): one
window of each, in turn, round after round (A B C, B C A, ...), so that load arriving or leaving
during the measurement lands on every candidate alike. Each variant keeps its per-window figures
(``samples_us``), and ``noise`` says how far its typical window sits above its best: a lead
smaller than that is not a lead. After the first round a candidate slower than the best by more
than ``prune`` times can be left out of the remaining rounds (it is reported as pruned, with the
ratio measured, never dropped silently).

On CUDA, ``mode="graph"`` times the replay of a captured CUDA graph of a window's calls instead
of eager launches (no launch overhead: what a model served from CUDA graphs sees), and
``cold_l2`` sizes the rotation of input copies from the device's L2 so that no window reads its
inputs from L2. ``Timing.method`` says which clock and which mode a figure was taken with.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

Mode = Literal["eager", "graph"]
MODES: tuple[str, ...] = ("eager", "graph")
GRAPH_DEVICES: frozenset[str] = frozenset({"cuda"})  # where a window can be a captured graph's replay
COLD_L2_MAX_COPIES = 64  # a small input and a large L2 would otherwise want thousands
# A candidate is pruned from one call (before its warm-up) only when that call is this many
# times further off than ``prune`` asks: one call can meet a hiccup of the machine.
FIRST_CALL_FACTOR = 2.0

_now = time.perf_counter  # the CPU clock; a module attribute so that tests can drive a fake one


@dataclass(frozen=True)
class TimingConfig:
    warmup: int = 5
    windows: int = 5
    iters: int = 100
    # A large CPU shape can take tens of ms per call; a window then runs fewer calls (and
    # warm-up stops early once it has spent this long).
    window_budget_s: float | None = 0.25
    mode: Mode = "eager"
    cold_l2: bool = False
    # Time calls with a preallocated ``out=`` as the dispatcher makes them: handed to a variant
    # that takes it, else the variant's result copied into it (what a caller passing out pays).
    with_out: bool = False

    def __post_init__(self) -> None:
        for name in ("warmup", "windows", "iters"):
            if getattr(self, name) < (0 if name == "warmup" else 1):
                raise ValueError(f"{name}: expected a positive count, got {getattr(self, name)}")
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {self.mode!r}")


@dataclass(frozen=True)
class Timing:
    """Microseconds per call: ``best`` is the minimum over windows of each window's mean."""

    best_us: float
    median_us: float
    spread: float  # (slowest window - fastest window) / fastest window
    windows: int
    iters: int  # calls per window actually used
    method: str
    samples_us: tuple[float, ...] = ()  # each window's mean, in the order taken
    noise: float | None = None  # (median - best) / best; None with fewer than two windows

    def as_dict(self) -> dict[str, Any]:
        return {
            "best_us": self.best_us, "median_us": self.median_us, "spread": self.spread,
            "windows": self.windows, "iters": self.iters, "method": self.method,
            "samples_us": self.samples_us, "noise": self.noise,
        }


@dataclass(frozen=True)
class Pruned:
    """Timed for one round only: its first window was ``ratio`` times the best one's."""

    first_us: float
    ratio: float
    leader: str
    iters: int
    method: str


@dataclass(frozen=True)
class Failed:
    """Raised while it was timed (or gave no finite figure)."""

    reason: str


Outcome = Timing | Pruned | Failed


def summarise(samples: Sequence[float], iters: int, method: str) -> Timing:
    best = min(samples)
    median = statistics.median(samples)
    spread = (max(samples) - best) / best if best > 0 else 0.0
    noise = (median - best) / best if len(samples) > 1 and best > 0 else None
    return Timing(best, median, spread, len(samples), iters, method, tuple(samples), noise)


def check_mode(config: TimingConfig, device: torch.device | str) -> None:
    """ValueError when ``config`` asks for what ``device`` cannot do (before anything runs)."""
    dev = torch.device(device)
    if config.mode == "graph" and dev.type not in GRAPH_DEVICES:
        raise ValueError(f"timing mode graph: replays a captured CUDA graph, which {dev.type} does not have "
                         f"(devices: {', '.join(sorted(GRAPH_DEVICES))}); use eager")
    if config.cold_l2 and dev.type not in GRAPH_DEVICES:
        raise ValueError(f"cold L2: the input rotation is sized from the device's L2 size, which torch reports "
                         f"for CUDA only, not {dev.type}; use --rotate N for a fixed number of input copies")


def l2_bytes(device: torch.device | str) -> int:
    """The L2 cache size of a CUDA device, in bytes."""
    dev = torch.device(device)
    return int(torch.cuda.get_device_properties(dev.index or 0).L2_cache_size)


def cold_copies(device: torch.device | str, case_bytes: int) -> int:
    """How many input copies a cold-L2 rotation needs: enough that the copies together are twice
    the L2, so that each window's inputs were evicted since they were last read."""
    if case_bytes <= 0:
        return 1
    return max(1, min(COLD_L2_MAX_COPIES, math.ceil(2 * l2_bytes(device) / case_bytes)))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def _clock(device: torch.device):
    """A (start, stop -> seconds, name) triple for timing one window on ``device``."""
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
        t0[0] = _now()

    def stop() -> float:
        return _now() - t0[0]

    return start, stop, "perf_counter"


def _capture_graph(device: torch.device, calls: Sequence[Callable[[], Any]], iters: int) -> Callable[[], None]:
    """Capture ``iters`` calls (cycling over ``calls``) into one CUDA graph; returns its replay.

    Warmed up on a side stream first, as torch.cuda.graphs asks. Untested here: no CUDA."""
    if device.type != "cuda":
        raise ValueError(f"timing mode graph: no CUDA graphs on {device.type}")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for i in range(min(3, iters)):
            calls[i % len(calls)]()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            calls[i % len(calls)]()
    sync(device)
    return graph.replay


def _on_device(device: torch.device):
    if device.type in ("cuda", "npu") and device.index is not None:
        # Events record on the current device's stream: make that the device being measured.
        return getattr(torch, device.type).device(device)
    import contextlib

    return contextlib.nullcontext()


def measure(
    calls: Sequence[Callable[[], Any]],
    device: torch.device | str = "cpu",
    config: TimingConfig = TimingConfig(),
) -> Timing:
    """Time ``calls`` (one, or several over rotating input copies for a cold cache), cycling:
    one variant on its own, all its windows in a row."""
    out = measure_interleaved({"_": calls}, device, config)["_"]
    if isinstance(out, Failed):
        raise RuntimeError(out.reason)
    assert isinstance(out, Timing)
    return out


def measure_interleaved(
    calls: Mapping[str, Sequence[Callable[[], Any]]],
    device: torch.device | str = "cpu",
    config: TimingConfig = TimingConfig(),
    *,
    prune: float | None = None,
    deadline: float | None = None,
    eager_only: Collection[str] = (),
    first: Mapping[str, float] | None = None,
    spent: dict[str, float] | None = None,
) -> dict[str, Outcome]:
    """Time each entry of ``calls`` (name -> its calls, cycled) in alternating rounds: round r
    runs one window of every candidate still timed, starting at the r-th (A B C, B C A, ...).

    ``prune``: a candidate more than ``prune`` times slower than the best is timed no further
    (a ``Pruned`` outcome with the ratio): judged first from ``first`` (seconds one call of it
    took, when the caller has timed one, as verification does) against the warm candidates'
    per-call time, with a margin of ``FIRST_CALL_FACTOR``, then after the first round from the
    lower of its warm-up and window figures against the best window.
    Candidates warm up fastest first, so a slow one can be judged before it costs a warm-up.
    ``deadline`` (``time.monotonic()``): once passed, no further round starts (every candidate
    keeps the windows it has, at least one). A candidate that raises is a ``Failed`` outcome and
    the others go on. In graph mode, the candidates in ``eager_only`` (not safe to capture) are
    timed eagerly and their ``method`` says so. ``spent`` (name -> seconds) gains what each
    candidate's warm-up and windows took (where a calibration's time goes)."""
    dev = torch.device(device)
    if any(len(c) == 0 for c in calls.values()):
        raise ValueError("calls: expected at least one callable per candidate, got none")
    if prune is not None and not prune > 1:
        raise ValueError(f"prune: expected a factor above 1, got {prune}")
    with _on_device(dev):
        return _interleaved(dict(calls), dev, config, prune, deadline, set(eager_only), dict(first or {}),
                            spent if spent is not None else {})


def _interleaved(calls: dict[str, Sequence[Callable[[], Any]]], dev: torch.device, config: TimingConfig,
                 prune: float | None, deadline: float | None, eager_only: set[str],
                 first: dict[str, float], spent: dict[str, float]) -> dict[str, Outcome]:
    out: dict[str, Outcome] = {}

    def took(name: str, since: float) -> None:
        spent[name] = spent.get(name, 0.0) + (time.perf_counter() - since)

    iters: dict[str, int] = {}
    per_call: dict[str, float] = {}
    windows: dict[str, Callable[[], None]] = {}
    start, stop, clock = _clock(dev)
    methods: dict[str, str] = {}
    for name in calls:
        graph = config.mode == "graph" and name not in eager_only
        mode = "graph replay" if graph else "eager (not graph_safe)" if config.mode == "graph" else "eager"
        methods[name] = f"{clock}, {mode}" + (", interleaved" if len(calls) > 1 else "")
    for name in sorted(calls, key=lambda n: first.get(n, 0.0)):  # fastest first: see the docstring
        if prune is not None and per_call and name in first:
            leader = min(per_call, key=per_call.__getitem__)
            ratio = first[name] / per_call[leader] if per_call[leader] > 0 else 0.0
            if ratio > prune * FIRST_CALL_FACTOR:  # one call, so a wider margin for a hiccup in it
                out[name] = Pruned(first[name] * 1e6, ratio, leader, 1,
                                   methods[name].replace(", interleaved", "") + ", one call")
                continue
        cs = calls[name]
        t_name = time.perf_counter()
        try:
            iters[name], per_call[name] = _warm_up(cs, dev, config)
            graph = config.mode == "graph" and name not in eager_only
            windows[name] = _capture_graph(dev, cs, iters[name]) if graph else _eager(cs, iters[name])
        except Exception as exc:  # a variant that verified but crashes when timed is rejected
            out[name] = Failed(f"raised while timed: {type(exc).__name__}: {exc}")
            windows.pop(name, None)
        took(name, t_name)
    samples: dict[str, list[float]] = {name: [] for name in windows}
    active = [n for n in calls if n in windows]
    for r in range(config.windows):
        if r and deadline is not None and time.monotonic() >= deadline:
            break
        order = active[r % len(active):] + active[:r % len(active)] if active else []
        for name in order:
            t_name = time.perf_counter()
            try:
                sync(dev)
                start()
                windows[name]()
                t = stop() / iters[name] * 1e6
            except Exception as exc:
                out[name] = Failed(f"raised while timed: {type(exc).__name__}: {exc}")
                active.remove(name)
                continue
            finally:
                took(name, t_name)
            if not math.isfinite(t) or t <= 0:
                out[name] = Failed("timing was not finite")
                active.remove(name)
                continue
            samples[name].append(t)
        if r == 0 and prune is not None and len(active) > 1:
            # Each one's lower figure of its warm-up and its window: a hiccup in one is not enough
            # to prune a variant.
            fig = {n: min(samples[n][0], per_call[n] * 1e6) for n in active}
            leader = min(active, key=fig.__getitem__)
            for name in list(active):
                ratio = fig[name] / samples[leader][0]
                if ratio > prune:
                    out[name] = Pruned(fig[name], ratio, leader, iters[name], methods[name])
                    active.remove(name)
        if not active:
            break
    for name in active:
        out[name] = summarise(samples[name], iters[name], methods[name])
    return {name: out[name] for name in calls}  # in the order given


def _warm_up(cs: Sequence[Callable[[], Any]], dev: torch.device, config: TimingConfig) -> tuple[int, float]:
    """Run the warm-up calls; return how many calls one window makes (fewer than
    ``config.iters`` when a call is slow enough that a window would exceed its budget), and
    the seconds per call they took."""
    n = len(cs)
    budget = config.window_budget_s
    t = _now()
    done = 0
    for i in range(max(config.warmup, 1)):
        cs[i % n]()
        done += 1
        if budget is not None and i + 1 < config.warmup and _now() - t > budget:
            break  # a slow call: its first calls have warmed it up enough
    sync(dev)
    per_call = (_now() - t) / done
    if budget is not None and per_call > 0:
        return max(1, min(config.iters, int(budget / per_call))), per_call
    return config.iters, per_call


def _eager(cs: Sequence[Callable[[], Any]], iters: int) -> Callable[[], None]:
    n = len(cs)
    if n == 1:
        (fn,) = cs

        def window() -> None:
            for _ in range(iters):
                fn()
    else:
        def window() -> None:
            for i in range(iters):
                cs[i % n]()

    return window

"""Bad index values met on an accelerator, counted on the device and reported on request.

On CUDA or an NPU the dispatcher does not read index tensors on the host (that is a
host-device synchronisation per call, which stalls an eager serving loop's launch queue).
Instead an op's device rule (``OpSpec.device_rule``) makes each bad value harmless on the
device and adds how many it met to a per-device ``int64`` counter, with device ops only.
:func:`check_errors` is the one place that synchronises: it reads the counters, resets them and
raises ``ValueError`` saying how many values of which kind were bad. A host value check
(``KV_CHECK_VALUES=1``, or any call on the CPU) raises the same way first, for its device.
"""

from __future__ import annotations

import threading

import torch

from kernel_variants._capture import capturing

# What each entry of a counter counts; the order is the counter's layout.
KINDS: tuple[str, ...] = (
    "slot index outside [0, N) and not pad_slot_id (treated as a pad)",
    "slot index used by more than one live sequence (counted, not repaired)",
    "num_accepted_tokens outside 1..L (treated as a pad)",
    "query_start_loc sequence bound not in 0 = start <= ... <= end = T (bounds repaired, sequence a pad)",
)
SLOT, DUPLICATE, ACCEPTED, QUERY_START = range(len(KINDS))

_counters: dict[torch.device, torch.Tensor] = {}
_lock = threading.Lock()


def counter(device: torch.device) -> torch.Tensor | None:
    """The ``int64 [len(KINDS)]`` counter of ``device``, made on first use; None when it does not
    exist yet and a graph is being captured (a tensor made inside a capture would be zeroed again
    by every replay: the first eager call, a serving engine's warm-up, makes it)."""
    found = _counters.get(device)
    if found is not None:
        return found
    if capturing(device.type):
        return None
    with _lock:
        found = _counters.get(device)
        if found is None:
            found = _counters[device] = torch.zeros(len(KINDS), dtype=torch.int64, device=device)
    return found


def add(device: torch.device, kind: int, count: torch.Tensor) -> None:
    """Add ``count`` (a 0-d integer tensor on ``device``) to entry ``kind`` of its counter: one
    device op, no sync."""
    c = counter(device)
    if c is not None:
        c[kind].add_(count)


def _read_and_reset(c: torch.Tensor) -> list[int]:
    # The copy and the reset are queued in stream order: a count added after the copy is kept
    # for the next check, never lost between the read and the reset.
    seen = c.clone()
    c.zero_()
    return seen.tolist()


def check_errors(device: str | torch.device | None = None) -> None:
    """Raise ``ValueError`` if any call on an accelerator met bad index values since the last check.

    Synchronises with each device (once per call of this function, not per op call): reads the
    per-device counters of bad values that the dispatched ops made harmless on the device (see
    "What value checks cost and where they run"), resets them, and raises with the count per kind
    and device. ``device``: only that device's counter (``"cuda:0"``, ``torch.device("npu", 1)``);
    None: every device used so far. Returns None when nothing bad was met. Not for use inside a
    CUDA/NPU graph capture or ``torch.compile`` (it reads values on the host).
    """
    if device is None:
        devices = list(_counters)
    else:
        dev = torch.device(device)
        devices = [dev] if dev in _counters else []
    problems = []
    for dev in devices:
        for kind, n in zip(KINDS, _read_and_reset(_counters[dev]), strict=True):
            if n:
                problems.append(f"{n} x {kind} on {dev}")
    if problems:
        raise ValueError("bad index values since the last check_errors(): " + "; ".join(problems)
                         + " (set KV_CHECK_VALUES=1 to find the call: every call then checks on the host)")


def pending() -> bool:
    """Whether any device has a counter yet, i.e. the device rule has run there (a dict test:
    cheap enough per call)."""
    return bool(_counters)


def raise_pending(device: torch.device) -> None:
    """For a host value check: what the device rule counted on ``device`` is reported first."""
    if device in _counters:
        check_errors(device)

"""Calibration across the ranks of a ``torchrun`` job: one table for a fleet of identical devices.

Every rank takes a share of the (shape, variant) pairs and measures it on its own device
(``cuda:LOCAL_RANK``, ``npu:LOCAL_RANK`` or the CPU). Rank 0 gathers the measurements, records
them and decides each shape's winner, then broadcasts the exported table; every other rank
imports it, so all ranks dispatch identically. Ranks must share one device fingerprint and one
set of variant versions, or the figures of one would be applied to another: that is checked
first, and a mismatch is an error on every rank naming the ranks that differ.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernel_variants._dtypes import as_dtype, dtype_name
from kernel_variants.registry import Features
from kernel_variants.registry._spec import Shape

from ._calibrate import CalibrationResult, Progress, measure_shape
from ._dispatcher import dispatcher
from ._exchange import ImportReport, build_document, import_document, parse_document
from ._fingerprint import fingerprint
from ._table import DEFAULT_MARGIN, Measurement, check_margin
from ._timing import TimingConfig

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class RankMismatch(ValueError):
    """Ranks of one job differ in device fingerprint or variant versions."""


@dataclass
class DistributedResult:
    rank: int
    world_size: int
    result: CalibrationResult  # every rank's measurements, and the winners of the shared table
    imported: ImportReport | None  # on ranks other than 0: what importing rank 0's table changed


def torchrun_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the variables torchrun sets; ValueError without them."""
    missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(f"--distributed: run under torchrun (missing {', '.join(missing)}), e.g. "
                         "torchrun --nproc-per-node 8 -m kernel_variants calibrate --distributed ...")
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    except ValueError:
        raise ValueError("--distributed: RANK, WORLD_SIZE and LOCAL_RANK must be integers") from None


def rank_device(device: str, local_rank: int) -> str:
    """The device this rank measures on: the device type given, indexed by the local rank."""
    dev = torch.device(device)
    if dev.index is not None:
        raise ValueError(f"--device: give the device type ({dev.type}) with --distributed; "
                         f"each rank uses {dev.type}:LOCAL_RANK")
    if dev.type not in _BACKENDS:
        raise ValueError(f"--device: distributed calibration supports {', '.join(_BACKENDS)}, got {dev.type}")
    return "cpu" if dev.type == "cpu" else f"{dev.type}:{local_rank}"


def mismatches(per_rank: Sequence[dict[str, str]], what: str) -> list[str]:
    """One phrase per rank whose ``what`` differs from rank 0's, naming the differing keys."""
    ref = per_rank[0]
    out = []
    for r, other in enumerate(per_rank[1:], start=1):
        keys = [k for k in sorted(set(ref) | set(other)) if ref.get(k) != other.get(k)]
        if keys:
            diff = ", ".join(f"{k} {other.get(k, '(none)')!r} vs {ref.get(k, '(none)')!r}" for k in keys)
            out.append(f"rank {r} {what} differs from rank 0's: {diff}")
    return out


def shard(shapes: Sequence[Shape], variants: Sequence[str], rank: int, world: int) -> list[tuple[Shape, list[str]]]:
    """This rank's (shape, variants) share of every pair, in shape order.

    The variant order rotates per shape so that no rank is left with only the slowest variant.
    """
    pairs = [(s, variants[(i + j) % len(variants)]) for i, s in enumerate(shapes) for j in range(len(variants))]
    mine: dict[Shape, list[str]] = {}
    for s, v in pairs[rank::world]:
        mine.setdefault(s, []).append(v)
    return list(mine.items())


def calibrate_distributed(
    op: str,
    shapes: Sequence[Shape],
    *,
    dtype: str | torch.dtype,
    device: str,
    features: Features,
    timing: TimingConfig,
    variants: Sequence[str] | None = None,
    rotate: int = 0,
    margin: float = DEFAULT_MARGIN,
    progress: Callable[[Progress], None] | None = None,
) -> DistributedResult:
    """Calibrate ``shapes`` across the ranks of this torchrun job (see the module docstring).

    Joins the default process group, or creates it from the torchrun environment (gloo on CPU,
    nccl on CUDA, hccl on Ascend) and destroys it before returning.
    """
    import torch.distributed as dist

    local = torchrun_env()[2]
    dev = rank_device(device, local)
    dt = as_dtype(dtype)
    check_margin(margin)
    if dev.startswith("cuda"):
        torch.cuda.set_device(local)
    elif dev.startswith("npu"):
        torch.npu.set_device(local)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(_BACKENDS[torch.device(dev).type])
    try:
        return _run(dist, op, list(shapes), dt, dev, features, timing, variants, rotate, margin, progress)
    finally:
        if owned:
            dist.destroy_process_group()


def _run(dist, op, shapes, dt, dev, features, timing, variants, rotate, margin, progress) -> DistributedResult:
    rank, world = dist.get_rank(), dist.get_world_size()
    d = dispatcher()
    spec = d.registry.spec(op)
    entries = d.registry.variants(spec.name)
    versions = {rv.id: rv.version for rv in entries}
    asked = {"variants": ",".join(variants) if variants is not None else "(all)"}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (fingerprint(dev), versions, asked))
    problems = mismatches([fp for fp, _, _ in everyone], "device fingerprint")
    problems += mismatches([v for _, v, _ in everyone], "variant versions")
    problems += mismatches([a for _, _, a in everyone], "choice of variants")
    if problems:
        raise RankMismatch("ranks must measure identical devices and variants: " + "; ".join(problems))
    # Identical registries on every rank (checked above), so each rank reaches the same verdict here.
    if variants is not None:
        missing = [v for v in variants if v not in versions]
        if missing:
            raise ValueError(f"variants: {', '.join(missing)} not registered for {op} "
                             f"(registered: {', '.join(sorted(versions))})")
    wanted = [rv.id for rv in entries if variants is None or rv.id in variants]
    share = shard(shapes, wanted, rank, world)
    total = sum(len(vs) for _, vs in share)
    done, start = 0, time.perf_counter()
    payload: list[str] = []
    failure: BaseException | None = None
    try:
        for shape, vids in share:
            def taken(m: Measurement) -> None:
                nonlocal done
                done += 1
                if progress is not None:
                    progress(Progress(done, total, m.shape, m.variant, time.perf_counter() - start))

            ms = measure_shape(entries, spec, shape, dtype=dt, device=dev, features=features, timing=timing,
                               rotate=rotate, only=vids, on_result=taken)
            payload += [m.model_dump_json() for m in ms]
    except Exception as exc:  # the other ranks wait in the gather below: they must hear of it
        failure = exc
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (None if failure is None else f"{type(failure).__name__}: {failure}", payload))
    failed = [f"rank {r}: {err}" for r, (err, _) in enumerate(gathered) if err is not None]
    if failure is not None:
        raise failure
    if failed:
        raise RuntimeError("distributed calibration failed on " + "; ".join(failed))
    order = {s: i for i, s in enumerate(shapes)}
    measurements = sorted((Measurement.model_validate_json(t) for _, p in gathered for t in p),
                          key=lambda m: (order.get(m.shape, len(order)), m.variant))
    result = CalibrationResult(spec.name, dev, dtype_name(dt), measurements=measurements)
    imported = None
    if rank == 0:
        status = None
        try:
            versions = {(rv.op, rv.id): rv.version for rv in entries}
            result.winners.update(d.table.store_results(measurements, versions, margin))
            text = build_document(dev).model_dump_json()
        except Exception as exc:  # the other ranks wait in the broadcast below
            status, text = f"rank 0: {type(exc).__name__}: {exc}", ""
            failure = exc
        box = [status, text]
        dist.broadcast_object_list(box, src=0)
        d.invalidate()
        if failure is not None:
            raise failure
    else:
        box = [None, None]
        dist.broadcast_object_list(box, src=0)
        status, text = box
        if status is not None:
            raise RuntimeError(f"distributed calibration failed on {status}")
        doc = parse_document(text, source="rank 0's table")
        imported = import_document(doc, device=dev, source="rank 0's table")
        groups = {m.group for m in measurements}
        for w in doc.winners:
            if w.group in groups and w.shape in order:
                result.winners[w.shape] = w
    dist.barrier()
    return DistributedResult(rank, world, result, imported)

"""Calibration across the ranks of a ``torchrun`` job: one table for a fleet of identical devices;
and at run time, ranks that tune together and a check that they agree.

Every rank takes a share of the (shape, variant) pairs and measures it on its own device
(``cuda:LOCAL_RANK``, ``npu:LOCAL_RANK`` or the CPU). Rank 0 gathers the measurements, records
them and decides each shape's winner, then broadcasts the exported table; every other rank
imports it, so all ranks dispatch identically. Ranks must share one device fingerprint and one
set of variant versions, or the figures of one would be applied to another: that is checked
first, and a mismatch is an error on every rank naming the ranks that differ. Each rank
times its share interleaved, but prunes nothing: a rank sees only part of a shape's variants.

At run time (``KV_TUNE=1`` in an initialised process group), ``tune_together`` makes rank 0
measure a key no rank has measured and every rank run rank 0's choice; ``check_agreement()``
returns the keys on which ranks' decisions differ.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernel_variants._decide import admissions, wants_tuning
from kernel_variants._dtypes import as_dtype, dtype_name
from kernel_variants._policy import Decision
from kernel_variants._registry.keys import CallKey, Features
from kernel_variants._registry.spec import Shape
from kernel_variants._table.exchange import (
    build_document,
    import_document,
    parse_document,
)
from kernel_variants._table.fingerprint import fingerprint, fingerprint_id
from kernel_variants._table.replicate import ingest, rows_at
from kernel_variants._table.rows import (
    DEFAULT_MARGIN,
    Group,
    Measurement,
    check_margin,
    key_from_parts,
    key_parts,
    key_text,
)
from kernel_variants._table.store import CalibrationWarning
from kernel_variants._tuning.calibrate import CalibrationResult, Progress, measure_shape
from kernel_variants._tuning.timing import TimingConfig

if TYPE_CHECKING:
    from kernel_variants._runtime.dispatcher import Dispatcher

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class RankMismatch(ValueError):
    """Ranks of one job differ in device fingerprint or variant versions."""


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
    d: Dispatcher,
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
) -> CalibrationResult:
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
        return _run(d, dist, op, list(shapes), dt, dev, features, timing, variants, rotate, margin, progress)
    finally:
        if owned:
            dist.destroy_process_group()


def _run(d, dist, op, shapes, dt, dev, features, timing, variants, rotate, margin, progress) -> CalibrationResult:
    rank, world = dist.get_rank(), dist.get_world_size()
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
                               rotate=rotate, only=vids, on_result=taken, qualifier=d.qualifier)
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
            text = build_document(d.table, dev).model_dump_json()
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
        imported = import_document(doc, d.table, d.versions(), device=dev, source="rank 0's table")
        d.invalidate()
        groups = {m.group for m in measurements}
        for w in doc.winners:
            if w.group in groups and w.shape in order:
                result.winners[w.shape] = w
    dist.barrier()
    result.rank, result.world_size, result.imported = rank, world, imported
    return result


# Agreement at run time: online tuning (KV_TUNE=1) under torch.distributed, and checking it.


def tuning_world() -> int:
    """The size of the default process group when torch.distributed is initialised, else 1."""
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size()


_warned_divergence = False


def tune_together(d: Dispatcher, key: CallKey, forced: str | None, *, build: bool = False) -> Decision:
    """Decide ``key`` on every rank of the default group at once (a collective: each rank calls
    it when its memo first misses ``key``, which in an SPMD job is the same call on every rank).

    Ranks say whether their table has a measured row for ``key``; if any has none, rank 0
    measures it (the others wait), then rank 0 sends its choice and its rows for the key. Every
    rank records the choice (``Dispatcher.agreed``) and runs it; ranks of rank 0's fingerprint
    also store its rows, so later processes find them. Ranks that reached different calls here
    are warned once and decide on their own (no measurement): ``check_agreement`` reports it."""
    import torch.distributed as dist

    global _warned_divergence
    text = key_text(key)
    facts = dataclasses.replace(d.facts(key), tune=True)
    runnable = [rv.id for rv in facts.runnable() if rv.id not in facts.excluded]
    need = bool(runnable) and wants_tuning(facts, d.figures(key, runnable))
    # Rank 0 chooses among the variants admitted on every rank: each qualifies its own first.
    barred = sorted(d.settle(facts, admissions))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (text, need, barred))
    if any(t != text for t, _, _ in everyone):
        if not _warned_divergence:
            _warned_divergence = True
            others = "; ".join(f"rank {r}: {t}" for r, (t, _, _) in enumerate(everyone) if t != text)
            warnings.warn(f"KV_TUNE: ranks reached different calls at the same point ({text} here; {others}); "
                          "they decide on their own, untuned (kernel_variants.check_agreement() lists where they "
                          "differ)", CalibrationWarning, stacklevel=4)
        return d.decide(key, forced, tune=False, build=build)
    measured = any(n for _, n, _ in everyone)
    anywhere = {v for _, _, b in everyone for v in b}
    fpid = fingerprint_id(fingerprint(key.where))
    box: list = [None]
    if dist.get_rank() == 0:
        failure = None
        try:
            if need:
                d._tune(key)
            mine = d.decide(key, None, tune=False, exclude=anywhere)
            rows = rows_at(d.table, fpid, Group.of(key), key.shape, d.versions())
            box = [(None, mine.chosen.id if mine.chosen is not None else None, fpid, rows)]
        except Exception as exc:  # the other ranks wait in the broadcast below: they must hear of it
            failure = exc
            box = [(f"{type(exc).__name__}: {exc}", None, fpid, [])]
        dist.broadcast_object_list(box, src=0)
        if failure is not None:
            raise failure
    else:
        dist.broadcast_object_list(box, src=0)
    error, chosen, fpid0, rows = box[0]
    if error is not None:
        raise RuntimeError(f"KV_TUNE: rank 0 failed to measure {text}: {error}")
    if dist.get_rank() != 0 and rows and fpid0 == fpid:
        ingest(d.table, rows)
    if chosen is not None:
        d.agreed[text] = chosen
    if measured:
        d.invalidate()  # on every rank alike, so that memos (and the collectives they lead to) stay in step
    return d.decide(key, forced, tune=False, build=build)


@dataclass(frozen=True)
class Disagreement:
    """A call key on which the ranks' decisions differ: rank -> the variant it runs (None: none can)."""

    key: str
    choices: dict[int, str | None]

    def __str__(self) -> str:
        return f"{self.key}: " + ", ".join(f"rank {r} {v or '(nothing)'}" for r, v in sorted(self.choices.items()))


def check_agreement(d: Dispatcher) -> list[Disagreement]:
    """The call keys on which the ranks of the default process group decide differently.

    A collective: every rank calls it. Each rank contributes the keys it has dispatched (with
    the variant it ran); every rank then decides every key any rank met (without running or
    measuring anything: what it would run, or what it ran), and the keys whose variants differ
    are returned, the same list on every rank. Without torch.distributed, or with one rank, [].
    """
    import torch.distributed as dist

    if tuning_world() <= 1:
        return []
    mine = {text: (key_parts(key), vid) for text, (key, vid) in d.decided.items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    parts = {text: p for seen in everyone for text, (p, _) in seen.items()}
    choices: dict[str, str | None] = {}
    for text, p in sorted(parts.items()):
        if text in mine:
            choices[text] = mine[text][1]
            continue
        try:
            key = key_from_parts(d.registry, p)
            decision = d.decide(key, d.pinned(key.op), tune=False, qualify=False)
            choices[text] = decision.chosen.id if decision.chosen is not None else None
        except ValueError:  # an op or features this rank does not have
            choices[text] = None
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, choices)
    out = []
    for text in sorted(parts):
        per = {r: c.get(text) for r, c in enumerate(everyone)}
        if len(set(per.values())) > 1:
            out.append(Disagreement(text, per))
    return out

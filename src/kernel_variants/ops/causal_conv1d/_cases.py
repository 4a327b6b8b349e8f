"""Realistic inputs for one call of an op, built once, replayable on fresh copies of the state.

Calibration times variants on these; the conformance tests check every variant on them. With
``poison=True`` every state row a variant must not read (slots of other sequences, history of
sequences without initial state, rows before the history) and the pad sequence's tokens hold
NaN, so reading one shows up in the output (or, for a variant declaring autograd, in a
gradient), and every row it must not write is compared bit for bit afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from kernel_variants._registry.case import Case
from kernel_variants._registry.models import Capabilities

PAD_SLOT_ID = -1


def _lengths(gen: torch.Generator, batch: int, seqlen: int) -> list[int]:
    """B lengths averaging ``seqlen``, including short and empty ones when there is room."""
    if seqlen == 0:
        return [0] * batch
    lengths = torch.randint(0, 2 * seqlen, (batch,), generator=gen).tolist()
    total = batch * seqlen
    diff = total - sum(lengths)
    i = 0
    while diff != 0:
        step = max(-lengths[i], min(diff, 2 * seqlen))
        lengths[i] += step
        diff -= step
        i = (i + 1) % batch
    return lengths


def make_case(
    op: str,
    batch: int,
    dim: int,
    seqlen: int,
    *,
    width: int = 4,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    bias: bool = True,
    activation: str | None = "silu",
    states: bool = True,
    varlen: bool = False,
    spec: bool = False,
    noncontig: bool = False,
    strided: bool = False,
    offset: bool = False,
    index_dtype: torch.dtype = torch.int32,
    slot_indices: bool = True,
    initial_flags: bool = True,
    pad: bool = False,
    poison: bool = False,
    extra_rows: int = 0,
    pad_slot_id: int = PAD_SLOT_ID,
    seed: int = 0,
) -> Case:
    """A call of ``op`` on (B=batch, D=dim, L=seqlen) with real slot indices into a larger pool.

    ``noncontig`` makes the pool a view of a bigger one (extra leading rows and a slot stride of
    two), ``strided`` makes x, weight and bias strided views too, ``offset`` starts x, weight,
    bias and the index tensors a few elements into their allocations (a slice of a larger
    projection, as engines pass them), ``index_dtype`` is the index tensors' dtype (int32 or
    int64: the contract takes both), ``pad`` maps one sequence to the pad slot (the middle one;
    the only one at B=1), ``spec`` adds num_accepted_tokens (update). Without ``slot_indices`` sequence b uses
    slot b (no index tensor); without ``initial_flags`` no has_initial_state is passed (prefill).
    ``pad_slot_id`` is the call's pad id; one inside the pool (``0``, say) is then never a live
    slot (and, with ``poison``, holds NaN like every slot no sequence uses), so a variant that
    confuses a live sequence with the pad, or reads the pad slot, shows up.
    """
    gen = torch.Generator().manual_seed(seed)
    # The values are drawn where they are used: a large prefill's x made on the host would cost
    # seconds of host time and a copy per case on an accelerator. Indices stay on the host.
    values = gen if torch.device(device).type == "cpu" else torch.Generator(device=device).manual_seed(seed)
    if activation == "none":  # the feature's name for no activation; the call's is None
        activation = None

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=values, device=values.device).to(dtype=dtype, device=device)

    def maybe_strided(t: torch.Tensor) -> torch.Tensor:
        """The same values as a view with every stride doubled (last dim included), and with
        ``offset`` one that starts inside its allocation (an odd number of elements in, so a
        kernel that assumes an aligned or zero-offset start shows up)."""
        if strided:
            big = torch.zeros(*[2 * s for s in t.shape], dtype=t.dtype, device=t.device)
            view = big[tuple(slice(1 if offset else 0, None, 2) for _ in t.shape)]
        elif offset:
            view = torch.zeros(t.numel() + 3, dtype=t.dtype, device=t.device)[3:].view(t.shape)
        else:
            return t
        view.copy_(t)
        return view

    def shifted(t: torch.Tensor) -> torch.Tensor:
        """A 1-D host tensor on the device, one element into its allocation with ``offset``."""
        t = t.to(device)
        return torch.zeros(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].copy_(t) if offset else t

    def index(t: torch.Tensor) -> torch.Tensor:
        return shifted(t.to(index_dtype))

    keep = width - 1
    weight = maybe_strided(randn(dim, width) * (1.0 / width))
    b = maybe_strided(randn(dim)) if bias else None
    if op == "causal_conv1d_update":
        states = True
        rows = keep + (seqlen - 1 if spec else 0) + extra_rows
    else:
        rows = keep + extra_rows
    n_slots = batch + 3
    pad_at = batch // 2 if states and pad and slot_indices else None  # the pad sequence, if any
    pool = base = None
    indices = None
    if states:
        lead = 2 if noncontig else 0
        base = randn(n_slots * (2 if noncontig else 1), rows + lead, dim)
        pool = base[:: 2 if noncontig else 1, lead:] if noncontig else base
        if not slot_indices:
            perm = torch.arange(batch)
        elif 0 <= pad_slot_id < n_slots:  # the pad id names a slot of the pool: no sequence lives there
            free = torch.tensor([s for s in range(n_slots) if s != pad_slot_id])
            perm = free[torch.randperm(n_slots - 1, generator=gen)[:batch]]
        else:
            perm = torch.randperm(n_slots, generator=gen)[:batch]
        if pad_at is not None:
            perm[pad_at] = pad_slot_id
        indices = index(perm) if slot_indices else None
        if poison:
            used = set(perm.tolist()) - {pad_slot_id}
            for s in range(n_slots):
                if s not in used:
                    pool[s] = float("nan")
    if op == "causal_conv1d_update":
        x = maybe_strided(randn(batch, dim) if seqlen == 1 and not spec else randn(batch, seqlen, dim))
        if poison and pad_at is not None:  # a pad's tokens may be anything: none may reach a result
            x[pad_at] = float("nan")
        nat = None
        if spec:
            accepted = torch.randint(1, seqlen + 1, (batch,), generator=gen)
            if poison:  # rows before n-1 are dropped unread by a verify step that accepted n
                for slot, n in zip(perm.tolist(), accepted.tolist(), strict=True):
                    if slot != pad_slot_id and n > 1:
                        pool[slot, : n - 1] = float("nan")
            nat = index(accepted)
        kwargs = dict(activation=activation, conv_state_indices=indices, num_accepted_tokens=nat,
                      pad_slot_id=pad_slot_id)
        return Case(_spec(op), (x, pool, weight, b), kwargs, {"conv_state": base})
    qsl = None
    if varlen:
        lengths = _lengths(gen, batch, seqlen)
        x = maybe_strided(randn(sum(lengths), dim))
        qsl = index(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]))
        if poison and pad_at is not None:
            start = sum(lengths[:pad_at])
            x[start:start + lengths[pad_at]] = float("nan")
    else:
        x = maybe_strided(randn(batch, seqlen, dim))
        if poison and pad_at is not None:
            x[pad_at] = float("nan")
    init = None
    if states:
        init = torch.rand(batch, generator=gen) < 0.7
        init[0] = True
        if batch > 1:
            init[-1] = False
        if not initial_flags:
            init[:] = False  # what None means: no sequence reads its slot
        if poison:
            for i, slot in enumerate(perm.tolist()):
                if slot == pad_slot_id:
                    continue
                if not init[i]:
                    pool[slot] = float("nan")
                elif rows > keep:
                    pool[slot, : rows - keep] = float("nan")
        init = shifted(init) if initial_flags else None
    kwargs = dict(conv_states=pool, cache_indices=indices, has_initial_state=init,
                  query_start_loc=qsl, activation=activation, pad_slot_id=pad_slot_id)
    return Case(_spec(op), (x, weight, b), kwargs, {"conv_states": base} if states else {})


# The package's specs by op name, filled in by the package once built (the specs hold this
# module's functions, so it cannot import them).
SPECS: dict[str, Any] = {}


def _spec(op: str):
    return SPECS[op]


def spec_case(op: str):
    """``make_case`` as an op spec takes it: the shape as a tuple over (B, D, L)."""
    def case(shape: tuple[int, ...], **options: Any) -> Case:
        batch, dim, seqlen = shape
        return make_case(op, batch, dim, seqlen, **options)

    return case


# Named calls the conformance suite tries on every variant, at each width it claims.
FN_CASES: dict[str, dict[str, Any]] = {
    "L=1": dict(shape=(3, 64, 1)),
    "L<W-1": dict(shape=(3, 33, 2), poison=True),
    "odd-D": dict(shape=(2, 37, 9), poison=True),
    "B=1-long": dict(shape=(1, 130, 67)),
    "no-states": dict(shape=(2, 40, 7), states=False),
    "no-bias-no-act": dict(shape=(2, 24, 6), bias=False, activation=None),
    "pad": dict(shape=(4, 48, 5), pad=True, poison=True),
    "noncontig": dict(shape=(3, 32, 6), noncontig=True, poison=True),
    "extra-rows": dict(shape=(2, 16, 3), extra_rows=3, poison=True),
    "varlen": dict(shape=(5, 40, 4), varlen=True, poison=True),
    "varlen-pad-noncontig": dict(shape=(4, 24, 3), varlen=True, pad=True, noncontig=True, poison=True),
    "slot-b": dict(shape=(3, 40, 5), slot_indices=False, poison=True),
    "no-initial-flags": dict(shape=(3, 40, 5), initial_flags=False, poison=True),
    "strided-inputs": dict(shape=(2, 48, 6), strided=True, noncontig=True, poison=True),
    "varlen-strided": dict(shape=(3, 24, 4), varlen=True, strided=True, poison=True),
    # A pad id inside the pool: slot 0 is the pad, live sequences use other slots. Through a view
    # (adapters that compact sequences 0..B-1 then must not hand a kernel pad id 0), and packed.
    "pad-in-range": dict(shape=(4, 48, 5), pad=True, pad_slot_id=0, noncontig=True, poison=True),
    "pad-in-range-varlen": dict(shape=(4, 32, 3), varlen=True, pad=True, pad_slot_id=0, poison=True),
    # Engines hand int64 indices as often as int32 (the contract takes both), and slices of a
    # larger projection (x starts inside its allocation): a kernel that reads either as the other
    # is wrong on every such call.
    "int64-indices-varlen": dict(shape=(4, 40, 5), varlen=True, pad=True, index_dtype=torch.int64, poison=True),
    "int64-pad-in-range": dict(shape=(4, 48, 5), pad=True, pad_slot_id=0, index_dtype=torch.int64, noncontig=True,
                               poison=True),
    "offset": dict(shape=(3, 40, 6), offset=True, pad=True, noncontig=True, poison=True),
    "offset-varlen-strided": dict(shape=(3, 24, 4), varlen=True, offset=True, strided=True, poison=True),
    # One sequence, the pad: a variant limited to B=1 meets the pad too.
    "B=1-pad": dict(shape=(1, 48, 5), pad=True, poison=True),
    # A pad id past the pool's end: a kernel that tests only for negative pads writes there.
    "pad-past-pool": dict(shape=(4, 40, 5), pad=True, pad_slot_id=1 << 20, poison=True),
    # The only empty call the contract has: packed sequences that are all empty (T = 0). The
    # pool must come back untouched but for the history each sequence carries over.
    "empty-varlen": dict(shape=(3, 32, 0), varlen=True, poison=True),
}
UPDATE_CASES: dict[str, dict[str, Any]] = {
    "2d": dict(shape=(3, 64, 1)),
    "L=4": dict(shape=(2, 37, 4)),
    "B=1": dict(shape=(1, 130, 1)),
    "extra-rows": dict(shape=(2, 24, 2), extra_rows=2),
    "pad": dict(shape=(4, 32, 1), pad=True, poison=True),
    "noncontig": dict(shape=(3, 40, 2), noncontig=True),
    "no-bias-no-act": dict(shape=(2, 24, 1), bias=False, activation=None),
    "spec": dict(shape=(3, 40, 4), spec=True, poison=True),
    "spec-pad-noncontig": dict(shape=(4, 24, 3), spec=True, pad=True, noncontig=True, extra_rows=1, poison=True),
    "slot-b": dict(shape=(3, 40, 2), slot_indices=False),
    "strided-inputs": dict(shape=(3, 48, 2), strided=True, noncontig=True),
    "spec-strided": dict(shape=(2, 32, 3), spec=True, strided=True, poison=True),
    # A pad id inside the pool (see FN_CASES), contiguous and through a view with extra rows.
    "pad-in-range": dict(shape=(4, 32, 1), pad=True, pad_slot_id=0, poison=True),
    "pad-in-range-noncontig": dict(shape=(4, 40, 2), pad=True, pad_slot_id=0, noncontig=True, extra_rows=1,
                                   poison=True),
    "spec-pad-in-range": dict(shape=(4, 24, 3), spec=True, pad=True, pad_slot_id=0, extra_rows=1, poison=True),
    # int64 indices and inputs inside their allocations (see FN_CASES); the pad alone at B=1.
    "int64-indices": dict(shape=(4, 32, 1), pad=True, index_dtype=torch.int64, poison=True),
    "spec-int64": dict(shape=(3, 40, 4), spec=True, pad=True, index_dtype=torch.int64, poison=True),
    "offset": dict(shape=(3, 40, 2), offset=True, pad=True, noncontig=True, poison=True),
    "spec-offset-strided": dict(shape=(2, 32, 3), spec=True, offset=True, strided=True, poison=True),
    "B=1-pad": dict(shape=(1, 40, 1), pad=True, poison=True),
    "pad-past-pool": dict(shape=(4, 32, 1), pad=True, pad_slot_id=1 << 20, poison=True),
}


# The check a calibration runs at each shape it measures holds the traps of the small cases too:
# a pad sequence, and NaN in every state row the call must not read.
CHECK_OPTIONS: dict[str, Any] = dict(pad=True, poison=True)


def conformance(named: dict[str, dict[str, Any]]):
    """Each named call at every width the capabilities claim (up to 5)."""
    def cases(caps: Capabilities) -> Iterator[tuple[str, dict[str, Any]]]:
        lo, hi = caps.width
        for name, options in named.items():
            for width in range(max(lo, 1), min(hi if hi is not None else 5, 5) + 1):
                yield f"{name} W={width}", {**options, "width": width}

    return cases

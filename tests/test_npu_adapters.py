"""The adapters of kernels this machine cannot run, against CPU doubles of those kernels.

Each double has the exact schema (or signature) of the real kernel and mimics its quirks: the
Ascend C and PTO ops registered under test namespaces with ``torch.library``, weight ``[W, D]``
only, int32 indices only, contiguous tensors only, history in rows ``0..W-2`` of a slot, pad
rows left as NaN, empty sequences skipped, num_accepted_tokens ignored below W=4 (Ascend C);
the Ascend C host's tiling cache keyed without the dtype (a reused entry reads the data as the
first call's dtype), its undefined D % 16 != 0 (the tail channels are left unwritten) and its
bias read without a stride; the PTO host's width check; ``npu::causal_conv1d_update``'s host
pre-shift and sliding-window kernel; ``causal_conv1d_update_v2``'s output written over its x
and its stride-less bias; causal-conv1d's channel-first layouts and its bias stride check.
The numbers come from the reference, so what the tests check is the adapters: marshalling,
layout translation, and that the state lands in the caller's pool, views included.
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch
from test_conformance import _claimed_cases

import kernel_variants
from kernel_variants._registry.registry import RegisteredVariant
from kernel_variants._runtime.bind import call_key
from kernel_variants._tuning.verify import verify
from kernel_variants.kernels import _adapters, asc, dao, npu_conv_update, npu_triton, pto
from kernel_variants.kernels._adapters import FunctionRef, OpRef
from kernel_variants.ops.causal_conv1d import _reference as reference
from kernel_variants.ops.causal_conv1d._cases import make_case

NAN = float("nan")


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise RuntimeError(msg)


def _conv(hist: torch.Tensor, seg: torch.Tensor, weight_wd: torch.Tensor, bias, silu: bool) -> torch.Tensor:
    """Output rows of ``seg`` after ``hist``, in fp32, through the reference's own tap loop."""
    h = torch.cat([hist, seg]).float()
    return reference._conv(h, weight_wd.t(), bias, silu)


class AscendDouble:
    """What the Ascend C (``run_mode``) and PTO kernels do, on the CPU, quirks included."""

    MAX_CAPTURE_NUM = 1024  # the Ascend C host's tiling-cache entries

    def __init__(self, pto_checks: bool) -> None:
        self.pto = pto_checks
        self.calls: list[dict] = []
        self.tiling: dict[tuple, torch.dtype] = {}  # the Ascend C host's static tiling cache

    def _checks(self, x, weight, conv_states, indices: dict) -> None:
        _require(x.dtype in (torch.bfloat16, torch.float16), f"Only BF16 and FP16 are supported, got {x.dtype}")
        _require(x.is_contiguous() and weight.is_contiguous() and conv_states.is_contiguous(), "inputs must be contiguous")
        _require(weight.ndim == 2 and weight.shape[1] == x.shape[-1], f"weight must be 2D [width, dim], got {list(weight.shape)}")
        _require(conv_states.ndim == 3 and conv_states.shape[2] == x.shape[-1], "conv_states must be [N, state_len, dim]")
        for name, t in indices.items():
            _require(t is None or t.dtype == torch.int32, f"{name} dtype must be int32, got {None if t is None else t.dtype}")
        if self.pto:
            _require(x.shape[-1] % 16 == 0, f"dim must be multiple of 16, but got {x.shape[-1]}")

    def run(self, x, weight, conv_states, bias, qsl, ci, init, nat, silu, pad_slot_id, run_mode):
        width = weight.shape[0]
        keep = width - 1
        rows = conv_states.shape[1]
        dim = x.shape[-1]
        # Ascend C: 32-byte DataCopy of D channels; D % 16 != 0 is undefined: the tail is left unwritten.
        done = dim if self.pto else dim - dim % 16
        _require(rows >= keep, "state_len must be >= width-1")
        if init is not None:
            _require(init.dtype == torch.bool, "has_initial_state dtype must be bool")
        if x.ndim == 2:
            _require(qsl is not None and qsl.numel() >= 2, "query_start_loc must have at least 2 elements")
            starts = qsl.tolist()
            bounds = [(starts[b], starts[b + 1]) for b in range(len(starts) - 1)]
            flat = x
        else:
            bounds = [(b * x.shape[1], (b + 1) * x.shape[1]) for b in range(x.shape[0])]
            flat = x.reshape(-1, x.shape[-1])
        y = torch.full_like(flat, NAN)  # at::empty_like: rows the kernel skips hold garbage
        spec = run_mode == 1 and nat is not None and width == 4  # other widths ignore it
        writes = []
        for b, (start, end) in enumerate(bounds):
            slot = int(ci[b]) if ci is not None else b
            if ci is not None and slot == pad_slot_id:
                continue
            seg = flat[start:end]
            if seg.shape[0] == 0:
                continue  # nothing computed, nothing written back
            if run_mode == 0:
                use = init is not None and bool(init[b])
                hist = conv_states[slot, :keep] if use else torch.zeros(keep, x.shape[-1], dtype=x.dtype)
                offset = 0
            else:
                offset = min(max(int(nat[b]) - 1, 0), rows - keep) if spec else 0
                hist = conv_states[slot, offset : offset + keep]
            y[start:end, :done] = _conv(hist, seg, weight, bias, silu).to(x.dtype)[:, :done]
            if spec and keep - 1 + seg.shape[0] <= rows:
                head = conv_states[slot, offset + 1 : offset + keep].clone()
                writes.append((slot, torch.cat([head, seg])))
            else:
                writes.append((slot, torch.cat([hist, seg])[-keep:].clone()))
        for slot, new in writes:
            conv_states[slot, : new.shape[0], :done] = new[:, :done]
        return y.view(x.shape)

    def tiling_dtype(self, x, weight, conv_states, bias, qsl, ci, init, nat, activation_mode, pad_slot_id, run_mode):
        """The dtype of the tiling the Ascend C host uses: looked up by the upstream key, which
        holds shapes, flags and the pad id but no dtype; a new key is stored (up to 1024)."""
        packed = x.ndim == 2
        batch = qsl.numel() - 1 if packed else x.shape[0]
        present = [t is not None and t.numel() > 0 for t in (bias, ci, init, nat)]
        key = (x.shape[-1], x.shape[0] if packed else x.shape[0] * x.shape[1], 0 if packed else x.shape[1],
               batch, 0 if packed else 1, weight.shape[0], conv_states.shape[1], conv_states.shape[0],
               activation_mode, pad_slot_id, run_mode, *present)
        if key not in self.tiling and len(self.tiling) < self.MAX_CAPTURE_NUM:
            self.tiling[key] = x.dtype
        return self.tiling.get(key, x.dtype)

    def asc(self, x, weight, conv_states, bias=None, query_start_loc=None, cache_indices=None,
            has_initial_state=None, num_accepted_tokens=None, activation_mode=0, pad_slot_id=-1, run_mode=0):
        self.calls.append(dict(run_mode=run_mode, activation_mode=activation_mode, weight=weight,
                               conv_states=conv_states, query_start_loc=query_start_loc, cache_indices=cache_indices,
                               pad_slot_id=pad_slot_id))
        _require(isinstance(activation_mode, int) and run_mode in (0, 1), "bad activation_mode or run_mode")
        _require(2 <= weight.shape[0] <= 4, "Only support width in [2,4]")
        self._checks(x, weight, conv_states, dict(query_start_loc=query_start_loc, cache_indices=cache_indices,
                                                  num_accepted_tokens=num_accepted_tokens))
        if bias is not None:  # read from the data pointer on, whatever its stride
            bias = bias.as_strided((bias.shape[0],), (1,))
        dtype = self.tiling_dtype(x, weight, conv_states, bias, query_start_loc, cache_indices, has_initial_state,
                                  num_accepted_tokens, activation_mode, pad_slot_id, run_mode)
        if dtype != x.dtype:  # a stale tiling picks the other dtype's template: the same bytes, read as dtype
            y = self.run(x.view(dtype), weight.view(dtype), conv_states.view(dtype),
                         None if bias is None else bias.view(dtype), query_start_loc, cache_indices,
                         has_initial_state, num_accepted_tokens, activation_mode != 0, pad_slot_id, run_mode)
            return y.view(x.dtype)
        return self.run(x, weight, conv_states, bias, query_start_loc, cache_indices, has_initial_state,
                        num_accepted_tokens, activation_mode != 0, pad_slot_id, run_mode)

    def pto_op(self, x, weight, conv_states, query_start_loc, cache_indices, has_initial_state, bias=None,
               activation_mode=False, pad_slot_id=-1):
        self.calls.append(dict(activation_mode=activation_mode, weight=weight, conv_states=conv_states,
                               query_start_loc=query_start_loc, cache_indices=cache_indices, pad_slot_id=pad_slot_id))
        _require(2 <= weight.shape[0] <= 64, f"Only filter widths 2..64 are supported, got {weight.shape[0]}")
        _require(isinstance(activation_mode, bool), "activation_mode must be a bool")
        self._checks(x, weight, conv_states, dict(query_start_loc=query_start_loc, cache_indices=cache_indices))
        _require(bias is None or bias.is_contiguous(), "bias must be contiguous")
        return self.run(x, weight, conv_states, bias, query_start_loc if x.ndim == 2 else None, cache_indices,
                        has_initial_state, None, activation_mode, pad_slot_id, 0)


ASC_SCHEMA = ("causal_conv1d(Tensor x, Tensor weight, Tensor conv_states, Tensor? bias=None, "
              "Tensor? query_start_loc=None, Tensor? cache_indices=None, Tensor? has_initial_state=None, "
              "Tensor? num_accepted_tokens=None, int activation_mode=0, int pad_slot_id=-1, "
              "int run_mode=0) -> Tensor")
PTO_SCHEMA = ("causal_conv1d(Tensor x, Tensor weight, Tensor conv_states, Tensor query_start_loc, "
              "Tensor cache_indices, Tensor has_initial_state, Tensor? bias=None, bool activation_mode=False, "
              "int pad_slot_id=-1) -> Tensor")

ASC_DOUBLE = AscendDouble(pto_checks=False)
PTO_DOUBLE = AscendDouble(pto_checks=True)
# Kept for the whole session: a torch.library namespace can be defined once per process.
_LIBS = []
for _ns, _schema, _impl in (("kv_test_asc", ASC_SCHEMA, ASC_DOUBLE.asc), ("kv_test_pto", PTO_SCHEMA, PTO_DOUBLE.pto_op)):
    _lib = torch.library.Library(_ns, "DEF")
    _lib.define(_schema)
    _lib.impl("causal_conv1d", _impl, "CPU")
    _LIBS.append(_lib)


class ConvUpdateDouble:
    """``npu::causal_conv1d_update`` on the CPU: its host's pre-shift (rows 0..S-L-1 := rows
    L..S-1 of every indexed slot, pads clamped to slot 0), then its kernel's sliding window at
    rows o..o+W-2 (o = n-1 with num_accepted_tokens, else 0), rows addressed in the whole pool."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, x, weight, conv_state, conv_state_indices, bias=None, num_accepted_tokens=None,
                 query_start_loc=None, activation_mode=False, pad_slot_id=-1):
        self.calls.append(dict(x=x, weight=weight, conv_state=conv_state, indices=conv_state_indices,
                               num_accepted_tokens=num_accepted_tokens, pad_slot_id=pad_slot_id))
        _require(x.dim() == 3, f"x must be 3D tensor [batch, seq_len, dim], got shape {list(x.shape)}")
        _require(weight.dim() == 2 and conv_state.dim() == 3, "weight must be 2D, conv_state 3D")
        _require(x.dtype in (torch.bfloat16, torch.float16), f"Only BF16 and FP16 are supported, got {x.dtype}")
        _require(weight.dtype == x.dtype and conv_state.dtype == x.dtype, "dtypes must match x dtype")
        _require(x.is_contiguous() and weight.is_contiguous() and conv_state.is_contiguous(), "must be contiguous")
        _require(query_start_loc is None or query_start_loc.numel() == 0, "query_start_loc: not modelled")
        batch, length, dim = x.shape
        width, rows = weight.shape[0], conv_state.shape[1]
        has_idx = conv_state_indices.numel() > 0
        spec = num_accepted_tokens is not None and num_accepted_tokens.numel() > 0
        for t in (conv_state_indices, num_accepted_tokens):
            _require(t is None or t.numel() == 0 or t.dtype == torch.int32, "indices must be int32")
        y = torch.full_like(x, NAN)  # at::empty_like: pad rows hold garbage
        shift = rows - length
        if shift > 0:  # the host's pre-shift
            if has_idx:
                safe = conv_state_indices.long().clamp_min(0)
                view = conv_state.index_select(0, safe)
                view[:, :shift] = view[:, length : length + shift].clone()
                conv_state.index_copy_(0, safe, view)
            else:
                conv_state[:, :shift] = conv_state[:, length : length + shift].clone()
        flat = conv_state.view(-1, dim)  # the kernel's row offsets address the whole pool

        def row(slot: int, r: int) -> int:
            _require(0 <= slot * rows + r < flat.shape[0], "row outside the pool")
            return slot * rows + r

        w = weight.float()
        b = bias.float() if bias is not None and bias.numel() > 0 else None

        def finish(acc):
            acc = acc + b if b is not None else acc
            return (acc / (1.0 + torch.exp(-acc)) if activation_mode else acc).to(x.dtype)

        for i in range(batch):
            slot = int(conv_state_indices[i]) if has_idx else i
            if has_idx and slot == pad_slot_id:
                continue
            n = int(num_accepted_tokens[i]) if spec else length
            o = n - 1 if spec else 0
            calc = min(n, length)
            for j in range(calc):  # the window slides by one row per token
                acc = torch.zeros(dim)
                for k in range(width - 1):
                    r = flat[row(slot, k + o)].clone()
                    if k + o != 0:
                        flat[row(slot, k + o - 1)] = r
                    acc += r.float() * w[k]
                flat[row(slot, o + width - 2)] = x[i, j]
                y[i, j] = finish(acc + x[i, j].float() * w[width - 1])
            for j in range(length - calc):  # tokens past n append
                acc = torch.zeros(dim)
                for k in range(width - 1):
                    acc += flat[row(slot, k + o + j)].float() * w[k]
                flat[row(slot, o + width - 1 + j)] = x[i, calc + j]
                y[i, calc + j] = finish(acc + x[i, calc + j].float() * w[width - 1])
        return y


UPDATE_SCHEMA = ("causal_conv1d_update(Tensor x, Tensor weight, Tensor(a!) conv_state, Tensor conv_state_indices, "
                 "Tensor? bias=None, Tensor? num_accepted_tokens=None, Tensor? query_start_loc=None, "
                 "bool activation_mode=False, int pad_slot_id=-1) -> Tensor")
UPDATE_DOUBLE = ConvUpdateDouble()
_lib = torch.library.Library("kv_test_upd", "DEF")
_lib.define(UPDATE_SCHEMA)
_lib.impl("causal_conv1d_update", UPDATE_DOUBLE, "CPU")
_LIBS.append(_lib)


def update_v2(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None, num_accepted_tokens=None,
              query_start_loc=None, max_query_len=-1, pad_slot_id=-1, block_idx_last_scheduled_token=None,
              initial_state_idx=None, validate_data=False):
    """``causal_conv1d_update_v2`` on the CPU: strided state and weight, output over x, history
    from row 0 (or n-1), state rewritten in rows 0..W-2 (0..W-1+L-2), fp16 internally."""
    update_v2.calls.append(dict(conv_state=conv_state, weight=weight, indices=conv_state_indices, bias=bias,
                                pad_slot_id=pad_slot_id))
    _require(x.dtype in (torch.bfloat16, torch.float16), "fp16/bf16 only")
    if bias is not None:  # loaded at bias_ptr + channel, whatever its stride
        bias = bias.as_strided((bias.shape[0],), (1,))
    _require(conv_state_indices is not None, "conv_state_indices is loaded unconditionally")
    _require(weight.shape[1] == x.shape[-1], "weight must be (width, dim)")
    x3 = x if x.ndim == 3 else x.unsqueeze(1)
    width, length = weight.shape[0], x3.shape[1]
    keep = width - 1
    spec = num_accepted_tokens is not None
    eff = keep + length - 1 if spec else keep
    tokens = x3.clone()
    for b in range(x3.shape[0]):
        slot = int(conv_state_indices[b])
        if slot == pad_slot_id:
            continue  # output row left as x's
        offset = int(num_accepted_tokens[b]) - 1 if spec else 0
        hist = conv_state[slot, offset : offset + keep]
        x3[b] = _conv(hist.half(), tokens[b].half(), weight, bias, activation is not None).to(x.dtype)
        src = offset + 1 if spec else length
        stream = torch.cat([conv_state[slot, src : src + max(eff - length, 0)], tokens[b]])
        conv_state[slot, :eff] = stream[-eff:]
    return x


update_v2.calls = []


def _wrong_signature(x, conv_state, weight, bias=None, activation=None):
    return x


def _dao_module() -> types.ModuleType:
    """causal-conv1d's two entry points on the CPU, with their layouts and checks."""
    mod = types.ModuleType("kv_test_causal_conv1d")

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                         final_states_out=None, activation=None):
        bias = bias.contiguous() if bias is not None else None  # what the package's Python wrapper does
        batch, dim, _ = x.shape
        keep = weight.shape[1] - 1
        if initial_states is not None or return_final_states:
            _require(x.stride(1) == 1 and x.stride(2) > 1, "Only channel-last layout supports initial/final states")
            _require(dim % 8 == 0 and x.stride(2) % 8 == 0, "channel last layout requires dim % 8 == 0")
        out = torch.empty_like(x)
        final = final_states_out
        if return_final_states and final is None:
            final = torch.empty(batch, keep, dim, dtype=x.dtype).transpose(1, 2)
        for b in range(batch):
            hist = initial_states[b].t() if initial_states is not None else torch.zeros(keep, dim, dtype=x.dtype)
            out[b] = _conv(hist, x[b].t(), weight.t(), bias, activation is not None).t().to(x.dtype)
            if return_final_states:
                _require(final.stride(1) == 1, "final_states_out must be channel-last")
                final[b] = torch.cat([hist, x[b].t()])[-keep:].t()
        return (out, final) if return_final_states else out

    def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                             conv_state_indices=None):
        x3 = x.unsqueeze(-1) if x.dim() == 2 else x
        _require(conv_state_indices is None or conv_state_indices.dtype == torch.int32, "indices must be int32")
        _require(bias is None or bias.stride(-1) == 1, "bias.stride(-1) == 1")  # causal_conv1d.cpp
        if conv_state_indices is None:
            _require(conv_state.shape[0] == x3.shape[0], "conv_state must be [batch, dim, state_len]")
        out = torch.empty_like(x3)
        keep = weight.shape[1] - 1
        rows = conv_state.shape[2]
        for b in range(x3.shape[0]):
            slot = int(conv_state_indices[b]) if conv_state_indices is not None else b
            if slot < 0:
                out[b] = 0
                continue
            state = conv_state[slot].t()  # [S, D] view of the caller's pool
            out[b] = _conv(state[rows - keep :], x3[b].t(), weight.t(), bias, activation is not None).t().to(x.dtype)
            state.copy_(torch.cat([state, x3[b].t()])[-rows:])
        return out.squeeze(-1) if x.dim() == 2 else out

    mod.causal_conv1d_fn = causal_conv1d_fn
    mod.causal_conv1d_update = causal_conv1d_update
    return mod


def into_copy(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None,
              num_accepted_tokens=None, pad_slot_id=-1, **kwargs):
    """What SGLang's adoption of causal_conv1d_update_v2 did: hand it ``conv_states.contiguous()``."""
    return update_v2(x, conv_state.contiguous(), weight, bias, activation, conv_state_indices, num_accepted_tokens,
                     pad_slot_id=pad_slot_id, **kwargs)


@pytest.fixture
def dao_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "kv_test_causal_conv1d", _dao_module())


def _cpu(variants) -> dict[str, RegisteredVariant]:
    return {v.op: RegisteredVariant(v, "test", "1") for v in variants}


def _asc():
    return _cpu(asc.variants(asc.AscAdapter(OpRef("kv_test_asc::causal_conv1d")), devices={"cpu"}))


def _pto():
    return _cpu(pto.variants(pto.PtoAdapter(OpRef("kv_test_pto::causal_conv1d")), devices={"cpu"}))


def _npu_triton(target=f"{__name__}:update_v2"):
    return _cpu(npu_triton.variants(npu_triton.NpuTritonAdapter(FunctionRef(target)), devices={"cpu"}))


def _dao():
    return _cpu(dao.variants(dao.DaoAdapter("kv_test_causal_conv1d", needs_cuda=False), devices={"cpu"}))


def _npu_conv_update():
    adapter = npu_conv_update.NpuConvUpdateAdapter(OpRef("kv_test_upd::causal_conv1d_update"))
    return _cpu(npu_conv_update.variants(adapter, devices={"cpu"}))


@pytest.fixture
def adapters(dao_module):
    return {"asc": _asc(), "pto": _pto(), "npu_triton_update": _npu_triton(), "dao": _dao(),
            "npu_conv_update": _npu_conv_update()}


ENTRIES = [("asc", "causal_conv1d_fn"), ("asc", "causal_conv1d_update"), ("pto", "causal_conv1d_fn"),
           ("npu_triton_update", "causal_conv1d_update"), ("dao", "causal_conv1d_fn"), ("dao", "causal_conv1d_update"),
           ("npu_conv_update", "causal_conv1d_update")]


@pytest.mark.parametrize(("name", "op"), ENTRIES, ids=[f"{n}:{o}" for n, o in ENTRIES])
def test_adapter_on_its_double_matches_the_reference_on_every_claimed_case(adapters, name, op):
    """The conformance suite's cases, drawn from what the adapter declares, on the CPU double."""
    rv = adapters[name][op]
    assert rv.unavailable_reason() is None
    failures, ran = [], 0
    for label, case in _claimed_cases(rv, "cpu"):
        ran += 1
        why = verify(rv.variant.fn, case)
        if why is not None:
            failures.append(f"{label}: {why}")
    assert ran >= 20, f"{name} claims only {ran} cases"
    assert not failures, f"{name} failed {len(failures)} of {ran} cases:\n" + "\n".join(failures)


def _case(op, **kw):
    base = dict(batch=3, dim=32, seqlen=3, width=4, dtype=torch.bfloat16)
    return make_case(op, **{**base, **kw})


def test_int64_indices_reach_the_kernels_as_int32(adapters):
    """The doubles raise on int64, as the real kernels' checks do; the adapters convert."""
    for name, op in ENTRIES:
        update = op == "causal_conv1d_update"
        case = _case(op, pad=True, poison=True, varlen=not update and name != "dao", spec=update and name != "dao")
        for key in ("cache_indices", "conv_state_indices", "query_start_loc", "num_accepted_tokens"):
            if case.kwargs.get(key) is not None:
                case.kwargs[key] = case.kwargs[key].long()
        assert verify(adapters[name][op].variant.fn, case) is None, (name, op)


def test_a_pad_slot_id_other_than_minus_one(adapters):
    """causal-conv1d skips negative slots only; the others take pad_slot_id as given."""
    for name, op in ENTRIES:
        case = _case(op, batch=4, pad=True, poison=True)
        key = "conv_state_indices" if op == "causal_conv1d_update" else "cache_indices"
        n_slots = case.state().shape[0]
        idx = case.kwargs[key]
        case.kwargs[key] = torch.where(idx == -1, n_slots + 5, idx).to(torch.int32)
        case.kwargs["pad_slot_id"] = n_slots + 5
        assert verify(adapters[name][op].variant.fn, case) is None, (name, op)


def test_asc_marshalling_weight_activation_and_run_mode(adapters):
    ASC_DOUBLE.calls.clear()
    for op, act, run_mode in (("causal_conv1d_fn", "silu", 0), ("causal_conv1d_fn", None, 0),
                              ("causal_conv1d_update", "silu", 1), ("causal_conv1d_update", None, 1)):
        case = _case(op, activation=act)
        assert verify(adapters["asc"][op].variant.fn, case) is None
        call = ASC_DOUBLE.calls[-1]
        assert call["run_mode"] == run_mode
        assert call["activation_mode"] == (1 if act else 0) and type(call["activation_mode"]) is int
        weight = case.args[1] if op == "causal_conv1d_fn" else case.args[2]
        assert torch.equal(call["weight"], weight.t()) and call["weight"].is_contiguous()


def test_pto_marshalling_bool_activation_required_tensors_and_dim_padding(adapters):
    PTO_DOUBLE.calls.clear()
    for act in ("silu", None):
        case = _case("causal_conv1d_fn", dim=40, activation=act, states=False)  # 40 is no multiple of 16
        assert verify(adapters["pto"]["causal_conv1d_fn"].variant.fn, case) is None
        call = PTO_DOUBLE.calls[-1]
        assert call["activation_mode"] is (act is not None)
        assert call["weight"].shape == (4, 48)


def test_npu_triton_gets_the_callers_pool_as_a_view_and_the_weight_without_a_copy(adapters):
    update_v2.calls.clear()
    case = _case("causal_conv1d_update", noncontig=True).fresh()
    out = adapters["npu_triton_update"]["causal_conv1d_update"].variant.fn(*case.args, **case.kwargs)
    call = update_v2.calls[-1]
    pool, weight = case.args[1], case.args[2]
    assert call["conv_state"].data_ptr() == pool.data_ptr() and call["conv_state"].stride() == pool.stride()
    assert call["weight"].data_ptr() == weight.data_ptr() and call["weight"].shape == (4, 32)
    assert call["indices"].dtype == torch.int32
    assert out.data_ptr() != case.args[0].data_ptr(), "the kernel writes over its x: never the caller's"


def test_pad_rows_come_back_zero_though_the_kernels_leave_them_uninitialised(adapters):
    case = _case("causal_conv1d_fn", batch=4, pad=True).fresh()
    x, weight, bias = case.args
    kw = case.kwargs
    raw = torch.ops.kv_test_asc.causal_conv1d(x, weight.t().contiguous(), kw["conv_states"].clone(), bias, None,
                                              kw["cache_indices"], kw["has_initial_state"], None, 1, -1, 0)
    pad = kw["cache_indices"] == -1
    assert raw[pad].isnan().all(), "the double mimics the kernel: pad rows uninitialised"
    for name in ("asc", "pto"):
        again = case.fresh()
        out = adapters[name]["causal_conv1d_fn"].variant.fn(*again.args, **again.kwargs)
        assert (out[pad] == 0).all() and not out.isnan().any()


def test_asc_declares_num_accepted_tokens_for_width_4_only(adapters):
    rv = adapters["asc"]["causal_conv1d_update"]
    caps = rv.variant.capabilities
    assert caps.num_accepted_tokens and caps.num_accepted_tokens_width == (4, 4)
    w3 = _case("causal_conv1d_update", width=3, spec=True, batch=4)
    assert "only for width 4..4" in caps.uncovered(call_key(w3.op, *w3.args, **w3.kwargs))
    assert verify(rv.variant.fn, _case("causal_conv1d_update", width=4, spec=True, noncontig=True)) is None
    # Why the limit is declared: below W=4 the kernel ignores num_accepted_tokens.
    case = w3.fresh()
    x, pool, weight, bias = case.args
    kw = case.kwargs
    raw = torch.ops.kv_test_asc.causal_conv1d(x, weight.t().contiguous(), pool.contiguous(), bias, None,
                                              kw["conv_state_indices"], None, kw["num_accepted_tokens"], 1, -1, 1)
    expected = reference.causal_conv1d_update(*w3.fresh().args, **kw)
    assert not torch.allclose(raw.float(), expected.float(), atol=0.1)
    with pytest.raises(ValueError, match="W=4 only"):
        rv.variant.fn(*w3.fresh().args, **kw)


@pytest.mark.parametrize(("name", "op"), ENTRIES, ids=[f"{n}:{o}" for n, o in ENTRIES])
def test_state_lands_in_a_non_contiguous_pool(adapters, name, op):
    specs = (False, True) if op == "causal_conv1d_update" and name != "dao" else (False,)
    for extra_rows in (0, 2):
        for spec in specs:
            case = _case(op, noncontig=True, extra_rows=extra_rows, spec=spec).fresh()
            before = case.pool_base.clone()
            adapters[name][op].variant.fn(*case.args, **case.kwargs)
            assert not torch.equal(before, case.pool_base), (extra_rows, spec)
            assert verify(adapters[name][op].variant.fn, case) is None, (extra_rows, spec)


def test_a_kernel_handed_a_contiguous_copy_of_the_pool_is_caught(adapters):
    """SGLang's adoption of causal_conv1d_update_v2 passed ``conv_states.contiguous()``."""
    broken = _npu_triton(f"{__name__}:into_copy")["causal_conv1d_update"].variant.fn
    good = adapters["npu_triton_update"]["causal_conv1d_update"].variant.fn
    contiguous = _case("causal_conv1d_update")
    assert verify(broken, contiguous) is None, "on a contiguous pool .contiguous() is the pool itself"
    strided = _case("causal_conv1d_update", noncontig=True)
    assert verify(good, strided) is None
    assert "conv_state:" in (verify(broken, strided) or "")


def test_a_scatter_into_a_copy_of_the_pool_is_caught(adapters, monkeypatch):
    real = _adapters.scatter_rows

    def into_copy(pool, *args):
        real(pool.contiguous(), *args)

    case = _case("causal_conv1d_update", noncontig=True, spec=True)
    fn_case = _case("causal_conv1d_fn", noncontig=True)
    assert verify(adapters["asc"]["causal_conv1d_update"].variant.fn, case) is None
    monkeypatch.setattr(asc, "scatter_rows", into_copy)
    monkeypatch.setattr(_adapters, "scatter_rows", into_copy)
    assert "conv_state:" in (verify(adapters["asc"]["causal_conv1d_update"].variant.fn, case) or "")
    assert "conv_states:" in (verify(adapters["pto"]["causal_conv1d_fn"].variant.fn, fn_case) or "")


def test_kernels_are_recognised_by_schema_and_a_mismatch_says_what_was_found():
    pto_on_asc = pto.PtoAdapter(OpRef("kv_test_asc::causal_conv1d")).probe()
    assert "kv_test_asc::causal_conv1d has the schema" in pto_on_asc and "int run_mode=0" in pto_on_asc
    assert "PTO-ISA" in pto_on_asc
    asc_on_pto = asc.AscAdapter(OpRef("kv_test_pto::causal_conv1d")).probe()
    assert "bool activation_mode=False" in asc_on_pto and "Ascend C" in asc_on_pto
    missing = asc.AscAdapter(OpRef("kv_test_none::causal_conv1d")).probe()
    assert missing == "op kv_test_none::causal_conv1d is not registered"
    wrong = npu_triton.NpuTritonAdapter(FunctionRef(f"{__name__}:_wrong_signature")).probe()
    assert "_wrong_signature(x, conv_state, weight, bias=None, activation=None) is not" in wrong
    absent = npu_triton.NpuTritonAdapter(FunctionRef("kv_no_such_module:f")).probe()
    assert absent == "kv_no_such_module not installed (pip install kv_no_such_module)"
    assert asc.AscAdapter(OpRef("kv_test_asc::causal_conv1d")).probe() is None


def test_kv_pto_op_names_a_pto_build_beside_the_ascend_c_one():
    assert pto.default_ref({}).qualname == "npu::causal_conv1d"
    ref = pto.default_ref({"KV_PTO_OP": "kv_test_pto::causal_conv1d"})
    assert ref.qualname == "kv_test_pto::causal_conv1d" and ref.device == "npu"
    assert pto.PtoAdapter(OpRef(ref.qualname)).probe() is None


def test_registered_variants_say_precisely_why_they_cannot_run_here(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernel_variants.reload()
    reasons = {(rv.op, rv.id): rv.unavailable_reason() for rv in kernel_variants.variants()}
    expected_ids = {"asc", "pto", "npu_triton_update", "npu_conv_update", "triton", "dao"}
    assert expected_ids <= {vid for _, vid in reasons}
    if _adapters.import_reason(["torch_npu"]) is not None:
        for key in [("causal_conv1d_fn", "asc"), ("causal_conv1d_update", "asc"), ("causal_conv1d_fn", "pto"),
                    ("causal_conv1d_update", "npu_triton_update"), ("causal_conv1d_update", "npu_conv_update")]:
            assert reasons[key] == "torch_npu not installed (pip install torch_npu)"
    if not torch.cuda.is_available():
        assert "CUDA" in reasons[("causal_conv1d_fn", "dao")] or "not installed" in reasons[("causal_conv1d_fn", "dao")]
        assert reasons[("causal_conv1d_fn", "triton")] in (
            "triton not installed (pip install triton)",
            "no CUDA device (set TRITON_INTERPRET=1 to run on CPU under the interpreter)")


def test_import_needs_none_of_the_optional_packages():
    code = ("import sys, kernel_variants as kv\n"
            "[v.unavailable_reason() for v in kv.variants() if v.id in ('triton', 'dao')]\n"
            "heavy = {'torch_npu', 'sgl_kernel_npu', 'triton', 'causal_conv1d'} & set(sys.modules)\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

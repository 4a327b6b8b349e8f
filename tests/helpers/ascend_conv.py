"""CPU doubles of the Ascend and causal-conv1d kernels this machine cannot run, and the
adapters of kernel_variants built on them.

Each double has the exact schema (or signature) of the real kernel and mimics its quirks: the
Ascend C and PTO ops registered under test namespaces with ``torch.library``, weight ``[W, D]``
only, int32 indices only, contiguous tensors only, history in rows ``0..W-2`` of a slot, pad
rows left as NaN, empty sequences skipped, num_accepted_tokens ignored below W=4 (Ascend C);
the Ascend C host's tiling cache keyed without the dtype (a reused entry reads the data as the
first call's dtype), its undefined D % 16 != 0 (the tail channels are left unwritten) and its
bias read without a stride; the PTO host's width check; ``npu::causal_conv1d_update``'s host
pre-shift and sliding-window kernel; ``causal_conv1d_update_v2``'s output written over its x
and its stride-less bias; causal-conv1d's channel-first layouts and its bias stride check.
The numbers come from the reference, so what a test checks is the adapters.

Importing this module defines the ``kv_test_asc``, ``kv_test_pto`` and ``kv_test_upd`` torch
library namespaces (once per process, which is all torch allows).
"""

from __future__ import annotations

import types

import torch

from kernel_variants._registry.registry import RegisteredVariant
from kernel_variants.kernels import asc, dao, npu_conv_update, npu_triton, pto
from kernel_variants.kernels._adapters import FunctionRef, OpRef
from kernel_variants.ops.causal_conv1d import _reference as reference

DAO_MODULE = "kv_test_causal_conv1d"  # the module name the causal-conv1d double is installed under

NAN = float("nan")


def require(ok: bool, msg: str) -> None:
    if not ok:
        raise RuntimeError(msg)


def conv_rows(hist: torch.Tensor, seg: torch.Tensor, weight_wd: torch.Tensor, bias, silu: bool) -> torch.Tensor:
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
        require(x.dtype in (torch.bfloat16, torch.float16), f"Only BF16 and FP16 are supported, got {x.dtype}")
        require(x.is_contiguous() and weight.is_contiguous() and conv_states.is_contiguous(), "inputs must be contiguous")
        require(weight.ndim == 2 and weight.shape[1] == x.shape[-1], f"weight must be 2D [width, dim], got {list(weight.shape)}")
        require(conv_states.ndim == 3 and conv_states.shape[2] == x.shape[-1], "conv_states must be [N, state_len, dim]")
        for name, t in indices.items():
            require(t is None or t.dtype == torch.int32, f"{name} dtype must be int32, got {None if t is None else t.dtype}")
        if self.pto:
            require(x.shape[-1] % 16 == 0, f"dim must be multiple of 16, but got {x.shape[-1]}")

    def run(self, x, weight, conv_states, bias, qsl, ci, init, nat, silu, pad_slot_id, run_mode):
        width = weight.shape[0]
        keep = width - 1
        rows = conv_states.shape[1]
        dim = x.shape[-1]
        # Ascend C: 32-byte DataCopy of D channels; D % 16 != 0 is undefined: the tail is left unwritten.
        done = dim if self.pto else dim - dim % 16
        require(rows >= keep, "state_len must be >= width-1")
        if init is not None:
            require(init.dtype == torch.bool, "has_initial_state dtype must be bool")
        if x.ndim == 2:
            require(qsl is not None and qsl.numel() >= 2, "query_start_loc must have at least 2 elements")
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
            y[start:end, :done] = conv_rows(hist, seg, weight, bias, silu).to(x.dtype)[:, :done]
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
        require(isinstance(activation_mode, int) and run_mode in (0, 1), "bad activation_mode or run_mode")
        require(2 <= weight.shape[0] <= 4, "Only support width in [2,4]")
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
        require(2 <= weight.shape[0] <= 64, f"Only filter widths 2..64 are supported, got {weight.shape[0]}")
        require(isinstance(activation_mode, bool), "activation_mode must be a bool")
        self._checks(x, weight, conv_states, dict(query_start_loc=query_start_loc, cache_indices=cache_indices))
        require(bias is None or bias.is_contiguous(), "bias must be contiguous")
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
# Module-level, so defined once per process: torch.library refuses a namespace defined twice.
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
        require(x.dim() == 3, f"x must be 3D tensor [batch, seq_len, dim], got shape {list(x.shape)}")
        require(weight.dim() == 2 and conv_state.dim() == 3, "weight must be 2D, conv_state 3D")
        require(x.dtype in (torch.bfloat16, torch.float16), f"Only BF16 and FP16 are supported, got {x.dtype}")
        require(weight.dtype == x.dtype and conv_state.dtype == x.dtype, "dtypes must match x dtype")
        require(x.is_contiguous() and weight.is_contiguous() and conv_state.is_contiguous(), "must be contiguous")
        require(query_start_loc is None or query_start_loc.numel() == 0, "query_start_loc: not modelled")
        batch, length, dim = x.shape
        width, rows = weight.shape[0], conv_state.shape[1]
        has_idx = conv_state_indices.numel() > 0
        spec = num_accepted_tokens is not None and num_accepted_tokens.numel() > 0
        for t in (conv_state_indices, num_accepted_tokens):
            require(t is None or t.numel() == 0 or t.dtype == torch.int32, "indices must be int32")
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
            require(0 <= slot * rows + r < flat.shape[0], "row outside the pool")
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
    require(x.dtype in (torch.bfloat16, torch.float16), "fp16/bf16 only")
    if bias is not None:  # loaded at bias_ptr + channel, whatever its stride
        bias = bias.as_strided((bias.shape[0],), (1,))
    require(conv_state_indices is not None, "conv_state_indices is loaded unconditionally")
    require(weight.shape[1] == x.shape[-1], "weight must be (width, dim)")
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
        x3[b] = conv_rows(hist.half(), tokens[b].half(), weight, bias, activation is not None).to(x.dtype)
        src = offset + 1 if spec else length
        stream = torch.cat([conv_state[slot, src : src + max(eff - length, 0)], tokens[b]])
        conv_state[slot, :eff] = stream[-eff:]
    return x


update_v2.calls = []


def wrong_signature(x, conv_state, weight, bias=None, activation=None):
    return x


def make_dao_module() -> types.ModuleType:
    """causal-conv1d's two entry points on the CPU, with their layouts and checks."""
    mod = types.ModuleType("kv_test_causal_conv1d")

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                         final_states_out=None, activation=None):
        bias = bias.contiguous() if bias is not None else None  # what the package's Python wrapper does
        batch, dim, _ = x.shape
        keep = weight.shape[1] - 1
        if initial_states is not None or return_final_states:
            require(x.stride(1) == 1 and x.stride(2) > 1, "Only channel-last layout supports initial/final states")
            require(dim % 8 == 0 and x.stride(2) % 8 == 0, "channel last layout requires dim % 8 == 0")
        out = torch.empty_like(x)
        final = final_states_out
        if return_final_states and final is None:
            final = torch.empty(batch, keep, dim, dtype=x.dtype).transpose(1, 2)
        for b in range(batch):
            hist = initial_states[b].t() if initial_states is not None else torch.zeros(keep, dim, dtype=x.dtype)
            out[b] = conv_rows(hist, x[b].t(), weight.t(), bias, activation is not None).t().to(x.dtype)
            if return_final_states:
                require(final.stride(1) == 1, "final_states_out must be channel-last")
                final[b] = torch.cat([hist, x[b].t()])[-keep:].t()
        return (out, final) if return_final_states else out

    def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                             conv_state_indices=None):
        x3 = x.unsqueeze(-1) if x.dim() == 2 else x
        require(conv_state_indices is None or conv_state_indices.dtype == torch.int32, "indices must be int32")
        require(bias is None or bias.stride(-1) == 1, "bias.stride(-1) == 1")  # causal_conv1d.cpp
        if conv_state_indices is None:
            require(conv_state.shape[0] == x3.shape[0], "conv_state must be [batch, dim, state_len]")
        out = torch.empty_like(x3)
        keep = weight.shape[1] - 1
        rows = conv_state.shape[2]
        for b in range(x3.shape[0]):
            slot = int(conv_state_indices[b]) if conv_state_indices is not None else b
            if slot < 0:
                out[b] = 0
                continue
            state = conv_state[slot].t()  # [S, D] view of the caller's pool
            out[b] = conv_rows(state[rows - keep :], x3[b].t(), weight.t(), bias, activation is not None).t().to(x.dtype)
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


def library(ns: str, schema: str, impl, name: str = "causal_conv1d") -> torch.library.Library:
    """A test namespace ``ns`` with one op of ``schema``, implemented on the CPU by ``impl``."""
    lib = torch.library.Library(ns, "DEF")
    lib.define(schema)
    lib.impl(name, impl, "CPU")
    return lib


def registered(variants) -> dict[str, RegisteredVariant]:
    """op -> the variant as the registry would hold it, from a kernel module's ``variants()``."""
    return {v.op: RegisteredVariant(v, "test", "1") for v in variants}


def asc_variants():
    return registered(asc.variants(asc.AscAdapter(OpRef("kv_test_asc::causal_conv1d")), devices={"cpu"}))


def pto_variants():
    return registered(pto.variants(pto.PtoAdapter(OpRef("kv_test_pto::causal_conv1d")), devices={"cpu"}))


def npu_triton_variants(target=f"{__name__}:update_v2"):
    return registered(npu_triton.variants(npu_triton.NpuTritonAdapter(FunctionRef(target)), devices={"cpu"}))


def dao_variants():
    """Needs a causal-conv1d double at ``sys.modules[DAO_MODULE]``."""
    return registered(dao.variants(dao.DaoAdapter(DAO_MODULE, needs_cuda=False), devices={"cpu"}))


def npu_conv_update_variants():
    adapter = npu_conv_update.NpuConvUpdateAdapter(OpRef("kv_test_upd::causal_conv1d_update"))
    return registered(npu_conv_update.variants(adapter, devices={"cpu"}))


def adapters(npu_triton_target: str = f"{__name__}:update_v2") -> dict[str, dict[str, RegisteredVariant]]:
    """Every adapter on its double, by name then op (the causal-conv1d double must be installed)."""
    return {"asc": asc_variants(), "pto": pto_variants(), "npu_triton_update": npu_triton_variants(npu_triton_target),
            "dao": dao_variants(), "npu_conv_update": npu_conv_update_variants()}


# (adapter, op) for every entry point the adapters have.
ENTRIES = [("asc", "causal_conv1d_fn"), ("asc", "causal_conv1d_update"), ("pto", "causal_conv1d_fn"),
           ("npu_triton_update", "causal_conv1d_update"), ("dao", "causal_conv1d_fn"), ("dao", "causal_conv1d_update"),
           ("npu_conv_update", "causal_conv1d_update")]

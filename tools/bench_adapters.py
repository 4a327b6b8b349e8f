"""Engine adapters: what ``kernel_variants.integrations.vllm`` and ``.sglang`` add over calling
the chosen variant directly (issue 24: <= 2.0 us through the vLLM and sglang adapters).

Forms, each called as the engine calls it, in the engine's layout (views of channel-last
allocations, as the engines hand them over):
- ``vLLM decode``: ``integrations.vllm.causal_conv1d_update``, x ``(B, dim)``, conv_state the
  ``(N, dim, W-1)`` transpose of ``[N, W-1, dim]``, int32 slot indices;
- ``vLLM prefill``: ``integrations.vllm.causal_conv1d_fn``, x the ``(dim, T)`` transpose of
  ``[T, dim]``, the same pool, ``query_start_loc``, cache indices, initial-state flags;
- ``sglang decode`` / ``sglang prefill``: ``integrations.sglang``'s functions of the same name
  (prefill with ``seq_lens_cpu``, as sglang passes it);
- ``public op``: the dispatched op on the same call in the op's own layout, for reference;
- ``floor``: a function with the engine's leading parameters that does one dict lookup and calls
  the variant, handed the op's own layout (the least any Python-level adapter adds here), and
  ``floor + views``: the same, handed the engine's layout and making the views back (what a
  Python adapter cannot avoid before it checks or decides anything).

A no-op variant (KV_QUALIFY=off lets it be chosen without a force) makes the difference to a
direct call of it exactly what the path adds, whatever any kernel costs. The decode step of the
issue (B=1, D=2048, W=4, bf16, the variant the dispatcher chooses here) and a prefill of one
4-token sequence at that width are timed the same way against a direct call of that variant
(whose output is fresh: the no-op variant's is not, so only these rows show what the adapter
does with a fresh output). Each round calls every form ``--number`` times, the
order rotated each round; a form's figure is the median over ``--rounds`` rounds of its
per-call time minus the direct call's in the same round. One thread; grad mode (a plain
script) and torch.inference_mode (serving). Measures whatever kernel_variants is on the path,
on the call path it takes by default (the compiled call core when built: ``kv build``).

Rounds are short (1000 calls, a few ms) and many: on cores shared with other work, a burst of
it then lands in a few rounds, which the median leaves out, instead of in every long one.

    python tools/bench_adapters.py [--out reports] [--number 1000] [--rounds 101]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Callable

import torch
from _report import (  # tools/ is sys.path[0]
    built_call_core,
    conv_noops,
    cpu_model,
    markdown_table,
    noop_registry,
    per_call_us,
    write_report,
)

import kernel_variants as kv
from kernel_variants._runtime.dispatcher import dispatcher, reset
from kernel_variants.integrations import sglang as kv_sglang
from kernel_variants.integrations import vllm as kv_vllm
from kernel_variants.ops.causal_conv1d import ConvCapabilities
from kernel_variants.plugin import Variant

TARGET_US = 2.0
Forms = dict[str, Callable[[], object]]


def _rounds(forms: Forms, number: int, rounds: int) -> dict[str, list[float]]:
    """Per form, its per-call time in each round. The order rotates so that no form always
    follows the same one (a form's cache footprint is its successor's cold start)."""
    names = list(forms)
    for fn in forms.values():
        for _ in range(200):  # entries learned, caches warm, before any window
            fn()
    times: dict[str, list[float]] = {name: [0.0] * rounds for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name][r] = per_call_us(forms[name], number)
    return times


def _against(name: str) -> str:
    """The direct call a form is measured against: the one with the pad id that form hands the
    op (vLLM's null block 0; -1 for sglang and for the public op's default)."""
    return "direct" if name.startswith(("vLLM", "floor")) else "direct, pad -1"


def _added(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(t - d for t, d in zip(ts, times[_against(name)], strict=True))
            for name, ts in times.items() if not name.startswith("direct")}


def _call_path() -> str:
    """Which call path the ops take by default, as the installed version reports it."""
    try:
        from kernel_variants._runtime import callcore
        on, where = callcore.status()
    except Exception as exc:  # a call path without this report: measure it all the same
        return f"unknown ({type(exc).__name__})"
    return f"compiled call core ({where})" if on else f"Python path: {where}"


class Setup:
    """One decode and one varlen prefill call, channel-last allocations and the engines' views
    of them. Slot 2 of 4: neither vLLM's null block (0) nor sglang's pad id (-1)."""

    def __init__(self, batch: int, dim: int, length: int, dtype: torch.dtype, width: int = 4) -> None:
        keep, n = width - 1, batch + 3
        self.x1 = torch.randn(batch, dim, dtype=dtype)  # decode: one token per sequence
        self.pool = torch.randn(n, keep, dim, dtype=dtype)  # [N, W-1, D]
        self.w, self.b = torch.randn(dim, width, dtype=dtype), torch.randn(dim, dtype=dtype)
        self.idx = torch.arange(2, 2 + batch, dtype=torch.int32)
        self.xt = torch.randn(batch * length, dim, dtype=dtype)  # prefill: [T, D]
        self.qsl = torch.arange(0, batch * length + 1, length, dtype=torch.int32)
        self.lens = [length] * batch
        self.init = torch.ones(batch, dtype=torch.bool)

    def decode_kw(self, pad: int) -> dict:
        return dict(activation="silu", conv_state_indices=self.idx, pad_slot_id=pad)

    def prefill_kw(self, pad: int) -> dict:
        return dict(conv_states=self.pool, cache_indices=self.idx, has_initial_state=self.init,
                    query_start_loc=self.qsl, activation="silu", pad_slot_id=pad)

    def decode_forms(self, direct: Callable[..., object], floor_table: dict) -> Forms:
        s, pool_v = self, self.pool.transpose(1, 2)
        op, vl, sg = kv.causal_conv1d_update, kv_vllm.causal_conv1d_update, kv_sglang.causal_conv1d_update
        user = dict(activation="silu", conv_state_indices=s.idx)

        def floor(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None,
                  num_accepted_tokens=None, null_block_id=0):
            return floor_table["update"](x, conv_state, weight, bias, activation=activation,
                                         conv_state_indices=conv_state_indices,
                                         num_accepted_tokens=num_accepted_tokens, pad_slot_id=null_block_id)

        def views(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None,
                  num_accepted_tokens=None, null_block_id=0):
            return floor_table["update"](x, conv_state.transpose(-1, -2), weight, bias, activation=activation,
                                         conv_state_indices=conv_state_indices,
                                         num_accepted_tokens=num_accepted_tokens, pad_slot_id=null_block_id)

        return {
            # Keywords written out, as the floor passes them: a ** of a dict would be charged to
            # the direct call and taken off every figure.
            "direct": lambda: direct(s.x1, s.pool, s.w, s.b, activation="silu", conv_state_indices=s.idx,
                                     num_accepted_tokens=None, pad_slot_id=0),
            "direct, pad -1": lambda: direct(s.x1, s.pool, s.w, s.b, activation="silu", conv_state_indices=s.idx,
                                             num_accepted_tokens=None, pad_slot_id=-1),
            "floor": lambda: floor(s.x1, s.pool, s.w, s.b, "silu", conv_state_indices=s.idx),
            "floor + views": lambda: views(s.x1, pool_v, s.w, s.b, "silu", conv_state_indices=s.idx),
            "public op": lambda: op(s.x1, s.pool, s.w, s.b, **user),
            # vLLM's mamba mixers pass the activation positionally, the indices by keyword.
            "vLLM decode": lambda: vl(s.x1, pool_v, s.w, s.b, "silu", conv_state_indices=s.idx),
            "sglang decode": lambda: sg(s.x1, pool_v, s.w, s.b, "silu", conv_state_indices=s.idx),
        }

    def prefill_forms(self, direct: Callable[..., object], floor_table: dict) -> Forms:
        s, pool_v, x_v = self, self.pool.transpose(1, 2), self.xt.t()
        op, vl, sg = kv.causal_conv1d_fn, kv_vllm.causal_conv1d_fn, kv_sglang.causal_conv1d_fn
        user = dict(conv_states=s.pool, cache_indices=s.idx, has_initial_state=s.init, query_start_loc=s.qsl,
                    activation="silu")

        def floor(x, weight, bias, conv_states, query_start_loc, cache_indices=None, has_initial_state=None,
                  activation="silu", pad_slot_id=-1, null_block_id=0):
            return floor_table["fn"](x, weight, bias, conv_states=conv_states, cache_indices=cache_indices,
                                     has_initial_state=has_initial_state, query_start_loc=query_start_loc,
                                     activation=activation, pad_slot_id=null_block_id)

        def views(x, weight, bias, conv_states, query_start_loc, cache_indices=None, has_initial_state=None,
                  activation="silu", pad_slot_id=-1, null_block_id=0):
            y = floor_table["fn"](x.t(), weight, bias, conv_states=conv_states.transpose(-1, -2),
                                  cache_indices=cache_indices, has_initial_state=has_initial_state,
                                  query_start_loc=query_start_loc, activation=activation, pad_slot_id=null_block_id)
            return y.t()

        return {
            "direct": lambda: direct(s.xt, s.w, s.b, conv_states=s.pool, cache_indices=s.idx,
                                     has_initial_state=s.init, query_start_loc=s.qsl, activation="silu",
                                     pad_slot_id=0),
            "direct, pad -1": lambda: direct(s.xt, s.w, s.b, conv_states=s.pool, cache_indices=s.idx,
                                             has_initial_state=s.init, query_start_loc=s.qsl, activation="silu",
                                             pad_slot_id=-1),
            "floor": lambda: floor(s.xt, s.w, s.b, s.pool, s.qsl, s.idx, s.init),
            "floor + views": lambda: views(x_v, s.w, s.b, pool_v, s.qsl, s.idx, s.init),
            "public op": lambda: op(s.xt, s.w, s.b, **user),
            "vLLM prefill": lambda: vl(x_v, s.w, s.b, conv_states=pool_v, query_start_loc=s.qsl,
                                       cache_indices=s.idx, has_initial_state=s.init, activation="silu"),
            "sglang prefill": lambda: sg(x_v, s.w, s.b, conv_states=pool_v, query_start_loc=s.qsl,
                                         seq_lens_cpu=s.lens, cache_indices=s.idx, has_initial_state=s.init,
                                         activation="silu"),
        }


def _chosen(name: str, *args: object, **kwargs: object) -> tuple[str, Callable[..., object]]:
    """The variant the dispatcher picks for this call, and its function (called directly)."""
    vid = kv.bind(getattr(kv, name), *args, **kwargs).variant
    return vid, dispatcher().registry.get(name, vid).variant.fn


def _rows(label: str, mode: str, t: dict[str, list[float]]) -> tuple[list[list[object]], dict[str, object]]:
    added = _added(t)
    rows = []
    for name, us in added.items():
        if name.startswith("floor"):
            continue
        engine = name.split()[0] in ("vLLM", "sglang")
        verdict = ("meets" if us <= TARGET_US else f"misses by {us - TARGET_US:.2f} us") if engine else "reference"
        # The adapter's own share: what it adds over the public op on the same call, per round
        # (the machine's speed moves both alike, so this holds where absolute figures drift).
        over = (statistics.median(a - p for a, p in zip(t[name], t["public op"], strict=True))
                if engine else "")
        rows.append([label, mode, name, statistics.median(t[_against(name)]), added["floor"],
                     added["floor + views"], us, over, verdict])
    return rows, {"direct_us": statistics.median(t["direct"]), **{f"{k} added_us": v for k, v in added.items()},
                  "rounds": t}


def _noop_rows(number: int, rounds: int) -> tuple[list[list[object]], dict[str, object]]:
    s = Setup(batch=1, dim=64, length=4, dtype=torch.float32)
    noop_fn, noop_update = conv_noops(torch.empty_like(s.xt), torch.empty_like(s.x1))

    caps = dict(devices={"cpu"}, dtypes={"float32"})
    variants = (Variant(id="noop", op="causal_conv1d_update", version="1", fn=noop_update, priority=10_000,
                        capabilities=ConvCapabilities(**caps)),
                Variant(id="noop", op="causal_conv1d_fn", version="1", fn=noop_fn, priority=10_000,
                        capabilities=ConvCapabilities(varlen=True, **caps)))

    floor_table = {"update": noop_update, "fn": noop_fn}
    rows, data = [], {}
    for mode_name in ("grad mode", "inference_mode"):
        reset(noop_registry(*variants))
        with torch.inference_mode() if mode_name == "inference_mode" else torch.enable_grad():
            for op, args, kw in (("causal_conv1d_update", (s.x1, s.pool, s.w, s.b), s.decode_kw(0)),
                                 ("causal_conv1d_fn", (s.xt, s.w, s.b), s.prefill_kw(0))):
                vid, _ = _chosen(op, *args, **kw)
                assert vid == "noop", f"{op}: the no-op variant was not chosen ({vid})"
            for label, forms in (("no-op decode", s.decode_forms(noop_update, floor_table)),
                                 ("no-op prefill", s.prefill_forms(noop_fn, floor_table))):
                more, d = _rows(label, mode_name, _rounds(forms, number, rounds))
                rows += more
                data[f"{label}/{mode_name}"] = d
    return rows, data


def _kernel_rows(step: str, number: int, rounds: int) -> tuple[list[list[object]], dict[str, object]]:
    """A ``step`` on the variant chosen here, D=2048, W=4, bf16: the issue's ``decode`` (B=1), or a
    ``prefill`` of one 4-token sequence (a real variant's fresh output, which the no-op variant's
    cached one is not)."""
    reset()
    decode = step == "decode"
    s = Setup(batch=1, dim=2048, length=1 if decode else 4, dtype=torch.bfloat16)
    with torch.inference_mode():
        if decode:
            vid, fn = _chosen("causal_conv1d_update", s.x1, s.pool, s.w, s.b, **s.decode_kw(0))
            forms = s.decode_forms(fn, {"update": fn})
        else:
            vid, fn = _chosen("causal_conv1d_fn", s.xt, s.w, s.b, **s.prefill_kw(0))
            forms = s.prefill_forms(fn, {"fn": fn})
        t = _rounds(forms, number, rounds)
    rows, data = _rows(f"{vid} (chosen) {step} {'B=1' if decode else '1x4'} D=2048 bf16", "inference_mode", t)
    return rows, {f"{step}/{vid}": data}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="reports")
    p.add_argument("--number", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=101)
    args = p.parse_args(argv)
    os.environ["KV_CACHE_DIR"] = tempfile.mkdtemp(prefix="kv-adapters-")  # never the user's table
    os.environ["KV_QUALIFY"] = "off"  # the no-op variants are chosen, not qualified (they compute nothing)
    torch.set_num_threads(1)
    built_call_core("bench_adapters")
    path = _call_path()
    rows, data = _noop_rows(args.number, args.rounds)
    for step in ("decode", "prefill"):
        more, more_data = _kernel_rows(step, max(args.number // 5, 100), args.rounds)
        rows += more
        data.update(more_data)
    headers = ["call", "mode", "form", "direct us", "floor added", "floor + views added", "added us",
               "over public op us", f"<= {TARGET_US} us"]
    cpu = cpu_model()
    text = (f"# Engine adapters (causal_conv1d, W=4, silu, bias, state pool + int32 slot indices; "
            f"1 thread; {cpu}; {path})\n\n{markdown_table(headers, rows)}\n\n"
            "Added = median over rotating rounds of (the form's per-call us - the direct call's, same round; the "
            "direct call with the pad id the form hands the op: 0 for vLLM's null block, else -1). "
            "No-op calls: B=1, D=64, fp32, decode one token, prefill one sequence of 4 tokens. 'floor': the "
            "engine's leading parameters and one dict lookup around the variant, the least a Python adapter adds "
            "here; '+ views': the same making the channel-last views of the engine's layout (the result's too). "
            "'over public op': median per round of the adapter's time minus the public op's on the same call (the "
            "adapter's own share, steadier than absolute figures on a machine whose speed drifts). "
            f"Target (issue 24): <= {TARGET_US} us through the vLLM and sglang adapters.")
    print(text)
    data.update(cpu=cpu, call_path=path)
    md, js = write_report(args.out, "adapters", text, data)
    print(f"\nwrote {md} and {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

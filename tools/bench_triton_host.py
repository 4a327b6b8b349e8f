"""Host cost of the ``triton`` conv variants around their launches: the Python a call runs before
and after Triton's own launcher, with the launch replaced by a no-op, on this CPU.

On a GPU a small decode call is host-bound (the H200 runs in docs/devices.md: the direct call of
``triton`` costs the host 43-70 us, the launch itself 23.6 us of it), so every microsecond of the
wrapper's Python is a microsecond of each serving step. This measures that Python without a GPU:
``kernels()`` is swapped for kernels whose launch does nothing, and the wrapper is called on CPU
tensors, fp16, W = 4, silu, a state pool with slot indices. Beside it, ``torch.empty`` of the
output alone: the one allocation the wrapper cannot avoid, as the floor on this machine. CUDA-only
costs (the device guard, a CUDA allocation) are not in these figures.

Rows alternate within each round; each figure is the minimum over rounds of the per-call time.

    python tools/bench_triton_host.py [--out reports] [--number 20000] [--rounds 9]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from types import SimpleNamespace

import torch
from _report import cpu_model, markdown_table, per_call_us, write_report  # tools/ is sys.path[0]

D, W, N = 4096, 4, 8


class _NoLaunch:
    """A jitted kernel's ``kernel[grid](...)`` that launches nothing."""

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def _calls(triton_conv) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(0)
    dt = torch.float16

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dt)

    pool, w, b = rnd(N, W - 1, D), rnd(D, W), rnd(D)
    out: dict[str, Callable[[], object]] = {}
    for batch in (1, 64):
        x, idx = rnd(batch, D), torch.arange(batch, dtype=torch.int32) % N
        out[f"decode B={batch}"] = (lambda x=x, idx=idx: triton_conv.causal_conv1d_update(
            x, pool, w, b, activation="silu", conv_state_indices=idx, pad_slot_id=-1))
        out[f"torch.empty, decode B={batch}"] = lambda x=x: torch.empty(x.shape, dtype=x.dtype, device=x.device)
    tokens, seqs = 256, 4
    xp = rnd(tokens, D)
    qsl = torch.arange(0, tokens + 1, tokens // seqs, dtype=torch.int32)
    idx, init = torch.arange(seqs, dtype=torch.int32), torch.ones(seqs, dtype=torch.bool)
    out[f"prefill T={tokens}, {seqs} sequences"] = lambda: triton_conv.causal_conv1d_fn(
        xp, w, b, conv_states=pool, cache_indices=idx, has_initial_state=init, query_start_loc=qsl,
        activation="silu", pad_slot_id=-1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="reports")
    p.add_argument("--number", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args(argv)
    if importlib.util.find_spec("triton") is None:
        print("triton is not installed (the 'triton' extra): nothing to measure here")
        return 0
    from kernel_variants.kernels import triton_conv

    torch.set_num_threads(1)
    import triton

    # cdiv: what wrappers before 977ffbe read from the kernels (this tool times old trees too).
    stub = SimpleNamespace(fn_conv=_NoLaunch(), fn_state=_NoLaunch(), update=_NoLaunch(), cdiv=triton.cdiv)
    triton_conv.kernels = lambda interpret: stub  # this process only: nothing else runs a kernel
    calls = _calls(triton_conv)
    best = dict.fromkeys(calls, float("inf"))
    names = list(calls)
    with torch.inference_mode():  # as a serving loop calls them
        for fn in calls.values():
            fn()
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                best[name] = min(best[name], per_call_us(calls[name], args.number))
    rows = [[name, best[name]] for name in names]
    title = (f"# Triton conv wrappers' host Python, launch stubbed (fp16, D={D}, W={W}, 1 thread; "
             f"{cpu_model()})")
    md = "\n\n".join([title, markdown_table(["call", "us per call"], rows),
                      "Minimum over alternating rounds. `torch.empty` alone is the floor: the output's "
                      "allocation, which every call makes."])
    print(md)
    paths = write_report(args.out, "triton_host", md, {"us": best, "cpu": cpu_model(), "number": args.number,
                                                       "rounds": args.rounds})
    print(f"\nwrote {paths[0]} and {paths[1]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""gated_rms_norm (vLLM's RMSNormGated) beyond what conformance sees: bad input named and nothing
written, "swish" as "silu", Mamba2's composite (the norm rounded before the weight) within the
dtype's tolerance, gates at and past fp32's range, and cpu_native's other ISA builds (AVX2 and the
portable one, in a child under ATEN_CPU_CAPABILITY). (Conformance of every variant against the
reference is tests/test_conformance.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import kernel_variants as kv
from kernel_variants._native import build
from kernel_variants._tolerances import mismatch
from kernel_variants.ops.gated_rms_norm._spec import reference

T, D = 3, 32


def _call():
    g = torch.Generator().manual_seed(0)
    return dict(x=torch.randn(T, D, generator=g), z=torch.randn(T, D, generator=g),
                weight=torch.randn(D, generator=g), eps=1e-6)


BAD = {
    # name: (changes, exception, message fragment)
    "x not a tensor": (dict(x=[[1.0]]), TypeError, "x: expected a torch.Tensor, got list"),
    "x int": (dict(x=torch.ones(T, D, dtype=torch.int32)), TypeError,
              "x: expected dtype float32, bfloat16 or float16, got int32"),
    "z not a tensor": (dict(z=1.0), TypeError, "z: expected a torch.Tensor or None, got float"),
    "z shape": (dict(z=torch.randn(T, D + 1)), ValueError, r"z: expected None or shape \[3, 32\] \(x's\), got \[3, 33\]"),
    "z dtype": (dict(z=torch.randn(T, D).bfloat16()), TypeError, r"z: expected dtype float32 \(x's\), got bfloat16"),
    "z device": (dict(z=torch.randn(T, D, device="meta")), ValueError, r"z: expected device cpu \(x's\), got meta"),
    "weight shape": (dict(weight=torch.randn(D - 1)), ValueError, r"weight: expected None or shape \[D=32\], got \[31\]"),
    "weight dtype": (dict(x=torch.randn(T, D).bfloat16(), z=None, weight=torch.randn(D).half()), TypeError,
                     "weight: expected x's dtype bfloat16 or float32, got float16"),
    "eps type": (dict(eps="1e-6"), TypeError, "eps: expected a float, got str"),
    "eps negative": (dict(eps=-1e-6), ValueError, "eps: expected a finite number >= 0, got -1e-06"),
    "group_size type": (dict(group_size=8.0), TypeError, "group_size: expected None or an int, got float"),
    "group_size bool": (dict(group_size=True), TypeError, "group_size: expected None or an int, got bool"),
    "group_size not a divisor": (dict(group_size=12), ValueError, "group_size: expected None or a divisor of D=32, got 12"),
    "group_size zero": (dict(group_size=0), ValueError, "group_size: expected None or a divisor of D=32, got 0"),
    "norm_before_gate type": (dict(norm_before_gate=1), TypeError, "norm_before_gate: expected a bool, got int"),
    "activation name": (dict(activation="gelu"), ValueError,
                        "activation: expected \"silu\", \"swish\" or \"sigmoid\", got 'gelu'"),
    "activation type": (dict(activation=None), TypeError, "activation: expected a str, got NoneType"),
    "out shape": (dict(out=torch.empty(T, D + 1)), ValueError, r"out: expected shape \[3, 32\]"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_refused_by_name_before_anything_is_written(name):
    changes, exc, match = BAD[name]
    call = {**_call(), **changes}
    before = {k: v.clone() for k, v in call.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"}
    with pytest.raises(exc, match=match):
        kv.gated_rms_norm(**call)
    with pytest.raises(exc, match=match):
        kv.explain("gated_rms_norm", **call)
    for k, v in before.items():
        assert torch.equal(call[k], v), f"a refused call wrote {k}"


def _available():
    return [rv.id for rv in kv.variants("gated_rms_norm") if rv.unavailable_reason() is None]


@pytest.mark.parametrize("vid", _available())
def test_swish_is_silu_for_every_variant(vid):
    call = _call()
    with kv.force(gated_rms_norm=vid):
        silu = kv.gated_rms_norm(**call, group_size=8, activation="silu")
        swish = kv.gated_rms_norm(**call, group_size=8, activation="swish")
    assert torch.equal(silu, swish)


@pytest.mark.parametrize("groups", [1, 8])
def test_mamba2s_composite_is_within_the_dtypes_tolerance(groups):
    """vLLM's Mixer2RMSNormGated.forward_native rounds the norm to x's dtype before the weight
    (and multiplies in x's dtype): one more rounding than RMSNormGated, within bf16's tolerance."""
    g = torch.Generator().manual_seed(1)
    x, z = ((torch.randn(16, 512, generator=g) * 3).bfloat16() for _ in range(2))
    w = (1 + 0.5 * torch.randn(512, generator=g)).bfloat16()
    s = x * F.silu(z.float())
    s = s.unflatten(-1, (groups, -1))
    mixer2 = w * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)).flatten(-2).to(x.dtype)
    assert mismatch(kv.gated_rms_norm(x, z, w, 1e-6, 512 // groups), mixer2, "mixer2") is None


# Gates at and past fp32's range, where exp(-z) overflows: the sigmoid from exp(-|z|) never sees
# inf / inf; NaN, inf and the silu(-inf) = NaN of the reference where it has them.
EXTREME = (float("-inf"), float("inf"), float("nan"), -3.3e38, 3.3e38, -1e30, 1e30, -1e4, 1e4, -104.0, -88.5,
           -87.0, 88.0, -25.0, 25.0, -20.5, 20.5, -0.0, 0.0, 0.5)


def check_extreme_gates(vid: str = "cpu_native") -> None:
    """``vid`` against the reference on gates of EXTREME (after the norm: every value; before it:
    the finite ones that keep x * act(z) finite), both activations, one group and groups, a
    ragged tail, every dtype. Raises AssertionError naming the first mismatch."""
    fn = next(rv for rv in kv.variants("gated_rms_norm") if rv.id == vid).variant.fn
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        g = torch.Generator().manual_seed(2)
        for dim, group in ((136, None), (96, 32), (99, 33)):
            x = torch.randn(8, dim, generator=g).to(dtype)
            w = (1 + 0.5 * torch.randn(dim, generator=g)).to(dtype)
            vals = torch.tensor(EXTREME, dtype=torch.float64)
            idx = (torch.arange(dim)[None, :] + torch.arange(8)[:, None]) % len(EXTREME)
            wide = vals[idx].to(dtype)
            finite = vals[idx].clamp(-1e4, 1e4).nan_to_num(0.0).to(dtype)
            for act in ("silu", "sigmoid"):
                for after, z in ((True, wide), (False, finite)):
                    got = fn(x, z, w, 1e-6, group, after, act)
                    want = reference(x, z, w, 1e-6, group, after, act)
                    why = mismatch(got, want, f"{vid} {dtype} D={dim} group={group} {act} after={after}")
                    assert why is None, why


native = pytest.mark.skipif(build.toolchain_missing() is not None, reason="no C++ toolchain")


@pytest.mark.parametrize("vid", _available())
def test_extreme_gates_match_the_reference(vid):
    check_extreme_gates(vid)


@native
@pytest.mark.parametrize(("cap", "isa"), [("avx2", "avx2"), ("default", "default")])
def test_the_other_isa_builds_in_a_child(cap, isa):
    """cpu_native's AVX2 and portable builds (ATEN_CPU_CAPABILITY caps which one serves, read
    once per process): the extreme gates and the conformance list against the reference."""
    if build.load_extension(_rms_extension()).gemma_rms_norm_isa()[0] == "default" and cap != "default":
        pytest.skip("this CPU runs the portable build only")
    source = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from helpers.conformance import assert_conforms
        from kernel_variants._native import build
        from kernel_variants._runtime.dispatcher import dispatcher
        from kernel_variants.kernels.cpu_native._build import RMS
        from test_ops_gated_rms_norm import check_extreme_gates
        assert build.load_extension(RMS).gemma_rms_norm_isa() == ({isa!r},) * 3
        check_extreme_gates()
        print("cases", assert_conforms(dispatcher().registry.get("gated_rms_norm", "cpu_native"), "cpu"))
    """)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": cap, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cases" in done.stdout


def _rms_extension():
    from kernel_variants.kernels.cpu_native._build import RMS

    return RMS

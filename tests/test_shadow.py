"""Shadow verification of live calls (KV_SHADOW): a variant right on every synthetic case and
wrong on activation outliers qualifies and is chosen; shadowed, it returns a wrong result to no
caller, and after its first mismatch it no longer serves that class of calls."""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap
import types
import warnings

import pytest
import torch

import kernel_variants as kv
from kernel_variants._cli import main
from kernel_variants._runtime import shadow
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants.ops.causal_conv1d import _reference as reference

PLUGIN = textwrap.dedent("""
    import torch
    from kernel_variants.ops.causal_conv1d import ConvCapabilities
    from kernel_variants.ops.causal_conv1d import _reference as reference
    from kernel_variants.plugin import Variant, hookimpl

    def _outliers(x):
        return bool((x.abs() > 20).any())

    def outlier_fn(x, weight, bias=None, **kw):
        # Right on randn inputs; on an outlier, a wrong output and a wrong state row.
        y = reference.causal_conv1d_fn(x, weight, bias, **kw)
        if _outliers(x):
            y = y + 1
            if kw.get("conv_states") is not None:
                kw["conv_states"].add_(1)
        return y

    def outlier_update(x, conv_state, weight, bias=None, **kw):
        y = reference.causal_conv1d_update(x, conv_state, weight, bias, **kw)
        return y * 2 if _outliers(x) else y

    caps = ConvCapabilities(devices={"cpu"}, dtypes={"float32"})

    @hookimpl
    def kv_register_variants(register):
        register(Variant(id="outlier", op="causal_conv1d_fn", version="1", priority=90, capabilities=caps,
                         fn=outlier_fn))
        register(Variant(id="outlier", op="causal_conv1d_update", version="1", priority=90,
                         capabilities=caps, fn=outlier_update))
""")


class _Dist:
    def __init__(self, eps: list[importlib.metadata.EntryPoint]) -> None:
        self.entry_points, self.metadata, self.version = eps, {"name": "kv-outlier"}, "0.0.1"

    @property
    def name(self) -> str:
        return "kv-outlier"


@pytest.fixture
def outlier_plugin(tmp_path, monkeypatch, reference_only):
    """The adversary, installed through an entry point, as a user's plugin would be."""
    (tmp_path / "kv_outlier_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = importlib.metadata.EntryPoint("outlier", "kv_outlier_plugin", "kernel_variants")
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [_Dist([ep])])


def _prefill(outlier: bool):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 32, generator=gen)
    if outlier:
        x[1, 5, 7] = 40.0
    w, b = torch.randn(32, 4, generator=gen), torch.randn(32, generator=gen)
    pool = torch.randn(4, 3, 32, generator=gen)
    args = (x, w, b)
    kwargs = dict(conv_states=pool, cache_indices=torch.tensor([2, 0], dtype=torch.int32),
                  has_initial_state=torch.tensor([True, False]), activation="silu")
    return args, kwargs


def _expected(args, kwargs):
    pool = kwargs["conv_states"].clone()
    y = reference.causal_conv1d_fn(*args, **{**kwargs, "conv_states": pool})
    return y, pool


def _shadowing(monkeypatch, rate: str, seed: str = "0") -> None:
    monkeypatch.setenv("KV_SHADOW", rate)
    monkeypatch.setenv("KV_SHADOW_SEED", seed)
    kv.reload()


def test_without_shadowing_the_adversary_is_chosen_and_wrong(outlier_plugin):
    kv.reload()
    args, kwargs = _prefill(outlier=True)
    want, want_pool = _expected(args, kwargs)
    got = kv.causal_conv1d_fn(*args, **kwargs)
    assert kv.explain("causal_conv1d_fn", *args, **kwargs).chosen.id == "outlier"
    assert [v.passed for v in kv.verdicts() if v.variant == "outlier"] == [True]  # qualification passed it
    assert not torch.allclose(got, want)
    assert not torch.equal(kwargs["conv_states"], want_pool)


def test_shadowed_adversary_returns_nothing_wrong_and_stops_serving(outlier_plugin, monkeypatch, capsys):
    _shadowing(monkeypatch, "1")
    clean_args, clean_kwargs = _prefill(outlier=False)
    kv.causal_conv1d_fn(*clean_args, **clean_kwargs)  # agrees: served and shadowed, no mismatch
    args, kwargs = _prefill(outlier=True)
    want, want_pool = _expected(args, kwargs)
    with pytest.warns(kv.ShadowMismatch, match="'outlier' disagrees with the reference") as caught:
        got = kv.causal_conv1d_fn(*args, **kwargs)
    # The caller got the reference's output and state, not the variant's.
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(kwargs["conv_states"], want_pool)
    # The verdict for the class failed, naming the output, the error and the tolerance, and the
    # next call of that class goes elsewhere.
    (verdict,) = [v for v in kv.verdicts() if v.variant == "outlier" and v.group.op == "causal_conv1d_fn"]
    assert not verdict.passed and verdict.where == "shadow"
    assert verdict.failed_case.startswith("shadowed call at B=2")
    assert "output" in verdict.reason and "atol=" in verdict.reason and "max error 1" in verdict.reason
    assert kv.explain("causal_conv1d_fn", *args, **kwargs).chosen.id != "outlier"
    args2, kwargs2 = _prefill(outlier=True)
    want2, _ = _expected(args2, kwargs2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kv.ShadowMismatch)
        torch.testing.assert_close(kv.causal_conv1d_fn(*args2, **kwargs2), want2)
    (count,) = [c for c in kv.shadow_report().counts if c.variant == "outlier" and c.op == "causal_conv1d_fn"]
    assert (count.served, count.shadowed, count.mismatches) == (2, 2, 1)
    # The saved inputs reproduce the comparison, from Python and from the command line.
    saved = count.last_mismatch
    assert saved in str(caught[0].message) and saved == verdict.evidence
    why, _ = kv.replay_mismatch(saved)
    assert why is not None and "output" in why
    assert main(["shadow", "--replay", saved]) == 1
    assert "still disagrees" in capsys.readouterr().out
    assert main(["shadow"]) == 0
    listed = capsys.readouterr().out
    assert "outlier" in listed and f"kv shadow --replay {saved}" in listed
    # A qualification run again does not lift it: the live call's inputs still fail it.
    kv.qualify("causal_conv1d_fn", variants=["outlier"], dtype="fp32", redo=True)
    (again,) = [v for v in kv.verdicts() if v.variant == "outlier" and v.group.op == "causal_conv1d_fn"]
    assert not again.passed and again.evidence == saved


def test_rate_zero_adds_nothing_to_a_decision(outlier_plugin):
    kv.reload()
    args, kwargs = _prefill(outlier=False)
    kv.causal_conv1d_fn(*args, **kwargs)
    hits = list(dispatcher().memo.values())
    assert hits and all(h.fn is not None and not hasattr(h.fn, "__wrapped__") for h in hits)
    assert kv.shadow_report().counts == []


def test_sampling_is_deterministic_per_stream(outlier_plugin, monkeypatch):
    def sampled() -> list[int]:
        _shadowing(monkeypatch, "0.3", seed="7")
        args, kwargs = _prefill(outlier=False)
        shadowed, before = [], 0
        for i in range(40):
            kv.causal_conv1d_fn(*args, **kwargs)
            now = next(c for c in kv.shadow_report().counts if c.variant == "outlier").shadowed
            if now > before:
                shadowed.append(i)
            before = now
        return shadowed

    first, second = sampled(), sampled()
    assert first == second and 0 < len(first) < 40


def test_shadow_covers_out_and_bind(outlier_plugin, monkeypatch):
    _shadowing(monkeypatch, "1")
    args, kwargs = _prefill(outlier=True)
    want, _ = _expected(args, kwargs)
    out = torch.empty_like(args[0])
    with pytest.warns(kv.ShadowMismatch):
        got = kv.causal_conv1d_fn(*args, **kwargs, out=out)
    assert got is out
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # Decode, through kv.bind: the bound call is shadowed too.
    x = torch.randn(2, 32)
    x[0, 3] = -50.0
    pool, w = torch.randn(4, 3, 32), torch.randn(32, 4)
    slots = torch.tensor([1, 3], dtype=torch.int32)
    bound = kv.bind("causal_conv1d_update", torch.randn(2, 32), pool.clone(), w, conv_state_indices=slots)
    assert bound.variant == "outlier"
    ref_pool = pool.clone()
    want = reference.causal_conv1d_update(x, ref_pool, w, conv_state_indices=slots)
    with pytest.warns(kv.ShadowMismatch):
        got = bound(x, pool, w, conv_state_indices=slots)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(pool, ref_pool)


def test_shadow_never_runs_while_a_graph_is_captured(outlier_plugin, monkeypatch):
    _shadowing(monkeypatch, "1")
    args, kwargs = _prefill(outlier=False)
    kv.causal_conv1d_fn(*args, **kwargs)
    monkeypatch.setattr(shadow, "capturing", lambda device: True)
    kv.causal_conv1d_fn(*args, **kwargs)
    (c,) = [c for c in kv.shadow_report().counts if c.variant == "outlier"]
    assert (c.served, c.shadowed) == (2, 1)


@pytest.mark.parametrize("raw", ["2", "-0.1", "often"])
def test_a_bad_rate_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("KV_SHADOW", raw)
    with pytest.raises(ValueError, match="KV_SHADOW: expected a rate between 0 and 1"):
        kv.reload()
    monkeypatch.delenv("KV_SHADOW")
    with pytest.raises(TypeError, match="rate: expected a rate"):
        kv.shadow(None)


# --------------------------------------------------------------------------------------------
# patch(shadow=...): the engine's own function as the oracle
# --------------------------------------------------------------------------------------------


@pytest.fixture
def engine(monkeypatch):
    """A vLLM whose conv update is right (the reference, in vLLM's layout), bound where its
    model code binds it."""
    from kernel_variants.integrations import vllm as kv_vllm

    def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None,
                             num_accepted_tokens=None, query_start_loc=None, max_query_len=-1, null_block_id=0):
        with kv.force(causal_conv1d_update="reference"):
            return kv_vllm.causal_conv1d_update(x, conv_state, weight, bias, activation, conv_state_indices,
                                                num_accepted_tokens, query_start_loc, max_query_len, null_block_id)

    def causal_conv1d_fn(*args, **kwargs):
        raise AssertionError("not called here")

    modules = {kv_vllm.UTILS_MODULE: {"PAD_SLOT_ID": -1, "NULL_BLOCK_ID": 0},
               kv_vllm.MODULE: {"causal_conv1d_fn": causal_conv1d_fn, "causal_conv1d_update": causal_conv1d_update},
               "vllm.model_executor.layers.mamba.mamba_mixer2": {"causal_conv1d_update": causal_conv1d_update}}
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        vars(module).update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    return kv_vllm, sys.modules["vllm.model_executor.layers.mamba.mamba_mixer2"], causal_conv1d_update


def _decode(outlier: bool):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 32, generator=gen)
    if outlier:
        x[2, 9] = 35.0
    cache = torch.randn(5, 3, 32, generator=gen)  # vLLM's [N, W-1, D] allocation
    w = torch.randn(32, 4, generator=gen)
    return x, cache, w, torch.tensor([1, 0, 4], dtype=torch.int32)  # slot 0: the null block


def test_engine_shadow_returns_the_engines_result_and_reroutes(outlier_plugin, engine):
    kv_vllm, mixer, own = engine
    kv.reload()
    x, cache, w, slots = _decode(outlier=True)
    want_cache = cache.clone()
    want = own(x, want_cache.transpose(-1, -2), w, conv_state_indices=slots)
    with kv_vllm.patch():  # unshadowed: the adversary serves, and is wrong
        got = mixer.causal_conv1d_update(x, cache.clone().transpose(-1, -2), w, conv_state_indices=slots)
        assert not torch.allclose(got, want)
    with kv_vllm.patch(shadow=1.0) as handle:
        assert handle.shadow == 1.0
        clean = _decode(outlier=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", kv.ShadowMismatch)
            mixer.causal_conv1d_update(clean[0], clean[1].transpose(-1, -2), clean[2], conv_state_indices=clean[3])
        with pytest.warns(kv.ShadowMismatch, match="disagrees with the engine's .*'outlier' no longer serves"):
            got = mixer.causal_conv1d_update(x, cache.transpose(-1, -2), w, conv_state_indices=slots)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert torch.equal(cache, want_cache)  # the pool as the engine wrote it, the null slot untouched
        (verdict,) = [v for v in kv.verdicts() if v.variant == "outlier" and v.group.op == "causal_conv1d_update"]
        assert not verdict.passed and "against the engine's" in verdict.reason
        x2, cache2, w2, slots2 = _decode(outlier=True)
        want2 = own(x2, cache2.clone().transpose(-1, -2), w2, conv_state_indices=slots2)
        with warnings.catch_warnings():
            warnings.simplefilter("error", kv.ShadowMismatch)
            got2 = mixer.causal_conv1d_update(x2, cache2.transpose(-1, -2), w2, conv_state_indices=slots2)
        torch.testing.assert_close(got2, want2)
    (c,) = [c for c in kv.shadow_report().counts if (c.op, c.variant) == ("causal_conv1d_update", "outlier")]
    assert (c.shadowed, c.mismatches) == (2, 1)
    why, ran = kv.replay_mismatch(verdict.evidence)
    assert why is not None and "against the reference" in ran


def test_a_call_that_needs_gradients_is_not_shadowed(monkeypatch):
    _shadowing(monkeypatch, "1")
    spec = dispatcher().registry.spec("causal_conv1d_fn")
    fn = shadow.wrap(spec, "mine", reference.causal_conv1d_fn, lambda *a: pytest.fail("judged"))
    x, w = torch.randn(1, 8, 32, requires_grad=True), torch.randn(32, 4)
    fn(x, w).sum().backward()  # the result is the variant's own, on the caller's graph
    assert x.grad is not None
    fn(x.detach(), w)
    (c,) = [c for c in kv.shadow_report().counts if c.variant == "mine"]
    assert (c.served, c.shadowed) == (2, 1)


def test_a_variant_that_takes_out_is_shadowed_in_grad_mode(with_variants, monkeypatch):
    from kernel_variants.ops.gemma_rms_norm import _spec as gemma
    from kernel_variants.plugin import Capabilities, Variant

    def writes_out(*args, **kwargs):  # right, and handed out= by the dispatcher
        return gemma.reference_fn(*args, **kwargs)

    monkeypatch.setenv("KV_SHADOW", "1")
    with_variants(Variant(id="writes_out", op="gemma_rms_norm", version="1", priority=90, isolate=False,
                          fn=writes_out, capabilities=Capabilities(
                              devices={"cpu"}, dtypes={"float32"}, takes_out=True, in_place=True)))
    x, w = torch.randn(4, 64), torch.randn(64)
    out = torch.empty_like(x)
    with kv.force(gemma_rms_norm="writes_out"):
        assert kv.gemma_rms_norm(x, w, out=out) is out  # grad mode on: the default
    torch.testing.assert_close(out, gemma.reference_fn(x, w), rtol=0, atol=0)
    (c,) = [c for c in kv.shadow_report().counts if c.variant == "writes_out"]
    assert (c.served, c.shadowed, c.mismatches) == (1, 1, 0)


def test_kv_shadow_as_the_first_call_holds(monkeypatch):
    import kernel_variants._runtime.dispatcher as dispatch

    monkeypatch.setattr(dispatch, "_current", None)  # a process whose first call is kv.shadow
    kv.shadow(1.0, seed=5)
    assert (shadow.rate(), shadow.seed()) == (1.0, 5)
    kv.shadow(0)


@pytest.mark.parametrize("policy", ["require", "off"])
def test_a_mismatch_bars_the_variant_even_when_nothing_can_be_saved(outlier_plugin, monkeypatch, policy):
    monkeypatch.setenv("KV_QUALIFY", policy)
    _shadowing(monkeypatch, "1")

    def full_disk(doc):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shadow, "save_mismatch", full_disk)
    args, kwargs = _prefill(outlier=True)
    want, want_pool = _expected(args, kwargs)
    with pytest.warns(kv.ShadowMismatch, match="inputs not saved: OSError"):
        got = kv.causal_conv1d_fn(*args, **kwargs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(kwargs["conv_states"], want_pool)
    # KV_QUALIFY=off skips the checks the user chose to skip, not a wrong answer seen live.
    assert kv.explain("causal_conv1d_fn", *args, **kwargs).chosen.id != "outlier"


def test_an_engine_that_writes_its_result_over_x_is_not_a_mismatch(outlier_plugin, engine):
    kv_vllm, mixer, own = engine

    def writes_over_x(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None, **kw):
        y = own(x.clone(), conv_state, weight, bias, activation, conv_state_indices, **kw)
        return x.copy_(y)  # as vLLM's GPU decode: out = x

    vars(sys.modules[kv_vllm.MODULE])["causal_conv1d_update"] = writes_over_x
    vars(mixer)["causal_conv1d_update"] = writes_over_x
    kv.reload()
    x, cache, w, slots = _decode(outlier=False)
    want = own(x.clone(), cache.clone().transpose(-1, -2), w, conv_state_indices=slots)
    with kv_vllm.patch(shadow=1.0), warnings.catch_warnings():
        warnings.simplefilter("error", kv.ShadowMismatch)
        got = mixer.causal_conv1d_update(x, cache.transpose(-1, -2), w, conv_state_indices=slots)
    torch.testing.assert_close(got, want)
    assert all(v.passed for v in kv.verdicts() if v.variant == "outlier")

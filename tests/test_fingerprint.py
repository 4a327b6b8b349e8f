"""Each GPU of a process is itself: its fingerprint, and so the table rows its calls read and
write, come from the device the call's tensors are on, not from device 0: two GPU models in one
process must not read each other's timings.

No GPU here: the CUDA properties are faked per ordinal, and keys carry the ordinal a CUDA
tensor's device would give them."""

from __future__ import annotations

import types

import pytest
import torch

import kernel_variants as kv
from kernel_variants._registry.keys import device_index
from kernel_variants._runtime import dispatcher as _dispatcher
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._table import fingerprint as _fingerprint
from kernel_variants._table.fingerprint import fingerprint, fingerprint_id
from kernel_variants._table.rows import key_text

FN = "causal_conv1d_fn"


@pytest.fixture
def two_gpus(monkeypatch):
    """cuda:0 an H200, cuda:1 an L4, cuda:2 another H200; device 1 current."""
    models = {0: "NVIDIA H200", 1: "NVIDIA L4", 2: "NVIDIA H200"}
    monkeypatch.setattr(_fingerprint, "_cuda", lambda index: {"name": models[index], "driver": "x"})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    _fingerprint._fingerprint.cache_clear()
    yield models
    _fingerprint._fingerprint.cache_clear()


def test_each_ordinal_is_fingerprinted_as_itself(two_gpus):
    fp0, fp1, fp2 = (fingerprint(f"cuda:{i}") for i in range(3))
    assert (fp0["name"], fp1["name"]) == ("NVIDIA H200", "NVIDIA L4")
    assert fingerprint_id(fp0) != fingerprint_id(fp1)  # two models: two sets of rows
    assert fingerprint_id(fp0) == fingerprint_id(fp2)  # one model on two ordinals: shared rows
    assert fingerprint("cuda") == fp1  # a bare "cuda" is the current device, as torch reads it


def test_a_key_carries_its_devices_ordinal_and_the_table_is_read_for_that_device(two_gpus, monkeypatch):
    assert device_index(types.SimpleNamespace(device=torch.device("cuda", 2))) == 2
    assert device_index(torch.zeros(1)) is None
    spec = dispatcher().registry.spec(FN)
    cpu_key = spec.key_of(torch.randn(1, 8, 16), torch.randn(16, 4))
    assert cpu_key.index is None and cpu_key.where == "cpu"
    key = cpu_key._replace(device="cuda", index=1)
    assert key.where == "cuda:1" and "on cuda:1 " in key.describe()
    assert key_text(key) == key_text(key._replace(index=0))  # rows keyed by type + fingerprint
    asked = []
    real = _dispatcher.fingerprint
    monkeypatch.setattr(_dispatcher, "fingerprint", lambda device: asked.append(device) or real(device))
    dispatcher().found(key, ["reference"])
    dispatcher().found(key._replace(index=0), ["reference"])
    assert asked == ["cuda:1", "cuda:0"]


def test_capabilities_compare_the_device_type_not_the_ordinal():
    spec = dispatcher().registry.spec(FN)
    key = spec.key_of(torch.randn(1, 8, 16), torch.randn(16, 4))._replace(device="cuda", index=1)
    triton = [rv for rv in kv.variants(FN) if rv.id == "triton"]
    assert triton, "the triton variant is registered on every machine (available or not)"
    for rv in triton:  # declared for "cuda": an ordinal does not make it "not in devices"
        why = rv.variant.capabilities.uncovered(key)
        assert why is None or "device" not in why

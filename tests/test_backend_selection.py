"""Automatic backend selection per device and dtype, on any machine.

The README's order: CUDA -> triton, else extension, else reference; CPU -> extension, else
reference; float64 skips the backends without float64 kernels (Triton, and the extension on
CUDA). A CUDA device is faked here: the backends' device checks and implementations are
replaced on the registry's own entries (which forgets the memoised selections), so their
preference order and float64 devices are the real ones and nothing runs on a GPU.
"""

import types
import warnings

import pytest
import torch

from fasttrans import backends

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def _runs_anywhere(monkeypatch, *names):
    """Backends ``names`` pass their device checks everywhere, with a stub implementation."""
    stub = types.SimpleNamespace(attention_fwd=None, norm_fwd=None, dropout_fwd=None)
    for name in names:
        monkeypatch.setattr(backends.BACKENDS[name], "_check", lambda device: None)
        monkeypatch.setattr(backends.BACKENDS[name], "_impl", stub)


@pytest.fixture(autouse=True)
def _automatic(monkeypatch):
    monkeypatch.delenv("FASTTRANS_BACKEND", raising=False)
    monkeypatch.setattr(backends.registry, "_warned", set())


def test_preference_order_per_device():
    assert backends.registry._preference(CUDA) == ("triton", "extension", "reference")
    # Triton on CPU is its interpreter: never chosen automatically
    assert backends.registry._preference(CPU) == ("extension", "reference")


@pytest.mark.parametrize("op", backends.OPS)
def test_cuda_prefers_triton_and_runs_float64_on_the_reference(monkeypatch, op):
    _runs_anywhere(monkeypatch, "triton", "extension")
    for dtype in (None, torch.float16, torch.bfloat16, torch.float32):
        assert backends.select_backend(op, CUDA, dtype).name == "triton", dtype
    with pytest.warns(RuntimeWarning) as caught:
        assert backends.select_backend(op, CUDA, torch.float64).name == "reference"
    reasons = sorted(str(w.message) for w in caught)
    assert len(reasons) == 2
    assert "'extension' backend: backend 'extension' has no float64 kernels on cuda" in reasons[0]
    assert "'triton' backend: backend 'triton' has no float64 kernels on cuda" in reasons[1]


def test_cuda_without_triton_falls_back_to_the_extension_with_a_warning(monkeypatch):
    _runs_anywhere(monkeypatch, "triton", "extension")
    monkeypatch.setattr(backends.BACKENDS["triton"], "_check", lambda device: "no triton in this test")
    with pytest.warns(RuntimeWarning, match="attention on cuda is not using the 'triton' backend: no triton in this"):
        assert backends.select_backend("attention", CUDA, torch.float32).name == "extension"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        assert backends.select_backend("norm", CUDA, torch.float16).name == "extension"
    with pytest.warns(RuntimeWarning, match="no float64 kernels on cuda"):
        assert backends.select_backend("norm", CUDA, torch.float64).name == "reference"
    monkeypatch.setattr(backends.BACKENDS["extension"], "_check", lambda device: "no extension in this test")
    with pytest.warns(RuntimeWarning, match="not using the 'extension' backend: no extension in this test"):
        assert backends.select_backend("norm", CUDA, torch.float32).name == "reference"


def test_cpu_prefers_the_extension_float64_included(monkeypatch):
    _runs_anywhere(monkeypatch, "triton", "extension")  # an available Triton is still not chosen
    for dtype in (None, torch.float32, torch.float64):
        assert backends.select_backend("norm", CPU, dtype).name == "extension", dtype
    monkeypatch.setattr(backends.BACKENDS["extension"], "_check", lambda device: "no extension in this test")
    with pytest.warns(RuntimeWarning, match="not using the 'extension' backend: no extension in this test"):
        assert backends.select_backend("norm", CPU, torch.float32).name == "reference"

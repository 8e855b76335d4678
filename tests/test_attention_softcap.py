"""fasttrans.attention's ``softcap``: scores soft-capped before the masks, as Gemma 2 caps its
attention logits. Checked against the formula eager attention computes, on every backend
that runs here (the reference, the CPU extension, Triton through its interpreter), with
every mask kind, grouped-query heads, values of another head dim, sinks and torch.compile;
a backend without capping kernels refuses the call when forced, and automatic selection runs
it on the reference with a warning. The kernels' tile layouts, low precision and huge scores
are tests/test_attention_extension.py's and tests/test_attention_triton.py's, the CUDA
kernels' tests/test_cuda_emulation.py's."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import fasttrans
from fasttrans import functional
from fasttrans.backends import registry
from fasttrans.functional import ShapeError
from conftest import backend_params
from helpers import assert_close_lowp, mask_case

B, H, HKV, LQ, LK, D = 2, 4, 2, 5, 9, 16
CAP = 1.5
BACKENDS = backend_params("attention")


def _eager(q, k, v, cap, allowed, bias=None):
    """Gemma 2's eager attention: scaled scores, divided by the cap, tanh, times the cap,
    then the mask and the softmax."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(2, 3) / math.sqrt(q.shape[-1])
    s = torch.tanh(s / cap) * cap
    if bias is not None:
        s = s + bias
    w = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.nan_to_num(w) @ v  # a row with no allowed key: zeros, as fasttrans gives


def _inputs(dtype=torch.float64, seed=0, dv=D):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, LQ, D, generator=g).to(dtype) * 3, torch.randn(B, HKV, LK, D, generator=g).to(dtype),
            torch.randn(B, HKV, LK, dv, generator=g).to(dtype))


def _mask(kind: str):
    return mask_case(kind, B, LQ, LK, torch.float64)


def _with_grads(fn, tensors, dy):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    return out.detach(), torch.autograd.grad(out, leaves, dy)


def _dtype(backend: str) -> torch.dtype:
    return torch.float32 if backend == "triton" else torch.float64  # Triton's kernels stop at fp32


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["none", "causal", "bool", "float", "key_lengths"])
def test_soft_capped_attention_matches_eager_gemma2(kind, backend):
    """In fp64 on the reference and the extension; Triton's fp32 by the fp32 floor of the
    tests' error rule (tests/helpers.py)."""
    dtype = _dtype(backend)
    q, k, v = _inputs(dtype)
    kw, allowed, bias = _mask(kind)
    bias = None if bias is None else bias.to(dtype)
    dy = torch.randn(B, H, LQ, D, dtype=torch.float64)
    tensors = (q, k, v) + ((bias,) if bias is not None else ())

    def ours(q, k, v, *b):
        with fasttrans.use_backend(backend):
            return fasttrans.attention(q, k, v, softcap=CAP, **{**kw, **({"attn_mask": b[0]} if b else {})})

    got, got_grads = _with_grads(ours, tensors, dy.to(dtype))
    want, want_grads = _with_grads(lambda q, k, v, *b: _eager(q, k, v, CAP, allowed, *b),
                                   tuple(t.double() for t in tensors), dy)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), (got, *got_grads), (want, *want_grads)):
        if dtype == torch.float64:
            torch.testing.assert_close(g, w, msg=lambda m: f"{name}: {m}")
        else:
            assert_close_lowp(name, g, w, None, dtype=dtype)
    uncapped = _eager(q.double(), k.double(), v.double(), math.inf, allowed, None if bias is None else bias.double())
    assert (got.double() - uncapped).abs().max() > 0.1, "the cap should change the output"


def _eager_with_sinks(q, k, v, cap, allowed, sinks):
    """The capped scores' softmax with a sink column (one logit per head, not capped) that
    attends to no value, as gpt-oss's eager attention adds it."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(2, 3) / math.sqrt(q.shape[-1])
    s = s if cap is None else torch.tanh(s / cap) * cap
    s = torch.cat([s.masked_fill(~allowed, float("-inf")), sinks.view(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
    return s.softmax(-1)[..., :-1] @ v


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dv", [D, 12], ids=["same_value_dim", "other_value_dim"])
def test_soft_capping_with_sinks_runs_on_every_backends_kernels(backend, dv):
    """A cap and sinks together: no fallback to the reference (a warning fails the test, a
    forced backend does not raise), the output and every gradient, the sinks' included, of
    the capped scores' softmax with the sink column."""
    dtype = _dtype(backend)
    q, k, v = _inputs(dtype, dv=dv)
    sinks = torch.randn(H, dtype=torch.float64).to(dtype)
    kw, allowed, _ = _mask("bool")
    dy = torch.randn(B, H, LQ, dv, dtype=torch.float64)

    def ours(q, k, v, s):
        with fasttrans.use_backend(backend), warnings.catch_warnings():
            warnings.simplefilter("error")
            return fasttrans.attention(q, k, v, softcap=CAP, sinks=s, **kw)

    got, got_grads = _with_grads(ours, (q, k, v, sinks), dy.to(dtype))
    want, want_grads = _with_grads(lambda q, k, v, s: _eager_with_sinks(q, k, v, CAP, allowed, s),
                                   (q.double(), k.double(), v.double(), sinks.double()), dy)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), (got, *got_grads), (want, *want_grads)):
        if dtype == torch.float64:
            torch.testing.assert_close(g, w, msg=lambda m: f"{name}: {m}")
        else:
            assert_close_lowp(name, g, w, None, dtype=dtype)
    uncapped = _eager_with_sinks(q.double(), k.double(), v.double(), None, allowed, sinks.double())
    assert (got.double() - uncapped).abs().max() > 0.1, "the cap should change the output"


@pytest.mark.parametrize("softcap", [None, 0, 0.0])
def test_no_cap_is_the_uncapped_call(softcap):
    q, k, v = _inputs(torch.float32)
    torch.testing.assert_close(fasttrans.attention(q, k, v, softcap=softcap), fasttrans.attention(q, k, v),
                               rtol=0, atol=0)


@pytest.mark.parametrize("softcap, error", [(-1.0, ShapeError), (float("nan"), ShapeError),
                                            (float("inf"), ShapeError), (True, TypeError), ("50", TypeError),
                                            (torch.tensor(50.0), TypeError)])
def test_bad_softcap_raises_naming_it(softcap, error):
    q, k, v = _inputs(torch.float32)
    with pytest.raises(error, match="softcap"):
        fasttrans.attention(q, k, v, softcap=softcap)


def test_automatic_selection_without_capping_kernels_warns_once_and_runs_the_reference(monkeypatch):
    """As with a backend whose kernels do not cap: here the CPU extension's cap is taken away."""
    monkeypatch.setattr(registry, "SOFTCAP_DEVICES", {"reference": ("cpu",)})
    monkeypatch.setattr(functional, "_reference_warned", set())
    q, k, v = _inputs(torch.float32)
    with pytest.warns(RuntimeWarning, match="soft-capped attention on cpu runs on the reference"):
        got = fasttrans.attention(q, k, v, softcap=CAP)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        fasttrans.attention(q, k, v, softcap=CAP)
    with fasttrans.use_backend("reference"):
        torch.testing.assert_close(got, fasttrans.attention(q, k, v, softcap=CAP), rtol=0, atol=0)
    with fasttrans.use_backend("extension"), pytest.raises(fasttrans.BackendUnavailableError, match="soft-cap"):
        fasttrans.attention(q, k, v, softcap=CAP)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_compiled_soft_capping_traces_without_a_graph_break_and_matches_eager(backend, with_sinks):
    q, k, v = _inputs(torch.float32)
    kw, _, bias = _mask("float")
    bias = bias.float()
    dy = torch.randn(B, H, LQ, D)
    sinks = torch.randn(H)

    def f(q, k, v, b, *s):
        return fasttrans.attention(q, k, v, attn_mask=b, key_lengths=torch.tensor([9, 4]), softcap=CAP,
                                   sinks=s[0] if s else None)

    torch._dynamo.reset()
    tensors = (q, k, v, bias) + ((sinks,) if with_sinks else ())
    with fasttrans.use_backend(backend):
        got, got_grads = _with_grads(torch.compile(f, fullgraph=True, backend="aot_eager"), tensors, dy)
        want, want_grads = _with_grads(f, tensors, dy)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


def test_soft_capping_under_torch_func_grad_runs_on_the_reference():
    q, k, v = _inputs()
    everything = torch.ones(LQ, LK, dtype=torch.bool)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = torch.func.grad(lambda q: fasttrans.attention(q, k, v, softcap=CAP).sum())(q)
    want = torch.func.grad(lambda q: _eager(q, k, v, CAP, everything).sum())(q)
    torch.testing.assert_close(got, want)

"""fasttrans.attention's ``sinks``: one logit per query head in every row's softmax, whose
weight goes to no value. Checked against the formula eager attention computes (the scores
with a sink column appended, a softmax, the column dropped) on every backend, with every
mask kind, grouped-query heads, dropout, half precision, torch.compile and torch.func."""

from __future__ import annotations

import warnings

import pytest
import torch

import fasttrans
from fasttrans import functional
from fasttrans.functional import DeviceError, DTypeError, ShapeError
from conftest import backend_params
from helpers import assert_close_lowp, mask_case

BACKENDS = backend_params("attention")
B, H, HKV, LQ, LK, D = 2, 4, 2, 5, 9, 16


def _eager(q, k, v, sinks, allowed, bias=None, keep=None, p=0.0):
    """gpt-oss's eager attention: scores, the sink column, softmax, the column dropped."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(2, 3) / q.shape[-1] ** 0.5
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~allowed, float("-inf"))
    rows = sinks.view(1, -1, 1) if sinks.dim() == 1 else sinks  # (H,): one per head
    column = rows.unsqueeze(-1).expand(*s.shape[:3], 1).to(s.dtype)
    w = torch.cat([s, column], -1).softmax(-1)[..., :-1]
    if keep is not None:
        w = w * keep / (1 - p)
    return w @ v


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, LQ, D, generator=g).to(dtype), torch.randn(B, HKV, LK, D, generator=g).to(dtype),
            torch.randn(B, HKV, LK, D, generator=g).to(dtype), (torch.randn(H, generator=g) * 2).to(dtype))


def _mask(kind: str):
    """mask_case's kind (a query that sees no key gets zeros: the sink takes all its weight)."""
    return mask_case(kind, B, LQ, LK)


def _with_grads(fn, tensors, dy):
    tensors = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*tensors)
    return out, torch.autograd.grad(out, tensors, dy)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["none", "causal", "bool", "float", "key_lengths"])
def test_sinks_match_eager_attention_with_a_sink_column(kind, backend):
    """Output and the gradients of q, k, v, the sinks (and a float mask) in fp32."""
    q, k, v, sinks = _inputs()
    kw, allowed, bias = _mask(kind)
    tensors = [q, k, v, sinks] + ([bias] if bias is not None else [])
    dy = torch.randn(B, H, LQ, D, generator=torch.Generator().manual_seed(7))

    def ours(q, k, v, sinks, bias=None):
        return fasttrans.attention(q, k, v, sinks=sinks, **{**kw, **({"attn_mask": bias} if bias is not None else {})})

    want, want_grads = _with_grads(lambda q, k, v, s, b=None: _eager(q, k, v, s, allowed, b), tensors, dy)
    with fasttrans.use_backend(backend):
        got, got_grads = _with_grads(ours, tensors, dy)
        with torch.no_grad():  # the inference route gives the same numbers
            torch.testing.assert_close(ours(*tensors), got, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("q", "k", "v", "sinks", "attn_mask"), got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"grad of {name}: {m}")
    if kind in ("bool", "key_lengths"):  # rows that see no key: zeros, and no gradient through them
        empty = ~allowed.expand(B, H, LQ, LK).any(-1)
        assert empty.any() and (got[empty] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_with_dropout_use_the_backends_keep_mask(backend):
    """Dropout after the softmax with the sink, on the weights of the keys: the keep mask the
    debug hook gives for the same seed."""
    q, k, v, sinks = _inputs()
    dy = torch.randn(B, H, LQ, D, generator=torch.Generator().manual_seed(7))
    p = 0.3
    with fasttrans.use_backend(backend):
        torch.manual_seed(11)
        keep = functional.attention_dropout_mask(q, k, p)
        torch.manual_seed(11)
        got, got_grads = _with_grads(lambda q, k, v, s: fasttrans.attention(q, k, v, sinks=s, dropout_p=p,
                                                                            is_causal=True), (q, k, v, sinks), dy)
    causal = torch.ones(LQ, LK, dtype=torch.bool).tril()
    want, want_grads = _with_grads(lambda q, k, v, s: _eager(q, k, v, s, causal, keep=keep.float(), p=p),
                                   (q, k, v, sinks), dy)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sinks_dtype", ["q's", "float32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sinks_in_half_precision_by_the_2x_rule(dtype, sinks_dtype, backend):
    """Half-precision inputs, the sinks in their dtype or in float32 (each gradient in its
    input's dtype)."""
    q, k, v, sinks = _inputs(dtype)
    if sinks_dtype == "float32":
        sinks = _inputs()[3]
    kw, allowed, _ = _mask("bool")
    dy = torch.randn(B, H, LQ, D, generator=torch.Generator().manual_seed(7)).to(dtype)
    with fasttrans.use_backend(backend):
        got, got_grads = _with_grads(lambda q, k, v, s: fasttrans.attention(q, k, v, sinks=s, **kw),
                                     (q, k, v, sinks), dy)
    ref, ref_grads = _with_grads(lambda q, k, v, s: _eager(q, k, v, s, allowed),
                                 [t.double() for t in (q, k, v, sinks)], dy.double())
    base, base_grads = _with_grads(lambda q, k, v, s: _eager(q, k, v, s, allowed), (q, k, v, sinks), dy)
    assert got.dtype == dtype and got_grads[3].dtype == sinks.dtype
    assert_close_lowp("out", got, ref, base)
    for name, a, r, b in zip(("dq", "dk", "dv", "dsinks"), got_grads, ref_grads, base_grads):
        assert_close_lowp(name, a, r, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(B, H, LQ), (1, H, LQ), (B, 1, 1)], ids=["per-row", "per-head-row", "per-sequence"])
def test_sinks_per_query_row(shape, backend):
    """Sinks broadcastable to (B, H, Lq), one per query row (Inkling 2's): output and the
    gradients of q, k, v and the sinks, summed over the rows each sink serves."""
    q, k, v, _ = _inputs()
    sinks = torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 2
    kw, allowed, _ = _mask("bool")
    dy = torch.randn(B, H, LQ, D, generator=torch.Generator().manual_seed(7))
    want, want_grads = _with_grads(lambda q, k, v, s: _eager(q, k, v, s, allowed), (q, k, v, sinks), dy)
    with fasttrans.use_backend(backend):
        got, got_grads = _with_grads(lambda q, k, v, s: fasttrans.attention(q, k, v, sinks=s, **kw),
                                     (q, k, v, sinks), dy)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got_grads[3].shape == shape
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sinks, error, what", [
    (torch.zeros(3), ShapeError, r"\(4,\)"),
    (torch.zeros(4, 1), ShapeError, r"\(B, H, Lq\)"),
    (torch.zeros(B, H, LQ + 1), ShapeError, r"\(B, H, Lq\)"),
    (torch.zeros(4, dtype=torch.int64), DTypeError, "float"),
    ([0.0] * 4, TypeError, "Tensor"),
])
def test_bad_sinks_raise_naming_them(sinks, error, what):
    q, k, v, _ = _inputs()
    with pytest.raises(error, match=f"sinks.*{what}|{what}.*sinks"):
        fasttrans.attention(q, k, v, sinks=sinks)


def test_sinks_on_another_device_raise_naming_them():
    q, k, v, sinks = _inputs()
    with pytest.raises(DeviceError, match="sinks"):
        fasttrans.attention(q, k, v, sinks=sinks.to("meta"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_sinks(backend):
    """A sink of -inf is no sink; one of +inf takes every row's weight: zeros. A row that
    sees no key gives zeros with either, never NaN."""
    q, k, v, _ = _inputs()
    kw, _, _ = _mask("key_lengths")  # the first sequence sees no key
    with fasttrans.use_backend(backend):
        plain = fasttrans.attention(q, k, v, **kw)
        none = fasttrans.attention(q, k, v, sinks=torch.full((H,), -torch.inf), **kw)
        everything = fasttrans.attention(q, k, v, sinks=torch.full((H,), torch.inf), **kw)
    torch.testing.assert_close(none, plain, rtol=1e-6, atol=1e-6)
    assert (everything == 0).all()


def test_sinks_under_vmap_keep_the_graph():
    """torch.vmap hides a batched input's requires_grad from the eager route: the gradients
    must still reach q and the sinks."""
    q, k, v, sinks = (t.requires_grad_() for t in _inputs())
    allowed = torch.ones(LQ, LK, dtype=torch.bool)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = torch.vmap(lambda q, k, v: fasttrans.attention(q[None], k[None], v[None], sinks=sinks)[0])(q, k, v)
    want = _eager(q, k, v, sinks, allowed)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    got_grads = torch.autograd.grad(out.sum(), (q, sinks))
    want_grads = torch.autograd.grad(want.sum(), (q, sinks))
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_sinks_trace_without_a_graph_break_and_match_eager(dtype):
    q, k, v, sinks = _inputs(dtype)
    dy = torch.randn(B, H, LQ, D, generator=torch.Generator().manual_seed(7)).to(dtype)

    def f(q, k, v, s):
        return fasttrans.attention(q, k, v, sinks=s, is_causal=True, causal_offset=LK - LQ)

    want, want_grads = _with_grads(f, (q, k, v, sinks), dy)
    torch._dynamo.reset()
    got, got_grads = _with_grads(torch.compile(f, fullgraph=True, backend="aot_eager"), (q, k, v, sinks), dy)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # the same kernels and ops: the same numbers
    for a, b in zip(got_grads, want_grads):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_sinks_under_torch_func_grad_run_on_the_reference():
    q, k, v, sinks = _inputs()
    allowed = torch.ones(LQ, LK, dtype=torch.bool)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the one-time notice of the reference fallback
        got = torch.func.grad(lambda s: fasttrans.attention(q, k, v, sinks=s).sum())(sinks)
    want = torch.func.grad(lambda s: _eager(q, k, v, s, allowed).sum())(sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_second_order_gradients_of_sinks_are_the_references():
    """backward(create_graph=True): on the automatically selected backend the gradients are
    the reference's, differentiable again (with a one-time warning); a backend asked for by
    name refuses, as it does without sinks."""
    q, k, v, sinks = (t.requires_grad_() for t in _inputs())
    allowed = torch.ones(LQ, LK, dtype=torch.bool)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        (gs,) = torch.autograd.grad(fasttrans.attention(q, k, v, sinks=sinks).pow(2).sum(), sinks, create_graph=True)
        (got,) = torch.autograd.grad(gs.sum(), q)
    (ws,) = torch.autograd.grad(_eager(q, k, v, sinks, allowed).pow(2).sum(), sinks, create_graph=True)
    (want,) = torch.autograd.grad(ws.sum(), q)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with fasttrans.use_backend("extension"), pytest.raises(fasttrans.backends.BackendUnavailableError,
                                                           match="create_graph"):
        torch.autograd.grad(fasttrans.attention(q, k, v, sinks=sinks).sum(), sinks, create_graph=True)


def test_empty_batch_with_sinks():
    q, k, v, sinks = _inputs()
    out = fasttrans.attention(q[:0], k[:0], v[:0], sinks=sinks)
    assert out.shape == (0, H, LQ, D)

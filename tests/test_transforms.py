"""torch.func transforms and forward-mode AD through the fasttrans ops.

The ops' autograd is registered with torch.library, which serves torch.autograd only; under
torch.func.grad / jacrev / jvp / jacfwd or a forward-mode dual level the ops are computed by
the reference implementation. These tests hold the derivatives they give against torch's
and against the kernels' own backward (a forward-mode tangent t and a reverse-mode
cotangent g must satisfy <g, J t> = <J^T g, t>).
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import fasttrans
from fasttrans import backends, functional

from helpers import fasttrans_ops_run, make_float_mask

pytestmark = pytest.mark.usefixtures("one_thread")

f64 = torch.float64


@pytest.fixture(autouse=True)
def _quiet_fallback(monkeypatch):
    # the fallback's one-time warning is tested on its own below
    monkeypatch.delenv("FASTTRANS_BACKEND", raising=False)
    monkeypatch.setattr(functional, "_reference_warned", {"attention", "layer_norm", "add_layer_norm", "rms_norm", "dropout"})


def _norm_case(op):
    x, r = torch.randn(5, 12, dtype=f64), torch.randn(5, 12, dtype=f64)
    w, b = torch.randn(12, dtype=f64), torch.randn(12, dtype=f64)
    if op == "layer_norm":
        return (x, w, b), lambda x, w, b: fasttrans.layer_norm(x, (12,), w, b), \
            lambda x, w, b: F.layer_norm(x, (12,), w, b)
    if op == "add_layer_norm":
        return (x, r, w, b), lambda x, r, w, b: fasttrans.add_layer_norm(x, r, w, b), \
            lambda x, r, w, b: (F.layer_norm(x + r, (12,), w, b), x + r)
    return (x, w), lambda x, w: fasttrans.rms_norm(x, (12,), w, 1e-6), lambda x, w: F.rms_norm(x, (12,), w, 1e-6)


@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm", "rms_norm"])
def test_jvp_of_norms_matches_torch(op):
    primals, ours, torchs = _norm_case(op)
    tangents = tuple(torch.randn_like(p) for p in primals)
    out, tan = torch.func.jvp(ours, primals, tangents)
    ref_out, ref_tan = torch.func.jvp(torchs, primals, tangents)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(tan, ref_tan)
    assert torch.cat([t.flatten() for t in (tan if isinstance(tan, tuple) else (tan,))]).abs().max() > 0.1


@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm", "rms_norm"])
def test_jacfwd_and_jacrev_of_norms_match_torch(op):
    primals, ours, torchs = _norm_case(op)
    first = lambda f: (lambda *a: f(*a)[0] if op == "add_layer_norm" else f(*a))  # noqa: E731
    argnums = tuple(range(len(primals)))
    for jac in (torch.func.jacfwd, torch.func.jacrev):
        got = jac(first(ours), argnums=argnums)(*primals)
        want = jac(first(torchs), argnums=argnums)(*primals)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


ATTENTION_CASES = {
    "plain": dict(),
    "key lengths + causal": dict(key_lengths=torch.tensor([7, 3]), is_causal=True),
    "bool mask": dict(attn_mask=torch.rand(2, 1, 5, 7) > 0.3),
    "float mask (differentiated)": dict(attn_mask=make_float_mask((2, 4, 5, 7), "cpu", f64)),
    "decoding offset": dict(is_causal=True, causal_offset=2),
    "dropout": dict(dropout_p=0.3),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES), ids=list(ATTENTION_CASES))
def test_jvp_of_attention_agrees_with_the_kernels_backward(case):
    kw = dict(ATTENTION_CASES[case])
    mask = kw.pop("attn_mask", None)
    q = torch.randn(2, 4, 5, 8, dtype=f64)
    k, v = torch.randn(2, 2, 7, 8, dtype=f64), torch.randn(2, 2, 7, 8, dtype=f64)  # grouped-query
    primals = (q, k, v) if mask is None or mask.dtype == torch.bool else (q, k, v, mask)

    def f(q, k, v, m=mask):
        torch.manual_seed(11)  # the same dropout mask in both calls
        return fasttrans.attention(q, k, v, attn_mask=m, **kw)

    tangents = tuple(torch.randn_like(p) for p in primals)
    out, tan = torch.func.jvp(f, primals, tangents)

    leaves = tuple(p.clone().requires_grad_() for p in primals)
    kernel_out = f(*leaves)  # torch.autograd through the extension's kernels
    g = torch.randn_like(kernel_out)
    grads = torch.autograd.grad(kernel_out, leaves, g)
    torch.testing.assert_close(out, kernel_out.detach())
    lhs = (g * tan).sum()
    rhs = sum((gr * t).sum() for gr, t in zip(grads, tangents))
    torch.testing.assert_close(lhs, rhs, rtol=1e-10, atol=1e-10)
    assert tan.abs().max() > 0.1


def test_grad_transform_of_attention_matches_autograd():
    q, k, v = (torch.randn(2, 2, 6, 8, dtype=f64) for _ in range(3))
    lengths = torch.tensor([6, 2])

    def loss(q, k, v):
        return fasttrans.attention(q, k, v, key_lengths=lengths, is_causal=True).pow(2).sum()

    got = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(loss(*leaves), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_dropout_jvp_scales_the_tangent_by_the_keep_mask():
    x, t = torch.randn(6, 32, dtype=f64), torch.randn(6, 32, dtype=f64)
    torch.manual_seed(5)
    keep = functional.dropout_mask(x, 0.25)
    torch.manual_seed(5)
    out, tan = torch.func.jvp(lambda x: functional.dropout(x, 0.25), (x,), (t,))
    torch.testing.assert_close(tan, t * keep / 0.75)
    torch.testing.assert_close(out, x * keep / 0.75)


def test_jvp_through_an_encoder_layer_agrees_with_its_backward():
    layer = fasttrans.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).double()
    x, t = torch.randn(2, 5, 16, dtype=f64), torch.randn(2, 5, 16, dtype=f64)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    out, tan = torch.func.jvp(lambda x: layer(x, src_key_padding_mask=pad), (x,), (t,))
    leaf = x.clone().requires_grad_()
    kernel_out = layer(leaf, src_key_padding_mask=pad)
    g = torch.randn_like(kernel_out)
    (gx,) = torch.autograd.grad(kernel_out, leaf, g)
    torch.testing.assert_close(out, kernel_out.detach())
    torch.testing.assert_close((g * tan).sum(), (gx * t).sum(), rtol=1e-10, atol=1e-10)




def test_vmap_alone_keeps_the_kernels_and_matches():
    x = torch.randn(3, 4, 8)
    w, b = torch.randn(8), torch.randn(8)
    q = torch.randn(3, 2, 2, 5, 8)  # a vmapped batch of (B, H, L, D) attention inputs
    norm = backends.select_backend("norm", "cpu", x.dtype).name
    attention = backends.select_backend("attention", "cpu", q.dtype).name
    assert "reference" not in (norm, attention)
    got, ops = fasttrans_ops_run(lambda: torch.func.vmap(lambda x: fasttrans.layer_norm(x, (8,), w, b))(x))
    torch.testing.assert_close(got, F.layer_norm(x, (8,), w, b))
    assert ops == {f"fasttrans::norm_fwd_{norm}"}  # the kernels' op, not the reference's PyTorch ops
    got, ops = fasttrans_ops_run(lambda: torch.func.vmap(lambda q: fasttrans.attention(q, q, q, is_causal=True))(q))
    want = torch.stack([F.scaled_dot_product_attention(t, t, t, is_causal=True) for t in q])
    torch.testing.assert_close(got, want)
    assert ops == {f"fasttrans::attention_fwd_{attention}"}


@pytest.mark.parametrize("transform", ["jvp", "grad"])
def test_a_forced_kernel_backend_refuses_transforms(transform):
    x = torch.randn(3, 8, dtype=f64)
    call = lambda x: fasttrans.layer_norm(x, (8,)).pow(2).sum()  # noqa: E731
    with fasttrans.use_backend("extension"):
        with pytest.raises(backends.BackendUnavailableError, match="torch.func.*reference backend"):
            if transform == "jvp":
                torch.func.jvp(call, (x,), (x,))
            else:
                torch.func.grad(call)(x)
    with fasttrans.use_backend("reference"):  # the reference computes it
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.func.grad(call)(x)


def test_the_fallback_warns_once_per_op(monkeypatch):
    monkeypatch.setattr(functional, "_reference_warned", set())
    x = torch.randn(3, 8, dtype=f64)
    with pytest.warns(RuntimeWarning, match="layer_norm under torch.func"):
        torch.func.jvp(lambda x: fasttrans.layer_norm(x, (8,)), (x,), (x,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.func.jvp(lambda x: fasttrans.layer_norm(x, (8,)), (x,), (x,))

"""The oracle itself: fasttrans.reference against torch, fp64 gradcheck through every mask."""

import math

import pytest
import torch
import torch.nn.functional as F

from fasttrans import reference

from helpers import make_bool_mask, make_float_mask, make_key_lengths


def _qkv(B, H, Hkv, Lq, Lk, D, dtype=torch.float64, grad=False):
    q = torch.randn(B, H, Lq, D, dtype=dtype)
    k = torch.randn(B, Hkv, Lk, D, dtype=dtype)
    v = torch.randn(B, Hkv, Lk, D, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _sdpa_mask(B, H, Lq, Lk, *, attn_mask=None, key_lengths=None, is_causal=False, causal_offset=0):
    """The same masks as one additive float mask for F.scaled_dot_product_attention."""
    allowed = reference.allowed_mask(B, H, Lq, Lk, attn_mask=attn_mask, key_lengths=key_lengths,
                                     is_causal=is_causal, causal_offset=causal_offset)
    m = torch.zeros(B, H, Lq, Lk, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        m = m + attn_mask
    return m


@pytest.mark.parametrize("mask", ["none", "bool", "float", "key_lengths", "causal", "causal_offset", "all"])
@pytest.mark.parametrize("shape", [(2, 4, 2, 5, 7, 8), (1, 3, 3, 17, 17, 16), (2, 2, 1, 1, 9, 3)])
def test_attention_matches_sdpa(mask, shape):
    B, H, Hkv, Lq, Lk, D = shape
    q, k, v = _qkv(*shape)
    kw = {}
    if mask in ("bool", "all"):
        kw["attn_mask"] = make_bool_mask((B, 1, Lq, Lk), "cpu")
    if mask == "float":
        kw["attn_mask"] = make_float_mask((1, H, Lq, Lk), "cpu", torch.float64, neg_inf_frac=0.0)
    if mask in ("key_lengths", "all"):
        kw["key_lengths"] = make_key_lengths(B, Lk, "cpu")
    if mask in ("causal", "causal_offset", "all"):
        kw["is_causal"] = True
        kw["causal_offset"] = Lk - Lq if mask != "causal" else 0
    out = reference.attention(q, k, v, **kw)
    m = _sdpa_mask(B, H, Lq, Lk, **kw)
    kr, vr = (t.repeat_interleave(H // Hkv, 1) for t in (k, v))
    expected = F.scaled_dot_product_attention(q, kr, vr, attn_mask=m)
    rows_ok = torch.isfinite(m).any(-1, keepdim=True)  # sdpa gives NaN on fully masked rows
    torch.testing.assert_close(out, torch.where(rows_ok, expected, torch.zeros_like(expected)), atol=1e-10, rtol=1e-10)
    assert torch.equal(out[~rows_ok.expand_as(out)], torch.zeros_like(out[~rows_ok.expand_as(out)]))


def test_lse_and_fully_masked_rows():
    q, k, v = _qkv(2, 2, 2, 4, 6, 8)
    kl = torch.tensor([6, 0])
    out, lse = reference.attention_with_lse(q, k, v, key_lengths=kl)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isposinf(lse[1]).all()
    s = (q[0] @ k[0].transpose(-1, -2)) / math.sqrt(8)
    torch.testing.assert_close(lse[0], torch.logsumexp(s, -1))


def test_dropout_uses_the_given_keep_mask():
    q, k, v = _qkv(1, 2, 2, 5, 5, 4)
    keep = torch.rand(1, 2, 5, 5) > 0.3
    out = reference.attention(q, k, v, dropout_p=0.3, dropout_mask=keep)
    p = torch.softmax((q @ k.transpose(-1, -2)) / 2.0, -1) * keep / 0.7
    torch.testing.assert_close(out, p @ v)
    with pytest.raises(ValueError, match="dropout_mask"):
        reference.attention(q, k, v, dropout_p=0.3)


def test_upcast_false_computes_in_low_precision():
    q, k, v = (t.half() for t in _qkv(1, 2, 2, 33, 33, 16))
    hi = reference.attention(q, k, v)
    lo = reference.attention(q, k, v, upcast=False)
    assert hi.dtype == lo.dtype == torch.float16
    assert not torch.equal(hi, lo)  # a different rounding path, otherwise the 2x rule would be vacuous
    torch.testing.assert_close(hi, lo, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("case", ["key_lengths+causal", "float_mask", "bool_mask+offset", "gqa+dropout", "fully_masked"])
def test_attention_gradcheck(case):
    B, H, Hkv, Lq, Lk, D = 2, 2, 1 if "gqa" in case else 2, 3, 4, 3
    q, k, v = _qkv(B, H, Hkv, Lq, Lk, D, grad=True)
    kw = {}
    inputs = [q, k, v]
    if case == "key_lengths+causal":
        kw.update(key_lengths=torch.tensor([4, 2]), is_causal=True, causal_offset=1)
    elif case == "bool_mask+offset":
        kw.update(attn_mask=make_bool_mask((B, 1, Lq, Lk), "cpu"), is_causal=True, causal_offset=-1)
    elif case == "gqa+dropout":
        kw.update(dropout_p=0.25, dropout_mask=torch.rand(B, H, Lq, Lk) > 0.25)
    elif case == "fully_masked":
        kw.update(key_lengths=torch.tensor([0, 3]))
    mask = None
    if case == "float_mask":
        mask = torch.randn(1, H, Lq, Lk, dtype=torch.float64, requires_grad=True)
        inputs.append(mask)

    def f(*args):
        extra = {"attn_mask": args[3]} if len(args) > 3 else {}
        return reference.attention(*args[:3], **kw, **extra)

    assert torch.autograd.gradcheck(f, tuple(inputs))
    if case == "fully_masked":
        f(*inputs).sum().backward()
        assert torch.equal(q.grad[0], torch.zeros_like(q.grad[0]))


@pytest.mark.parametrize("shape,ns", [((3, 7), (7,)), ((2, 3, 4, 5), (4, 5)), ((1, 1), (1,))])
def test_norms_match_torch(shape, ns):
    x = torch.randn(shape, dtype=torch.float64) * 3 + 1
    w = torch.randn(ns, dtype=torch.float64)
    b = torch.randn(ns, dtype=torch.float64)
    torch.testing.assert_close(reference.layer_norm(x, ns, w, b, 1e-5), F.layer_norm(x, ns, w, b, 1e-5))
    torch.testing.assert_close(reference.layer_norm(x, ns), F.layer_norm(x, ns))
    torch.testing.assert_close(reference.rms_norm(x, ns, w, 1e-6), F.rms_norm(x, ns, w, 1e-6))
    torch.testing.assert_close(reference.rms_norm(x, ns), F.rms_norm(x, ns))
    r = torch.randn(shape, dtype=torch.float64)
    y, h = reference.add_layer_norm(x, r, w.flatten()[: shape[-1]], None)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, F.layer_norm(x + r, (shape[-1],), w.flatten()[: shape[-1]]))


def test_layer_norm_statistics_survive_a_large_offset():
    # E[x²]−E[x]² would lose every digit here; the centred two-pass variance does not
    x = torch.randn(4, 256) + 3000.0
    expected = F.layer_norm(x.double(), (256,)).float()
    out = reference.layer_norm(x, (256,))
    torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-3)
    naive_var = (x * x).mean(-1, keepdim=True) - x.mean(-1, keepdim=True) ** 2
    naive = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(naive_var + 1e-5)
    assert (naive - expected).abs().max() > 1e-2  # the shape of the test: the shortcut really fails here


def test_norm_gradcheck():
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: reference.add_layer_norm(*a), (x, r, w, b))
    assert torch.autograd.gradcheck(lambda x, w: reference.rms_norm(x, (6,), w), (x, w))
    assert torch.autograd.gradcheck(lambda x, w, b: reference.layer_norm(x, (6,), w, b), (x, w, b))

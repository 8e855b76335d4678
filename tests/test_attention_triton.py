"""The Triton attention kernels (kernels/attention.py): forward, backward, every mask kind.

Without a GPU the kernels run through Triton's interpreter (tests/conftest.py switches it on)
with small tiles (kernels/attention.py: INTERPRETER_CONFIGS), so the awkward sizes here
(1, 17, 97) exercise partial tiles, multi-tile loops and the causal diagonal. ``pytest -m
gpu`` runs the same checks on CUDA plus larger shapes and torch.compile.

Every output and gradient (q, k, v, and a float attn_mask) is compared with
fasttrans.reference under autograd: in fp64 on fp32 inputs, and for fp16/bf16 with the 2x
rule (tests/helpers.assert_close_lowp) against the fp32 reference on upcast inputs, with the
same-precision baseline ``reference.attention(..., upcast=False)`` on the low-precision inputs.
"""

import subprocess
import sys

import pytest
import torch

import fasttrans
from fasttrans import backends, functional, reference

from helpers import (FLOOR, TRITON_DEVICES, assert_close_lowp, attention_keep, huge_score_rows, make_bool_mask,
                     make_float_mask, skip_module_without_triton, subnormal_weight_with_inf_value)

skip_module_without_triton("attention")

from fasttrans.kernels import attention as K  # noqa: E402  (after conftest chose the interpreter)

DEVICES = TRITON_DEVICES
LOW = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------
# running attention three ways: Triton, the fp32/fp64 reference, PyTorch in low precision
# ---------------------------------------------------------------------------------------
def _masks(kind: str, B, H, Lq, Lk, device, float_dtype=torch.float32):
    """attention kwargs for a mask kind; '+' combines kinds. 'causal_br' is bottom-right aligned."""
    kw = {}
    for part in kind.split("+"):
        if part == "none":
            continue
        if part == "bool":
            kw["attn_mask"] = make_bool_mask((B, 1, Lq, Lk), device)  # broadcast over heads
        elif part == "float":
            kw["attn_mask"] = make_float_mask((H, Lq, Lk), device, dtype=float_dtype)  # broadcast over batch
        elif part == "key_lengths":
            kl = torch.randint(1, Lk + 1, (B,), device=device)
            kl[0] = max(Lk // 2, 1)  # a partial last key tile
            kw["key_lengths"] = kl
        elif part == "causal":
            kw["is_causal"] = True
        elif part == "causal_br":
            kw.update(is_causal=True, causal_offset=Lk - Lq)
        elif part == "causal_neg":
            kw.update(is_causal=True, causal_offset=-3)  # the first rows see no key at all
        else:
            raise ValueError(part)
    return kw


def _inputs(B, H, Hkv, Lq, Lk, D, device):
    return (torch.randn(B, H, Lq, D, device=device), torch.randn(B, Hkv, Lk, D, device=device),
            torch.randn(B, Hkv, Lk, D, device=device))


def _run(fn, q, k, v, dout, kw, cast=None, cast_mask=True):
    """{name: tensor}: the output and the gradients of q, k, v (and a float attn_mask) under autograd."""
    leaves = {n: (t.to(cast) if cast else t).detach().clone().requires_grad_() for n, t in zip("qkv", (q, k, v))}
    kw = dict(kw)
    mask = kw.get("attn_mask")
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(cast) if cast and cast_mask else mask
        kw["attn_mask"] = leaves["mask"] = mask.detach().clone().requires_grad_()
    out = fn(leaves["q"], leaves["k"], leaves["v"], **kw)
    out.backward(dout.to(out.dtype))
    return {"out": out.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}


def _triton(q, k, v, **kw):
    with fasttrans.use_backend("triton"):
        return fasttrans.attention(q, k, v, **kw)


def _check(q, k, v, kw, dtype=torch.float32, dout=None):
    """Triton output and every gradient against the reference (2x rule in low precision)."""
    dout = torch.randn(q.shape, device=q.device) if dout is None else dout
    got = _run(_triton, q, k, v, dout, kw, cast=dtype)
    if dtype == torch.float32:
        ref = _run(reference.attention, q, k, v, dout, kw, cast=torch.float64)
        base = {n: None for n in ref}
    else:
        ref = _run(reference.attention, q, k, v, dout, kw, cast=torch.float32)
        base = _run(lambda *a, **k_: reference.attention(*a, upcast=False, **k_), q, k, v, dout, kw, cast=dtype)
    for name in ref:
        assert_close_lowp(name, got[name], ref[name], base[name], dtype=dtype)
    return got


# ---------------------------------------------------------------------------------------
# every mask kind and combination, fp32, against the fp64 reference
# ---------------------------------------------------------------------------------------
MASK_COMBOS = ["none", "bool", "float", "key_lengths", "causal", "causal_br", "causal_neg", "bool+key_lengths",
               "float+causal", "key_lengths+causal_br", "bool+key_lengths+causal", "float+key_lengths+causal_neg"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", MASK_COMBOS)
def test_masks_match_reference(kind, device):
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 33, 45, 24
    q, k, v = _inputs(B, H, Hkv, Lq, Lk, D, device)
    _check(q, k, v, _masks(kind, B, H, Lq, Lk, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["bool", "float", "bool+causal"])
def test_dense_mask_key_columns_with_and_without_partial_tiles(kind, device):
    """The dK/dV kernel runs a key tile's loops as without a mask where every query tile left
    to it is full in every head of its group: key columns all allowed, or all allowed but in
    one head of a group, one with a partial block, one with a dead block between live ones,
    and padding."""
    B, H, Hkv, Lq, Lk, D = 1, 4, 2, 70, 160, 16
    q, k, v = _inputs(B, H, Hkv, Lq, Lk, D, device)
    allowed = torch.ones(B, H, Lq, Lk, dtype=torch.bool, device=device)
    allowed[:, 1, :, 32:64] = torch.rand(B, Lq, 32, device=device) > 0.3  # one head of the first group
    allowed[:, :, 20:40, 64:96] = torch.rand(B, H, 20, 32, device=device) > 0.5  # a partial block
    allowed[:, :, 32:64, 96:128] = False  # a dead block between live ones
    allowed[:, :, :, 140:] = False  # padding
    mask = allowed if kind.startswith("bool") else \
        torch.zeros(B, H, Lq, Lk, device=device).masked_fill(~allowed, float("-inf"))
    _check(q, k, v, dict(attn_mask=mask, is_causal=kind.endswith("causal")))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["none", "bool+key_lengths+causal", "float+causal_br"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_low_precision_within_twice_torch_error(dtype, kind, device):
    B, H, Hkv, Lq, Lk, D = 2, 2, 1, 40, 70, 64
    q, k, v = _inputs(B, H, Hkv, Lq, Lk, D, device)
    _check(q, k, v, _masks(kind, B, H, Lq, Lk, device, float_dtype=dtype), dtype=dtype)


# ---------------------------------------------------------------------------------------
# sizes, head dims, grouped-query and strided inputs
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("Lq, Lk", [(1, 1), (1, 97), (97, 1), (97, 97), (17, 33)], ids=lambda s: str(s))
def test_awkward_lengths(Lq, Lk, device):
    q, k, v = _inputs(1, 2, 2, Lq, Lk, 40, device)
    _check(q, k, v, _masks("causal_br", 1, 2, Lq, Lk, device))
    _check(q, k, v, _masks("bool+key_lengths", 1, 2, Lq, Lk, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("D", [1, 16, 40, 64, 80, 128, 200])
def test_head_dims(D, device):
    # 40 and 80 pad to 64 and 128 (masked lanes); 200 pads to 256, where dK and dV are two passes
    q, k, v = _inputs(2, 2, 1, 19, 23, D, device)
    _check(q, k, v, _masks("float+causal", 2, 2, 19, 23, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("D", [16, 80, 128])
def test_head_dims_low_precision(D, dtype, device):
    q, k, v = _inputs(1, 2, 2, 17, 31, D, device)
    _check(q, k, v, _masks("key_lengths+causal", 1, 2, 17, 31, device), dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("H, Hkv", [(6, 1), (6, 2), (6, 3), (4, 4)], ids=lambda s: str(s))
def test_grouped_query_cross_attention(H, Hkv, device):
    q, k, v = _inputs(2, H, Hkv, 21, 50, 32, device)
    _check(q, k, v, _masks("float+key_lengths+causal_br", 2, H, 21, 50, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["none", "key_lengths+causal_neg", "bool"])
@pytest.mark.parametrize("scale", [0.3, -0.7, 0.0], ids=["positive", "negative", "zero"])
def test_scales_of_every_sign(scale, kind, device):
    # a positive scale is folded into exp2's argument after the row maximum (FOLD_SCALE);
    # the others scale the scores first
    q, k, v = _inputs(2, 2, 1, 21, 37, 32, device)
    _check(q, k, v, dict(_masks(kind, 2, 2, 21, 37, device), scale=scale))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["none", "key_lengths+causal"])
def test_folded_scale_gives_the_bits_of_scaled_scores(kind, device, monkeypatch):
    """(-q) k^T (-c) = q k^T c exactly, so the unfolded route on -q with scale -c must give
    the folded route's output and lse bit for bit, and the folded route must be taken."""
    folds = []
    launch = K._launch

    def spy(tuned, kernel, stage, grid, args, spec):
        if stage == "fwd":
            folds.append(spec.constexprs["FOLD_SCALE"])
        return launch(tuned, kernel, stage, grid, args, spec)

    monkeypatch.setattr(K, "_launch", spy)
    monkeypatch.setattr(K, "_FWD_SITES", {})  # no launch bound by an earlier test
    q, k, v = _inputs(2, 2, 1, 21, 37, 32, device)
    kw = _masks(kind, 2, 2, 21, 37, device)
    args = (kw.get("attn_mask"), kw.get("key_lengths"), kw.get("is_causal", False), kw.get("causal_offset", 0), 0.0)
    out, lse = K.attention_fwd(q, k, v, *args, 0.3, 0)
    out_neg, lse_neg = K.attention_fwd(-q, k, v, *args, -0.3, 0)
    assert folds == [True, False]
    assert torch.equal(out, out_neg) and torch.equal(lse, lse_neg)


def _tma_routes(monkeypatch, tma: bool) -> list:
    """Allow the attention kernels' loads through tensor descriptors (under the interpreter
    too), or not; returns the list that (stage, route) of each launch is appended to."""
    routes = []
    launch = K._launch

    def spy(tuned, kernel, stage, grid, args, spec):
        routes.append((stage, spec.constexprs["TMA"]))
        return launch(tuned, kernel, stage, grid, args, spec)

    monkeypatch.setattr(K, "_launch", spy)
    monkeypatch.setattr(K, "TMA_UNDER_INTERPRETER", tma)
    monkeypatch.setattr(K, "TMA_ENABLED", tma)
    for sites in ("_FWD_SITES", "_BWD_SITES", "_ATTENTION_SITES"):  # no launch bound by an earlier call
        monkeypatch.setattr(K, sites, {})
    return routes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["none", "causal_br", "causal_neg", "key_lengths+causal", "key_lengths"])
def test_tma_route_gives_the_bits_of_pointer_loads(kind, device, monkeypatch):
    """Tiles loaded through tensor descriptors (zeros outside the matrix: keys past kv_len,
    query rows past Lq) give the output and every gradient of pointer loads bit for bit, with
    a padded head dim, grouped heads, (B, L, H, D) views, partial last tiles and a key length
    of 0; and match the reference (fp16: the route's dtypes on a GPU, of compute capability 9
    or more). Dense masks and dropout (the heavy class) keep pointer loads."""
    if device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9 or more")
    B, H, Hkv, Lq, Lk, D = 2, 2, 1, 37, 45, 24
    q = torch.randn(B, Lq, H, D, device=device).transpose(1, 2)
    k, v = (torch.randn(B, Lk, Hkv, D, device=device).transpose(1, 2) for _ in range(2))
    kw = _masks(kind, B, H, Lq, Lk, device)
    if "key_lengths" in kw:
        kw["key_lengths"][-1] = 0
    dout = torch.randn(q.shape, device=device)
    results = []
    for tma in (True, False):
        routes = _tma_routes(monkeypatch, tma)
        results.append(_run(_triton, q, k, v, dout, kw, cast=torch.float16))
        assert routes == [("fwd", tma), ("dq", tma), ("dkdv", tma)], routes
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name
    routes = _tma_routes(monkeypatch, True)
    _check(q, k, v, kw, dtype=torch.float16, dout=dout)
    assert routes == [("fwd", True), ("dq", True), ("dkdv", True)], routes
    routes = _tma_routes(monkeypatch, True)
    _triton(q.half(), k.half(), v.half(), dropout_p=0.3, **kw)
    kw_mask = _masks("bool", B, H, Lq, Lk, device)
    _triton(q.half(), k.half(), v.half(), **kw_mask)
    assert routes == [("fwd", False), ("fwd", False)], routes


@pytest.mark.parametrize("device", DEVICES)
def test_tma_route_needs_16_byte_rows(device, monkeypatch):
    """TMA takes rows that start on 16-byte boundaries only: fp16 rows of 20 elements (40
    bytes) and a key tensor offset by one element go by pointer loads, and still match."""
    q, k, v = _inputs(1, 2, 2, 19, 23, 20, device)
    routes = _tma_routes(monkeypatch, True)
    _check(q, k, v, {"is_causal": True}, dtype=torch.float16)
    # the autograd route above clones its inputs: the backend gets this k as it is
    k = torch.randn(2 * 23 * 32 + 1, device=device)[1:].view(1, 2, 23, 32)  # 4-byte aligned only
    q, v = torch.randn(1, 2, 19, 32, device=device), torch.randn(1, 2, 23, 32, device=device)
    out, _ = K.attention_fwd(q, k, v, None, None, False, 0, 0.0, 32**-0.5, 0)
    torch.testing.assert_close(out, reference.attention(q, k, v))
    assert routes == [("fwd", False), ("dq", False), ("dkdv", False), ("fwd", False)], routes


@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs_and_broadcast_masks(device):
    """(B, L, H, D)-layout views and masks with stride-0 broadcast dims, read without copies."""
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 18, 27, 32
    q = torch.randn(B, Lq, H, D, device=device).transpose(1, 2)  # (B, H, Lq, D), non-contiguous
    kv = torch.randn(B, Lk, 2, Hkv, D, device=device)  # packed k and v
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous() and q.stride(-1) == 1
    for mask in (make_float_mask((Lq, Lk), device), make_float_mask((B, 1, 1, Lk), device),
                 make_bool_mask((1, H, Lq, 1), device, p_keep=0.8), make_float_mask((Lk, Lq), device).t()):
        _check(q, k, v, {"attn_mask": mask, "is_causal": True})


# ---------------------------------------------------------------------------------------
# empty rows, zero key lengths, determinism
# ---------------------------------------------------------------------------------------
def _backend_fwd(q, k, v, attn_mask=None, key_lengths=None, is_causal=False, causal_offset=0):
    B, H, Lq, Lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if attn_mask is not None:
        attn_mask = attn_mask.expand(B, H, Lq, Lk)
    kl = key_lengths.to(torch.int32) if key_lengths is not None else None
    return K.attention_fwd(q, k, v, attn_mask, kl, is_causal, causal_offset, 0.0, q.shape[-1] ** -0.5, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_fully_masked_rows_give_zero_and_no_nan(device):
    B, H, Lq, Lk, D = 2, 2, 20, 35, 16
    q, k, v = _inputs(B, H, H, Lq, Lk, D, device)
    mask = make_bool_mask((B, H, Lq, Lk), device)
    mask[:, :, 3] = False  # row 3: nothing allowed
    fmask = make_float_mask((B, H, Lq, Lk), device)
    fmask[:, :, 5] = float("-inf")  # row 5: every score -inf
    kl = torch.tensor([0, Lk], device=device)  # batch 0: no key at all
    for kw in ({"attn_mask": mask}, {"attn_mask": fmask}, {"key_lengths": kl}, {"is_causal": True, "causal_offset": -4},
               {"attn_mask": fmask, "key_lengths": kl, "is_causal": True}):
        got = _check(q, k, v, kw)
        for name, t in got.items():
            assert torch.isfinite(t).all(), f"{name} has non-finite values for {list(kw)}"
    out, lse = _backend_fwd(q, k, v, attn_mask=mask)
    assert (out[:, :, 3] == 0).all() and torch.isposinf(lse[:, :, 3]).all()
    assert torch.isfinite(lse[:, :, :3]).all()
    out, lse = _backend_fwd(q, k, v, key_lengths=kl)
    assert (out[0] == 0).all() and torch.isposinf(lse[0]).all() and torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_key_length_zero_everywhere(device):
    q, k, v = _inputs(2, 2, 1, 9, 13, 16, device)
    kl = torch.zeros(2, dtype=torch.long, device=device)
    got = _check(q, k, v, {"key_lengths": kl})
    for name, t in got.items():
        assert (t == 0).all(), f"{name}: expected exact zeros when no key may be attended"


@pytest.mark.parametrize("device", DEVICES)
def test_huge_finite_float_mask_values_stay_finite(device):
    """Scores are kept in log2 units, scale * log2(e) * (q . k + mask): a finite mask value
    past float32 max / log2(e), torch.finfo(torch.float32).min for one, must not turn into an
    infinite score (a row of them is not fully masked: the other backends and torch weigh it)."""
    q = torch.tensor([[[[1.0, 0.0]]]], device=device)
    k = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]], device=device)
    v = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]], device=device)
    fmin = torch.finfo(torch.float32).min
    for row in ([3e38, 0.0], [-3e38, -3e38], [fmin, fmin], [fmin, 0.0], [float("-inf"), fmin],
                [float("-inf"), float("-inf")], [float("inf"), 0.0], [float("nan"), 0.0]):
        mask = torch.tensor(row, device=device).view(1, 1, 1, 2)
        with fasttrans.use_backend("triton"):
            got = fasttrans.attention(q, k, v, attn_mask=mask)
        want = reference.attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(got, want, equal_nan=True, msg=lambda m: f"mask row {row}: {m}")
    # and through the backward, a padding mask filled with finfo.min (rows partly masked)
    B, H, Lq, Lk, D = 2, 2, 11, 19, 8
    q, k, v = _inputs(B, H, H, Lq, Lk, D, device)
    mask = torch.zeros(B, 1, 1, Lk, device=device)
    mask[0, ..., 13:] = fmin
    mask[1, ..., :5] = fmin
    _check(q, k, v, {"attn_mask": mask})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("Lq,causal_offset", [(3, 0), (15, -10), (17, -12), (16, -11)])
def test_an_infinite_key_no_query_sees_gets_zero_gradients(Lq, causal_offset, device):
    """The dK/dV kernel loads the query rows past Lq of a partial tile as zeros: 0 * inf in a
    key must not make them NaN and reach dK and dV (the key is hidden: causal alignment)."""
    Lk, D = 8, 4
    q, k, v = (torch.randn(1, 1, L, D, device=device) for L in (Lq, Lk, Lk))
    hidden = Lq + causal_offset  # the first key no query may see
    k[0, 0, hidden, 0] = float("inf")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with fasttrans.use_backend("triton"):
        out = fasttrans.attention(*leaves, is_causal=True, causal_offset=causal_offset)
    dq, dk, dv = torch.autograd.grad(out, leaves, torch.randn_like(out))
    # dq = dS K takes 0 * inf in the hidden key's column, NaN as in the reference; not checked
    assert torch.isfinite(out).all()
    assert (dk[0, 0, hidden:] == 0).all() and (dv[0, 0, hidden:] == 0).all(), (dk[0, 0, hidden:], dv[0, 0, hidden:])
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


@pytest.mark.parametrize("device", DEVICES)
def test_backward_is_deterministic(device):
    B, H, Hkv, Lq, Lk, D = 2, 2, 1, 37, 41, 16
    q, k, v = _inputs(B, H, Hkv, Lq, Lk, D, device)
    kw = dict(attn_mask=make_float_mask((B, H, Lq, Lk), device), key_lengths=torch.tensor([41, 30], device=device),
              is_causal=True, dropout_p=0.2)
    dout = torch.randn(q.shape, device=device)

    def once():
        torch.manual_seed(1)
        return _run(_triton, q, k, v, dout, kw)

    first, second = once(), once()
    for name in first:
        assert torch.equal(first[name], second[name]), f"{name} differs between two identical runs"


# Lengths on a GPU are not read on the host (fasttrans.attention's docstring): the kernels
# clamp them to [0, Lk], so lengths out of range give exactly what the clamped ones give.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_key_lengths_out_of_range_are_clamped(is_causal, device):
    B, H, Hkv, Lq, Lk, D = 3, 2, 1, 9, 21, 16
    q, k, v = _inputs(B, H, Hkv, Lq, Lk, D, device)
    dout = torch.randn(q.shape, device=device)
    wild = torch.tensor([-4, Lk + 7, 2**30], dtype=torch.int32, device=device)
    clamped = wild.clamp(0, Lk)
    runs = []
    for lengths in (wild, clamped):
        out, lse = K.attention_fwd(q, k, v, None, lengths, is_causal, 0, 0.0, D ** -0.5, 0)
        grads = K.attention_bwd(dout, q, k, v, out, lse, None, lengths, is_causal, 0, 0.0, D ** -0.5, 0, False)
        runs.append((out, lse, *grads[:3]))
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], *runs):
        assert torch.equal(a, b), name
    ref = reference.attention(q.double(), k.double(), v.double(), key_lengths=clamped, is_causal=is_causal)
    assert_close_lowp("out", runs[0][0], ref, None, dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("B", [3, 65], ids=["few", "many"])
def test_device_key_lengths_cost_no_host_sync(B):
    q, k, v = (t.half() for t in _inputs(B, 2, 1, 64, 80, 64, "cuda"))
    lengths = torch.randint(0, 81, (B,), device="cuda")
    _triton(q, k, v, key_lengths=lengths)  # compiles and tunes (which synchronises) once
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = _triton(q, k, v, key_lengths=lengths)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = reference.attention(q.float(), k.float(), v.float(), key_lengths=lengths)
    assert_close_lowp("out", out, ref, reference.attention(q, k, v, key_lengths=lengths, upcast=False))


# An inf in v behind a weight below float32's smallest normal (the reference: 5.5e-42 * inf =
# inf). Through the interpreter the kernels give inf (tests/test_bad_inputs_fuzz.py); this
# pins what the compiled kernels do.
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "tl.math.exp2 compiles to ex2.approx.ftz.f32, which flushes subnormal weights (docs/semantics.md)"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inf_in_v_with_a_subnormal_weight_on_cuda(dtype):
    q, k, v, ref = subnormal_weight_with_inf_value(40, 9, dtype, "cuda")
    out = _triton(q, k, v, scale=1.0)
    torch.testing.assert_close(out, ref, equal_nan=True)


def _check_rounded_scores(q, k, v, dout, kw):
    """Triton in fp32 against the fp64 reference by twice the fp32 reference's error: the rule
    for scores float32 rounds coarsely (near 1e4 to 1e-3, near 1e9 to 64), differently in each
    matmul (the low-precision rule of tests/helpers.py)."""
    got = _run(_triton, q, k, v, dout, kw)
    ref = _run(reference.attention, q, k, v, dout, kw, cast=torch.float64)
    base = _run(reference.attention, q, k, v, dout, kw)
    for name in ref:
        assert_close_lowp(name, got[name], ref[name], base[name], dtype=torch.float32)


# Rows whose |lse| passes kernels/attention.py's EXACT_LSE get their max and sum recomputed by
# the backward's dQ kernel, where P = exp(S - lse) would be 1 instead of 1/l.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["none", "key_lengths+causal_br", "causal_neg"])
@pytest.mark.parametrize("fill", [-1e9, torch.finfo(torch.float32).min, -1e4, "logits", pytest.param(
    "logits_inexact", marks=pytest.mark.xfail(strict=False, reason=(
        "undetermined: dK/dV recomputes scores of a few hundred in other tile shapes than the forward, and "
        "whether their rounding keeps dk, dv within the bound depends on the machine's matmul (docs/semantics.md)")))],
    ids=str)
def test_rows_of_huge_scores_get_exact_gradients(fill, kind, device):
    B, H, Hkv, Lq, Lk, D = 2, 2, 1, 37, 41, 16
    q, k, v = _inputs(B, H, Hkv, Lq, Lk, D, device)
    kw = _masks(kind, B, H, Lq, Lk, device)
    mask = make_float_mask((B, H, Lq, Lk), device)
    q, k, kw["attn_mask"] = huge_score_rows(q, k, mask, fill)
    dout = torch.randn(q.shape, device=device)
    _check_rounded_scores(q, k, v, dout, kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_rows_of_huge_scores_with_dropout(dtype, device):
    """The exact statistics under dropout (which scales P after the softmax) and in fp16,
    where P and dO are rounded to the input dtype (the -1e9 mask stays float32, as it may)."""
    B, H, Hkv, Lq, Lk, D, p = 2, 4, 2, 23, 38, 32, 0.3
    q, k, v = _inputs(B, H, Hkv, Lq, Lk, D, device)
    kw = _masks("key_lengths+causal_br", B, H, Lq, Lk, device)
    mask = make_float_mask((B, H, Lq, Lk), device)
    mask[:, :, ::3] = -1e9
    kw["attn_mask"] = mask
    with fasttrans.use_backend("triton"):
        torch.manual_seed(7)
        keep = functional.attention_dropout_mask(q.to(dtype), k.to(dtype), p)
    dout = torch.randn(q.shape, device=device)

    def triton_dropout(q_, k_, v_, **kw_):
        torch.manual_seed(7)  # the same seed draw as the keep-mask above
        return _triton(q_, k_, v_, dropout_p=p, **kw_)

    def ref_dropout(q_, k_, v_, upcast=True, **kw_):
        return reference.attention(q_, k_, v_, dropout_p=p, dropout_mask=keep, upcast=upcast, **kw_)

    got = _run(triton_dropout, q, k, v, dout, kw, cast=dtype, cast_mask=False)
    ref = _run(ref_dropout, q, k, v, dout, kw, cast=torch.float64 if dtype == torch.float32 else torch.float32)
    if dtype == torch.float32:  # the yardstick of test_rows_of_huge_scores_get_exact_gradients
        base = _run(ref_dropout, q, k, v, dout, kw)
    else:
        base = _run(lambda *a, **w: ref_dropout(*a, upcast=False, **w), q, k, v, dout, kw, cast=dtype,
                    cast_mask=False)
    for name in ref:
        assert_close_lowp(name, got[name], ref[name], base[name], dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_of_huge_scores_in_one_block_of_one_head(device):
    """A kv group with rows of huge scores takes every query tile of its dK/dV loop through
    the per-element loop, which scales P by r: here one block of one head has such rows, and
    the group's other rows (r = 1) must come out as without them. dO is strided."""
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 70, 45, 16
    q, k, v = _inputs(B, H, Hkv, Lq, Lk, D, device)
    mask = make_float_mask((B, H, Lq, Lk), device)
    mask[1, 3, 40:44] = -1e9  # batch 1, second head of the second kv group, one block of rows
    kw = {"attn_mask": mask}
    dout = torch.randn(B, Lq, H, D, device=device).transpose(1, 2)
    _check_rounded_scores(q, k, v, dout, kw)


# ---------------------------------------------------------------------------------------
# soft-capped scores (softcap: Gemma 2's logit cap), in every kernel and its score loops
# ---------------------------------------------------------------------------------------
def _capped_inputs(B, H, Hkv, Lq, Lk, D, device):
    """q, k, v whose scaled scores (spread about 3) the cap of 2 bends well away from linear."""
    q, k, v = _inputs(B, H, Hkv, Lq, Lk, D, device)
    return q * 2, k * 1.5, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["none", "causal_br", "bool+key_lengths+causal", "float+key_lengths+causal_neg"])
def test_soft_capped_scores_match_reference(kind, device):
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 33, 45, 24
    q, k, v = _capped_inputs(B, H, Hkv, Lq, Lk, D, device)
    kw = _masks(kind, B, H, Lq, Lk, device)
    got = _check(q, k, v, {**kw, "softcap": 2.0})
    assert (got["out"] - _triton(q, k, v, **kw)).abs().max() > 0.1, "the cap should change the output"


@pytest.mark.parametrize("device", DEVICES)
def test_gemma2s_cap_keeps_fp32_accuracy(device):
    """At Gemma 2's cap of 50, over scores up to about 30, the capped scores' absolute error
    (about 1.2e-7 times the cap, docs/semantics.md) keeps the fp32 rule."""
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 33, 45, 24
    q, k, v = _inputs(B, H, Hkv, Lq, Lk, D, device)
    _check(q * 3, k * 3, v, {**_masks("causal_br", B, H, Lq, Lk, device), "softcap": 50.0})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_soft_capped_scores_in_low_precision(dtype, device):
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 33, 45, 64
    q, k, v = _capped_inputs(B, H, Hkv, Lq, Lk, D, device)
    _check(q, k, v, {**_masks("float+causal_br", B, H, Lq, Lk, device), "softcap": 2.0}, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fill", [-1e4, -1e9])
def test_soft_capped_rows_of_huge_scores(fill, device):
    """The dQ kernel's exact statistics of rows under a mask of -1e4 or -1e9 cap as the
    forward's loop does."""
    B, H, Hkv, Lq, Lk, D = 2, 2, 1, 37, 41, 16
    q, k, v = _capped_inputs(B, H, Hkv, Lq, Lk, D, device)
    kw = {**_masks("key_lengths+causal_br", B, H, Lq, Lk, device), "softcap": 3.0}
    q, k, kw["attn_mask"] = huge_score_rows(q, k, make_float_mask((B, H, Lq, Lk), device), fill)
    dout = torch.randn(q.shape, device=device)
    _check_rounded_scores(q, k, v, dout, kw)


@pytest.mark.parametrize("device", DEVICES)
def test_soft_capped_scores_with_dropout(device):
    B, H, Hkv, Lq, Lk, D, p = 2, 4, 2, 23, 38, 32, 0.3
    q, k, v = _capped_inputs(B, H, Hkv, Lq, Lk, D, device)
    kw = {**_masks("bool+causal_br", B, H, Lq, Lk, device), "softcap": 2.0}
    with fasttrans.use_backend("triton"):
        torch.manual_seed(7)
        keep = functional.attention_dropout_mask(q, k, p)
    dout = torch.randn(q.shape, device=device)

    def triton_dropout(q_, k_, v_, **kw_):
        torch.manual_seed(7)  # the same seed draw as the keep-mask above
        return _triton(q_, k_, v_, dropout_p=p, **kw_)

    got = _run(triton_dropout, q, k, v, dout, kw)
    ref = _run(lambda *a, **w: reference.attention(*a, dropout_p=p, dropout_mask=keep, **w), q, k, v, dout, kw,
               cast=torch.float64)
    for name in ref:
        assert_close_lowp(name, got[name], ref[name], None, dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# dropout
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keep_fraction(p, device):
    # 65536 draws: the drop fraction's standard deviation is at most 0.002, so 0.01 is 5 sigma
    q, k = torch.randn(2, 2, 128, 8, device=device), torch.randn(2, 1, 128, 8, device=device)
    keep = K.attention_dropout_mask(q, k, p, 1234)
    assert keep.dtype == torch.bool and keep.shape == (2, 2, 128, 128)
    assert abs((~keep).float().mean().item() - p) <= 0.01
    # a different position gets a different draw: heads and batches are not copies of each other
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])
    assert torch.equal(keep, K.attention_dropout_mask(q, k, p, 1234))
    assert not torch.equal(keep, K.attention_dropout_mask(q, k, p, 1235))


# Lk = 11: one partial key tile; 150: several tiles and a tail
@pytest.mark.parametrize("Lk", [11, 150])
@pytest.mark.parametrize("device", DEVICES)
def test_dropout_mask_follows_its_definition(device, Lk):
    """The extension's mask (csrc/philox.h, tests.helpers.attention_keep), bit for bit; 37
    rows: whole and partial 16-row blocks."""
    q, k = torch.randn(2, 3, 37, 8, device=device), torch.randn(2, 1, Lk, 8, device=device)
    p, seed = 0.3, (7 << 32) + 12345
    keep = K.attention_dropout_mask(q, k, p, seed).cpu()
    assert torch.equal(keep, attention_keep(seed, p, 2, 3, 37, Lk))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["none", "float+key_lengths+causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_dropout_matches_reference_given_the_mask(kind, dtype, device):
    B, H, Hkv, Lq, Lk, D, p = 2, 4, 2, 23, 38, 32, 0.3
    q, k, v = _inputs(B, H, Hkv, Lq, Lk, D, device)
    kw = _masks(kind, B, H, Lq, Lk, device, float_dtype=dtype)
    with fasttrans.use_backend("triton"):
        torch.manual_seed(7)
        keep = functional.attention_dropout_mask(q.to(dtype), k.to(dtype), p)
    assert 0.2 < (~keep).float().mean().item() < 0.4
    dout = torch.randn(q.shape, device=device)

    def triton_dropout(q_, k_, v_, **kw_):
        torch.manual_seed(7)  # the same seed draw as the keep-mask above
        return _triton(q_, k_, v_, dropout_p=p, **kw_)

    def ref_dropout(q_, k_, v_, **kw_):
        return reference.attention(q_, k_, v_, dropout_p=p, dropout_mask=keep, **kw_)

    def base_dropout(q_, k_, v_, **kw_):
        return reference.attention(q_, k_, v_, dropout_p=p, dropout_mask=keep, upcast=False, **kw_)

    got = _run(triton_dropout, q, k, v, dout, kw, cast=dtype)
    ref = _run(ref_dropout, q, k, v, dout, kw, cast=torch.float64 if dtype == torch.float32 else torch.float32)
    base = _run(base_dropout, q, k, v, dout, kw, cast=dtype) if dtype != torch.float32 else dict.fromkeys(ref)
    for name in ref:
        assert_close_lowp(name, got[name], ref[name], base[name], dtype=dtype)


# ---------------------------------------------------------------------------------------
# torch.library registration: torch.compile and opcheck through the Triton launchers
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_matches_eager(device):
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 19, 23, 16
    q, k, v = _inputs(B, H, Hkv, Lq, Lk, D, device)
    mask = make_float_mask((H, Lq, Lk), device)
    kl = torch.tensor([Lk, 10], device=device)
    dout = torch.randn(q.shape, device=device)

    def f(q_, k_, v_):
        return fasttrans.attention(q_, k_, v_, attn_mask=mask, key_lengths=kl, is_causal=True)

    with fasttrans.use_backend("triton"):
        eager = _run(f, q, k, v, dout, {})
        # on CPU the interpreter cannot run inside Inductor's generated code: trace-only backend
        compiled_f = torch.compile(f, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
        compiled = _run(compiled_f, q, k, v, dout, {})
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_triton_ops(device):
    fwd, bwd, _, _ = backends.ops_for("triton")
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 19, 23, 16
    q, k, v = _inputs(B, H, Hkv, Lq, Lk, D, device)
    mask = make_float_mask((B, H, Lq, Lk), device)
    kl = torch.tensor([Lk, 10], device=device, dtype=torch.int32)
    args = (q, k, v, mask, kl, True, 0, 0.1, D ** -0.5, 123)
    torch.library.opcheck(fwd, tuple(t.clone().requires_grad_() if isinstance(t, torch.Tensor) and
                                     t.is_floating_point() else t for t in args))
    out, lse = fwd(*args)
    torch.library.opcheck(bwd, (torch.randn_like(out), q, k, v, out, lse, mask, kl, True, 0, 0.1, D ** -0.5, 123,
                                True))


# ---------------------------------------------------------------------------------------
# launcher contract
# ---------------------------------------------------------------------------------------
def test_float64_is_refused_with_a_reason():
    q = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="q: .*float64"):
        K.attention_fwd(q, q, q, None, None, False, 0, 0.0, 1.0, 0)


def test_autotuning_keys_bucket_the_sequence_lengths():
    """GPU autotuning runs once per power-of-two bucket of Lq and Lk, never per length."""
    tuners = [launcher.kernel for launcher in (*K._FWD_TUNED.values(), *K._DKDV_TUNED.values(),
                                               *K._DQ_TUNED.values())]
    assert tuners
    for tuner in tuners:
        assert "LQ_BUCKET" in tuner.keys and "LK_BUCKET" in tuner.keys
        assert not {"Lq", "Lk", "B", "H"} & set(tuner.keys), tuner.keys
        assert all(name in tuner.arg_names for name in tuner.keys)
    assert [K._bucket(n) for n in (0, 1, 5, 64, 65, 1000, 1024, 1025, 10**7)] == \
        [1, 1, 8, 64, 128, 1024, 1024, 2048, 1 << 16]


def test_interpreter_tiles_are_small_and_unequal():
    """The CPU tests rely on partial tiles and BLOCK_M != BLOCK_N for the sizes above."""
    fwd, dkdv = K.INTERPRETER_CONFIGS["fwd"].kwargs, K.INTERPRETER_CONFIGS["dkdv"].kwargs
    assert fwd["BLOCK_M"] != fwd["BLOCK_N"] and dkdv["BLOCK_M"] != dkdv["BLOCK_N"]
    assert max(fwd.values()) < 97 and max(dkdv.values()) < 97


def test_host_integer_helpers_match_triton():
    """The launchers' cdiv / next_power_of_2 (plain Python, cheap on the host) are Triton's."""
    import triton

    from fasttrans.kernels import cdiv, next_power_of_2

    for a in range(0, 600):
        for b in (1, 2, 3, 16, 17, 128):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    for n in list(range(0, 5000)) + [2**16 - 1, 2**16, 2**16 + 1, 2**31 - 1, 2**31]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def test_gpu_configurations_cover_every_class():
    """Every (precision, architecture, head-dim class, weight) has a handful of configurations;
    16-bit ones on sm_90 use wgmma, which needs the matmul M dimension (query tile; key tile in
    the transposed dK/dV) >= 64, but for the d256 heavy backward, whose tiles that size spill (dQ;
    dK/dV under Triton 3.8 and 3.9). fp32 tiles may be smaller (mma.sync, checked by compile-check)."""
    from fasttrans.kernels._attention_configs import TRITON_VERSION

    tables = (K.FWD_CONFIGS, K.BWD_DKDV_CONFIGS, K.BWD_DQ_CONFIGS,
              K.FWD_CONFIGS_FP32, K.BWD_DKDV_CONFIGS_FP32, K.BWD_DQ_CONFIGS_FP32)
    for table in tables:
        assert set(table) == {"sm_80", "sm_90"}
        for arch, classes in table.items():
            # light and heavy everywhere; the bool and dropout weights where they have entries of
            # their own (bool: at the head dims whose kernels read a bool mask's bits)
            assert {(d, w) for d in (64, 128, 256) for w in ("light", "heavy")} <= set(classes)
            assert all(w == "dropout" or (w == "bool" and d <= K.LISTS_MAX_HEAD_DIM.value)
                       for d, w in set(classes) - {(d, w) for d in (64, 128, 256) for w in ("light", "heavy")})
            assert all(1 <= len(cfgs) <= 4 for cfgs in classes.values())
    for cfgs in K.FWD_CONFIGS["sm_90"].values():
        assert all(c.kwargs["BLOCK_M"] >= 64 for c in cfgs)
    for cls, cfgs in K.BWD_DQ_CONFIGS["sm_90"].items():  # but d256 heavy, whose 64-row tiles spill
        assert all(c.kwargs["BLOCK_M"] >= 64 for c in cfgs) or cls == (256, "heavy")
    for cls, cfgs in K.BWD_DKDV_CONFIGS["sm_90"].items():  # likewise, but d256 heavy under Triton 3.8 and 3.9
        assert all(c.kwargs["BLOCK_N"] >= 64 for c in cfgs) or (cls == (256, "heavy") and TRITON_VERSION >= (3, 8))
    # the fp32 tables are their own (3xTF32 needs about twice the registers of a 16-bit tile)
    assert K.FWD_CONFIGS_FP32 is not K.FWD_CONFIGS and K.BWD_DQ_CONFIGS_FP32 is not K.BWD_DQ_CONFIGS
    assert K.BWD_DKDV_CONFIGS_FP32 is not K.BWD_DKDV_CONFIGS


def test_fp32_matmul_precision_follows_torch_tf32_flag():
    """fp32 runs 3xTF32 (fp32-level error) unless the user allowed TF32 for fp32 matmuls."""
    assert K.input_precision(torch.float16) == K.input_precision(torch.bfloat16) == "ieee"
    flag = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert K.input_precision(torch.float32) == "tf32x3"
        torch.backends.cuda.matmul.allow_tf32 = True
        assert K.input_precision(torch.float32) == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = flag


_NEW_TF32_API = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch, fasttrans
from fasttrans.kernels import attention as K
q = torch.randn(1, 2, 5, 8)
{setting}
with fasttrans.use_backend("triton"):
    out = fasttrans.attention(q, q, q)  # reads the setting at launch
print(K.input_precision(torch.float32), bool(torch.isfinite(out).all()))
"""


@pytest.mark.parametrize("setting, expected", [
    ("torch.backends.cuda.matmul.fp32_precision = 'tf32'", "tf32"),
    ("torch.backends.fp32_precision = 'tf32'", "tf32"),
    ("torch.backends.fp32_precision = 'tf32'; torch.backends.cuda.matmul.fp32_precision = 'ieee'", "tf32x3"),
    ("torch.set_float32_matmul_precision('high')", "tf32"),
    ("", "tf32x3"),
])
def test_fp32_precision_follows_torch_new_tf32_api(setting, expected):
    """torch's newer fp32_precision settings are honoured, and setting them does not break fp32
    attention: after them, reading the legacy allow_tf32 flag raises in torch >= 2.9. Each case
    runs in its own process, since these settings are process-wide and cannot all be undone."""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("this torch has no fp32_precision setting")
    code = _NEW_TF32_API.format(setting=setting)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-2:] == [expected, "True"]


def test_fp32_compile_targets_cover_every_fp32_configuration():
    """compile-check builds every fp32 entry in the precision its class runs (3xTF32, or IEEE
    for FP32_IEEE_CLASSES) and one single-TF32 build per kernel and arch; and with capped
    scores every entry a capped launch takes (the non-light ones, or CAPPED's)."""
    stages = {"attention_fwd": ("fwd", K.FWD_CONFIGS_FP32), "attention_bwd_dq": ("dq", K.BWD_DQ_CONFIGS_FP32),
              "attention_bwd_dkdv": ("dkdv", K.BWD_DKDV_CONFIGS_FP32)}
    every = K.compile_targets()
    targets = [t for t in every if "-fp32" in t["config"] and t["kernel"] in stages]
    for kernel, (stage, table) in stages.items():
        for arch in ("sm_80", "sm_90"):
            for capped in (False, True):
                built = [t for t in targets if t["kernel"] == kernel and t["archs"] == [arch]
                         and t["config"].endswith("-softcap") == capped]
                assert all(t["constexprs"]["SOFTCAP"] == (50.0 if capped else 0.0) for t in built)
                expected = []
                for (d, w), cfgs in table[arch].items():
                    if capped and w == "light":
                        continue
                    cfgs = K.CAPPED.get((stage, "fp32", arch, (d, w)), cfgs) if capped else cfgs
                    ieee = (d, w) in K.FP32_IEEE_CLASSES[stage][arch]
                    outputs = K.dkdv_outputs(d) if stage == "dkdv" else (None,)
                    expected += [(d, w, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], "ieee" if ieee else "tf32x3")
                                 for c in cfgs for _ in outputs]
                got = [(t["constexprs"]["HEAD_DIM"], t["config"].split("-")[1], t["constexprs"]["BLOCK_M"],
                        t["constexprs"]["BLOCK_N"], t["constexprs"]["INPUT_PRECISION"]) for t in built]
                tf32 = [g for g in got if g[4] == "tf32"]
                assert sorted(g for g in got if g[4] != "tf32") == sorted(expected), (kernel, arch, capped)
                assert len(tf32) == (0 if capped else 1)
                assert all((g[0], g[1]) not in K.FP32_IEEE_CLASSES[stage][arch] for g in tf32)
    for t in targets:
        assert t["signature"]["Q"] == "*fp32"
        assert t["matmul"] == (t["constexprs"]["INPUT_PRECISION"] != "ieee"), t["config"]
        if t["matmul"]:  # tiles below wgmma's 64 rows are allowed mma.sync on sm_90, and only those
            rows = t["constexprs"]["BLOCK_N" if t["kernel"] == "attention_bwd_dkdv" else "BLOCK_M"]
            assert t.get("wgmma", True) == (rows >= 64), t["config"]


def _round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the nearest TF32 value (10 explicit mantissa bits; ties away from zero, as cvt.rna)."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def _emulated_3xtf32_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """big*big + big*small + small*big, each product exact, summed in fp64 and rounded to fp32."""
    a_big, b_big = _round_to_tf32(a), _round_to_tf32(b)
    a_small, b_small = _round_to_tf32(a - a_big), _round_to_tf32(b - b_big)
    return (a_small.double() @ b_big.double() + a_big.double() @ b_small.double()
            + a_big.double() @ b_big.double()).float()


@pytest.mark.parametrize("D", [24, 64, 128, 256])
def test_3xtf32_attention_error_is_within_the_fp32_tolerance(D):
    """The premise of running fp32 as 3xTF32: attention computed with every matmul in emulated
    3xTF32 (the backward's formulas of the kernels) stays within the fp32 bound the GPU tests
    apply against the fp64 reference, and a single TF32 product does not."""
    torch.manual_seed(D)
    B, H, Lq, Lk = 1, 2, 96, 130
    q, k, v, do = (torch.randn(B, H, L, D) for L in (Lq, Lk, Lk, Lq))
    mask = torch.where(torch.rand(B, 1, Lq, Lk) < 0.2, float("-inf"), torch.randn(B, 1, Lq, Lk))
    mask[..., 0] = 0.0
    scale = D ** -0.5

    def attention(mm, q, k, v, do, mask):
        p = torch.softmax(mm(q, k.transpose(-1, -2)) * scale + mask, -1)
        out = mm(p, v)
        ds = p * (mm(do, v.transpose(-1, -2)) - (do * out).sum(-1, keepdim=True))
        return dict(out=out, dq=mm(ds, k) * scale, dk=mm(ds.transpose(-1, -2), q) * scale,
                    dv=mm(p.transpose(-1, -2), do))

    ref = attention(torch.matmul, *(t.double() for t in (q, k, v, do, mask)))
    x3 = attention(_emulated_3xtf32_matmul, q, k, v, do, mask)
    tf32 = attention(lambda a, b: (_round_to_tf32(a).double() @ _round_to_tf32(b).double()).float(),
                     q, k, v, do, mask)
    for name in ref:
        bound = FLOOR[torch.float32] * max(1.0, ref[name].abs().max().item())
        assert (x3[name].double() - ref[name]).abs().max().item() <= bound / 10, name
        assert (tf32[name].double() - ref[name]).abs().max().item() > bound, name


class _RecordingTuner(dict):
    """Stands in for an autotuned-kernel table: records the key and constexprs of each launch
    (a launch passes a kernels._launch.Spec)."""

    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def __missing__(self, key):
        return _RecordingLauncher(self.calls, key)


class _RecordingLauncher:
    """Stands in for a kernels._launch.Launcher: a launch, or the first of a bound site."""

    def __init__(self, calls, key):
        self.calls, self.key = calls, key

    def __call__(self, grid, args, spec, device_index=None, **options):
        self.calls.append((self.key, spec.constexprs))

    def bind(self, grid, args, spec, device_index=None):
        self(grid, args, spec, device_index)
        return lambda args: None


def _record_gpu_launches(monkeypatch, arch: str):
    """Run the GPU launch path here, for ``arch``, with the autotuned kernels replaced by
    recorders: ([(key, constexprs) of each launch], the real autotuner tables by stage)."""
    calls = []
    real = {"fwd": K._FWD_TUNED, "dkdv": K._DKDV_TUNED, "dq": K._DQ_TUNED}
    monkeypatch.setattr(K, "_interpreting", lambda: False)
    monkeypatch.setattr(K, "_gpu_arch", lambda device: arch)
    for name in ("_FWD_TUNED", "_DKDV_TUNED", "_DQ_TUNED"):
        monkeypatch.setattr(K, name, _RecordingTuner(calls))
    # every call its site's first, so that it looks its launcher up (the arch is not keyed)
    monkeypatch.setattr(K, "_FWD_SITES", {})
    monkeypatch.setattr(K, "_BWD_SITES", {})
    return calls, real


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_gpu_launches_pick_the_table_and_precision_of_their_class(arch, monkeypatch):
    """The GPU launch path (run here with the kernels replaced by a recorder): each launch looks
    up (precision class, arch, head-dim class, weight), and fp32 classes in FP32_IEEE_CLASSES
    launch with IEEE dots, the others with the flag's precision."""
    calls, real = _record_gpu_launches(monkeypatch, arch)
    bool_mask = {"attn_mask": (torch.rand(1, 1, 8, 8) > 0.3).expand(1, 2, 8, 8)}  # as the op layer passes it
    cases = [(torch.float32, 64, {}), (torch.float32, 256, {}), (torch.float32, 128, {"dropout_p": 0.1}),
             (torch.float16, 256, {}), (torch.bfloat16, 128, {"dropout_p": 0.1}),
             (torch.float16, 64, bool_mask), (torch.bfloat16, 128, bool_mask), (torch.float32, 64, bool_mask),
             (torch.float16, 64, dict(bool_mask, dropout_p=0.1)), (torch.float16, 64, {"dropout_p": 0.1})]
    # a bool mask (with dropout or not), or dropout alone, takes the bool or dropout entries of
    # sm_90's 16-bit tables, the heavy ones elsewhere
    own_entries = {"bool": {(64, "dq"), (128, "dkdv"), (128, "dq")},
                   "dropout": {(64, "fwd"), (128, "fwd"), (64, "dq"), (128, "dq"), (64, "dkdv"), (128, "dkdv")}} \
        if arch == "sm_90" else {}
    for dtype, D, extra in cases:
        q, k, v = (torch.randn(1, 2, 8, D, dtype=dtype) for _ in range(3))
        args = dict(attn_mask=extra.get("attn_mask"), key_lengths=None, is_causal=False, causal_offset=0,
                    dropout_p=extra.get("dropout_p", 0.0), scale=0.1, seed=0)
        calls.clear()
        K.attention_fwd(q, k, v, *args.values())
        out, lse = torch.zeros_like(q), torch.zeros(1, 2, 8)
        K.attention_bwd(torch.ones_like(q), q, k, v, out, lse, *args.values(), False)
        stages = ["fwd", "dq"] + ["dkdv"] * len(K.dkdv_outputs(D))  # dK/dV reads what dQ writes
        assert len(calls) == len(stages)
        for stage, (key, constexprs) in zip(stages, calls):
            precision = "fp32" if dtype == torch.float32 else "16-bit"
            weight = "heavy" if extra else "light"
            alone = {frozenset({"attn_mask"}): "bool", frozenset({"attn_mask", "dropout_p"}): "bool",
                     frozenset({"dropout_p"}): "dropout"}.get(frozenset(extra))
            if alone and precision == "16-bit" and (D, stage) in own_entries.get(alone, ()):
                weight = alone
            assert key == (precision, arch, D, weight), stage
            expected = K.input_precision(dtype)
            if dtype == torch.float32 and (D, weight) in K.FP32_IEEE_CLASSES[stage][arch]:
                expected = "ieee"
            assert constexprs["INPUT_PRECISION"] == expected, (stage, dtype, D)
            assert key in real[stage]  # an autotuner exists for it


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_loads_by_pointers_take_their_own_entries(tma, monkeypatch):
    """sm_90's 16-bit light entries are tiles for TMA's loops; a launch that loads by pointers
    (FASTTRANS_TMA=0 here, or a layout TMA cannot take) takes its class's BY_POINTERS entries
    where it has some, whose tiles do not spill that way (compile-check)."""
    from fasttrans.kernels import _attention_configs as C

    monkeypatch.setattr(K, "TMA_ENABLED", tma)
    calls, real = _record_gpu_launches(monkeypatch, "sm_90")
    seen = set()
    for D in (64, 128):
        q, k, v = (torch.randn(1, 2, 8, D, dtype=torch.float16) for _ in range(3))
        args = (None, None, True, 0, 0.0, 0.1, 0)
        calls.clear()
        K.attention_fwd(q, k, v, *args)
        K.attention_bwd(torch.ones_like(q), q, k, v, torch.zeros_like(q), torch.zeros(1, 2, 8), *args, False)
        for stage, (key, constexprs) in zip(["fwd", "dq", "dkdv"], calls):
            assert constexprs["TMA"] == tma, (stage, D)
            by_pointers = not tma and (D, "light") in C.BY_POINTERS.get(stage, {})
            assert key == ("16-bit", "sm_90", D, "light") + (("pointers",) if by_pointers else ()), (stage, D)
            assert key in real[stage]
            seen.add(key[-1])
    if C.BY_POINTERS and not tma:
        assert "pointers" in seen
    for stage, classes in C.BY_POINTERS.items():  # classes of the tables that take the TMA route
        table = {"fwd": C.FWD_CONFIGS, "dkdv": C.BWD_DKDV_CONFIGS, "dq": C.BWD_DQ_CONFIGS}[stage]["sm_90"]
        for cls, entries in classes.items():
            assert cls in table and cls[1] == "light" and entries and entries != table[cls], (stage, cls)


def test_dq_tiles_hold_whole_blocks_of_flags():
    """The dQ kernel writes one flag of rows of huge scores per EXACT_ROWS rows, which the
    dK/dV kernel reads whatever the dQ tile: every dQ entry (GPU tables, the ones before Triton
    3.9 and by pointers, the interpreter's) holds whole blocks of them."""
    from fasttrans.kernels import _attention_configs as C

    rows = K.EXACT_ROWS.value
    entries = [c for tables in (K.BWD_DQ_CONFIGS, K.BWD_DQ_CONFIGS_FP32) for table in tables.values()
               for cfgs in table.values() for c in cfgs]
    entries += [c for older in (C.BEFORE_TRITON_3_9, C.TRITON_3_7, C.TRITON_3_8) for (name, _, _), cfgs in older.items()
                if name.startswith("BWD_DQ") for c in cfgs]
    entries += [c for cfgs in C.BY_POINTERS.get("dq", {}).values() for c in cfgs]
    entries.append(K.INTERPRETER_CONFIGS["dq"])
    assert all(c.kwargs["BLOCK_M"] % rows == 0 for c in entries)


def test_tables_before_triton_3_9_replace_classes_that_exist(monkeypatch):
    """Below Triton 3.9 the classes of BEFORE_TRITON_3_9 take its entries (compile-checked with
    3.6, whose ptxas spills in the 3.9 entries), and under 3.7 and 3.8 those of TRITON_3_7 and
    TRITON_3_8 on top (compile-checked with each): each names a class of a table, and
    the dQ tile rule holds for its dQ entries; with 3.9 the tables are unchanged. As the module
    reads them under each version, whichever Triton is installed."""
    import importlib.util

    import triton

    from fasttrans.kernels import _attention_configs

    def as_on(version: str):
        monkeypatch.setattr(triton, "__version__", version)
        spec = importlib.util.spec_from_file_location(f"fasttrans.kernels._configs_as_on_{version}",
                                                      _attention_configs.__file__)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    old, C = as_on("3.6.0"), as_on("3.9.0")
    assert old.TRITON_VERSION == (3, 6) and C.TRITON_VERSION == (3, 9)
    for (table, arch, cls), entries in C.BEFORE_TRITON_3_9.items():
        assert cls in getattr(C, table)[arch], (table, arch, cls)
        assert entries and all(isinstance(e, triton.Config) for e in entries)
        assert getattr(old, table)[arch][cls] == entries
        assert getattr(C, table)[arch][cls] != entries, (table, arch, cls)  # 3.9 keeps its own
        if arch == "sm_90" and not table.endswith("FP32"):  # wgmma's M dimension, as in the 3.9 tables
            rows = "BLOCK_N" if table == "BWD_DKDV_CONFIGS" else "BLOCK_M"
            if all(e.kwargs[rows] >= 64 for e in getattr(C, table)[arch][cls]):
                assert all(e.kwargs[rows] >= 64 for e in entries), (table, cls)
    tables = ("FWD_CONFIGS", "FWD_CONFIGS_FP32", "BWD_DKDV_CONFIGS", "BWD_DKDV_CONFIGS_FP32", "BWD_DQ_CONFIGS",
              "BWD_DQ_CONFIGS_FP32")

    def changed(a, b):
        return {(t, arch, c) for t in tables for arch, classes in getattr(a, t).items() for c in classes
                if getattr(a, t)[arch][c] != getattr(b, t)[arch][c]}

    assert changed(C, old) == set(C.BEFORE_TRITON_3_9)
    assert old.BY_POINTERS == {} and C.BY_POINTERS
    # 3.7 and 3.8: 3.6's tables with the classes of their own replaced; 3.7 has a pointer route
    # of its own for the d128 light forward
    for version, own in (("3.7.1", C.TRITON_3_7), ("3.8.0", C.TRITON_3_8)):
        newer = as_on(version)
        assert changed(newer, old) == set(own), version
        for (table, arch, cls), entries in own.items():
            assert entries and all(isinstance(e, triton.Config) for e in entries)
            assert getattr(newer, table)[arch][cls] == entries
    assert set(as_on("3.7.1").BY_POINTERS) == {"fwd"} and set(as_on("3.7.1").BY_POINTERS["fwd"]) == {(128, "light")}
    assert as_on("3.8.0").BY_POINTERS == {}


def test_fp32_ieee_classes_are_the_large_head_dims():
    """IEEE fp32 is the exception: only classes at head dim 128 (masked) and 256."""
    for stage, archs in K.FP32_IEEE_CLASSES.items():
        assert set(archs) == {"sm_80", "sm_90"}
        for classes in archs.values():
            assert {(256, "light"), (256, "heavy")} <= classes
            assert all(d >= 128 for d, _ in classes) and (128, "light") not in classes


# ---------------------------------------------------------------------------------------
# CUDA only (pytest -m gpu): larger shapes, torch.compile, int64 offsets
# ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("kind", ["none", "causal", "bool+key_lengths", "float+causal_br"])
@pytest.mark.parametrize("dtype", (torch.float32, *LOW), ids=str)
@pytest.mark.parametrize("D", [64, 128, 256])
def test_gpu_large(D, dtype, kind):
    """Every head-dim class and weight of the GPU tables; fp32 (3xTF32) against the fp64 reference."""
    B, H, Hkv, Lq, Lk = 2, 8, 2, 1000, 1537
    q, k, v = _inputs(B, H, Hkv, Lq, Lk, D, "cuda")
    _check(q, k, v, _masks(kind, B, H, Lq, Lk, "cuda", float_dtype=dtype), dtype=dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("D", [64, 256])
def test_gpu_fp32_with_allow_tf32_has_tf32_error(D):
    """With torch.backends.cuda.matmul.allow_tf32 set, fp32 matmuls are single TF32: errors
    within a few TF32 roundings (unit 2^-11) of the fp64 reference, every gradient too."""
    B, H, Hkv, Lq, Lk = 2, 4, 2, 300, 517
    q, k, v = _inputs(B, H, Hkv, Lq, Lk, D, "cuda")
    kw = _masks("float+causal_br", B, H, Lq, Lk, "cuda")
    dout = torch.randn(q.shape, device="cuda")
    flag = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        got = _run(_triton, q, k, v, dout, kw, cast=torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = flag
    ref = _run(reference.attention, q, k, v, dout, kw, cast=torch.float64)
    for name in ref:
        bound = 8 * 2.0**-11 * max(1.0, ref[name].abs().max().item())
        err = (got[name].double() - ref[name].double()).abs().max().item()
        assert err <= bound, f"{name}: max error {err:.2e} > {bound:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpu_more_than_2_31_elements():
    """Batch/head offsets past 2^31 elements: the last batch entry must match its own small run."""
    B, H, L, D = 2, 64, 2**18 + 17, 64  # 2 * 64 * 262161 * 64 > 2^31 elements
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.float16)
    k, v = torch.randn_like(q[:, :, :64]), torch.randn_like(q[:, :, :64])
    out = _triton(q, k, v)
    last = _triton(q[-1:, -1:, -100:].contiguous(), k[-1:, -1:], v[-1:, -1:])
    torch.testing.assert_close(out[-1:, -1:, -100:], last, atol=FLOOR[torch.float16], rtol=0)

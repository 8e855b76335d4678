"""The C++ extension's attention (csrc/attention_cpu.cpp) against fasttrans.reference.

Forward output and every gradient (q, k, v and a float mask) are compared with the
reference's autograd gradients, over every mask kind and combination, grouped-query heads,
awkward sizes, fully masked rows, dropout (through the keep-mask hook), both backward
schedules and fp64 gradcheck. Low precision follows the 2x rule of tests/helpers.py.
The CUDA kernels run the same checks under ``pytest -m gpu``.
"""

import os
import time

import pytest
import torch

import fasttrans
from fasttrans import backends, reference
from fasttrans import functional as ftf

from helpers import (assert_close_lowp, attention_keep, cast_floating, huge_score_rows, make_bool_mask, make_float_mask,
                     philox4x32_10, require_extension, run_python, subnormal_weight_with_inf_value)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def schedule(request, monkeypatch):
    """The CPU backward schedule (fused / split), read by the kernel at every call."""
    monkeypatch.setenv("FASTTRANS_CPU_ATTENTION_BWD", request.param)
    return request.param


# ---------------------------------------------------------------------------------------
# the comparison: forward and every gradient against the reference's autograd
# ---------------------------------------------------------------------------------------
def _masks(kind, B, H, Lq, Lk, device, dtype, zero_length=False):
    """Keyword arguments for one mask kind of the op contract ("+" combines kinds)."""
    kw = {}
    for part in kind.split("+"):
        if part == "none":
            continue
        if part == "bool":
            m = make_bool_mask((B, 1, Lq, Lk), device)
            m[0, 0, 0] = False  # a fully masked row
            kw["attn_mask"] = m
        elif part == "float":
            kw["attn_mask"] = make_float_mask((B, H, Lq, Lk), device, dtype=dtype)
        elif part == "float_bcast":
            kw["attn_mask"] = make_float_mask((Lq, Lk), device, dtype=dtype)  # strides 0 on B and H
        elif part == "key_lengths":
            kl = torch.randint(1, Lk + 1, (B,), device=device)
            kl[0] = Lk
            if zero_length and B > 1:
                kl[1] = 0
            kw["key_lengths"] = kl
        elif part == "causal":
            kw["is_causal"] = True
        elif part == "causal_bottom_right":
            kw["is_causal"] = True
            kw["causal_offset"] = Lk - Lq
        elif part == "causal_negative":  # rows i < 3 see no key at all
            kw["is_causal"] = True
            kw["causal_offset"] = -3
        else:
            raise ValueError(part)
    return kw


def _run(fn, q, k, v, dout, kw):
    """out and the gradients of (q, k, v[, float mask]) for out.backward(dout)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    kw = dict(kw)
    mask = kw.get("attn_mask")
    if mask is not None and mask.dtype != torch.bool:
        kw["attn_mask"] = mask.detach().clone().requires_grad_()
        leaves.append(kw["attn_mask"])
    out = fn(*leaves[:3], **kw)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def _extension(q, k, v, **kw):
    with fasttrans.use_backend("extension"):
        return fasttrans.attention(q, k, v, **kw)


def _check_against_reference(q, k, v, kw, names=("out", "dq", "dk", "dv", "dmask")):
    dtype = q.dtype
    dout = torch.randn_like(q)
    got = _run(_extension, q, k, v, dout, kw)
    if dtype in (torch.float32, torch.float64):
        ref = _run(reference.attention, q, k, v, dout, kw)
        base = [None] * len(ref)
    else:
        ref = _run(reference.attention, q.float(), k.float(), v.float(), dout.float(), cast_floating(kw, torch.float32))
        base = _run(lambda *a, **w: reference.attention(*a, upcast=False, **w), q, k, v, dout, kw)
    assert len(got) == len(ref)
    for name, g, r, b in zip(names, got, ref, base):
        assert g.dtype == (kw["attn_mask"].dtype if name == "dmask" else dtype), name
        assert_close_lowp(name, g, r, b, dtype=dtype)
    return got


def _qkv(B, H, Hkv, Lq, Lk, D, dtype, device="cpu"):
    return (torch.randn(B, H, Lq, D, dtype=dtype, device=device), torch.randn(B, Hkv, Lk, D, dtype=dtype, device=device),
            torch.randn(B, Hkv, Lk, D, dtype=dtype, device=device))


MASK_KINDS = [
    "none", "bool", "float", "float_bcast", "key_lengths", "causal", "causal_bottom_right", "causal_negative",
    "key_lengths+causal", "bool+key_lengths+causal_bottom_right", "float+key_lengths+causal_negative",
]
# (B, H, Hkv, Lq, Lk, D): length 1, primes near block edges (the CPU tiles are 64 x 128 / 64 x 64,
# and a sequence of up to 96 is one tile: 96 x 91 is the largest single tile), grouped-query
# heads, head dims from 8 to 256. The CPU forward takes the scores of a single block of up to
# 4 query rows as dot products, of a single larger block through per-tile transposes of K, and
# of several blocks from a transposed copy of K: a few decoding-sized queries against several
# key tiles, and 130 = 64 + 64 + 2 rows (a last block of two rows next to full ones). The dot
# products run over sixteen keys at a time and the head dim in chunks of sixteen: key counts
# and head dims that leave partial groups (D = 200 = 12 x 16 + 8).
SHAPES = [
    (1, 1, 1, 1, 1, 8),
    (2, 4, 2, 1, 300, 64),
    (2, 2, 1, 4, 129, 40),
    (1, 2, 1, 130, 40, 16),
    (2, 4, 2, 17, 97, 40),
    (2, 2, 1, 97, 17, 64),
    (1, 3, 3, 65, 130, 24),
    (2, 2, 2, 33, 70, 128),
    (1, 2, 1, 96, 91, 32),
    (1, 2, 1, 2, 37, 200),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("device", DEVICES)
def test_matches_reference_fp32(ext, device, kind, shape):
    require_extension(device, "attention")
    B, H, Hkv, Lq, Lk, D = shape
    q, k, v = _qkv(*shape, torch.float32, device)
    _check_against_reference(q, k, v, _masks(kind, B, H, Lq, Lk, device, torch.float32, zero_length=True))


LOWP_CASES = [
    ("none", (2, 4, 2, 97, 70, 64)),
    ("bool+key_lengths+causal_bottom_right", (2, 4, 2, 3, 150, 64)),
    ("float", (2, 2, 1, 33, 97, 40)),
    ("bool+key_lengths+causal_bottom_right", (2, 4, 2, 70, 97, 64)),
    ("float_bcast+key_lengths+causal", (1, 2, 2, 97, 33, 128)),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind,shape", LOWP_CASES, ids=[c[0] for c in LOWP_CASES])
@pytest.mark.parametrize("device", DEVICES)
def test_matches_reference_low_precision(ext, device, kind, shape, dtype):
    require_extension(device, "attention")
    B, H, Hkv, Lq, Lk, D = shape
    q, k, v = _qkv(*shape, dtype, device)
    _check_against_reference(q, k, v, _masks(kind, B, H, Lq, Lk, device, dtype, zero_length=True))


@pytest.mark.parametrize("D", [8, 40, 64, 128, 256])
@pytest.mark.parametrize("device", DEVICES)
def test_head_dims(ext, device, D):
    require_extension(device, "attention")
    q, k, v = _qkv(2, 2, 1, 19, 67, D, torch.float32, device)
    _check_against_reference(q, k, v, _masks("float+key_lengths+causal_bottom_right", 2, 2, 19, 67, device,
                                               torch.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_fp64_matches_reference(ext, device):
    require_extension(device, "attention")
    if device == "cuda":  # float64 runs on the CPU kernels only (docs/design.md): a named error
        q, k, v = _qkv(1, 2, 1, 3, 5, 8, torch.float64, device)
        with fasttrans.use_backend("extension"), pytest.raises(
                RuntimeError, match=r"^q: the CUDA kernels support float32, float16 and bfloat16, got Double"):
            fasttrans.attention(q, k, v)
        return
    q, k, v = _qkv(2, 4, 2, 23, 41, 16, torch.float64)
    _check_against_reference(q, k, v, _masks("float+key_lengths+causal", 2, 4, 23, 41, "cpu", torch.float64))


# ---------------------------------------------------------------------------------------
# masks: strides, fully masked rows, empty keys
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs_and_masks(ext, device):
    """q/k/v as (B, L, H, D) transposes and a mask stored key-major are read in place."""
    require_extension(device, "attention")
    B, H, Lq, Lk, D = 2, 3, 29, 45, 32
    q = torch.randn(B, Lq, H, D, device=device).transpose(1, 2)
    k = torch.randn(B, Lk, H, D, device=device).transpose(1, 2)
    v = torch.randn(B, Lk, H, D, device=device).transpose(1, 2)
    mask = make_float_mask((B, H, Lk, Lq), device).transpose(-1, -2)  # stride(-1) = Lq
    assert not q.is_contiguous() and mask.stride(-1) == Lq
    _check_against_reference(q, k, v, dict(attn_mask=mask, is_causal=True, causal_offset=Lk - Lq))


@pytest.mark.parametrize("device", DEVICES)
def test_fully_masked_rows_are_zero_with_zero_gradients(ext, device):
    require_extension(device, "attention")
    B, H, Lq, Lk, D = 3, 2, 70, 90, 16
    q, k, v = _qkv(B, H, H, Lq, Lk, D, torch.float32, device)
    mask = make_bool_mask((B, H, Lq, Lk), device)
    mask[..., 0] = True  # every row that may see a key sees key 0 ...
    mask[:, :, 5] = False  # ... except row 5, which sees none
    kl = torch.tensor([Lk, 0, 50], device=device)  # batch 1: no key at all
    kw = dict(attn_mask=mask, key_lengths=kl, is_causal=True, causal_offset=-10)  # rows < 10 see nothing
    out, dq, dk, dv = _check_against_reference(q, k, v, kw)
    empty = torch.zeros(B, H, Lq, dtype=torch.bool, device=device)
    empty[:, :, :10] = True
    empty[:, :, 5] = True
    empty[1] = True
    assert out[empty].abs().max() == 0 and dq[empty].abs().max() == 0
    assert dk[1].abs().max() == 0 and dv[1].abs().max() == 0
    assert dk[2, :, 50:].abs().max() == 0 and dv[2, :, 50:].abs().max() == 0  # keys past key_lengths
    _, lse = ext[0](q, k, v, mask, kl.int(), True, -10, 0.0, D ** -0.5, 0)
    assert torch.isinf(lse[empty]).all() and (lse[empty] > 0).all()
    assert torch.isfinite(lse[~empty]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_zero_key_length_everywhere(ext, device):
    require_extension(device, "attention")
    q, k, v = _qkv(2, 2, 2, 5, 9, 8, torch.float32, device)
    _check_against_reference(q, k, v, dict(key_lengths=torch.zeros(2, dtype=torch.long, device=device)))


@pytest.mark.parametrize("device", DEVICES)
def test_decoding_step(ext, device):
    """One query against a long cache: bottom-right causal alignment, ragged lengths."""
    require_extension(device, "attention")
    q, k, v = _qkv(3, 4, 2, 1, 200, 64, torch.float32, device)
    _check_against_reference(q, k, v, dict(is_causal=True, causal_offset=199,
                                           key_lengths=torch.tensor([200, 77, 1], device=device)))


# ---------------------------------------------------------------------------------------
# the backward's own inputs: no query rows, the shape of lse
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("q_shape", [(2, 3, 0, 8), (2, 0, 4, 8)], ids=["Lq0", "H0"])
@pytest.mark.parametrize("device", DEVICES)
def test_backward_without_query_rows_gives_zero_key_gradients(ext, device, q_shape):
    require_extension(device, "attention")
    fwd, bwd = ext[0], ext[1]
    q = torch.randn(q_shape, device=device)
    k, v = torch.randn(2, 1, 5, 8, device=device), torch.randn(2, 1, 5, 8, device=device)
    junk = [torch.full((80,), float("nan"), device=device) for _ in range(8)]
    del junk  # on CUDA the allocator hands these NaN blocks out again: dK, dV must be written
    out, lse = fwd(q, k, v, None, None, False, 0, 0.0, 0.35, 0)
    dq, dk, dv, _ = bwd(torch.randn_like(out), q, k, v, out, lse, None, None, False, 0, 0.0, 0.35, 0, False)
    assert dq.shape == q.shape
    assert torch.equal(dk, torch.zeros_like(k)) and torch.equal(dv, torch.zeros_like(v))


@pytest.mark.parametrize("device", DEVICES)
def test_backward_checks_the_shape_of_lse(ext, device):
    require_extension(device, "attention")
    fwd, bwd = ext[0], ext[1]
    q, k, v = _qkv(2, 2, 1, 5, 7, 8, torch.float32, device)
    out, lse = fwd(q, k, v, None, None, False, 0, 0.0, 0.35, 0)
    for bad in (lse[:, :, :4], lse[0], lse.reshape(2, 10)):
        with pytest.raises(RuntimeError, match=r"lse: expected shape \(B, H, Lq\)"):
            bwd(torch.randn_like(out), q, k, v, out, bad, None, None, False, 0, 0.0, 0.35, 0, False)


# ---------------------------------------------------------------------------------------
# the backward: both schedules, deterministic
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["fused", "split"], indirect=True)
@pytest.mark.parametrize("kind", ["none", "float+key_lengths+causal_bottom_right", "bool+causal_negative"])
def test_backward_schedules_match_reference(ext, schedule, kind):
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 150, 140, 32
    q, k, v = _qkv(B, H, Hkv, Lq, Lk, D, torch.float32)
    _check_against_reference(q, k, v, _masks(kind, B, H, Lq, Lk, "cpu", torch.float32, zero_length=True))


# ---------------------------------------------------------------------------------------
# dense bool masks by tiles: blocks hiding every key are skipped, blocks allowing every key
# are computed as unmasked (csrc/attention_cpu.cpp, classify_mask_tile)
# ---------------------------------------------------------------------------------------
def _tile_blocks(D, dtype=torch.float32):
    """(rows, keys) of a block that is a whole number of the kernels' forward and backward tiles."""
    from fasttrans.extension import cpu_attention_tiles

    fasttrans.attention(*_qkv(1, 1, 1, 2, 2, D, dtype))  # loads the extension
    t = cpu_attention_tiles(D, dtype)
    return max(t["forward"][0], t["backward"][0]), max(t["forward"][1], t["backward"][1])


def _block_mask(B, H, Lq, Lk, rows, keys, seed):
    """A bool (B, H, Lq, Lk) mask whose blocks of rows x keys are each hidden, allowed or
    random: every kind in every row of blocks, so that tiles of each kind meet in one row."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, H, Lq, Lk, generator=g) < 0.5
    n_r, n_k = -(-Lq // rows), -(-Lk // keys)
    for b in range(B):
        for h in range(H):
            for i in range(n_r):
                kinds = torch.randint(0, 3, (n_k,), generator=g)
                kinds[i % n_k], kinds[(i + 1) % n_k] = 0, 1  # a hidden and an allowed block per row
                for j in range(n_k):
                    if kinds[j] < 2:
                        mask[b, h, i * rows:(i + 1) * rows, j * keys:(j + 1) * keys] = bool(kinds[j])
    return mask


@pytest.mark.parametrize("schedule", ["fused", "split"], indirect=True)
@pytest.mark.parametrize("kind", ["bool", "bool_per_head", "bool+causal_bottom_right", "bool+key_lengths", "bool_q1",
                                  "bool_keys", "bool_rows"])
def test_bool_masks_with_hidden_allowed_and_mixed_tiles_match_reference(ext, schedule, kind):
    B, H, Hkv, D = 2, 4, 2, 32
    rows, keys = _tile_blocks(D)
    Lq, Lk = (1, 3 * keys) if kind == "bool_q1" else (3 * rows - 5, 3 * keys + 7)
    q, k, v = _qkv(B, H, Hkv, Lq, Lk, D, torch.float32)
    mask = _block_mask(B, H if kind == "bool_per_head" else 1, Lq, Lk, rows, keys, seed=3)
    if kind == "bool_keys":  # (B, 1, 1, Lk), a padding mask's shape: one row for every query
        mask = mask[:, :, -1:]
    elif kind == "bool_rows":  # (B, 1, Lq, 1) broadcast over the keys: rows hidden or not
        mask = mask[..., :1].clone()
        mask[:, :, ::2] = True
    kw = {"attn_mask": mask}
    if "+" in kind:
        kw.update(_masks(kind.split("+", 1)[1], B, H, Lq, Lk, "cpu", torch.float32, zero_length=True))
    _check_against_reference(q, k, v, kw)


@pytest.mark.parametrize("schedule", ["fused", "split"], indirect=True)
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_keys_of_a_tile_the_bool_mask_hides_are_never_read(ext, schedule, value):
    """An inf or NaN key or value in a block the mask hides entirely never enters the output or
    any gradient (as on the Triton kernels), where a mixed tile weighs a hidden key's inf value
    by 0 (NaN, as the reference's dense product)."""
    B, H, D = 1, 2, 16
    rows, keys = _tile_blocks(D)
    Lq, Lk = 2 * rows, 3 * keys
    q, k, v = _qkv(B, H, H, Lq, Lk, D, torch.float32)
    mask = torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
    mask[..., keys:2 * keys] = False  # the middle block of keys, for every row
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, keys + 3] = value
    v_bad[:, :, keys + 5] = value
    dout = torch.randn_like(q)
    got = _run(_extension, q, k_bad, v_bad, dout, {"attn_mask": mask})
    ref = _run(reference.attention, q, k, v, dout, {"attn_mask": mask})  # the same with finite hidden keys
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(g, r, msg=lambda m: f"{name}: {m}")
    mask[0, 0, 0, keys + 1] = True  # the block is mixed now: the hidden inf value enters as 0 * inf
    out = _extension(q, k, v_bad, attn_mask=mask)
    assert out[0, :, 0, :].isnan().any()


@pytest.mark.parametrize("kind", ["none", "causal", "key_lengths"])
def test_a_bool_mask_allowing_every_key_gives_the_bits_of_no_mask(ext, kind):
    B, H, Lq, Lk, D = 2, 2, 150, 200, 32
    q, k, v = _qkv(B, H, H, Lq, Lk, D, torch.float32)
    kw = _masks(kind, B, H, Lq, Lk, "cpu", torch.float32)
    dout = torch.randn_like(q)
    plain = _run(_extension, q, k, v, dout, kw)
    masked = _run(_extension, q, k, v, dout, {**kw, "attn_mask": torch.ones(B, 1, Lq, Lk, dtype=torch.bool)})
    for name, a, b in zip(("out", "dq", "dk", "dv"), masked, plain):
        assert torch.equal(a, b), name


# Rows whose scores are all huge: a finite mask value (-1e9, finfo.min, -1e4) over every key
# the row sees, or logits in the hundreds. The backward recomputes P from the float32 lse,
# which cannot hold log l next to 1e9; the extension recomputes these rows' max and sum
# (csrc/attention_cpu.cpp, exact_large_lse; csrc/attention_cuda.cu, attention_row_kernel),
# where P = exp(S - lse) would be 1 instead of 1/l.
HUGE_FILLS = [-1e9, torch.finfo(torch.float32).min, -1e4, "logits"]
HUGE_KINDS = ["none", "key_lengths+causal_bottom_right", "causal_negative"]


def _huge_score_inputs(kind, fill, D, device, Lq=70, zero_length=True):
    """(q, k, v, dout, op keywords) of B=2 H=4 Hkv=2 Lk=90 in float32 with rows of huge scores
    (huge_score_rows) under a float mask; zero_length: batch 1 has key length 0, where kind has
    key lengths."""
    B, H, Hkv, Lk = 2, 4, 2, 90
    q, k, v = _qkv(B, H, Hkv, Lq, Lk, D, torch.float32, device)
    kw = _masks(kind, B, H, Lq, Lk, device, torch.float32, zero_length=zero_length)
    mask = make_float_mask((B, H, Lq, Lk), device)
    q, k, kw["attn_mask"] = huge_score_rows(q, k, mask, fill)
    return q, k, v, torch.randn_like(q), kw


def _check_huge_scores(kind, fill, D, device, dropout_p=0.0, Lq=70, softcap=None):
    q, k, v, dout, kw = _huge_score_inputs(kind, fill, D, device, Lq)
    kw["softcap"] = softcap
    ref_kw = dict(kw)
    if dropout_p:  # the reference drops what the extension's seed draw drops (its keep-mask hook)
        torch.manual_seed(7)
        with fasttrans.use_backend("extension"):
            ref_kw["dropout_mask"] = ftf.attention_dropout_mask(q, k, dropout_p)
        kw["dropout_p"] = ref_kw["dropout_p"] = dropout_p
        torch.manual_seed(7)
    # Scores near 1e4 are rounded to 1e-3 in float32 and near 1e9 to 64, differently by each
    # GEMM: the yardstick is the reference in float64, and the extension may be off by twice
    # as much as the reference in float32 (the low-precision rule of tests/helpers.py).
    got = _run(_extension, q, k, v, dout, kw)
    base = _run(reference.attention, q, k, v, dout, ref_kw)
    ref = _run(reference.attention, q.double(), k.double(), v.double(), dout.double(),
               cast_floating(ref_kw, torch.float64))
    for name, g, r, b in zip(("out", "dq", "dk", "dv", "dmask"), got, ref, base, strict=True):
        assert_close_lowp(name, g, r, b, dtype=torch.float32)


@pytest.mark.parametrize("schedule", ["fused", "split"], indirect=True)
@pytest.mark.parametrize("kind", HUGE_KINDS)
@pytest.mark.parametrize("fill", HUGE_FILLS, ids=str)
@pytest.mark.parametrize("D", [16, 64])
def test_rows_of_huge_scores_get_exact_gradients(ext, schedule, kind, fill, D):
    _check_huge_scores(kind, fill, D, "cpu")


# The CPU backward takes tiles of one or two query rows query-major (csrc/attention_cpu.cpp,
# bwd_rows) and computes the others' rows rounded up to whole vectors (bwd_tile): 9 rows run as
# 16, the rows past them on zeros.
@pytest.mark.parametrize("schedule", ["fused", "split"], indirect=True)
@pytest.mark.parametrize("Lq, fill", [(1, -1e9), (2, -1e9), (9, -1e9), (9, "logits")], ids=str)
def test_short_query_tiles_get_exact_gradients_on_huge_rows(ext, schedule, Lq, fill):
    _check_huge_scores("key_lengths+causal_bottom_right", fill, 16, "cpu", Lq=Lq)


# A row whose weights are one-hot in float32 (scores hundreds apart) has a score gradient
# P (dP - sum(P dP)) of exactly 0 in the reference. The CPU backward takes sum(P dP) as
# dO . O, and O is then the row of V that dP was formed from: summed in dP's order, the two
# cancel exactly, on both tile layouts (Lq 1 and 2 query-major, 9 and 70 key-major, and the
# causal tiles' last rows either way).
@pytest.mark.parametrize("schedule", ["fused", "split"], indirect=True)
@pytest.mark.parametrize("Lq", [1, 2, 9, 70])
def test_one_hot_rows_get_exactly_zero_score_gradients(ext, schedule, Lq):
    torch.manual_seed(0)
    q, k, v, dout, kw = _huge_score_inputs("key_lengths+causal_bottom_right", "logits", 64, "cpu", Lq,
                                           zero_length=False)
    _, dq, _, _, dmask = _run(_extension, q, k, v, dout, kw)
    _, _, _, _, ref_dmask = _run(reference.attention, q, k, v, dout, kw)
    one_hot = (ref_dmask == 0).all(-1)
    assert one_hot.sum() >= one_hot.numel() // 4, "the inputs should make many rows one-hot"
    assert (dmask[one_hot] == 0).all() and (dq[one_hot] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", HUGE_KINDS)
@pytest.mark.parametrize("fill", HUGE_FILLS, ids=str)
@pytest.mark.parametrize("D", [16, 64])
def test_rows_of_huge_scores_get_exact_gradients_on_cuda(ext, kind, fill, D):
    _check_huge_scores(kind, fill, D, "cuda")


# An inf in v behind a weight below float32's smallest normal: the reference gives 5.5e-42 *
# inf = inf. CUDA's expf keeps subnormal results (ex2 of a normal-range fraction times a
# power of two), so the CUDA kernels need no recompute; the CPU kernel's exp_u20 flushes them
# and recomputes the block (tested on the CPU in tests/test_bad_inputs_fuzz.py).
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("Lq,Lk", [(1, 2), (40, 9), (300, 300)])
def test_inf_in_v_with_a_subnormal_weight_on_cuda(ext, dtype, Lq, Lk):
    q, k, v, ref = subnormal_weight_with_inf_value(Lq, Lk, dtype, "cuda")
    out = _extension(q, k, v, scale=1.0)
    torch.testing.assert_close(out, ref, equal_nan=True)


@pytest.mark.parametrize("schedule", ["fused", "split"], indirect=True)
@pytest.mark.parametrize("device", DEVICES)
def test_rows_of_huge_scores_with_dropout(ext, schedule, device):
    require_extension(device, "attention")
    _check_huge_scores("key_lengths+causal_bottom_right", -1e9, 32, device, dropout_p=0.25)


def test_backward_schedule_env_is_validated(ext, monkeypatch):
    monkeypatch.setenv("FASTTRANS_CPU_ATTENTION_BWD", "fastest")
    q, k, v = (t.requires_grad_() for t in _qkv(1, 1, 1, 4, 4, 8, torch.float32))
    out = _extension(q, k, v)
    with pytest.raises(RuntimeError, match="FASTTRANS_CPU_ATTENTION_BWD"):
        out.sum().backward()


@pytest.mark.parametrize("schedule", ["fused", "split"], indirect=True)
def test_backward_is_deterministic(ext, schedule):
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 130, 150, 40
    q, k, v = _qkv(B, H, Hkv, Lq, Lk, D, torch.float32)
    kw = _masks("float+key_lengths+causal_bottom_right", B, H, Lq, Lk, "cpu", torch.float32)
    dout = torch.randn_like(q)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        first = _run(_extension, q, k, v, dout, kw)
        torch.set_num_threads(2)  # the same bits however the work items land on the threads
        for _ in range(3):
            again = _run(_extension, q, k, v, dout, kw)
            for a, b in zip(first, again):
                assert torch.equal(a, b)
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------
# soft-capped scores (softcap: Gemma 2's logit soft-capping)
# ---------------------------------------------------------------------------------------
# Every tile layout and mask path of the forward and backward: the single-block dot products
# (Lq 1, 3), bwd_rows (Lq 1, 2) and bwd_tile, masked and full tiles, the float mask's gradient.
SOFTCAP_CASES = [
    ("none", (2, 4, 2, 97, 70, 64)),
    ("bool", (2, 4, 2, 1, 300, 64)),
    ("bool+key_lengths+causal_bottom_right", (2, 4, 2, 3, 150, 64)),
    ("float", (2, 2, 1, 33, 97, 40)),
    ("float+causal_bottom_right", (1, 2, 1, 2, 37, 200)),
    ("float_bcast+key_lengths+causal", (1, 2, 2, 97, 33, 128)),
    ("causal", (1, 2, 1, 130, 40, 16)),
]


def _softcap_inputs(shape, dtype=torch.float32):
    """q, k, v whose scaled scores (spread about 3) the cap of 2 bends well away from linear."""
    q, k, v = _qkv(*shape, dtype)
    return q * 2, k * 1.5, v


@pytest.mark.parametrize("schedule", ["fused", "split"], indirect=True)
@pytest.mark.parametrize("kind,shape", SOFTCAP_CASES, ids=[c[0] for c in SOFTCAP_CASES])
def test_soft_capped_scores_match_reference(ext, schedule, kind, shape):
    B, H, Hkv, Lq, Lk, D = shape
    q, k, v = _softcap_inputs(shape)
    kw = _masks(kind, B, H, Lq, Lk, "cpu", torch.float32, zero_length=True)
    got = _check_against_reference(q, k, v, {**kw, "softcap": 2.0})
    uncapped = _run(_extension, q, k, v, torch.randn_like(q), kw)
    assert (got[0] - uncapped[0]).abs().max() > 0.1, "the cap should change the output"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_soft_capped_scores_in_low_precision(ext, dtype):
    shape = (2, 4, 2, 70, 97, 64)
    q, k, v = _softcap_inputs(shape, dtype)
    kw = _masks("bool+key_lengths+causal_bottom_right", *shape[:2], *shape[3:5], "cpu", dtype)
    _check_against_reference(q, k, v, {**kw, "softcap": 2.0})


def test_soft_capped_scores_gradcheck_fp64(ext):
    q, k, v = (t.requires_grad_() for t in _softcap_inputs((1, 2, 1, 5, 7, 8), torch.float64))
    bias = make_float_mask((1, 2, 5, 7), "cpu", dtype=torch.float64).requires_grad_()
    fn = lambda q, k, v, m: _extension(q, k, v, attn_mask=m, is_causal=True, causal_offset=2, softcap=1.5)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, bias))


@pytest.mark.parametrize("schedule", ["fused", "split"], indirect=True)
@pytest.mark.parametrize("Lq, fill", [(2, -1e4), (70, -1e4), (70, -1e9), (70, "logits")], ids=str)
def test_soft_capped_rows_of_huge_scores(ext, schedule, Lq, fill):
    """Rows under a mask of -1e9 take the exact log-sum-exp path, which caps as the tiles do;
    huge products are capped to the cap."""
    _check_huge_scores("key_lengths+causal_bottom_right", fill, 16, "cpu", Lq=Lq, softcap=3.0)


@pytest.mark.parametrize("schedule", ["fused", "split"], indirect=True)
def test_soft_capped_scores_with_dropout(ext, schedule):
    _check_huge_scores("none", -1e9, 32, "cpu", dropout_p=0.25, softcap=3.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind,shape", SOFTCAP_CASES, ids=[c[0] for c in SOFTCAP_CASES])
def test_soft_capped_scores_match_reference_on_cuda(ext, kind, shape, dtype):
    require_extension("cuda", "attention")
    B, H, Hkv, Lq, Lk, D = shape
    q, k, v = (t.cuda() for t in _softcap_inputs(shape, dtype))
    kw = _masks(kind, B, H, Lq, Lk, "cuda", dtype, zero_length=True)
    _check_against_reference(q, k, v, {**kw, "softcap": 2.0})


@pytest.mark.gpu
@pytest.mark.parametrize("fill", [-1e4, -1e9, "logits"], ids=str)
def test_soft_capped_rows_of_huge_scores_on_cuda(ext, fill):
    require_extension("cuda", "attention")
    _check_huge_scores("key_lengths+causal_bottom_right", fill, 16, "cuda", Lq=70, softcap=3.0)
    _check_huge_scores("none", -1e9, 32, "cuda", dropout_p=0.25, softcap=3.0)


def _thread_cpu_ticks() -> dict[str, int]:
    """CPU time (utime + stime, in clock ticks) of each thread of this process, from /proc."""
    ticks = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # fields from the 3rd (state) on
        except FileNotFoundError:  # a thread that ended
            continue
        ticks[task] = int(fields[11]) + int(fields[12])
    return ticks


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads per-thread CPU time from Linux's /proc")
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_one_long_sequence_is_split_over_threads(ext, phase):
    # B = H = 1: the only work to share is along the sequence (the forward's query blocks; the
    # backward's split schedule, chosen because one (batch, kv head) item cannot fill 2 threads)
    q, k, v = (t.requires_grad_() for t in _qkv(1, 1, 1, 2048, 2048, 64, torch.float32))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        used: dict[str, int] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the shares are read from enough clock ticks
            if phase == "forward":
                before = _thread_cpu_ticks()
                with torch.no_grad():
                    _extension(q, k, v, is_causal=True)
            else:
                loss = _extension(q, k, v, is_causal=True).sum()
                before = _thread_cpu_ticks()
                loss.backward()
            after = _thread_cpu_ticks()
            for task, t in after.items():
                used[task] = used.get(task, 0) + t - before.get(task, t)
            if sum(used.values()) >= 60:
                break
    finally:
        torch.set_num_threads(threads)
    shares = sorted(used.values(), reverse=True)
    total = sum(shares)
    assert total >= 60, f"only {total} CPU clock ticks in a minute of calls"
    # split, not necessarily even: another process may hold a core
    assert shares[1] >= 0.1 * total, f"CPU ticks per thread {shares}: the work stayed on one thread"


# ---------------------------------------------------------------------------------------
# the forward's running max: rows whose max moves between key tiles
# ---------------------------------------------------------------------------------------
# The CPU forward moves a row's running max only when a key tile's max passes it by more than
# ln 16, and takes a tile that leaves it in place in one pass (csrc/common.h,
# exp_row_in_one_pass: fp32 tiles of 64 or 128 keys); a tile whose scores pass it, or hold a
# NaN or an inf, goes back to the row max's pass. Lk = 400: six full tiles of 64 keys (three of
# 128), then a ragged one.
MOVING_MAX_CASES = ["growing", "shrinking", "late_jump", "late_jump_masked", "negative_scale",
                    "key_lengths+causal", "late_nan", "late_inf_mask"]


def _moving_max_case(case):
    B, H, Lq, Lk, D = 2, 2, 70, 400, 32
    q, k, v = _qkv(B, H, H, Lq, Lk, D, torch.float32)
    ramp = torch.linspace(0.25, 4.0, Lk).view(1, 1, Lk, 1)
    kw = {}
    if case in ("growing", "key_lengths+causal"):
        k = k * ramp
    if case == "key_lengths+causal":
        kw.update(key_lengths=torch.tensor([Lk, 300]), is_causal=True, causal_offset=Lk - Lq)
    elif case == "shrinking":
        k = k * ramp.flip(2)
    elif case == "late_jump":  # scores of about 110 on one late key (exp overflows float32 past 88)
        q = q + 1.0
        k[:, :, Lk - 90] = 20.0
    elif case == "late_jump_masked":  # the same through a float mask (tiles with a mask)
        kw["attn_mask"] = torch.zeros(B, H, Lq, Lk)
        kw["attn_mask"][..., 200:] = torch.linspace(0, 120, Lk - 200)
    elif case == "negative_scale":
        k = k * ramp
        kw["scale"] = -0.5
    elif case == "late_nan":  # a NaN in key 250, past the rows' first tile: that head's rows are NaN
        k[0, 1, 250, 3] = float("nan")
    elif case == "late_inf_mask":  # +inf on a late key: those rows are NaN, as in the reference
        kw["attn_mask"] = torch.zeros(B, H, Lq, Lk)
        kw["attn_mask"][1, 0, 5, 300] = float("inf")
    return q, k, v, kw


@pytest.mark.parametrize("case", MOVING_MAX_CASES)
def test_running_max_moves_between_key_tiles(ext, case):
    q, k, v, kw = _moving_max_case(case)
    if case not in ("late_nan", "late_inf_mask"):
        _check_against_reference(q, k, v, kw)
        return
    with torch.no_grad():
        out, want = _extension(q, k, v, **kw), reference.attention(q, k, v, **kw)
    nan_rows = torch.isnan(want).any(-1)
    assert nan_rows.any() and torch.equal(torch.isnan(out).any(-1), nan_rows)
    assert torch.isnan(out[nan_rows]).all()
    assert_close_lowp("out", out[~nan_rows], want[~nan_rows], None, dtype=torch.float32)


@pytest.mark.slow(minutes=0.5)
@pytest.mark.parametrize("tiles", ["64x128,64x64", "64x64,64x64"])
def test_one_pass_rows_at_both_key_tile_widths(ext, tiles):
    """The cases above in a child process whose forward key tiles are 128 or 64 keys wide,
    the widths the one-pass rows take (the suite's tiles follow the machine's L2), in this
    process's instruction set."""
    proc = run_python(["-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                       "-k", "running_max_moves"], timeout=600, FASTTRANS_CPU_ATTENTION_TILES=tiles,
                      FASTTRANS_CPU_ARCH=os.environ.get("FASTTRANS_CPU_ARCH", ""))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"{len(MOVING_MAX_CASES)} passed" in proc.stdout, proc.stdout[-2000:]


# ---------------------------------------------------------------------------------------
# dropout: the keep-mask hook, its definition and its statistics
# ---------------------------------------------------------------------------------------
def test_philox_known_answers():
    # Random123's known-answer vectors for philox4x32_10 (the oracle of the tests below)
    assert philox4x32_10([0, 0, 0, 0], 0).tolist() == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert philox4x32_10([0xFFFFFFFF] * 4, 2**64 - 1).tolist() == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


# Lk = 11: inside the first 64-key group of the row generator; 150: two full groups and a tail
@pytest.mark.parametrize("Lk", [11, 150])
@pytest.mark.parametrize("device", DEVICES)
def test_dropout_mask_follows_its_definition(ext, device, Lk):
    """csrc/philox.h's mask (tests.helpers.attention_keep), bit for bit; 37 rows: whole and
    partial 16-row blocks."""
    require_extension(device, "attention")
    impl = backends.BACKENDS["extension"].impl()
    q, k = torch.randn(2, 3, 37, 8, device=device), torch.randn(2, 1, Lk, 8, device=device)
    p, seed = 0.3, (7 << 32) + 12345
    keep = impl.attention_dropout_mask(q, k, p, seed).cpu()
    assert keep.dtype == torch.bool and keep.shape == (2, 3, 37, Lk)
    assert torch.equal(keep, attention_keep(seed, p, 2, 3, 37, Lk))


def test_dropout_keep_fraction_and_independence(ext):
    impl = backends.BACKENDS["extension"].impl()
    q, k = torch.randn(4, 4, 64, 8), torch.randn(4, 4, 256, 8)
    for p in (0.1, 0.5, 0.9):
        keep = impl.attention_dropout_mask(q, k, p, 1234).float()
        n = keep.numel()
        assert abs(keep.mean().item() - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5
    a = impl.attention_dropout_mask(q, k, 0.5, 1)
    b = impl.attention_dropout_mask(q, k, 0.5, 2)
    assert 0.4 < (a == b).float().mean().item() < 0.6  # different seeds: unrelated masks
    assert torch.equal(a, impl.attention_dropout_mask(q, k, 0.5, 1))  # same seed: same mask


@pytest.mark.parametrize("schedule", ["fused", "split"], indirect=True)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("Lq", [70, 9, 2, 1])  # the CPU backward's tile forms (see above)
def test_dropout_matches_reference_with_the_hook_mask(ext, device, schedule, Lq):
    require_extension(device, "attention")
    B, H, Hkv, Lk, D, p = 2, 4, 2, 90, 32, 0.25
    q, k, v = _qkv(B, H, Hkv, Lq, Lk, D, torch.float32, device)
    kw = dict(key_lengths=torch.tensor([90, 40], device=device), is_causal=True, causal_offset=Lk - Lq,
              attn_mask=make_float_mask((B, H, Lq, Lk), device))
    torch.manual_seed(7)
    with fasttrans.use_backend("extension"):
        keep = ftf.attention_dropout_mask(q, k, p)
    dout = torch.randn_like(q)
    torch.manual_seed(7)
    got = _run(_extension, q, k, v, dout, dict(kw, dropout_p=p))
    ref = _run(reference.attention, q, k, v, dout, dict(kw, dropout_p=p, dropout_mask=keep))
    for name, g, r in zip(("out", "dq", "dk", "dv", "dmask"), got, ref):
        assert_close_lowp(name, g, r, None)
    assert not torch.equal(got[0], _extension(q, k, v, **kw))  # dropout did act


# ---------------------------------------------------------------------------------------
# torch.library: opcheck, gradcheck, torch.compile
# ---------------------------------------------------------------------------------------
def _op_samples():
    q, k, v = _qkv(2, 4, 2, 9, 13, 8, torch.float32)
    kl = torch.tensor([13, 5], dtype=torch.int32)
    fmask = make_float_mask((2, 4, 9, 13), "cpu").masked_fill(torch.eye(9, 13, dtype=torch.bool), 0.0)
    bmask = make_bool_mask((2, 1, 9, 13), "cpu").expand(2, 4, 9, 13)
    return [
        (q, k, v, None, None, False, 0, 0.0, 0.35, 0),
        (q, k, v, fmask, kl, True, 4, 0.0, 0.35, 0),
        (q, k, v, bmask, kl, True, -2, 0.2, 0.35, 99),
    ]


def test_opcheck_forward(ext):
    fwd = ext[0]
    for args in _op_samples():
        args = list(args)
        for i in (0, 1, 2):
            args[i] = args[i].clone().requires_grad_()
        if args[3] is not None and args[3].dtype != torch.bool:
            args[3] = args[3].clone().requires_grad_()
        torch.library.opcheck(fwd, tuple(args))


def test_opcheck_backward(ext):
    fwd, bwd = ext[0], ext[1]
    for q, k, v, mask, kl, causal, off, p, scale, seed in _op_samples():
        out, lse = fwd(q, k, v, mask, kl, causal, off, p, scale, seed)
        dout = torch.randn_like(out)
        mask_grad = mask is not None and mask.dtype != torch.bool
        torch.library.opcheck(bwd, (dout, q, k, v, out, lse, mask, kl, causal, off, p, scale, seed, mask_grad))


def test_opcheck_with_softcap(ext):
    """The ops' trailing softcap, forward and backward (fakes, autograd, schema)."""
    fwd, bwd = ext[0], ext[1]
    for q, k, v, mask, kl, causal, off, p, scale, seed in _op_samples():
        grad_mask = mask is not None and mask.dtype != torch.bool
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        mask_leaf = mask.clone().requires_grad_() if grad_mask else mask
        torch.library.opcheck(fwd, (*leaves, mask_leaf, kl, causal, off, p, scale, seed, 1.5))
        out, lse = fwd(q, k, v, mask, kl, causal, off, p, scale, seed, 1.5)
        torch.library.opcheck(bwd, (torch.randn_like(out), q, k, v, out, lse, mask, kl, causal, off, p, scale, seed,
                                    grad_mask, 1.5))


def test_opcheck_dropout_mask(ext):
    q, k, _ = _qkv(2, 2, 1, 5, 7, 8, torch.float32)
    torch.library.opcheck(torch.ops.fasttrans.attention_dropout_mask_extension, (q, k, 0.3, 5))


GRADCHECK_CASES = [
    ("key_lengths", dict(key_lengths=[6, 2])),
    ("causal", dict(is_causal=True, causal_offset=1)),
    ("float_mask", dict(mask=True)),
    ("all", dict(mask=True, key_lengths=[6, 3], is_causal=True, causal_offset=-1)),
    ("dropout", dict(dropout_p=0.3, key_lengths=[5, 6])),
]


@pytest.mark.parametrize("schedule", ["fused", "split"], indirect=True)
@pytest.mark.parametrize("name,case", GRADCHECK_CASES, ids=[c[0] for c in GRADCHECK_CASES])
def test_gradcheck_fp64(ext, name, case, schedule):
    fwd = ext[0]
    B, H, Hkv, Lq, Lk, D = 2, 2, 1, 5, 6, 4
    q, k, v = (t.requires_grad_() for t in _qkv(B, H, Hkv, Lq, Lk, D, torch.float64))
    inputs = [q, k, v]
    mask = None
    if case.get("mask"):
        mask = torch.randn(B, H, Lq, Lk, dtype=torch.float64)
        mask[0, 0, 1, 2] = float("-inf")
        mask.requires_grad_()
        inputs.append(mask)
    kl = torch.tensor(case["key_lengths"], dtype=torch.int32) if "key_lengths" in case else None
    causal, off, p = case.get("is_causal", False), case.get("causal_offset", 0), case.get("dropout_p", 0.0)

    def f(q, k, v, *m):
        return fwd(q, k, v, m[0] if m else None, kl, causal, off, p, 0.5, 1234)[0]

    assert torch.autograd.gradcheck(f, tuple(inputs))


def test_compiles_without_graph_breaks(ext):
    q, k, v = (t.requires_grad_() for t in _qkv(2, 4, 2, 9, 13, 8, torch.float32))
    kl = torch.tensor([13, 4])

    def f(q, k, v):
        return fasttrans.attention(q, k, v, key_lengths=kl, is_causal=True, causal_offset=4)

    torch._dynamo.reset()
    with fasttrans.use_backend("extension"):
        out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
        out.sum().backward()
        ref = f(q.detach(), k.detach(), v.detach())
    torch.testing.assert_close(out, ref)
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_forced_extension_on_unsupported_device_says_why(ext):
    q = torch.randn(1, 1, 2, 4, device="meta")
    with fasttrans.use_backend("extension"), pytest.raises(fasttrans.BackendUnavailableError, match="meta"):
        fasttrans.attention(q, q, q)


# ---------------------------------------------------------------------------------------
# tiles: chosen per machine from its L2 size, or set by FASTTRANS_CPU_ATTENTION_TILES
# ---------------------------------------------------------------------------------------
_TILES_ENV = "FASTTRANS_CPU_ATTENTION_TILES"


def _working_sets(D, elem, fwd, bwd):
    """Bytes a forward and a backward tile step touch (csrc/attention_cpu.cpp, "Tile sizes")."""
    (fm, fn), (bm, bn) = fwd, bwd
    return (fm * fn + 2 * fm * D + 2 * fn * D) * elem, (3 * bm * bn + 3 * bm * D + 4 * bn * D) * elem


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("D", [8, 64, 128, 256])
def test_tiles_shrink_to_fit_half_the_l2(ext, D, dtype):
    from fasttrans.extension import cpu_attention_tiles

    elem = 8 if dtype == torch.float64 else 4
    previous = None
    for l2 in (4 << 20, 2 << 20, 1 << 20, 512 << 10, 256 << 10, 64 << 10, 0):
        t = cpu_attention_tiles(D, dtype, l2_bytes=l2)
        assert t["l2_bytes"] == l2
        fwd_bytes, bwd_bytes = _working_sets(D, elem, t["forward"], t["backward"])
        # the largest tiles (64 x 128, 64 x 64) when they fit; else halved until they do or are 16 x 16
        assert t["forward"] == (64, 128) or fwd_bytes <= l2 // 2 or t["forward"] == (16, 16), t
        assert t["backward"] == (64, 64) or bwd_bytes <= l2 // 2 or t["backward"] == (16, 16), t
        if t["forward"] != (16, 16):
            assert fwd_bytes <= l2 // 2 and 2 * fwd_bytes > l2 // 2 or t["forward"] == (64, 128), t
        if previous is not None:  # a smaller cache never gets larger tiles
            for side in ("forward", "backward"):
                assert all(a <= b for a, b in zip(t[side], previous[side])), (t, previous)
        previous = t
    # the machines measured (L2 of 1 and 2 MiB per core) keep the largest tiles in fp32
    if dtype == torch.float32:
        for l2 in (1 << 20, 2 << 20):
            t = cpu_attention_tiles(D, dtype, l2_bytes=l2)
            assert (t["forward"], t["backward"]) == ((64, 128), (64, 64))


def test_tiles_follow_this_machine_or_the_setting(ext):
    from fasttrans.extension import cpu_attention_tiles

    fasttrans.attention(*_qkv(1, 1, 1, 2, 2, 8, torch.float32))  # the kernels have chosen
    t = cpu_attention_tiles(64)
    forced = os.environ.get(_TILES_ENV)
    if forced:
        fm, fn, bm, bn = (int(x) for x in forced.replace(",", "x").split("x"))
        assert (t["forward"], t["backward"], t["l2_bytes"]) == ((fm, fn), (bm, bn), 0)
        return
    l2 = os.sysconf("SC_LEVEL2_CACHE_SIZE") if "SC_LEVEL2_CACHE_SIZE" in os.sysconf_names else -1
    if l2 >= 128 << 10:  # smaller reports are taken as wrong (csrc/attention_cpu.cpp)
        assert t["l2_bytes"] == l2
    assert t["l2_bytes"] >= 128 << 10
    assert t == cpu_attention_tiles(64, l2_bytes=t["l2_bytes"])


def test_tiles_argument_errors(ext):
    from fasttrans.extension import cpu_attention_tiles

    for kw, name in [({"head_dim": 0}, "head_dim"), ({"dtype": torch.int32}, "dtype"), ({"l2_bytes": -1}, "l2_bytes")]:
        with pytest.raises(ValueError, match=name):
            cpu_attention_tiles(**kw)


def test_tiles_setting_is_validated(ext):
    code = f"""
import os, torch, fasttrans
from fasttrans.extension import cpu_attention_tiles
q = torch.randn(1, 1, 4, 8)
for bad in ("64x128", "64x128,0x64", "64x128,64x2048", "64x128,64x64x", "big"):
    os.environ["{_TILES_ENV}"] = bad
    try:
        fasttrans.attention(q, q, q)
    except RuntimeError as e:
        assert "{_TILES_ENV}" in str(e) and bad in str(e), e
    else:
        raise AssertionError(bad)
os.environ["{_TILES_ENV}"] = "8x24,16x8"  # read at the first call that succeeds, then kept
fasttrans.attention(q, q, q)
os.environ["{_TILES_ENV}"] = "32x32,32x32"
fasttrans.attention(q, q, q)
print(cpu_attention_tiles(64))
"""
    proc = run_python(["-c", code])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "{'forward': (8, 24), 'backward': (16, 8), 'l2_bytes': 0}"

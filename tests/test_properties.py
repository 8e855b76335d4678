"""Property-based cross-backend tests: random shapes and mask combinations vs the reference.

Every backend that can run on this machine is checked (Triton through its interpreter on
CPU, so sizes stay small). Failing examples are stored in tests/hypothesis-db, which is
part of the repository, so a regression found once is replayed on every run.
Set FASTTRANS_FUZZ_EXAMPLES to raise the number of examples for long runs.
"""

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

import fasttrans
from fasttrans import reference

from conftest import backend_params
from helpers import assert_close_lowp, fuzz_settings

EXAMPLES = int(os.environ.get("FASTTRANS_FUZZ_EXAMPLES", "25"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=DirectoryBasedExampleDatabase(str(Path(__file__).parent / "hypothesis-db")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def attention_cases(draw):
    B = draw(st.integers(1, 3))
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 3))
    Lq = draw(st.integers(1, 19))
    Lk = draw(st.integers(0, 19))
    D = draw(st.sampled_from([1, 3, 8, 16, 24, 40]))
    case = dict(B=B, H=H, Hkv=Hkv, Lq=Lq, Lk=Lk, D=D, seed=draw(st.integers(0, 2**16)))
    if draw(st.booleans()):
        case["key_lengths"] = draw(st.lists(st.integers(0, Lk), min_size=B, max_size=B))
    if draw(st.booleans()):
        case["is_causal"] = True
        case["causal_offset"] = draw(st.integers(-Lq, Lk))
    mask_kind = draw(st.sampled_from(["none", "bool", "float", "float_grad"]))
    if mask_kind != "none":
        # each of the 4 dims is either full or broadcast (size 1), and rank may be < 4
        full = (B, H, Lq, Lk)
        dims = [draw(st.booleans()) for _ in range(4)]
        shape = tuple(s if keep else 1 for s, keep in zip(full, dims))
        rank = draw(st.integers(2, 4))
        case["mask"] = (mask_kind, shape[4 - rank:])
    case["scale"] = draw(st.sampled_from([None, 0.5]))
    return case


def _run_attention(case, backend, dtype=torch.float32):
    g = torch.Generator().manual_seed(case["seed"])
    B, H, Hkv, Lq, Lk, D = (case[k] for k in ("B", "H", "Hkv", "Lq", "Lk", "D"))
    q = torch.randn(B, H, Lq, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, Lk, D, generator=g, dtype=dtype)
    kw = {}
    if "key_lengths" in case:
        kw["key_lengths"] = torch.tensor(case["key_lengths"])
    if case.get("is_causal"):
        kw.update(is_causal=True, causal_offset=case["causal_offset"])
    mask_grad = False
    if "mask" in case:
        kind, shape = case["mask"]
        if kind == "bool":
            kw["attn_mask"] = torch.rand(shape, generator=g) < 0.7
        else:
            m = torch.randn(shape, generator=g, dtype=dtype)
            kw["attn_mask"] = m.masked_fill(torch.rand(shape, generator=g) < 0.15, float("-inf"))
            mask_grad = kind == "float_grad"
    if case["scale"] is not None:
        kw["scale"] = case["scale"]
    inputs = [q, k, v] + ([kw["attn_mask"]] if mask_grad else [])
    dout = torch.randn(B, H, Lq, D, generator=g, dtype=dtype)

    def grads(fn, tensors):
        tensors = [t.detach().clone().requires_grad_() for t in tensors]
        extra = {"attn_mask": tensors[3]} if mask_grad else {}
        out = fn(*tensors[:3], **{**kw, **extra})
        return [out] + list(torch.autograd.grad(out, tensors, dout.to(out.dtype), allow_unused=True))

    with fasttrans.use_backend(backend):
        got = grads(fasttrans.attention, inputs)
    # fp64 oracle on the same (rounded) inputs
    inputs64 = [t.double() for t in inputs]
    kw64 = {**kw, "attn_mask": kw["attn_mask"].double()} if "mask" in case and kw["attn_mask"].dtype != torch.bool else kw
    kw, saved = kw64, kw
    expected = grads(reference.attention, inputs64)
    kw = saved
    names = ["out", "dq", "dk", "dv", "dmask"]
    for name, a, e in zip(names, got, expected):
        e = torch.zeros_like(a, dtype=torch.float64) if e is None else e
        # finite-ness: -inf mask entries may make a gradient entry exactly 0, never NaN
        assert_close_lowp(f"{backend} {name}", a.float(), e, None, dtype=torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params("attention"))
@FUZZ
@given(case=attention_cases())
def test_attention_matches_reference(backend, case):
    _run_attention(case, backend)


@st.composite
def tiled_attention_cases(draw):
    """Shapes of several CPU attention tiles each way (the forward's are 128 keys wide at most;
    csrc/attention_cpu.cpp picks them by head dim and L2 size), with score scales and a ramp
    over the keys that moves a row's max from one key tile to the next."""
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 2))
    Lq, Lk = draw(st.integers(1, 200)), draw(st.integers(1, 400))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16]))
    case = dict(B=B, H=H, Hkv=Hkv, Lq=Lq, Lk=Lk, D=draw(st.sampled_from([8, 16, 40, 64, 72, 128])), dtype=dtype,
                q_scale=draw(st.sampled_from([0.1, 1.0, 2.0])), ramp=draw(st.sampled_from([0.0, 0.03, -0.03])),
                mask=draw(st.sampled_from(["none", "bool", "float", "float_bcast"])),
                dropout_p=draw(st.sampled_from([0.0, 0.0, 0.2])), seed=draw(st.integers(0, 2**16)))
    if draw(st.booleans()):
        case["key_lengths"] = draw(st.lists(st.integers(0, Lk), min_size=B, max_size=B))
    if draw(st.booleans()):
        case["causal_offset"] = draw(st.integers(-Lq, Lk))
    return case


@fuzz_settings(25)
@given(case=tiled_attention_cases())
def test_extension_attention_across_tiles_matches_reference(ext, case):
    """The CPU kernels' tiling (rows and keys over several tiles, the running max moving
    between key tiles, partial last tiles, dropout's counters) against the fp64 reference;
    the fuzz above stays within one tile. The baseline is the reference in the test's dtype.
    Derandomized: the same examples on every machine."""
    g = torch.Generator().manual_seed(case["seed"])
    B, H, Hkv, Lq, Lk, D, dtype = (case[k] for k in ("B", "H", "Hkv", "Lq", "Lk", "D", "dtype"))
    q = torch.randn(B, H, Lq, D, generator=g) * case["q_scale"]
    k = torch.randn(B, Hkv, Lk, D, generator=g)
    # every score grows by `ramp` per key (q's first lane 1, k's first lane a ramp): over a
    # tile of 128 keys, past the ln 16 the running max may lag. Scores stay of order ten: near
    # one-hot rows (huge scores, large queries) make dS = P (dP - dO . O) cancel to below the
    # fp32 reference's rounding, a bound of its own (test_attention_extension.py's huge-score tests)
    q[..., 0] = 1.0
    k[..., 0] += case["ramp"] * D ** 0.5 * torch.arange(Lk)
    v = torch.randn(B, Hkv, Lk, D, generator=g)
    dout = torch.randn(B, H, Lq, D, generator=g)
    kw = {}
    if case["mask"] == "bool":
        kw["attn_mask"] = torch.rand(B, 1, Lq, Lk, generator=g) < 0.8
    elif case["mask"] == "float":
        kw["attn_mask"] = torch.randn(B, H, Lq, Lk, generator=g) * 3
    elif case["mask"] == "float_bcast":
        kw["attn_mask"] = torch.randn(Lq, Lk, generator=g)
    if "key_lengths" in case:
        kw["key_lengths"] = torch.tensor(case["key_lengths"])
    if "causal_offset" in case:
        kw.update(is_causal=True, causal_offset=case["causal_offset"])
    # every run sees the same inputs, rounded to the test's dtype
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    if "attn_mask" in kw and kw["attn_mask"].dtype != torch.bool:
        kw["attn_mask"] = kw["attn_mask"].to(dtype)

    def run(backend, as_dtype):
        tensors = [t.detach().to(as_dtype).requires_grad_() for t in (q, k, v)]
        args = {n: t.to(as_dtype) if n == "attn_mask" and t.dtype != torch.bool else t for n, t in kw.items()}
        torch.manual_seed(case["seed"])  # the same dropout seed for every run
        with fasttrans.use_backend(backend):
            out = fasttrans.attention(*tensors, dropout_p=case["dropout_p"], **args)
        return [out] + list(torch.autograd.grad(out, tensors, dout.to(as_dtype)))

    got = run("extension", dtype)
    expected = run("reference", torch.float64)
    baseline = run("reference", dtype)
    for name, a, e, base in zip(("out", "dq", "dk", "dv"), got, expected, baseline):
        assert_close_lowp(f"extension {name}", a, e, base, dtype=dtype)


@st.composite
def norm_cases(draw):
    return dict(
        M=draw(st.integers(1, 9)),
        N=draw(st.sampled_from([1, 2, 7, 33, 64, 100, 257])),
        strided=draw(st.booleans()),
        weight=draw(st.booleans()),
        bias=draw(st.booleans()),
        kind=draw(st.sampled_from(["layer_norm", "add_layer_norm", "rms_norm"])),
        eps=draw(st.sampled_from([1e-5, 1e-6, 0.1])),
        scale=draw(st.sampled_from([1.0, 100.0])),
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.parametrize("backend", backend_params("norm"))
@FUZZ
@given(case=norm_cases())
# a row whose two values nearly coincide (var ≈ 30·eps): before the backward re-centred xhat,
# the saved mean's rounding alone put every backend's dx error at 2.8× torch's
@example(case=dict(M=7, N=2, strided=True, weight=True, bias=True, kind="layer_norm", eps=1e-6, scale=1.0, seed=7))
def test_norms_match_reference(backend, case):
    g = torch.Generator().manual_seed(case["seed"])
    M, N = case["M"], case["N"]
    base = torch.randn(M, 2 * N, generator=g) * case["scale"] + 3.0
    x = base[:, ::2] if case["strided"] else base[:, :N]  # strided: last stride 2, copied explicitly
    if case["strided"] and N > 1:
        x = torch.randn(M, 3, N, generator=g)[:, 1]  # rows with a row stride of 3N, last stride 1
    r = torch.randn(M, N, generator=g)
    w = torch.randn(N, generator=g) if case["weight"] else None
    b = torch.randn(N, generator=g) if case["bias"] and case["kind"] != "rms_norm" else None
    dy = torch.randn(M, N, generator=g)
    dh = torch.randn(M, N, generator=g)
    kind, eps = case["kind"], case["eps"]

    def run(fn_mod, tensors):
        x_, r_, w_, b_ = (t.detach().clone().requires_grad_() if t is not None else None for t in tensors)
        if kind == "layer_norm":
            outs, cot = (fn_mod.layer_norm(x_, (N,), w_, b_, eps),), (dy,)
        elif kind == "rms_norm":
            outs, cot = (fn_mod.rms_norm(x_, (N,), w_, eps),), (dy,)
        else:
            outs, cot = fn_mod.add_layer_norm(x_, r_, w_, b_, eps), (dy, dh)
        leaves = [t for t in (x_, r_, w_, b_) if t is not None and (t is not r_ or kind == "add_layer_norm")]
        gr = torch.autograd.grad(outs, leaves, [c.to(o.dtype) for o, c in zip(outs, cot)])
        return list(outs) + list(gr)

    with fasttrans.use_backend(backend):
        got = run(fasttrans, (x, r, w, b))
    expected = run(reference, tuple(t.double() if t is not None else None for t in (x, r, w, b)))
    # PyTorch's own fp32 result as the baseline: some gradients are ill-conditioned (at N = 2
    # the exact dx is ~0, a difference of terms of size rstd * |dy * w|, so any fp32 result
    # carries rounding noise far above a floor relative to |dx|)
    baseline = run(reference, (x, r, w, b))
    for i, (a, e, base) in enumerate(zip(got, expected, baseline)):
        assert_close_lowp(f"{backend} {kind} output/grad #{i}", a, e, base)

"""Fuzzing of malformed and edge-case inputs (hypothesis): clear errors, no crashes, no NaN.

The project's standard for bad input: a clear error that names the argument and says what
was expected; nothing crashes the process (no segfault, abort or out-of-bounds read) and
nothing returns NaN where the reference (fasttrans/reference.py) returns numbers.

1. The public functions (attention, layer_norm, add_layer_norm, rms_norm, dropout) are called
   on the CPU with the extension backend forced and with the reference backend, on drawn
   calls: a valid call (every legitimately accepted edge case: zero-size dims, exotic strides,
   broadcast masks of any float dtype, causal offsets far out of range, dropout_p 0 or 1, ...)
   with zero to two corruptions from a catalog (wrong ranks, shapes, dtypes and devices,
   non-dividing head counts, head dim 0, bad masks and key_lengths, scalars out of range or of
   the wrong type, ...). Each call either
     * raises a ValueError / TypeError / RuntimeError (fasttrans's ShapeError, DTypeError,
       DeviceError included) whose message starts with the name of a corrupted argument
       ("k, v: expected ..."), the same error on both backends; or, only for the extension,
       BackendUnavailableError for what it documents it cannot run (the meta device, head
       dims past 256) while the reference computes the call; or
     * succeeds on both backends with the extension's outputs (and, for float32/float64, the
       gradients of a random loss) equal to the reference's within a per-dtype tolerance, NaN
       only where the reference has NaN (where the reference has NaN the extension may have a
       number: the reference's autograd turns 0 * inf into NaN where the kernels skip a key).
   A call with no corruption must succeed: that is how the accepted edge cases are pinned
   (the catalogs below say which inputs are legitimately accepted). One place deviates from
   "equal to the reference" for rounding, not for behaviour: the norms' tolerances grow with
   a row's condition (max|h| / std), since rows of tiny spread against their mean, with
   eps = 0, are ill-conditioned for any implementation.
   The valid draws also run on the Triton kernels (test_triton_*_edge_inputs: float32 and
   float16, through the interpreter without a GPU).
   Numeric edge cases that the draws rarely or never reach have tests of their own (section
   1d): finite scales near the float32 range or subnormal, an inf in v meeting a subnormal
   weight, values whose squares overflow, and the gradients of rows of huge (finite) scores.
2. The raw registered ops (torch.ops.fasttrans.*_extension, padding_key_lengths,
   is_causal_mask), which skip every Python check, are called with malformed inputs in a
   subprocess (a crash would kill pytest): hand-written cases with an expected outcome, and
   drawn random calls that only must not crash (any exception a RuntimeError).

Examples are derandomized (the same ones on every run); tensor values come from a
torch.Generator seeded by a drawn seed, so a failing example reproduces as printed.
FASTTRANS_FUZZ_EXAMPLES=n draws n fresh random examples per test instead, for long runs (and
as many random raw-op calls per op, from a fresh seed).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fasttrans
from fasttrans import functional
from fasttrans.backends import BackendUnavailableError

from helpers import fuzz_settings as _fuzz
from helpers import subnormal_weight_with_inf_value

_LONG_RUN = os.environ.get("FASTTRANS_FUZZ_EXAMPLES")  # also the number of drawn raw-op calls per op


pytestmark = pytest.mark.usefixtures("one_thread", "ext")

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
FLOATS = [F64, F32, F16, BF16]
# extension vs reference: the same formulas in a different order (fp32 / fp64 accumulation in
# both); low precision outputs are rounded once from fp32, so they differ by an ulp or two
TOL = {
    F64: dict(atol=1e-9, rtol=1e-9),
    F32: dict(atol=5e-5, rtol=5e-5),
    F16: dict(atol=4e-3, rtol=4e-3),
    BF16: dict(atol=3.2e-2, rtol=3.2e-2),
}
# gradients (of float32 / float64 inputs; parameters of other dtypes receive theirs in their dtype)
GRAD_TOL = {F64: dict(atol=1e-8, rtol=1e-8), F32: dict(atol=2e-4, rtol=2e-4),
            F16: dict(atol=1e-2, rtol=1e-2), BF16: dict(atol=6e-2, rtol=6e-2)}


def _grad_tol(*dtypes) -> dict:
    """The loosest of the dtypes' gradient tolerances: a float64 parameter of a float32 op
    gets a gradient computed in float32, and a float32 mask of a float64 op one in float32."""
    return max((GRAD_TOL[d] for d in dtypes), key=lambda t: t["atol"])


# --------------------------------------------------------------------------------------
# tensors from specs
# --------------------------------------------------------------------------------------
# Memory layouts, all legitimately accepted by every op (the logical shape is the same):
LAYOUTS = [
    "contiguous",
    "transposed",    # the last two dims swapped in memory: inner stride != 1 (a copy is made)
    "permuted",      # dims 1 and 2 swapped in memory (the heads of a merged (B, L, H*D) tensor)
    "expanded",      # stride 0 on every dim but the last (broadcast, never materialised)
    "stride0",       # stride 0 in every dim: one element seen everywhere
    "overlap",       # stride 1 in every dim: rows overlap in memory (as_strided)
    "overlap_lead",  # the last two dims dense, the leading dims stride 1 (overlapping matrices)
    "inner_stride",  # every other element of the last dim
    "offset",        # one element into the storage: data misaligned for SIMD
]


def _values(g, shape, dtype, scale=1.0, shift=0.0):
    """Values from g: normal * scale + shift for floating dtypes."""
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.6
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if not dtype.is_floating_point:
        return torch.randint(-3, 4, shape, generator=g).to(dtype)
    return (torch.randn(shape, generator=g, dtype=F64) * scale + shift).to(dtype)


def _tensor(g, shape, dtype, layout="contiguous", scale=1.0, shift=0.0):
    """A tensor of ``shape`` and ``dtype`` with values from ``g``, laid out as ``layout``."""
    shape = tuple(shape)
    n = len(shape)

    def values(s):
        return _values(g, s, dtype, scale, shift)

    if layout == "contiguous" or n == 0:
        return values(shape)
    if layout == "transposed" and n >= 2:
        return values(shape[:-2] + (shape[-1], shape[-2])).transpose(-1, -2)
    if layout == "permuted" and n >= 3:
        return values((shape[0], shape[2], shape[1]) + shape[3:]).transpose(1, 2)
    if layout == "expanded":
        return values((1,) * (n - 1) + shape[-1:]).expand(shape)
    if layout == "stride0":
        return values((1,)).as_strided(shape, (0,) * n)
    if layout == "overlap":
        return values((1 + sum(max(s - 1, 0) for s in shape),)).as_strided(shape, (1,) * n)
    if layout == "overlap_lead" and n >= 2:
        size = 1 + sum(max(s - 1, 0) for s in shape[:-2]) + max(shape[-2] - 1, 0) * shape[-1] + max(shape[-1] - 1, 0)
        return values((size,)).as_strided(shape, (1,) * (n - 2) + (shape[-1], 1))
    if layout == "inner_stride":
        return values(shape[:-1] + (2 * shape[-1],))[..., ::2]
    if layout == "offset":
        return values((math.prod(shape) + 1,))[1:].view(shape)
    return values(shape)  # a layout that needs more dims: contiguous


def _set_one(g, t: torch.Tensor, value: float) -> None:
    """t[i] = value at a random index i, in place (into the storage of a view: a stride-0 or
    overlapping layout shows the value at every index that shares the element)."""
    idx = tuple(int(torch.randint(s, (1,), generator=g)) for s in t.shape)
    with torch.no_grad():
        t[idx] = value


def _first(mask: torch.Tensor) -> tuple:
    return tuple(int(i) for i in mask.nonzero()[0])


def _compare(name: str, ext, ref, tol) -> None:
    """ext equals ref within tol wherever ref is not NaN, and is NaN only where ref is."""
    assert (ext is None) == (ref is None), f"{name}: extension {ext is None and 'None'} vs reference {ref is None and 'None'}"
    if ext is None:
        return
    assert ext.shape == ref.shape, f"{name}: shape {tuple(ext.shape)} != reference {tuple(ref.shape)}"
    assert ext.dtype == ref.dtype, f"{name}: dtype {ext.dtype} != reference {ref.dtype}"
    assert ext.device == ref.device, f"{name}: device {ext.device} != reference {ref.device}"
    if ext.device.type == "meta" or not ext.dtype.is_floating_point:
        return
    nan_here = ext.isnan() & ~ref.isnan()
    assert not nan_here.any(), (
        f"{name}: NaN where the reference has numbers ({int(nan_here.sum())} of {ext.numel()}, first at "
        f"{_first(nan_here)}: reference {ref[_first(nan_here)].item()})")
    # where the reference has NaN the extension may have a number: the reference's autograd gives
    # 0 * inf = NaN gradients where the kernels skip a masked key or row outright
    keep = ~ref.isnan()
    torch.testing.assert_close(ext[keep], ref[keep], **tol, msg=lambda m: f"{name}: {m}")


# --------------------------------------------------------------------------------------
# outcomes
# --------------------------------------------------------------------------------------
_NAMES = re.compile(r"^([A-Za-z_]\w*(?:, [A-Za-z_]\w*)*): ")


def _named(err: BaseException) -> set[str]:
    """The arguments an error message names in fasttrans's form "q: expected ...", "k, v: ..."."""
    msg = str(err)
    if msg.startswith("dropout probability has to be between 0 and 1"):  # torch's wording, for dropout's p
        return {"p"}
    m = _NAMES.match(msg)
    return set(m.group(1).split(", ")) if m else set()


def _outcome(call):
    """('ok', outputs) or ('error', exception) of one call, warnings silenced (they are tested elsewhere)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = call()
    except Exception as e:  # noqa: BLE001 - every exception is judged below
        return "error", e
    return "ok", out if isinstance(out, tuple) else (out,)


def _check_error(err: BaseException, allowed: set[str], backend: str, case) -> None:
    assert isinstance(err, (ValueError, TypeError, RuntimeError)), (
        f"{backend}: {type(err).__name__} is not a ValueError/TypeError/RuntimeError: {err}\ncase: {case}")
    named = _named(err)
    assert named, f"{backend}: the error names no argument: {type(err).__name__}: {err}\ncase: {case}"
    assert named & allowed, (
        f"{backend}: the error names {sorted(named)}, not one of the corrupted arguments {sorted(allowed)}: "
        f"{type(err).__name__}: {err}\ncase: {case}")


def _judge(case, run, compare, unavailable: tuple[str, ...] = (), backend: str = "extension"):
    """Run ``run(backend)`` on ``backend`` and the reference and apply the rules of the module
    docstring.

    ``case['allowed']``: the names an error may name (empty: the call is valid and must succeed).
    ``unavailable``: the reasons for which ``backend`` may refuse a valid call
    (BackendUnavailableError), the message saying so.
    """
    allowed = case["allowed"]
    results = {b: run(b) for b in (backend, "reference")}
    (ek, ev), (rk, rv) = results[backend], results["reference"]
    if ek == "error" and isinstance(ev, BackendUnavailableError) and unavailable:
        assert any(why in str(ev) for why in unavailable), f"{backend}: unexpected {ev}\ncase: {case}"
        if rk == "error":
            _check_error(rv, allowed, "reference", case)
        return
    for backend, (kind, value) in results.items():
        if kind == "error" and not allowed:
            raise AssertionError(f"{backend} rejected a valid call: {type(value).__name__}: {value}\ncase: {case}") from value
        if kind == "error":
            _check_error(value, allowed, backend, case)
    if ek == "error" or rk == "error":
        assert ek == rk == "error", (
            f"{backend} {ek} ({ev if ek == 'error' else 'outputs'}), reference {rk} "
            f"({rv if rk == 'error' else 'outputs'})\ncase: {case}")
        assert (type(ev), str(ev)) == (type(rv), str(rv)), f"the backends disagree: {ev!r} vs {rv!r}\ncase: {case}"
        return
    compare(ev, rv)


def _run_with_grads(call, inputs, dtype, seed, want_grads):
    """A runner for _judge: the outputs of call() and, when asked, the gradients of a random
    loss with respect to the floating-point tensors among inputs (views included)."""
    def run(backend):
        def go():
            with fasttrans.use_backend(backend):
                torch.manual_seed(seed)  # the dropout seed: the same keep mask on both backends
                outs = call()
                outs = outs if isinstance(outs, tuple) else (outs,)
                grads = ()
                leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
                if want_grads and leaves and any(o.requires_grad for o in outs) and not any(o.is_meta for o in outs):
                    g = torch.Generator().manual_seed(seed)
                    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs)
                    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
                return tuple(o.detach() for o in outs), grads
        return _outcome(go)
    return run


@st.composite
def _corruptions(draw, catalog, first):
    """No corruption (first is None: the valid calls), or first and perhaps a second one."""
    if first is None:
        return []
    second = draw(st.sampled_from([None, None] + sorted(set(catalog) - {first})))
    return [first] if second is None else [first, second]


# --------------------------------------------------------------------------------------
# 1a. attention
# --------------------------------------------------------------------------------------
QKV = {"q", "k", "v"}
# corruption -> the arguments an error may name. Coupled shapes: q fixes B, H, Lq, D; k fixes
# Hkv, Lk; so a wrong k may be reported on v ("v: expected the shape of k") and so on.
ATTENTION_CORRUPTIONS = {
    "q_rank3": QKV, "q_rank5": QKV, "q_rank0": QKV, "k_rank3": QKV, "v_rank5": QKV,
    "q_int": QKV, "q_bool": QKV, "q_complex": QKV, "all_int": QKV, "k_other_float": QKV, "v_other_float": QKV,
    "k_batch": QKV, "k_head_dim": QKV, "v_len": QKV, "heads_not_dividing": QKV,
    "kv_heads_zero": QKV, "head_dim_zero": QKV,
    "q_meta": QKV, "k_meta": QKV, "v_meta": QKV, "q_sparse": QKV, "v_sparse": QKV, "q_list": QKV, "k_none": QKV,
    "mask_shape": {"attn_mask"}, "mask_rank5": {"attn_mask"}, "mask_int": {"attn_mask"},
    "mask_uint8": {"attn_mask"}, "mask_complex": {"attn_mask"}, "mask_meta": {"attn_mask"},
    "mask_sparse": {"attn_mask"}, "mask_list": {"attn_mask"},
    "kl_float": {"key_lengths"}, "kl_bool": {"key_lengths"}, "kl_complex": {"key_lengths"},
    "kl_shape": {"key_lengths"}, "kl_2d": {"key_lengths"}, "kl_0d": {"key_lengths"},
    "kl_negative": {"key_lengths"}, "kl_too_long": {"key_lengths"}, "kl_meta": {"key_lengths"},
    "kl_list": {"key_lengths"}, "kl_sparse": {"key_lengths"},
    "causal_int": {"is_causal"}, "causal_none": {"is_causal"}, "causal_str": {"is_causal"},
    "causal_np": {"is_causal"},
    "offset_float": {"causal_offset"}, "offset_bool": {"causal_offset"}, "offset_none": {"causal_offset"},
    "offset_np": {"causal_offset"}, "offset_tensor": {"causal_offset"},
    "p_negative": {"dropout_p"}, "p_above_one": {"dropout_p"}, "p_nan": {"dropout_p"}, "p_inf": {"dropout_p"},
    "p_neg_inf": {"dropout_p"}, "p_bool": {"dropout_p"}, "p_none": {"dropout_p"}, "p_str": {"dropout_p"},
    "p_tensor": {"dropout_p"},
    "scale_nan": {"scale"}, "scale_inf": {"scale"}, "scale_neg_inf": {"scale"}, "scale_str": {"scale"},
    "scale_tensor": {"scale"}, "scale_complex": {"scale"},
    "softcap_negative": {"softcap"}, "softcap_nan": {"softcap"}, "softcap_inf": {"softcap"},
    "softcap_str": {"softcap"}, "softcap_bool": {"softcap"}, "softcap_tensor": {"softcap"},
}
# Accepted edge values of the scalars (no corruption): any int causal_offset (clamped to
# [-Lq, Lk]: past those every key / no key is visible), dropout 0 or 1 (zeros, as torch) or
# any probability in between, any finite scale of moderate size (0 and negative included;
# for scales near the float32 range or subnormal see test_extreme_finite_scale_gives_no_nan).
OFFSETS = [0, 1, -1, 3, -3, 10**9, -10**9, 10**30, -10**30, 2**63, -2**63 - 1]
DROPOUTS = [0.0, 0.0, 0.0, 0, 1.0, 1, 0.3, 1e-300, 1 - 1e-16, np.float64(0.5)]
SCALES = [None, None, 0.0, -0.0, 1, -2.5, 1e-30, 0.125, 30.0, np.float64(0.5)]
# any finite cap >= 0 (None or 0: none); Triton's capped scores carry an absolute error of about 1.2e-7 times
# the cap (docs/semantics.md), so the caps here stay within a few hundred times the scores
SOFTCAPS = [None, None, None, None, 0, 0.5, 50.0, 1e-30, np.float64(3.0)]
MASK_DTYPES = [torch.bool, torch.bool, F32, F64, F16, BF16, "q"]
MASK_VALUES = ["random", "random", "neg_inf", "all_neg_inf", "all_blocked", "pos_inf", "nan", "huge"]
# inf / NaN at one place of q, k or v (and test_inf_in_v_with_a_subnormal_weight)
SPECIAL_VALUES = [None, None, None, None, "q_inf", "k_inf", "v_inf", "v_nan", "q_nan", "k_nan"]


@st.composite
def attention_cases(draw, corruption=None):
    dtype = draw(st.sampled_from(FLOATS))
    Hkv = draw(st.integers(1, 3))
    H = Hkv * draw(st.integers(1, 3))
    case = dict(
        dtype=dtype,
        B=draw(st.sampled_from([1, 2, 3, 0])), H=H, Hkv=Hkv,
        Lq=draw(st.sampled_from([1, 2, 3, 5, 9, 0])), Lk=draw(st.sampled_from([1, 2, 4, 7, 17, 0])),
        D=draw(st.sampled_from([1, 2, 3, 8, 16, 17, 257] if dtype in (F32, F64) else [1, 2, 8, 16, 17])),
        # v's head dim minus q's and k's (valid: the smaller side is padded)
        Dv_extra=draw(st.sampled_from([0, 0, 0, 0, 1, -1, 5])),
        layouts=[draw(st.sampled_from(LAYOUTS)) for _ in range(3)],
        mask=None, key_lengths=None,
        is_causal=draw(st.booleans()), causal_offset=draw(st.sampled_from(OFFSETS)),
        dropout_p=draw(st.sampled_from(DROPOUTS)), scale=draw(st.sampled_from(SCALES)),
        special=draw(st.sampled_from(SPECIAL_VALUES)),
        magnitude=draw(st.sampled_from([1.0, 1.0, 1e-3, 10.0])),
        corruptions=draw(_corruptions(ATTENTION_CORRUPTIONS, corruption)),
        grads=dtype in (F32, F64) and draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )
    if draw(st.booleans()):
        case["mask"] = dict(
            dtype=draw(st.sampled_from(MASK_DTYPES)),
            # which of (B, H, Lq, Lk) the mask has (1 = broadcast dim), as a 0-4-D tensor
            dims=draw(st.sampled_from([4, 4, 3, 2, 1, 0])), broadcast=draw(st.lists(st.booleans(), min_size=4, max_size=4)),
            values=draw(st.sampled_from(MASK_VALUES)), layout=draw(st.sampled_from(LAYOUTS)),
            grad=draw(st.booleans()),
        )
    if draw(st.booleans()):
        case["key_lengths"] = dict(
            dtype=draw(st.sampled_from([torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])),
            layout=draw(st.sampled_from(["contiguous", "expanded", "inner_stride", "offset"])),
            values=draw(st.sampled_from(["random", "zeros", "full"])),
        )
    case["softcap"] = draw(st.sampled_from(SOFTCAPS))
    case["allowed"] = set().union(*(ATTENTION_CORRUPTIONS[c] for c in case["corruptions"]))
    return case


def _attention_args(case):
    """(q, k, v, kwargs, inputs that may take gradients) of a case, corruptions applied."""
    g = torch.Generator().manual_seed(case["seed"])
    dtype, B, H, Hkv, Lq, Lk, D = (case[n] for n in ("dtype", "B", "H", "Hkv", "Lq", "Lk", "D"))
    c = set(case["corruptions"])
    if "heads_not_dividing" in c:
        H, Hkv = 3, 2
    if "kv_heads_zero" in c:
        Hkv = 0
    if "head_dim_zero" in c:
        D = 0
    qdt = {"q_int": torch.int32, "q_bool": torch.bool, "q_complex": torch.complex64,
           "all_int": torch.int64}.get(next((x for x in c if x in ("q_int", "q_bool", "q_complex", "all_int")), ""), dtype)
    other = F64 if dtype != F64 else F32
    kdt = torch.int64 if "all_int" in c else other if "k_other_float" in c else dtype
    vdt = torch.int64 if "all_int" in c else other if "v_other_float" in c else dtype
    mag = case["magnitude"]
    q = _tensor(g, (B, H, Lq, D), qdt, case["layouts"][0], mag)
    k = _tensor(g, (B + ("k_batch" in c), Hkv, Lk, D + ("k_head_dim" in c)), kdt, case["layouts"][1], mag)
    Dv = max(1, D + case["Dv_extra"]) if D > 0 else D
    v = _tensor(g, (B + ("k_batch" in c), Hkv, Lk + ("v_len" in c), Dv + ("k_head_dim" in c)), vdt, case["layouts"][2])
    special = case["special"]
    if special and q.dtype.is_floating_point and min(q.numel(), k.numel(), v.numel()) > 0:
        _set_one(g, {"q": q, "k": k, "v": v}[special[0]], {"inf": math.inf, "nan": math.nan}[special[2:]])
    grads = case["grads"] and all(t.dtype == dtype for t in (q, k, v))
    inputs = []
    if grads:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        inputs += [q, k, v]
    mask = None
    if case["mask"] is not None:
        m = case["mask"]
        full = (B, H, Lq, Lk)
        shape = tuple(1 if b else s for s, b in zip(full, m["broadcast"]))[4 - m["dims"]:]
        mdt = dtype if m["dtype"] == "q" else m["dtype"]
        if m["values"] == "random":
            mask = _tensor(g, shape, mdt, m["layout"])
        else:
            blocked = {"neg_inf": torch.rand(shape, generator=g) < 0.3, "all_neg_inf": torch.ones(shape, dtype=torch.bool),
                       "all_blocked": torch.ones(shape, dtype=torch.bool)}.get(m["values"])
            if mdt == torch.bool:
                mask = ~blocked if blocked is not None else torch.rand(shape, generator=g) < 0.7
            else:
                fill = {"pos_inf": math.inf, "nan": math.nan, "huge": 3e38 if mdt != F16 else 6e4}.get(m["values"])
                mask = _values(g, shape, mdt)
                mask = mask.masked_fill(blocked, -math.inf) if blocked is not None else \
                    mask.masked_fill(torch.rand(shape, generator=g) < 0.3, fill)
            if m["layout"] in ("expanded", "stride0") and mask.numel():
                mask = mask.reshape(-1)[:1].reshape((1,) * len(shape)).expand(shape)
            elif m["layout"] == "transposed" and mask.dim() >= 2:
                mask = mask.transpose(-1, -2).contiguous().transpose(-1, -2)
        if m["values"] == "huge":  # see test_gradients_of_rows_of_huge_scores: forward only
            grads = False
            inputs = []
            q, k, v = (t.detach() for t in (q, k, v))
        if m["grad"] and grads and mask.dtype in (F32, F64):
            mask = mask.detach().requires_grad_()
            inputs.append(mask)
    kl = None
    if case["key_lengths"] is not None:
        spec = case["key_lengths"]
        top = min(Lk, torch.iinfo(spec["dtype"]).max)
        values = {"random": torch.randint(0, top + 1, (B,), generator=g), "zeros": torch.zeros(B, dtype=torch.int64),
                  "full": torch.full((B,), top)}[spec["values"]].to(spec["dtype"])
        kl = values if spec["layout"] == "contiguous" or B == 0 else {
            "expanded": values[:1].expand(B),
            "inner_stride": torch.stack([values, values], 1).reshape(-1)[::2],
            "offset": torch.cat([values[:1], values])[1:],
        }[spec["layout"]]
    kw = dict(attn_mask=mask, key_lengths=kl, is_causal=case["is_causal"], causal_offset=case["causal_offset"],
              dropout_p=case["dropout_p"], scale=case["scale"], softcap=case["softcap"])
    # the other corruptions
    if "q_rank3" in c:
        q = q.flatten(0, 1)
    if "q_rank5" in c:
        q = q[None]
    if "q_rank0" in c:
        q = torch.tensor(1.0, dtype=dtype)
    if "k_rank3" in c:
        k = k.flatten(0, 1)
    if "v_rank5" in c:
        v = v[None]
    for name, t in (("q", q), ("k", k), ("v", v)):  # one of these per tensor
        if f"{name}_none" in c:
            t = None
        elif f"{name}_list" in c:
            t = t.detach().tolist()
        elif f"{name}_sparse" in c:
            t = t.detach().to_sparse()
        elif f"{name}_meta" in c:
            t = t.detach().to("meta")
        q, k, v = (t if n == name else x for n, x in zip("qkv", (q, k, v)))
    if "mask_shape" in c:
        kw["attn_mask"] = torch.ones(Lq + 2, Lk + 1, dtype=torch.bool)
    if "mask_rank5" in c:
        kw["attn_mask"] = torch.ones(1, B, H, Lq, Lk, dtype=torch.bool)
    if "mask_int" in c:
        kw["attn_mask"] = torch.ones(Lq, Lk, dtype=torch.int32)
    if "mask_uint8" in c:
        kw["attn_mask"] = torch.ones(Lq, Lk, dtype=torch.uint8)
    if "mask_complex" in c:
        kw["attn_mask"] = torch.zeros(Lq, Lk, dtype=torch.complex64)
    if "mask_meta" in c:
        kw["attn_mask"] = torch.zeros(Lq, Lk, device="meta")
    if "mask_sparse" in c:
        kw["attn_mask"] = torch.ones(Lq, Lk, dtype=torch.bool).to_sparse()
    if "mask_list" in c:
        kw["attn_mask"] = [[True] * Lk] * Lq
    bad_kl = {
        "kl_float": lambda: torch.full((B,), float(Lk)), "kl_bool": lambda: torch.ones(B, dtype=torch.bool),
        "kl_complex": lambda: torch.ones(B, dtype=torch.complex64), "kl_shape": lambda: torch.zeros(B + 1, dtype=torch.int64),
        "kl_2d": lambda: torch.zeros(B, 1, dtype=torch.int64), "kl_0d": lambda: torch.tensor(0),
        "kl_negative": lambda: torch.full((B,), -1), "kl_too_long": lambda: torch.full((B,), Lk + 1),
        "kl_meta": lambda: torch.zeros(B, dtype=torch.int64, device="meta"), "kl_list": lambda: [Lk] * B,
        "kl_sparse": lambda: torch.zeros(B, dtype=torch.int64).to_sparse(),
    }
    for name, make in bad_kl.items():
        if name in c:
            kw["key_lengths"] = make()
    scalars = {
        "causal_int": ("is_causal", 1), "causal_none": ("is_causal", None), "causal_str": ("is_causal", "True"),
        "causal_np": ("is_causal", np.bool_(True)),
        "offset_float": ("causal_offset", 1.5), "offset_bool": ("causal_offset", True),
        "offset_none": ("causal_offset", None), "offset_np": ("causal_offset", np.int64(1)),
        "offset_tensor": ("causal_offset", torch.tensor(1)),
        "p_negative": ("dropout_p", -0.1), "p_above_one": ("dropout_p", 1.5), "p_nan": ("dropout_p", math.nan),
        "p_inf": ("dropout_p", math.inf), "p_neg_inf": ("dropout_p", -math.inf), "p_bool": ("dropout_p", True),
        "p_none": ("dropout_p", None), "p_str": ("dropout_p", "0.1"), "p_tensor": ("dropout_p", torch.tensor(0.1)),
        "scale_nan": ("scale", math.nan), "scale_inf": ("scale", math.inf), "scale_neg_inf": ("scale", -math.inf),
        "scale_str": ("scale", "1.0"), "scale_tensor": ("scale", torch.tensor(1.0)), "scale_complex": ("scale", 1j),
        "softcap_negative": ("softcap", -1.0), "softcap_nan": ("softcap", math.nan),
        "softcap_inf": ("softcap", math.inf), "softcap_str": ("softcap", "50"), "softcap_bool": ("softcap", True),
        "softcap_tensor": ("softcap", torch.tensor(50.0)),
    }
    for name, (arg, value) in scalars.items():
        if name in c:
            kw[arg] = value
    return q, k, v, kw, inputs


def _score_scale(q, k, scale) -> float:
    """max(1, S / 30) with S a bound on |scale * q . k| (finite entries): both implementations
    round scores of size S, so the probabilities carry relative errors of about ulp(S), and
    the outputs and gradients with them."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)) or q.is_meta or k.numel() == 0 \
            or q.numel() == 0 or q.dim() != 4:
        return 1.0
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else abs(float(scale))
    qa, ka = (t.detach().double().abs().nan_to_num(0.0, 0.0, 0.0) for t in (q, k))
    return max(1.0, scale * qa.sum(-1).max().item() * ka.max().item() / 30)


def _scaled(tol: dict, c: float) -> dict:
    return dict(atol=tol["atol"] * c, rtol=tol["rtol"] * c)


@_fuzz(1500)
@given(case=attention_cases())
def test_attention_edge_inputs(case):
    """Valid calls, edge cases included: they must succeed and match the reference."""
    _check_attention(case)


@pytest.mark.parametrize("corruption", sorted(ATTENTION_CORRUPTIONS))
@_fuzz(12)
@given(data=st.data())
def test_attention_bad_inputs(corruption, data):
    """Calls with this corruption (and perhaps a second one): a named error, or (for a
    corruption that a call happens to make valid) the reference's outputs."""
    _check_attention(data.draw(attention_cases(corruption), label="case"))


def _check_attention(case, backend="extension"):
    q, k, v, kw, inputs = _attention_args(case)
    run = _run_with_grads(lambda: fasttrans.attention(q, k, v, **kw), inputs, case["dtype"], case["seed"], True)

    def compare(ext, ref):
        (out_e, grads_e), (out_r, grads_r) = ext, ref
        c = _score_scale(q, k, kw["scale"])
        _compare("out", out_e[0], out_r[0], _scaled(TOL[case["dtype"]], c))
        for i, (a, b) in enumerate(zip(grads_e, grads_r)):
            _compare(f"gradient {i}", a, b, _scaled(_grad_tol(b.dtype, case["dtype"]), c) if b is not None else {})

    # the extension runs neither meta tensors nor head dims past 256 (documented); the reference does
    _judge(case, run, compare, unavailable=("does not support device type 'meta'", "head dim"), backend=backend)


# The same valid edge inputs through the Triton kernels (without a GPU: Triton's interpreter,
# tests/conftest.py), which have no float64, and whose bfloat16 results the interpreter
# rounds differently from a GPU (its float32 -> bfloat16 casts truncate), so bfloat16 is
# checked only on CUDA (pytest -m gpu runs the Triton test files there).
_TRITON_WHY = fasttrans.backends.BACKENDS["triton"].unavailable_reason("cpu", "attention")
_TRITON_DTYPES = (torch.float32, torch.float16)
needs_triton = pytest.mark.skipif(_TRITON_WHY is not None, reason=f"triton: {_TRITON_WHY}")


@pytest.mark.slow
@needs_triton
@_fuzz(200)
@given(case=attention_cases().filter(lambda c: c["dtype"] in _TRITON_DTYPES))
def test_triton_attention_edge_inputs(case):
    """Valid calls, edge cases included, on the Triton kernels: they must match the reference."""
    _check_attention(case, "triton")


# --------------------------------------------------------------------------------------
# 1b. layer_norm, add_layer_norm, rms_norm
# --------------------------------------------------------------------------------------
NORM_CORRUPTIONS = {
    "x_int": {"x"}, "x_bool": {"x"}, "x_complex": {"x"}, "x_sparse": {"x"}, "x_list": {"x"},
    # x on the meta device, its parameters not: the parameters are the ones on the wrong device
    "x_meta": {"x", "weight", "bias", "residual"},
    "ns_mismatch": {"normalized_shape"}, "ns_too_long": {"normalized_shape"}, "ns_empty": {"normalized_shape"},
    "ns_negative": {"normalized_shape"}, "ns_str": {"normalized_shape"}, "ns_float": {"normalized_shape"},
    "ns_tensor": {"normalized_shape"}, "ns_np": {"normalized_shape"},
    "weight_shape": {"weight"}, "weight_2d": {"weight"}, "weight_int": {"weight"}, "weight_complex": {"weight"},
    "weight_other_float": {"weight"}, "weight_meta": {"weight"}, "weight_sparse": {"weight"},
    "weight_list": {"weight"},
    "bias_shape": {"bias"}, "bias_int": {"bias"}, "bias_bool": {"bias"}, "bias_other_float": {"bias"},
    "bias_meta": {"bias"}, "bias_list": {"bias"},
    "eps_negative": {"eps"}, "eps_nan": {"eps"}, "eps_inf": {"eps"}, "eps_neg_inf": {"eps"}, "eps_str": {"eps"},
    "eps_bool": {"eps"}, "eps_tensor": {"eps"}, "eps_complex": {"eps"}, "eps_none": {"eps"},
    "residual_shape": {"residual"}, "residual_broadcast": {"residual"}, "residual_dtype": {"residual"},
    "residual_meta": {"residual"}, "residual_none": {"residual"}, "residual_list": {"residual"},
    "residual_sparse": {"residual"},
}
# Accepted eps: any finite non-negative float or int (0 too: rows of zero variance give NaN,
# as torch), None for rms_norm (torch's default).
EPS = [1e-5, 1e-5, 0.0, 0, 1, 1e-12, 1e3, 5e-324, -0.0]


@st.composite
def norm_cases(draw, corruption=None):
    op = draw(st.sampled_from(["layer_norm", "add_layer_norm", "rms_norm"]))
    dtype = draw(st.sampled_from(FLOATS))
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 5, 17, 0]), min_size=rank, max_size=rank)))
    shape = shape[:-1] + (draw(st.sampled_from([1, 2, 7, 16, 33, 70, 0])),)
    n_dims = 1 if op == "add_layer_norm" else draw(st.integers(1, rank))
    # parameters: x's dtype, or float32 with a float16/bfloat16 x (F.layer_norm's rule); rms_norm any float
    pdt = [dtype, F32] if dtype in (F16, BF16) else [dtype]
    if op == "rms_norm":
        pdt = FLOATS
    case = dict(
        op=op, dtype=dtype, shape=shape, n_dims=n_dims,
        ns_form=draw(st.sampled_from(["tuple", "list", "size", "int"] if n_dims == 1 else ["tuple", "list", "size"])),
        layout=draw(st.sampled_from(LAYOUTS)), residual_layout=draw(st.sampled_from(LAYOUTS)),
        weight=draw(st.sampled_from([None, "contiguous", "contiguous", "expanded", "inner_stride", "offset"])),
        bias=None if op == "rms_norm" else draw(st.sampled_from([None, "contiguous", "contiguous", "expanded", "inner_stride"])),
        param_dtype=draw(st.sampled_from(pdt)),
        eps=draw(st.sampled_from(EPS + ([None] if op == "rms_norm" else []))),
        magnitude=draw(st.sampled_from([1.0, 1.0, 1e-3, 1e3])),
        offset=draw(st.sampled_from([0.0, 0.0, 5.0])),
        special=draw(st.sampled_from([None, None, None, "inf", "nan", "-inf"])),
        corruptions=draw(_corruptions(NORM_CORRUPTIONS, corruption)),
        grads=dtype in (F32, F64) and draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )
    # what does not apply to an op is no corruption of it: rms_norm takes parameters of any
    # float dtype and eps=None, and no bias; add_layer_norm has no normalized_shape; only it a residual
    case["corruptions"] = [
        c for c in case["corruptions"]
        if not ((op == "rms_norm" and (c in ("weight_other_float", "eps_none") or c.startswith("bias_")))
                or (op == "add_layer_norm" and c.startswith("ns_"))
                or (op != "add_layer_norm" and c.startswith("residual_")))]
    case["allowed"] = set().union(*(NORM_CORRUPTIONS[c] for c in case["corruptions"]))
    return case


def _norm_args(case):
    """(call, inputs that may take gradients, x, normalized_shape, weight, bias, eps) of a case."""
    g = torch.Generator().manual_seed(case["seed"])
    op, dtype, shape, n_dims = case["op"], case["dtype"], case["shape"], case["n_dims"]
    c = set(case["corruptions"])
    xdt = {"x_int": torch.int32, "x_bool": torch.bool, "x_complex": torch.complex64}.get(
        next((x for x in c if x in ("x_int", "x_bool", "x_complex")), ""), dtype)
    x = _tensor(g, shape, xdt, case["layout"], case["magnitude"], case["offset"] * case["magnitude"])
    if case["special"] and x.numel() and xdt.is_floating_point:
        _set_one(g, x, float(case["special"]))
    r = None
    if op == "add_layer_norm":
        r = _tensor(g, shape, dtype, case["residual_layout"], case["magnitude"])
    ns = shape[len(shape) - n_dims:]
    pdt = case["param_dtype"]
    w = None if case["weight"] is None else _tensor(g, ns, pdt, case["weight"], 0.5, 1.0)
    b = None if case["bias"] is None else _tensor(g, ns, pdt, case["bias"])
    grads = case["grads"] and xdt == dtype
    inputs = []
    if grads:
        x = x.detach().requires_grad_()
        r = None if r is None else r.detach().requires_grad_()
        w = None if w is None or not w.dtype.is_floating_point else w.detach().requires_grad_()
        b = None if b is None else b.detach().requires_grad_()
        inputs = [t for t in (x, r, w, b) if t is not None]
    eps = case["eps"]
    ns_arg = {"tuple": tuple(ns), "list": list(ns), "size": torch.Size(ns), "int": ns[0] if ns else 0}[case["ns_form"]]
    other = F64 if dtype != F64 else F32
    if "x_list" in c:  # one of these
        x = x.tolist()
    elif "x_sparse" in c:
        x = x.detach().to_sparse()
    elif "x_meta" in c:
        x = x.detach().to("meta")
    bad_ns = {"ns_mismatch": tuple(ns[:-1]) + (ns[-1] + 1,), "ns_too_long": (2,) + tuple(shape),
              "ns_empty": (), "ns_negative": tuple(ns[:-1]) + (-1,), "ns_str": str(ns[-1]),
              "ns_float": float(ns[-1]), "ns_tensor": torch.tensor(ns[-1]), "ns_np": np.int64(ns[-1])}
    for name, value in bad_ns.items():
        if name in c:
            ns_arg = value
    N = ns[-1]
    bad_params = {
        "weight_shape": ("w", lambda: torch.ones(N + 1, dtype=pdt)),
        "weight_2d": ("w", lambda: torch.ones((1,) + tuple(ns), dtype=pdt)),
        "weight_int": ("w", lambda: torch.ones(ns, dtype=torch.int32)),
        "weight_complex": ("w", lambda: torch.ones(ns, dtype=torch.complex64)),
        "weight_other_float": ("w", lambda: torch.ones(ns, dtype=other)),
        "weight_meta": ("w", lambda: torch.ones(ns, dtype=pdt, device="meta")),
        "weight_sparse": ("w", lambda: torch.ones(ns, dtype=pdt).to_sparse()),
        "weight_list": ("w", lambda: [1.0] * N),
        "bias_shape": ("b", lambda: torch.zeros(N + 2, dtype=pdt)),
        "bias_int": ("b", lambda: torch.zeros(ns, dtype=torch.int64)),
        "bias_bool": ("b", lambda: torch.zeros(ns, dtype=torch.bool)),
        "bias_other_float": ("b", lambda: torch.zeros(ns, dtype=other)),
        "bias_meta": ("b", lambda: torch.zeros(ns, dtype=pdt, device="meta")),
        "bias_list": ("b", lambda: [0.0] * N),
        "residual_shape": ("r", lambda: torch.zeros(shape[:-1] + (N + 1,), dtype=dtype)),
        "residual_broadcast": ("r", lambda: torch.zeros(shape[-1:], dtype=dtype)),
        "residual_dtype": ("r", lambda: torch.zeros(shape, dtype=other)),
        "residual_meta": ("r", lambda: torch.zeros(shape, dtype=dtype, device="meta")),
        "residual_none": ("r", lambda: None),
        "residual_list": ("r", lambda: torch.zeros(shape).tolist()),
        "residual_sparse": ("r", lambda: torch.zeros(shape, dtype=dtype).to_sparse()),
    }
    for name, (arg, make) in bad_params.items():
        if name in c:
            value = make()
            w, b, r = (value if a == arg else old for a, old in (("w", w), ("b", b), ("r", r)))
    bad_eps = {"eps_negative": -1e-5, "eps_nan": math.nan, "eps_inf": math.inf, "eps_neg_inf": -math.inf,
               "eps_str": "1e-5", "eps_bool": True, "eps_tensor": torch.tensor(1e-5), "eps_complex": 1e-5j,
               "eps_none": None}
    for name, value in bad_eps.items():
        if name in c:
            eps = value
    call = {
        "layer_norm": lambda: fasttrans.layer_norm(x, ns_arg, w, b, eps),
        "add_layer_norm": lambda: fasttrans.add_layer_norm(x, r, w, b, eps),
        "rms_norm": lambda: fasttrans.rms_norm(x, ns_arg, w, eps),
    }[op]
    return call, inputs, x, r, ns, w, b, eps


def _constant_rows(h: torch.Tensor, n_dims: int) -> torch.Tensor:
    """Rows (over the last n_dims dims) of h whose elements are all equal (and finite)."""
    rows = h.detach().reshape(-1, math.prod(h.shape[h.dim() - n_dims:]))
    return ((rows == rows[:, :1]).all(-1) & rows.isfinite().all(-1)).reshape(h.shape[:h.dim() - n_dims])


def _norm_conditions(h: torch.Tensor, n_dims: int, eps, rms: bool) -> tuple[float, float]:
    """(cond, rstd) over h's rows with finite statistics, in float64: the largest max|h| * rstd
    and the largest rstd = 1 / sqrt(var + eps). Both implementations round h - mean, an error of
    about ulp(|h|) * rstd in y (large for rows of tiny spread against their mean with a small
    eps: ill-conditioned for any implementation), and the gradients carry one more factor rstd."""
    if h.numel() == 0:
        return 1.0, 1.0
    rows = h.detach().double().reshape(-1, math.prod(h.shape[h.dim() - n_dims:]))
    if eps is None:
        eps = torch.finfo(F64 if h.dtype == F64 else F32).eps
    spread = rows.pow(2).mean(-1) if rms else rows.var(-1, unbiased=False)
    rstd = (spread + eps).rsqrt()
    cond = rows.abs().amax(-1) * rstd
    # rows of one repeated value are exact in both (h - mean = 0): their rstd alone, up to
    # 1 / sqrt(eps), must not scale the tolerances of the others
    ok = rstd.isfinite() & cond.isfinite() & ~(rows == rows[:, :1]).all(-1)
    if not ok.any():
        return 1.0, 1.0
    return cond[ok].max().item(), rstd[ok].max().item()


@_fuzz(1500)
@given(case=norm_cases())
def test_norms_edge_inputs(case):
    """Valid calls, edge cases included: they must succeed and match the reference."""
    _check_norm(case)


@pytest.mark.parametrize("corruption", sorted(NORM_CORRUPTIONS))
@_fuzz(15)
@given(data=st.data())
def test_norms_bad_inputs(corruption, data):
    """Calls with this corruption (and perhaps a second one; one that does not apply to the
    drawn op is dropped, leaving a valid call): a named error, or the reference's outputs."""
    _check_norm(data.draw(norm_cases(corruption), label="case"))


def _check_norm(case, backend="extension"):
    call, inputs, x, r, ns, w, b, eps = _norm_args(case)
    run = _run_with_grads(call, inputs, case["dtype"], case["seed"], True)

    def compare(ext, ref):
        (out_e, grads_e), (out_r, grads_r) = ext, ref
        y_e, y_r = out_e[0], out_r[0]
        h = (x + r) if case["op"] == "add_layer_norm" else x
        if case["op"] != "rms_norm" and y_e.numel() and y_e.device.type != "meta" \
                and _constant_rows(h, len(ns)).any():
            # Rows of one repeated value: y is exact in both (the bias; NaN for eps = 0, as
            # torch), but their gradients are rstd times terms that cancel to 0, with rstd up
            # to 1 / sqrt(eps): rounding noise times up to 4.5e161 (torch gives NaN there)
            grads_e = grads_r = ()
        cond, rstd = _norm_conditions(h, len(ns), eps, case["op"] == "rms_norm") if y_e.device.type != "meta" \
            else (1.0, 1.0)
        # the tolerances allow ~800 float32 ulps of a well-conditioned row (cond up to 100)
        y_scale = max(1.0, cond / 100)
        tol = TOL[case["dtype"]]
        _compare("y", y_e, y_r, dict(atol=tol["atol"] * y_scale, rtol=tol["rtol"]))
        for i, (a, b_) in enumerate(zip(out_e[1:], out_r[1:])):
            _compare("h", a, b_, TOL[case["dtype"]])
        scale = y_scale * max(1.0, rstd)
        for i, (a, b_) in enumerate(zip(grads_e, grads_r)):
            if b_ is not None:
                tol = _grad_tol(b_.dtype, case["dtype"])
                _compare(f"gradient {i}", a, b_, dict(atol=tol["atol"] * scale, rtol=tol["rtol"]))
            else:
                _compare(f"gradient {i}", a, b_, {})

    _judge(case, run, compare, unavailable=("does not support device type 'meta'",), backend=backend)


@needs_triton
@_fuzz(300)
@given(case=norm_cases().filter(lambda c: c["dtype"] in _TRITON_DTYPES))
def test_triton_norms_edge_inputs(case):
    """Valid calls, edge cases included, on the Triton kernels: they must match the reference."""
    _check_norm(case, "triton")


# --------------------------------------------------------------------------------------
# 1c. dropout
# --------------------------------------------------------------------------------------
DROPOUT_CORRUPTIONS = {
    "input_int": {"input"}, "input_bool": {"input"}, "input_complex": {"input"}, "input_list": {"input"},
    "input_sparse": {"input"},
    "p_negative": {"p"}, "p_above_one": {"p"}, "p_nan": {"p"}, "p_inf": {"p"}, "p_neg_inf": {"p"},
    "p_bool": {"p"}, "p_none": {"p"}, "p_str": {"p"}, "p_tensor": {"p"},
}


@st.composite
def dropout_cases(draw, corruption=None):
    dtype = draw(st.sampled_from(FLOATS))
    rank = draw(st.integers(0, 3))
    case = dict(
        dtype=dtype, shape=tuple(draw(st.lists(st.sampled_from([1, 2, 3, 63, 64, 65, 0]), min_size=rank, max_size=rank))),
        layout=draw(st.sampled_from(LAYOUTS)),
        # accepted: p in [0, 1] as float or int (0 and training=False return the input itself, 1 zeros)
        p=draw(st.sampled_from([0.5, 0.5, 0.1, 0.0, 0, 1.0, 1, 1e-300, 1 - 1e-16, np.float64(0.25)])),
        training=draw(st.sampled_from([True, True, True, False])),
        inplace=draw(st.booleans()), meta=draw(st.sampled_from([False] * 7 + [True])),
        special=draw(st.sampled_from([None, None, "inf", "nan"])),
        corruptions=draw(_corruptions(DROPOUT_CORRUPTIONS, corruption)),
        grads=dtype in (F32, F64) and draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )
    case["allowed"] = set().union(*(DROPOUT_CORRUPTIONS[c] for c in case["corruptions"]))
    return case


@_fuzz(600)
@given(case=dropout_cases())
def test_dropout_edge_inputs(case):
    """Valid calls, edge cases included: they must succeed and match the reference."""
    _check_dropout(case)


@pytest.mark.parametrize("corruption", sorted(DROPOUT_CORRUPTIONS))
@_fuzz(12)
@given(data=st.data())
def test_dropout_bad_inputs(corruption, data):
    """Calls with this corruption (and perhaps a second one): a named error."""
    _check_dropout(data.draw(dropout_cases(corruption), label="case"))


def _check_dropout(case):
    c = set(case["corruptions"])
    dtype = {"input_int": torch.int32, "input_bool": torch.bool, "input_complex": torch.complex64}.get(
        next((x for x in c if x.startswith("input_") and x not in ("input_list", "input_sparse")), ""), case["dtype"])
    p = {"p_negative": -0.1, "p_above_one": 1.5, "p_nan": math.nan, "p_inf": math.inf, "p_neg_inf": -math.inf,
         "p_bool": True, "p_none": None, "p_str": "0.5", "p_tensor": torch.tensor(0.5)}.get(
        next((x for x in c if x.startswith("p_")), ""), case["p"])
    # in place: a fresh copy per backend; overlapping memory cannot be written in place (torch's
    # error for the same call of F.dropout), so the layout is dense then
    layout = "contiguous" if case["inplace"] and case["layout"] in ("expanded", "stride0", "overlap", "overlap_lead") \
        else case["layout"]
    base = _tensor(torch.Generator().manual_seed(case["seed"]), case["shape"], dtype, layout)
    if case["special"] and base.numel() and dtype.is_floating_point:
        _set_one(torch.Generator().manual_seed(case["seed"]), base, float(case["special"]))

    def make():
        x = base.clone() if case["inplace"] else base
        if "input_list" in c:
            return x.tolist()
        if "input_sparse" in c:
            return x.to_sparse()
        return x.to("meta") if case["meta"] else x

    def run(backend):
        def go():
            x = make()
            leaves = []
            if case["grads"] and isinstance(x, torch.Tensor) and x.dtype.is_floating_point and not x.is_meta and not case["inplace"]:
                x = x.detach().requires_grad_()
                leaves = [x]
            with fasttrans.use_backend(backend):
                torch.manual_seed(case["seed"])
                y = functional.dropout(x, p, case["training"], case["inplace"])
                grads = ()
                if leaves and y.requires_grad:
                    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(case["seed"]), dtype=y.dtype)
                    grads = torch.autograd.grad((y * g).sum(), leaves)
                return (y.detach(), x.detach() if case["inplace"] else None), grads
        return _outcome(go)

    def compare(ext, ref):
        (out_e, grads_e), (out_r, grads_r) = ext, ref
        _compare("output", out_e[0], out_r[0], TOL[case["dtype"]])
        _compare("input after an in-place call", out_e[1], out_r[1], TOL[case["dtype"]])
        for a, b in zip(grads_e, grads_r):
            _compare("gradient", a, b, GRAD_TOL[b.dtype])

    _judge(case, run, compare, unavailable=("does not support device type 'meta'",))


# --------------------------------------------------------------------------------------
# 1d. numeric edge cases of the public functions
# --------------------------------------------------------------------------------------
_HUGE_SCALE = ([1.0, 1.0], [2.0, -1.0], [3.0, 4.0], 2e38, F32, [3.0, 4.0])  # score 1 * 2e38: finite, one key: out = v
_SUBNORMAL_SCALE = ([-0.3], [math.inf], [2.0], 5e-324, F64, [0.0])  # score -inf * 5e-324 = -inf: no visible key


@pytest.mark.parametrize("backend,q,k,v,scale,dtype,expected", [
    ("extension", *_HUGE_SCALE), ("extension", *_SUBNORMAL_SCALE),
    pytest.param("triton", *_HUGE_SCALE, marks=needs_triton),  # (the Triton kernels take no float64)
], ids=["extension-huge", "extension-subnormal-with-inf-key", "triton-huge"])
def test_extreme_finite_scale_gives_no_nan(backend, q, k, v, scale, dtype, expected):
    # The scores are (q . k) * scale, as the reference's: a q scaled first overflows in the
    # first case ((2e38 q) . k = inf - 2e38) and underflows to 0 in the second (0 * inf = NaN).
    q, k, v = (torch.tensor([[[t]]], dtype=dtype) for t in (q, k, v))
    with fasttrans.use_backend("reference"):
        ref = fasttrans.attention(q, k, v, scale=scale)
    with fasttrans.use_backend(backend):
        out = fasttrans.attention(q, k, v, scale=scale)
    assert ref.flatten().tolist() == expected
    _compare("out", out, ref, TOL[dtype])


# lse = m + log(l) in one float32 loses log(l) when m is huge: both backends recompute such rows
@pytest.mark.parametrize("backend", ["extension", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("fill", [-1e9, torch.finfo(torch.float32).min], ids=["-1e9", "finfo.min"])
def test_gradients_of_rows_of_huge_scores(backend, fill):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 2, 8, generator=g)
    k, v = torch.randn(1, 1, 8, 8, generator=g), torch.randn(1, 1, 8, 8, generator=g)
    mask = torch.zeros(1, 1, 2, 8)
    mask[..., 1, :] = fill  # query 1 sees every key through the same huge finite value
    grads = {}
    for name in (backend, "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with fasttrans.use_backend(name):
            out = fasttrans.attention(*leaves, attn_mask=mask)
        grads[name] = torch.autograd.grad(out.sum(), leaves)
    for name, a, b in zip("qkv", grads[backend], grads["reference"]):
        _compare(f"gradient of {name}", a, b, GRAD_TOL[F32])


# A weight below FLT_MIN times an inf in v is inf (the reference's 5.5e-42 * inf). The
# extension's vectorised exp (at::vec exp_u20) flushes such weights to 0, so 0 * inf = NaN
# sends the query block back through the keys with std::exp. Lq = 2 takes the scores as dot
# products, 40 from tiles of K transposed per block, 300 from the transposed copy of K (in
# several query blocks); Lk = 300 puts the inf key in a later key tile than the largest score.
# The Triton cases run through the interpreter, whose exp2 keeps subnormals (on a GPU it is
# ex2.approx.ftz.f32: see docs/semantics.md, "Subnormal weights").
@pytest.mark.parametrize("backend,dtype", [
    ("extension", F32), ("extension", BF16), ("extension", F64),
    pytest.param("triton", F32, marks=needs_triton), pytest.param("triton", BF16, marks=needs_triton),
], ids=["extension-float32", "extension-bfloat16", "extension-float64", "triton-float32", "triton-bfloat16"])
@pytest.mark.parametrize("Lq,Lk", [(1, 2), (2, 9), (40, 9), (300, 300)])
def test_inf_in_v_with_a_subnormal_weight(backend, dtype, Lq, Lk):
    q, k, v, ref = subnormal_weight_with_inf_value(Lq, Lk, dtype)
    with fasttrans.use_backend(backend):
        out = fasttrans.attention(q, k, v, scale=1.0)
    _compare("out", out, ref, TOL[dtype])
    assert out[:, 1, :, 3].isnan().all()


@pytest.mark.parametrize("dtype,row", [(F32, [1e30, 2e30, 3e30]), (F32, [1e30, 2e30, 3e30] * 11),
                                       (F64, [1e200, -2e200, 3e200, 0.5e200])],
                         ids=["float32", "float32-vectors", "float64"])
def test_layer_norm_of_huge_values_gives_no_nan(dtype, row):
    # The squares about the mean overflow (|h| above ~1.8e19 in float32, ~1.3e154 in float64):
    # the variance is inf, rstd 0 and y = 0 * w + b, as the reference's two-pass variance gives.
    # The one-pass sums used to give inf - inf = NaN. (torch's own F.layer_norm gives NaN for
    # these rows; the exact values are finite.)
    x = torch.tensor([row], dtype=dtype)
    n = len(row)
    w = torch.linspace(0.5, 1.5, n, dtype=dtype)
    b = torch.linspace(-1.0, 1.0, n, dtype=dtype)
    g = torch.linspace(-2.0, 2.0, n, dtype=dtype)
    results = {}
    for backend in ("extension", "reference"):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        with fasttrans.use_backend(backend):
            y = fasttrans.layer_norm(leaves[0], (n,), leaves[1], leaves[2])
            y2, h = fasttrans.add_layer_norm(leaves[0], leaves[0] * 0.5, leaves[1], leaves[2], 1e-5)
        grads = torch.autograd.grad(((y + y2) * g).sum(), leaves)
        results[backend] = (y.detach(), y2.detach(), *grads)
    assert not any(t.isnan().any() for t in results["reference"])
    assert torch.equal(results["reference"][0], b.unsqueeze(0))  # the exact answer: rstd = 0
    for name, a, r in zip(("y", "add_layer_norm y", "dx", "dw", "db"), results["extension"], results["reference"]):
        _compare(name, a, r, TOL[dtype])


@pytest.mark.parametrize("eps", [0.0, 1e-5])
def test_layer_norm_of_constant_rows(eps):
    # h - mean is exactly 0 (0.3 * 10 / 10 is not 0.3 in float32: a mean taken as sum / N
    # would normalise rounding noise, 9.4e-6 instead of the bias, 1.0 instead of NaN)
    x = torch.full((2, 10), 0.3)
    with fasttrans.use_backend("extension"):
        out = fasttrans.layer_norm(x, (10,), eps=eps)
    exact = torch.nn.functional.layer_norm(x, (10,), eps=eps)  # torch: 0 (NaN for eps = 0)
    assert torch.equal(out, exact) or (eps == 0 and out.isnan().all() and exact.isnan().all())
    with fasttrans.use_backend("reference"):
        ref = fasttrans.layer_norm(x, (10,), eps=eps)
    torch.testing.assert_close(ref, exact, equal_nan=True, atol=0, rtol=0)


def test_attention_rejects_a_bool_scale():
    # as every other scalar does (dropout_p, causal_offset, eps, dropout's p)
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(TypeError, match="scale"):
        fasttrans.attention(q, q, q, scale=True)


def test_is_causal_error_message_distinguishes_numpy_bools():
    # numpy 2 names its bool type 'bool': "expected a bool, got bool" would contradict itself
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(TypeError) as err:
        fasttrans.attention(q, q, q, is_causal=np.bool_(True))
    assert "got bool" not in str(err.value), str(err.value)


# --------------------------------------------------------------------------------------
# 2. the raw registered ops, in a subprocess
# --------------------------------------------------------------------------------------
# The child loads the extension as tests/conftest.py's ``ext`` fixture does (so the ops have
# their fake implementations: meta inputs reach those), builds the tensors of each case and
# prints one line per case: "START id" before the call, "DONE id OK ..." or "DONE id ERR
# type|message" after it. A case that started without finishing crashed (or hung) the child;
# the parent records it and runs the remaining cases in a fresh child.
_CHILD = textwrap.dedent(r'''
    import faulthandler, json, math, sys, warnings
    faulthandler.enable()
    warnings.simplefilter("ignore")
    import torch
    from fasttrans import backends
    backends.BACKENDS["extension"].impl()
    backends.ops_for("extension")
    ops = torch.ops.fasttrans
    A, AB, ADM = ops.attention_fwd_extension, ops.attention_bwd_extension, ops.attention_dropout_mask_extension
    NF, NB, DF, DB = ops.norm_fwd_extension, ops.norm_bwd_extension, ops.dropout_fwd_extension, ops.dropout_bwd_extension
    PKL, ICM = ops.padding_key_lengths, ops.is_causal_mask
    DT = dict(f64=torch.float64, f32=torch.float32, f16=torch.float16, bf16=torch.bfloat16, i64=torch.int64,
              i32=torch.int32, i8=torch.int8, u8=torch.uint8, b=torch.bool, c64=torch.complex64)

    def T(shape, dtype="f32", layout="c", seed=0, device="cpu", fill=None):
        """A tensor: layout c(ontiguous) | t(ransposed) | e(xpanded) | z (stride 0 everywhere) |
        o(verlap: stride 1 everywhere) | s (inner stride 2) | m (misaligned: storage offset 1)."""
        g = torch.Generator().manual_seed(seed)
        dt = DT[dtype]
        def vals(s):
            if fill is not None:
                return torch.full(s, fill, dtype=dt) if dt != torch.bool else torch.full(s, bool(fill))
            if dt == torch.bool:
                return torch.rand(s, generator=g) < 0.5
            if dt.is_floating_point or dt.is_complex:
                return torch.randn(s, generator=g).to(dt)
            return torch.randint(-2, 9, s, generator=g).to(dt)
        shape = tuple(shape)
        n = len(shape)
        if layout == "c" or n == 0:
            t = vals(shape)
        elif layout == "t" and n >= 2:
            t = vals(shape[:-2] + (shape[-1], shape[-2])).transpose(-1, -2)
        elif layout == "e":
            t = vals((1,) * (n - 1) + shape[-1:]).expand(shape)
        elif layout == "z":
            t = vals((1,)).as_strided(shape, (0,) * n)
        elif layout == "o":
            t = vals((1 + sum(max(s - 1, 0) for s in shape),)).as_strided(shape, (1,) * n)
        elif layout == "s":
            t = vals(shape[:-1] + (2 * shape[-1],))[..., ::2]
        elif layout == "m":
            t = vals((math.prod(shape) + 1,))[1:].view(shape)
        else:
            t = vals(shape)
        return t.to(device) if device != "cpu" else t

    q, k, v = T((2, 4, 5, 8), seed=1), T((2, 2, 7, 8), seed=2), T((2, 2, 7, 8), seed=3)
    out, lse = A(q, k, v, None, None, False, 0, 0.0, 0.35, 0)
    do = T((2, 4, 5, 8), seed=4)
    x, r, w, b = T((6, 40), seed=5), T((6, 40), seed=6), T((40,), seed=7), T((40,), seed=8)
    y, h, mean, rstd = NF(x, r, w, b, 1e-5, False)
    dy = T((6, 40), seed=9)
    keep = DF(x, 0.5, 0)[1]
    kpm = torch.arange(7)[None, :] >= torch.tensor([[3], [7]])
    meta = lambda t: t.to("meta")

    def describe(result):
        items = result if isinstance(result, tuple) else (result,)
        return " ".join(f"{tuple(t.shape)}:{t.dtype}:{t.device.type}" if isinstance(t, torch.Tensor) else repr(t)
                        for t in items)

    for case_id, expr in json.loads(sys.stdin.read()):
        print("START", case_id, flush=True)
        try:
            result = eval(expr)
            print("DONE", case_id, "OK", describe(result), flush=True)
        except Exception as e:  # noqa: BLE001
            msg = str(e).replace("\n", " ")[:300]
            print("DONE", case_id, "ERR", f"{type(e).__name__}|{int(isinstance(e, RuntimeError))}|{msg}", flush=True)
''')


def _run_raw(cases: list[tuple[str, str]], timeout: float = 120) -> dict[str, tuple]:
    """{case id: ('ok', description) | ('error', type, is_runtime_error, message) | ('crash', detail)}."""
    results: dict[str, tuple] = {}
    pending = list(cases)
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    while pending:
        try:
            proc = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(pending), capture_output=True,
                                  text=True, timeout=timeout, env=env)
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            rc = "timeout"
        started = None
        for line in stdout.splitlines():
            parts = line.split(" ", 3)
            if parts[0] == "START":
                started = parts[1]
            elif parts[0] == "DONE":
                started = None
                if parts[2] == "OK":
                    results[parts[1]] = ("ok", parts[3] if len(parts) > 3 else "")
                else:
                    name, is_rt, msg = parts[3].split("|", 2)
                    results[parts[1]] = ("error", name, is_rt == "1", msg)
        done = {c for c, _ in pending if c in results}
        if started is None and rc != 0 and not done:
            raise AssertionError(f"the raw-op child failed before any case (rc {rc}):\n{stderr[-3000:]}")
        if started is not None:  # crashed or hung inside this case
            results[started] = ("crash", f"rc {rc}; stderr tail:\n{stderr[-2000:]}")
            done.add(started)
        elif rc != 0:
            raise AssertionError(f"the raw-op child exited with rc {rc} after its cases:\n{stderr[-3000:]}")
        pending = [(c, e) for c, e in pending if c not in done]
    return results


# Hand-written cases: id -> (expression, expectation). Expectations:
#   "ok"          succeeds (legitimate edge inputs of the op)
#   "error:NAME"  raises a RuntimeError whose message names NAME
#   "any"         either (the op trusts its caller for that value; documented here), never a crash
# Defaults of an attention_fwd call: A(q, k, v, mask, key_lengths, is_causal, causal_offset,
# dropout_p, scale, seed).
def _a(q="q", k="k", v="v", mask="None", kl="None", causal="False", off="0", p="0.0", scale="0.35", seed="0"):
    return f"A({q}, {k}, {v}, {mask}, {kl}, {causal}, {off}, {p}, {scale}, {seed})"


def _ab(dout="do", q="q", k="k", v="v", out="out", lse="lse", mask="None", kl="None", causal="False", off="0",
        p="0.0", scale="0.35", seed="0", mask_grad="False"):
    return f"AB({dout}, {q}, {k}, {v}, {out}, {lse}, {mask}, {kl}, {causal}, {off}, {p}, {scale}, {seed}, {mask_grad})"


def _nf(x="x", r="None", w="w", b="b", eps="1e-5", rms="False"):
    return f"NF({x}, {r}, {w}, {b}, {eps}, {rms})"


def _nb(dy="dy", dh="None", h="h", w="w", b="b", mean="mean", rstd="rstd", rms="False"):
    return f"NB({dy}, {dh}, {h}, {w}, {b}, {mean}, {rstd}, {rms})"


RAW_CASES = {
    # ---- attention_fwd_extension
    "afwd-valid": (_a(), "ok"),
    "afwd-q-3d": (_a(q="q[0]"), "error:q"),
    "afwd-q-5d": (_a(q="q[None]"), "error:q"),
    "afwd-q-0d": (_a(q="torch.tensor(1.0)"), "error:q"),
    "afwd-k-3d": (_a(k="k[0]"), "error:k"),
    "afwd-v-shape": (_a(v="v[:, :, :3]"), "error:v"),
    "afwd-v-dim": (_a(v="T((2, 2, 7, 4))"), "error:v"),
    "afwd-k-batch": (_a(k="T((3, 2, 7, 8))", v="T((3, 2, 7, 8))"), "error:k"),
    "afwd-k-head-dim": (_a(k="T((2, 2, 7, 4))", v="T((2, 2, 7, 4))"), "error:k"),
    "afwd-heads-not-dividing": (_a(k="T((2, 3, 7, 8))", v="T((2, 3, 7, 8))"), "error:k"),
    "afwd-kv-heads-zero": (_a(k="k[:, :0]", v="v[:, :0]"), "error:k"),
    "afwd-more-kv-heads-than-q-heads": (_a(q="q[:, :1]"), "error:k"),
    "afwd-q-int": (_a(q="q.int()", k="k.int()", v="v.int()"), "error:q"),
    "afwd-q-bool": (_a(q="q.bool()", k="k.bool()", v="v.bool()"), "error:q"),
    "afwd-q-complex": (_a(q="q.cfloat()", k="k.cfloat()", v="v.cfloat()"), "error:q"),
    "afwd-mixed-dtypes": (_a(k="k.double()"), "error:k"),
    "afwd-v-half": (_a(v="v.half()"), "error:v"),
    "afwd-mask-int": (_a(mask="torch.ones(5, 7, dtype=torch.int32)"), "error:attn_mask"),
    "afwd-mask-complex": (_a(mask="torch.ones(5, 7, dtype=torch.complex64)"), "error:attn_mask"),
    "afwd-kl-2d": (_a(kl="torch.tensor([[1, 2]])"), "error:key_lengths"),
    "afwd-kl-shape": (_a(kl="torch.tensor([1, 2, 3])"), "error:key_lengths"),
    "afwd-kl-0d": (_a(kl="torch.tensor(3)"), "error:key_lengths"),
    # legitimate edge inputs: empty dims, zero heads of both kinds, any strides, broadcast
    # masks of any float dtype, offsets past the sequences, any seed
    "afwd-B0": (_a(q="q[:0]", k="k[:0]", v="v[:0]"), "ok"),
    "afwd-H0": (_a(q="q[:, :0]"), "ok"),
    "afwd-Lq0": (_a(q="q[:, :, :0]"), "ok"),
    "afwd-Lk0": (_a(k="k[:, :, :0]", v="v[:, :, :0]"), "ok"),
    "afwd-D0": (_a(q="q[..., :0]", k="k[..., :0]", v="v[..., :0]"), "ok"),
    "afwd-D300": (_a(q="T((1, 1, 3, 300))", k="T((1, 1, 4, 300))", v="T((1, 1, 4, 300))"), "ok"),
    "afwd-stride0-everywhere": (_a(q="T((2, 4, 5, 8), layout='z')", k="T((2, 2, 7, 8), layout='z')",
                                   v="T((2, 2, 7, 8), layout='z')"), "ok"),
    "afwd-overlap": (_a(q="T((2, 4, 5, 8), layout='o')", k="T((2, 2, 7, 8), layout='o')",
                        v="T((2, 2, 7, 8), layout='o')"), "ok"),
    "afwd-transposed": (_a(q="T((2, 4, 5, 8), layout='t')", k="T((2, 2, 7, 8), layout='t')",
                           v="T((2, 2, 7, 8), layout='s')"), "ok"),
    "afwd-misaligned-half": (_a(q="T((2, 4, 5, 8), 'f16', 'm')", k="T((2, 2, 7, 8), 'f16', 'm')",
                                v="T((2, 2, 7, 8), 'f16', 'm')"), "ok"),
    "afwd-channels-last": (_a(q="q.contiguous(memory_format=torch.channels_last)"), "ok"),
    "afwd-mask-0d": (_a(mask="torch.tensor(True)"), "ok"),
    "afwd-mask-stride0": (_a(mask="T((2, 4, 5, 7), 'f64', 'z')"), "ok"),
    "afwd-mask-overlap-bf16": (_a(mask="T((2, 4, 5, 7), 'bf16', 'o')"), "ok"),
    "afwd-mask-all-blocked": (_a(mask="torch.zeros(5, 7, dtype=torch.bool)"), "ok"),
    "afwd-kl-float": (_a(kl="torch.tensor([1.5, 2.0])"), "any"),  # converted to int32
    "afwd-kl-negative-and-long": (_a(kl="torch.tensor([-5, 100])"), "ok"),  # clamped to [0, Lk]
    "afwd-kl-int64-past-int32": (_a(kl="torch.tensor([2**40, -2**40])"), "ok"),
    "afwd-kl-stride0": (_a(kl="torch.tensor([3]).expand(2)"), "ok"),
    "afwd-causal-max": (_a(causal="True", off=str(2**63 - 1)), "ok"),
    "afwd-causal-min": (_a(causal="True", off=str(-2**63)), "ok"),
    "afwd-seed-extremes": (_a(p="0.5", seed=str(-2**63)), "ok"),
    # dropout_p in [0, 1) (fasttrans.attention turns 1 into zeros before any kernel runs)
    "afwd-p-one": (_a(p="1.0"), "error:dropout_p"),
    "afwd-p-above-one": (_a(p="1.5"), "error:dropout_p"),
    "afwd-p-negative": (_a(p="-0.5"), "error:dropout_p"),
    "afwd-p-nan": (_a(p="math.nan"), "error:dropout_p"),
    "abwd-p-one": (_ab(p="1.0"), "error:dropout_p"),
    "afwd-scale-nan": (_a(scale="math.nan"), "any"),  # NaN out: the op trusts its scalars
    "afwd-scale-inf": (_a(scale="math.inf"), "any"),
    "afwd-meta": (_a(q="meta(q)", k="meta(k)", v="meta(v)"), "ok"),  # the fake implementation
    # ---- attention_bwd_extension
    "abwd-valid": (_ab(), "ok"),
    "abwd-dout-shape": (_ab(dout="do[:, :, :3]"), "error:dout"),
    "abwd-out-shape": (_ab(out="out[:1]"), "error:out"),
    "abwd-lse-shape": (_ab(lse="lse[:, :, :2]"), "error:lse"),
    "abwd-lse-4d": (_ab(lse="lse[..., None]"), "error:lse"),
    "abwd-mask-grad-without-mask": (_ab(mask_grad="True"), "error:mask_grad"),
    "abwd-mask-grad-bool-mask": (_ab(mask="torch.ones(5, 7, dtype=torch.bool)", mask_grad="True"), "error:mask_grad"),
    "abwd-mask-int": (_ab(mask="torch.ones(5, 7, dtype=torch.int64)"), "error:attn_mask"),
    "abwd-kl-shape": (_ab(kl="torch.tensor([3])"), "error:key_lengths"),
    "abwd-q-int": (_ab(q="q.int()", k="k.int()", v="v.int()"), "error:q"),
    "abwd-heads-not-dividing": (_ab(k="T((2, 3, 7, 8))", v="T((2, 3, 7, 8))"), "error:k"),
    "abwd-mask-grad-float-mask": (_ab(mask="torch.zeros(5, 7)", mask_grad="True"), "ok"),
    "abwd-dout-double": (_ab(dout="do.double()"), "ok"),  # converted to the accumulation dtype
    "abwd-out-int": (_ab(out="out.int()"), "error:out"),
    "abwd-lse-int": (_ab(lse="lse.int()"), "error:lse"),
    "abwd-dout-int": (_ab(dout="do.int()"), "error:dout"),
    "afwd-mask-wrong-shape": (_a(mask="torch.ones(5, 6, dtype=torch.bool)"), "error:attn_mask"),
    "afwd-mask-rank5": (_a(mask="torch.ones(1, 2, 4, 5, 7, dtype=torch.bool)"), "error:attn_mask"),
    "nbwd-h-int": (_nb(h="h.int()", dy="dy.int()"), "error:h"),
    "nbwd-bias-numel": (_nb(b="b[:3]"), "error:bias"),
    "dbwd-dy-int": ("DB(x.int(), keep, 0.5)", "error:dy"),
    "abwd-lse-nan": (_ab(lse="torch.full_like(lse, math.nan)"), "ok"),
    "abwd-stride0-everywhere": (_ab(dout="T((2, 4, 5, 8), layout='z')", q="T((2, 4, 5, 8), layout='z')",
                                    k="T((2, 2, 7, 8), layout='z')", v="T((2, 2, 7, 8), layout='z')",
                                    out="T((2, 4, 5, 8), layout='z')", lse="T((2, 4, 5), layout='z')"), "ok"),
    "abwd-overlap": (_ab(dout="T((2, 4, 5, 8), layout='o')", q="T((2, 4, 5, 8), layout='o')",
                         k="T((2, 2, 7, 8), layout='o')", out="T((2, 4, 5, 8), layout='o')"), "ok"),
    "abwd-Lk0": (_ab(k="k[:, :, :0]", v="v[:, :, :0]"), "ok"),
    "abwd-D0": (_ab(dout="do[..., :0]", q="q[..., :0]", k="k[..., :0]", v="v[..., :0]", out="out[..., :0]"), "ok"),
    "abwd-H0": (_ab(dout="do[:, :0]", q="q[:, :0]", out="out[:, :0]", lse="lse[:, :0]"), "ok"),
    "abwd-causal-extremes": (_ab(causal="True", off=str(-2**63)), "ok"),
    "abwd-kl-clamped": (_ab(kl="torch.tensor([-3, 90])"), "ok"),
    "abwd-D300": (_ab(dout="T((1, 1, 3, 300))", q="T((1, 1, 3, 300))", k="T((1, 1, 4, 300))",
                      v="T((1, 1, 4, 300))", out="T((1, 1, 3, 300))", lse="T((1, 1, 3))"), "ok"),
    "abwd-mask-grad-stride0": (_ab(mask="T((1, 1, 1, 1), 'f32').expand(2, 4, 5, 7)", mask_grad="True"), "ok"),
    # ---- attention_dropout_mask_extension
    "adm-valid": ("ADM(q, k, 0.5, 0)", "ok"),
    "adm-q-3d": ("ADM(q[0], k, 0.5, 0)", "error:q"),
    "adm-p-one": ("ADM(q, k, 1.0, 0)", "error:dropout_p"),
    "adm-p-nan": ("ADM(q, k, math.nan, 0)", "error:dropout_p"),
    "adm-p-negative": ("ADM(q, k, -0.5, 0)", "error:dropout_p"),
    "adm-empty": ("ADM(q[:0], k, 0.5, 0)", "ok"),
    # ---- norm_fwd_extension
    "nfwd-valid": (_nf(r="r"), "ok"),
    "nfwd-x-1d": (_nf(x="x[0]"), "error:x"),
    "nfwd-x-3d": (_nf(x="x[None]"), "error:x"),
    "nfwd-x-int": (_nf(x="x.int()"), "error:x"),
    "nfwd-x-complex": (_nf(x="x.cfloat()"), "error:x"),
    "nfwd-residual-shape": (_nf(r="r[:3]"), "error:residual"),
    "nfwd-residual-dtype": (_nf(r="r.double()"), "error:residual"),
    "nfwd-weight-numel": (_nf(w="w[:9]"), "error:weight"),
    "nfwd-bias-numel": (_nf(b="torch.zeros(41)"), "error:bias"),
    "nfwd-M0": (_nf(x="x[:0]", r="r[:0]"), "ok"),
    "nfwd-N0": (_nf(x="x[:, :0]", r="r[:, :0]", w="w[:0]", b="b[:0]"), "ok"),
    "nfwd-weight-2d-same-numel": (_nf(w="w.view(2, 20)"), "ok"),
    "nfwd-weight-int": (_nf(w="w.int()"), "any"),  # converted to the accumulation dtype
    "nfwd-weight-stride0": (_nf(w="T((40,), layout='z')", b="T((40,), layout='z')"), "ok"),
    "nfwd-x-stride0-everywhere": (_nf(x="T((6, 40), layout='z')", r="T((6, 40), layout='z')"), "ok"),
    "nfwd-x-overlap": (_nf(x="T((6, 40), layout='o')", r="T((6, 40), layout='o')"), "ok"),
    "nfwd-x-transposed": (_nf(x="T((6, 40), layout='t')", r="T((6, 40), layout='t')"), "ok"),
    "nfwd-misaligned-half": (_nf(x="T((6, 40), 'f16', 'm')", r="T((6, 40), 'f16', 'm')", w="T((40,), 'f16', 'm')"), "ok"),
    "nfwd-rms-ignores-bias": (_nf(b="torch.zeros(41)", rms="True"), "ok"),
    "nfwd-long-rows": (_nf(x="T((2, 70000), 'bf16')", r="T((2, 70000), 'bf16')", w="None", b="None"), "ok"),
    # outputs past 4 MiB take the streaming stores; misaligned rows must not take the direct path
    "nfwd-streaming-misaligned": (_nf(x="T((1100, 1024), layout='m')", r="T((1100, 1024), layout='m')",
                                      w="T((1024,))", b="T((1024,))"), "ok"),
    "nfwd-streaming-row-stride": (_nf(x="T((1100, 1025))[:, 1:]", w="None", b="None", rms="True"), "ok"),
    "nfwd-eps-nan": (_nf(eps="math.nan"), "any"),  # the op trusts its scalars
    "nfwd-eps-negative": (_nf(eps="-1.0"), "any"),
    "nfwd-meta": (_nf(x="meta(x)", w="meta(w)", b="meta(b)"), "ok"),
    # ---- norm_bwd_extension
    "nbwd-valid": (_nb(dh="dy"), "ok"),
    "nbwd-h-1d": (_nb(h="h[0]"), "error:h"),
    "nbwd-dy-shape": (_nb(dy="dy[:2]"), "error:dy"),
    "nbwd-dy-dtype": (_nb(dy="dy.double()"), "error:dy"),
    "nbwd-dh-shape": (_nb(dh="dy[:2]"), "error:dh"),
    "nbwd-dh-dtype": (_nb(dh="dy.double()"), "error:dh"),
    "nbwd-mean-numel": (_nb(mean="mean[:2]"), "error:mean"),
    "nbwd-rstd-numel": (_nb(rstd="rstd[:2]"), "error:rstd"),
    "nbwd-weight-numel": (_nb(w="w[:3]"), "error:weight"),
    "nbwd-dh-empty": (_nb(dh="dy[:0]"), "ok"),  # an empty dh means none
    "nbwd-rms-empty-mean": (_nb(mean="mean[:0]", rms="True"), "ok"),
    "nbwd-M0": (_nb(dy="dy[:0]", h="h[:0]", mean="mean[:0]", rstd="rstd[:0]"), "ok"),
    "nbwd-N0": (_nb(dy="dy[:, :0]", h="h[:, :0]", w="w[:0]", b="b[:0]"), "ok"),
    "nbwd-stride0-everywhere": (_nb(dy="T((6, 40), layout='z')", h="T((6, 40), layout='z')",
                                    mean="T((6,), layout='z')", rstd="T((6,), layout='z')"), "ok"),
    "nbwd-overlap": (_nb(dy="T((6, 40), layout='o')", dh="T((6, 40), layout='o')", h="T((6, 40), layout='o')"), "ok"),
    "nbwd-mean-int": (_nb(mean="mean.int()"), "ok"),
    "nbwd-bias-int": (_nb(b="b.int()"), "any"),
    "nbwd-large": (_nb(dy="T((1100, 1024))", dh="T((1100, 1024))", h="T((1100, 1024), layout='m')",
                       w="T((1024,))", b="T((1024,))", mean="T((1100,))", rstd="T((1100,))"), "ok"),
    # ---- dropout_fwd_extension / dropout_bwd_extension
    "dfwd-valid": ("DF(x, 0.5, 0)", "ok"),
    "dfwd-p-zero": ("DF(x, 0.0, 0)", "error:p"),
    "dfwd-p-one": ("DF(x, 1.0, 0)", "error:p"),
    "dfwd-p-negative": ("DF(x, -0.1, 0)", "error:p"),
    "dfwd-p-above-one": ("DF(x, 1.5, 0)", "error:p"),
    "dfwd-p-nan": ("DF(x, math.nan, 0)", "error:p"),
    "dfwd-p-inf": ("DF(x, math.inf, 0)", "error:p"),
    "dfwd-x-int": ("DF(x.int(), 0.5, 0)", "error:x"),
    "dfwd-x-bool": ("DF(x.bool(), 0.5, 0)", "error:x"),
    "dfwd-x-complex": ("DF(x.cfloat(), 0.5, 0)", "error:x"),
    "dfwd-0d": ("DF(torch.tensor(1.0), 0.5, 0)", "ok"),
    "dfwd-empty": ("DF(x[:0], 0.5, 0)", "ok"),
    "dfwd-stride0-everywhere": ("DF(T((5, 70), layout='z'), 0.5, 0)", "ok"),
    "dfwd-overlap": ("DF(T((5, 70), layout='o'), 0.5, 0)", "ok"),
    "dfwd-misaligned-bf16": ("DF(T((5, 70), 'bf16', 'm'), 0.5, 0)", "ok"),
    "dfwd-seed-extremes": ("DF(x, 0.5, -2**63)", "ok"),
    "dfwd-p-tiny": ("DF(x, 1e-300, 0)", "ok"),
    "dfwd-meta": ("DF(meta(x), 0.5, 0)", "ok"),
    "dbwd-valid": ("DB(x, keep, 0.5)", "ok"),
    "dbwd-keep-int": ("DB(x, keep.int(), 0.5)", "error:keep"),
    "dbwd-keep-uint8": ("DB(x, keep.to(torch.uint8), 0.5)", "error:keep"),
    "dbwd-keep-shape": ("DB(x, keep[:1], 0.5)", "error:keep"),
    "dbwd-keep-flat": ("DB(x, keep.flatten(), 0.5)", "error:keep"),
    "dbwd-p-one": ("DB(x, keep, 1.0)", "error:p"),
    "dbwd-p-nan": ("DB(x, keep, math.nan)", "error:p"),
    "dbwd-keep-stride0": ("DB(x, torch.ones(1, dtype=torch.bool).expand(6, 40), 0.5)", "ok"),
    "dbwd-dy-overlap": ("DB(T((6, 40), layout='o'), keep, 0.5)", "ok"),
    # bytes other than 0 / 1 in a bool tensor (a reinterpreted uint8 view): read as true
    "dbwd-keep-odd-bytes": ("DB(x, torch.full((6, 40), 7, dtype=torch.uint8).view(torch.bool), 0.5)", "any"),
    # ---- padding_key_lengths / is_causal_mask (CPU helpers of fasttrans.nn; no fake implementation)
    "pkl-valid": ("PKL(kpm)", "ok"),
    "pkl-float": ("PKL(kpm.float())", "error:key_padding_mask"),
    "pkl-1d": ("PKL(kpm[0])", "error:key_padding_mask"),
    "pkl-3d": ("PKL(kpm[None])", "error:key_padding_mask"),
    "pkl-empty": ("PKL(kpm[:0])", "ok"),
    "pkl-no-keys": ("PKL(kpm[:, :0])", "ok"),
    "pkl-stride0-everywhere": ("PKL(T((3, 5), 'b', 'z'))", "ok"),
    "pkl-overlap": ("PKL(T((3, 5), 'b', 'o'))", "ok"),
    "pkl-transposed": ("PKL(kpm.t())", "ok"),
    "pkl-meta": ("PKL(meta(kpm))", "any"),
    "icm-valid": ("ICM(torch.ones(4, 4, dtype=torch.bool).triu(1))", "ok"),
    "icm-1d": ("ICM(torch.ones(4, dtype=torch.bool))", "error:mask"),
    "icm-0d": ("ICM(torch.tensor(True))", "error:mask"),
    "icm-int": ("ICM(torch.ones(4, 4, dtype=torch.int32))", "error:mask"),
    "icm-complex": ("ICM(torch.ones(4, 4, dtype=torch.complex64))", "error:mask"),
    "icm-empty": ("ICM(torch.zeros(0, 4, 4))", "ok"),
    "icm-5d": ("ICM(T((2, 1, 3, 4, 4)))", "ok"),
    "icm-stride0-everywhere": ("ICM(T((2, 3, 4, 4), layout='z'))", "ok"),
    "icm-overlap": ("ICM(T((2, 4, 4), layout='o'))", "ok"),
    "icm-non-square": ("ICM(torch.ones(3, 5, dtype=torch.bool).triu(1))", "ok"),
    "icm-nan": ("ICM(torch.full((4, 4), math.nan))", "ok"),
    "icm-half-bf16": ("(ICM(T((4, 4), 'f16')), ICM(T((4, 4), 'bf16')))", "ok"),
    "icm-meta": ("ICM(torch.ones(4, 4, device='meta'))", "any"),
    # one meta tensor among CPU ones: the dispatcher picks the Meta kernel, the fake
    # implementation (fasttrans/backends/registration.py), which checks that the devices agree
    "afwd-meta-mask": (_a(mask="meta(torch.ones(5, 7, dtype=torch.bool))"), "error:attn_mask"),
    "afwd-meta-kl": (_a(kl="meta(torch.tensor([1, 2]))"), "error:key_lengths"),
    "abwd-meta-dout": (_ab(dout="meta(do)"), "error:dout"),
    "nfwd-meta-weight": (_nf(w="meta(w)"), "error:weight"),
    "nbwd-meta-bias": (_nb(b="meta(b)"), "error:bias"),
    "dbwd-meta-keep": ("DB(x, meta(keep), 0.5)", "error:keep"),
}
# Drawn raw calls: shapes near the valid ones with one or two things off, every dtype and
# layout, scalars anywhere in their range. They only must not crash (any exception a
# RuntimeError); the values are not checked.
_RAW_DTYPES = ["f32", "f32", "f64", "f16", "bf16", "i64", "i32", "b", "c64", "u8"]
_RAW_LAYOUTS = ["c", "c", "t", "e", "z", "o", "s", "m"]


def _raw_random_cases(rng: random.Random, per_op: int) -> list[tuple[str, str]]:
    def dims(base):
        d = list(base)
        for _ in range(rng.choice([1, 1, 2])):
            i = rng.randrange(len(d))
            d[i] = rng.choice([0, 1, d[i] + 1, max(d[i] - 1, 0), 3, 17])
        if rng.random() < 0.08:
            d = d[1:] if rng.random() < 0.5 else [1] + d
        return tuple(d)

    def t(base, dtype=None, p_none=0.0):
        """A tensor of shape base and this dtype (each off now and then), any layout."""
        if rng.random() < p_none:
            return "None"
        shape = dims(base) if rng.random() < 0.15 else tuple(base)
        dt = rng.choice(_RAW_DTYPES) if dtype is None or rng.random() < 0.05 else dtype
        return f"T({shape}, {dt!r}, {rng.choice(_RAW_LAYOUTS)!r}, {rng.randrange(1000)})"

    def fl():
        return rng.choice(["0.0", "0.5", "0.5", "0.1", "1.0", "1.5", "-0.5", "math.nan", "math.inf", "1e-300", "0.99"])

    def i64():
        return str(rng.choice([0, 1, -1, 3, 2**63 - 1, -2**63, rng.randrange(-50, 50)]))

    cases = []
    for n in range(per_op):
        B, H, Hkv, Lq, Lk, D = rng.choice([1, 2, 3]), 4, rng.choice([1, 2, 4]), rng.choice([1, 5, 70]), \
            rng.choice([1, 7, 130]), rng.choice([1, 8, 33])
        dt = rng.choice(["f32", "f64", "f16", "bf16"])
        mask = t((B, H, Lq, Lk)[rng.randrange(4):], rng.choice(["b", "f32", dt]), p_none=0.5)
        kl = t((B,), "i64", p_none=0.5)
        q, k, v = t((B, H, Lq, D), dt), t((B, Hkv, Lk, D), dt), t((B, Hkv, Lk, D), dt)
        causal = rng.choice(["True", "False"])
        cases.append((f"rand-afwd-{n}", f"A({q}, {k}, {v}, {mask}, {kl}, {causal}, {i64()}, {fl()}, {fl()}, {i64()})"))
        cases.append((f"rand-abwd-{n}", f"AB({t((B, H, Lq, D), dt)}, {q}, {k}, {v}, {t((B, H, Lq, D), dt)}, "
                                        f"{t((B, H, Lq), 'f32')}, {mask}, {kl}, {causal}, {i64()}, {fl()}, {fl()}, "
                                        f"{i64()}, {rng.choice(['True', 'False'])})"))
        M, N = rng.choice([1, 6, 300]), rng.choice([1, 16, 40, 1025])
        x, rms = t((M, N), dt), rng.choice(["True", "False"])
        cases.append((f"rand-nfwd-{n}", f"NF({x}, {t((M, N), dt, 0.5)}, {t((N,), dt, 0.4)}, {t((N,), dt, 0.4)}, "
                                        f"{fl()}, {rms})"))
        cases.append((f"rand-nbwd-{n}", f"NB({t((M, N), dt)}, {t((M, N), dt, 0.5)}, {x}, {t((N,), dt, 0.4)}, "
                                        f"{t((N,), dt, 0.4)}, {t((M,), 'f32')}, {t((M,), 'f32')}, {rms})"))
        shape = (rng.choice([1, 3]), rng.choice([1, 63, 64, 65, 200]))
        cases.append((f"rand-dfwd-{n}", f"DF({t(shape, dt)}, {fl()}, {i64()})"))
        cases.append((f"rand-dbwd-{n}", f"DB({t(shape, dt)}, {t(shape, 'b')}, {fl()})"))
        cases.append((f"rand-mask-{n}", f"(PKL({t((B, Lk), 'b')}), ICM({t((B, Lq, Lq), rng.choice(['b', 'f32', 'bf16']))}))"))
    return cases


_RAW_SEED = random.SystemRandom().randrange(2**32) if _LONG_RUN else 20240601
_RAW_PER_OP = int(_LONG_RUN) if _LONG_RUN else 200


@pytest.fixture(scope="module")
def raw_results():
    """The outcome of every raw case, hand-written and drawn, from one child (more after a crash)."""
    cases = [(cid, expr) for cid, (expr, _) in RAW_CASES.items()]
    cases += _raw_random_cases(random.Random(_RAW_SEED), _RAW_PER_OP)
    results = _run_raw(cases)
    missing = [cid for cid, _ in cases if cid not in results]
    assert not missing, f"cases without an outcome: {missing}"
    return results


def _check_raw(cid: str, outcome: tuple, expect: str) -> None:
    assert outcome[0] != "crash", f"{cid} crashed the process: {outcome[1]}"
    if outcome[0] == "error":
        _, name, is_runtime_error, msg = outcome
        assert is_runtime_error, f"{cid}: {name} is not a RuntimeError: {msg}"
    if expect == "ok":
        assert outcome[0] == "ok", f"{cid}: expected success, got {outcome[1]}: {outcome[3] if len(outcome) > 3 else ''}"
    elif expect.startswith("error:"):
        assert outcome[0] == "error", f"{cid}: expected a RuntimeError, the op returned {outcome[1]}"
        arg = expect[len("error:"):]
        assert not arg or re.search(rf"\b{re.escape(arg)}\b", outcome[3]), \
            f"{cid}: the error does not name '{arg}': {outcome[1]}: {outcome[3]}"


@pytest.mark.parametrize("cid", list(RAW_CASES))
def test_raw_op_case(raw_results, cid):
    _check_raw(cid, raw_results[cid], RAW_CASES[cid][1])


def test_raw_ops_on_drawn_calls_never_crash(raw_results):
    drawn = {cid: o for cid, o in raw_results.items() if cid.startswith("rand-")}
    assert len(drawn) == 7 * _RAW_PER_OP
    crashed = {cid: o[1] for cid, o in drawn.items() if o[0] == "crash"}
    assert not crashed, f"crashes (seed {_RAW_SEED}): {crashed}"
    not_runtime = {cid: o for cid, o in drawn.items() if o[0] == "error" and not o[2]}
    assert not not_runtime, f"errors that are not RuntimeErrors (seed {_RAW_SEED}): {not_runtime}"
    # the drawn calls reach the kernels as well as the checks
    assert sum(o[0] == "ok" for o in drawn.values()) >= len(drawn) // 10

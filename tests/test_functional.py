"""fasttrans.functional: validation, backend selection and the torch.library registration."""

import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import fasttrans
from fasttrans import backends, functional, reference
from fasttrans.functional import DeviceError, DTypeError, ShapeError

from conftest import backend_params
from helpers import attention_keep, make_float_mask


def _qkv(B=2, H=4, Hkv=2, Lq=5, Lk=7, D=8, dtype=torch.float32):
    return (torch.randn(B, H, Lq, D, dtype=dtype), torch.randn(B, Hkv, Lk, D, dtype=dtype),
            torch.randn(B, Hkv, Lk, D, dtype=dtype))


# ---------------------------------------------------------------------------------------
# validation: every bad input names its argument
# ---------------------------------------------------------------------------------------
q0, k0, v0 = _qkv()
ATTENTION_ERRORS = [
    ("rank", dict(q=q0[0]), ShapeError, "q"),
    ("q dtype", dict(q=q0.int()), DTypeError, "q"),
    ("k dtype", dict(k=k0.double()), DTypeError, "k"),
    ("batch", dict(k=k0[:1], v=v0[:1]), ShapeError, "k"),
    ("v shape", dict(v=v0[:, :, :3]), ShapeError, "v"),
    ("v head dim 0", dict(v=v0[..., :0]), ShapeError, "v"),
    ("head dim", dict(k=k0[..., :4], v=v0[..., :4]), ShapeError, "k"),
    ("heads", dict(k=torch.randn(2, 3, 7, 8), v=torch.randn(2, 3, 7, 8)), ShapeError, "heads"),
    ("no kv heads", dict(k=k0[:, :0], v=v0[:, :0]), ShapeError, "kv heads"),
    ("head dim 0", dict(q=q0[..., :0], k=k0[..., :0], v=v0[..., :0]), ShapeError, "head dim"),
    ("mask uint8", dict(attn_mask=torch.ones(5, 7, dtype=torch.uint8)), DTypeError, "attn_mask"),
    ("mask long", dict(attn_mask=torch.ones(5, 7, dtype=torch.long)), DTypeError, "attn_mask"),
    ("mask shape", dict(attn_mask=torch.ones(5, 6, dtype=torch.bool)), ShapeError, "attn_mask"),
    ("mask rank", dict(attn_mask=torch.ones(1, 2, 4, 5, 7, dtype=torch.bool)), ShapeError, "attn_mask"),
    ("key_lengths dtype", dict(key_lengths=torch.tensor([1.0, 2.0])), DTypeError, "key_lengths"),
    ("key_lengths shape", dict(key_lengths=torch.tensor([1, 2, 3])), ShapeError, "key_lengths"),
    ("key_lengths range", dict(key_lengths=torch.tensor([1, 8])), ShapeError, "key_lengths"),
    ("key_lengths negative", dict(key_lengths=torch.tensor([-1, 2])), ShapeError, "key_lengths"),
    ("is_causal", dict(is_causal=1), TypeError, "is_causal"),
    ("causal_offset", dict(causal_offset=1.5), TypeError, "causal_offset"),
    ("dropout_p high", dict(dropout_p=1.5), ShapeError, "dropout_p"),
    ("dropout_p bool", dict(dropout_p=True), ShapeError, "dropout_p"),
    ("dropout_p negative", dict(dropout_p=-0.1), ShapeError, "dropout_p"),
    ("scale", dict(scale=float("nan")), ShapeError, "scale"),
    ("not a tensor", dict(q=[1.0]), TypeError, "q"),
    ("sparse q", dict(q=q0.to_sparse()), TypeError, "q: expected a dense"),
    ("sparse v", dict(v=v0.to_sparse()), TypeError, "v: expected a dense"),
    ("sparse mask", dict(attn_mask=torch.ones(5, 7, dtype=torch.bool).to_sparse()), TypeError, "attn_mask: expected a dense"),
    ("sparse key_lengths", dict(key_lengths=torch.tensor([1, 2]).to_sparse()), TypeError, "key_lengths: expected a dense"),
    ("k device", dict(k=k0.to("meta")), DeviceError, "k: expected a tensor on cpu"),
    ("v device", dict(v=v0.to("meta")), DeviceError, "v: expected a tensor on cpu"),
]


@pytest.mark.parametrize("name,override,error,arg", ATTENTION_ERRORS, ids=[c[0] for c in ATTENTION_ERRORS])
def test_attention_rejects_bad_input(name, override, error, arg):
    kw = dict(q=q0, k=k0, v=v0)
    kw.update(override)
    with pytest.raises(error, match=arg):
        fasttrans.attention(**kw)


@pytest.mark.parametrize("B", [3, 65], ids=["values-read-in-python", "aminmax"])
def test_key_lengths_range_is_checked_for_any_batch_size(B):
    q = torch.randn(B, 1, 2, 8)
    k = torch.randn(B, 1, 5, 8)
    for bad, shown in ((6, "[0, 6]"), (-1, "[-1, 5]")):
        lengths = torch.full((B,), 5, dtype=torch.int16)
        lengths[B // 2] = bad
        lengths[0] = 0
        with pytest.raises(ShapeError, match=re.escape(f"key_lengths: expected values in [0, 5] (the key length), got {shown}")):
            fasttrans.attention(q, k, k, key_lengths=lengths)
    torch.testing.assert_close(fasttrans.attention(q, k, k, key_lengths=torch.full((B,), 5)), reference.attention(q, k, k))


def test_error_types_are_also_runtime_errors():
    # torch raises RuntimeError for these mistakes; code written against torch keeps working
    assert issubclass(ShapeError, RuntimeError) and issubclass(ShapeError, ValueError)
    assert issubclass(DTypeError, RuntimeError) and issubclass(DTypeError, TypeError)
    assert issubclass(DeviceError, RuntimeError)


x0 = torch.randn(3, 4, 6)
NORM_ERRORS = [
    (lambda: fasttrans.layer_norm(x0, (5,)), ShapeError, "normalized_shape"),
    (lambda: fasttrans.layer_norm(x0.int(), (6,)), DTypeError, "x"),
    (lambda: fasttrans.layer_norm(x0, (6,), torch.ones(5)), ShapeError, "weight"),
    (lambda: fasttrans.layer_norm(x0, (6,), None, torch.ones(4, 6)), ShapeError, "bias"),
    (lambda: fasttrans.layer_norm(x0, (6,), eps=-1.0), ShapeError, "eps"),
    (lambda: fasttrans.layer_norm(x0, (6,), eps=None), TypeError, "eps"),
    (lambda: fasttrans.add_layer_norm(x0, x0, eps=None), TypeError, "eps"),
    (lambda: fasttrans.layer_norm(x0, "6"), TypeError, "normalized_shape"),
    (lambda: fasttrans.add_layer_norm(x0, x0[:2]), ShapeError, "residual"),
    (lambda: fasttrans.add_layer_norm(x0, x0.double()), DTypeError, "residual"),
    (lambda: fasttrans.add_layer_norm(x0, None), TypeError, "residual"),
    (lambda: fasttrans.rms_norm(x0, (4, 5)), ShapeError, "normalized_shape"),
    (lambda: fasttrans.rms_norm(x0, (6,), torch.ones(6, dtype=torch.int32)), DTypeError, "weight"),
    (lambda: fasttrans.layer_norm(x0.to_sparse(), (6,)), TypeError, "x: expected a dense"),
    (lambda: fasttrans.layer_norm(x0, (6,), None, torch.ones(6).to_sparse()), TypeError, "bias: expected a dense"),
    (lambda: fasttrans.add_layer_norm(x0, x0.to_sparse()), TypeError, "residual: expected a dense"),
    (lambda: functional.dropout(x0.to_sparse(), 0.5), TypeError, "input: expected a dense"),
    # F.layer_norm's dtype rule: parameters in x's dtype, or float32 with a float16/bfloat16 x
    (lambda: fasttrans.layer_norm(x0, (6,), torch.ones(6, dtype=torch.float16)), DTypeError, "weight"),
    (lambda: fasttrans.layer_norm(x0.double(), (6,), None, torch.ones(6)), DTypeError, "bias"),
    (lambda: fasttrans.layer_norm(x0.half(), (6,), torch.ones(6, dtype=torch.bfloat16)), DTypeError, "weight"),
    (lambda: fasttrans.layer_norm(x0.half(), (6,), torch.ones(6), torch.ones(6).half()), DTypeError, "bias"),
    (lambda: fasttrans.add_layer_norm(x0, x0, torch.ones(6, dtype=torch.float64)), DTypeError, "weight"),
    (lambda: fasttrans.layer_norm(x0, (6,), torch.ones(6, device="meta")), DeviceError, "weight"),
    (lambda: fasttrans.add_layer_norm(x0, x0.to("meta")), DeviceError, "residual"),
]


@pytest.mark.parametrize("shape", [(0, 6), (2, 0, 6)])
def test_norms_of_empty_inputs_are_empty_as_in_torch(shape):
    x = torch.zeros(shape, requires_grad=True)
    w, b = torch.randn(6, requires_grad=True), torch.randn(6, requires_grad=True)
    y, h = fasttrans.add_layer_norm(x, x, w, b)
    outs = (fasttrans.layer_norm(x, (6,), w, b), fasttrans.rms_norm(x, (6,), w), y, h)
    assert all(o.shape == shape for o in outs)
    sum(o.sum() for o in outs).backward()
    assert torch.equal(w.grad, torch.zeros(6)) and torch.equal(b.grad, torch.zeros(6))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_rms_norm_default_eps_is_torchs(dtype):
    # torch takes eps=None as the epsilon of its fp32 statistics for fp16/bf16 (not the
    # input dtype's, which is 6e4 times larger for bf16): rows of small values show it
    x = torch.full((3, 4), 1e-3, dtype=dtype)
    x[1] = torch.randn(4, dtype=dtype)
    torch.testing.assert_close(fasttrans.rms_norm(x, (4,)), F.rms_norm(x, (4,)))
    torch.testing.assert_close(reference.rms_norm(x, (4,)), F.rms_norm(x, (4,)))


@pytest.mark.parametrize("call,error,arg", NORM_ERRORS)
def test_norms_reject_bad_input(call, error, arg):
    with pytest.raises(error, match=arg):
        call()


def test_the_common_case_shortcut_of_the_attention_checks_vouches_only_for_valid_arguments():
    """As for the norms: whatever the shortcut lets through, the detailed checks accept."""
    import itertools

    q = torch.randn(2, 4, 3, 8)
    k = torch.randn(2, 2, 5, 8)
    variants = {
        "q": [q, q.half(), q.double(), q.int(), q.to("meta"), q.to_sparse(), q[..., :0], q[0], q[:1], q[:, :3],
              q.transpose(1, 2)],
        "k": [k, k.half(), k[:1], k[..., :4], k[:, :1], torch.randn(2, 0, 5, 8), torch.randn(2, 3, 5, 8),
              k.to("meta"), k[0]],
        "v": ["k", k.double(), k[:, :, :2], k.to("meta"), k.to_sparse()],
        "is_causal": [False, True, 1, None],
        "causal_offset": [0, -3, True, 1.0],
        "dropout_p": [0.0, 0, 1, 0.5, 1.5, -0.1, float("nan"), True, None],
        "scale": [None, 0.5, 2, float("inf"), float("nan"), True, "0.5"],
    }
    accepted = 0
    for qq, kk, vv, causal, offset, p, scale in itertools.product(*variants.values()):
        vv = kk if isinstance(vv, str) else vv
        if not functional._common_attention_args(qq, kk, vv, causal, offset, p, scale):
            continue
        accepted += 1
        functional._validate_attention_operands(qq, kk, vv)  # raise if the shortcut was wrong
        functional._validate_attention_scalars(causal, offset, p, scale)
    assert accepted >= 50


def _norm_argument_variants():
    """(x, n, weight, bias, eps, residual): the common case and one or two things off it."""
    import itertools

    x = torch.randn(2, 3, 6)
    tensors = {
        "x": [x, x.half(), x.bfloat16(), x.double(), x.int(), x.to("meta"), x.to_sparse(), x[..., :4], x.mT],
        "weight": [None, torch.ones(6), torch.ones(6).half(), torch.ones(6).double(), torch.ones(1, 6),
                   torch.ones(5), torch.ones(6, device="meta"), torch.ones(6).to_sparse(), torch.ones(6).int(),
                   torch.ones(12)[::2]],
        "bias": [None, torch.zeros(6), torch.zeros(6).half(), torch.zeros(6).bfloat16(), torch.zeros(7)],
        "eps": [1e-5, 0.0, -1e-5, float("nan"), float("inf"), 1, True, None],
        "residual": [None, x, x.half(), x[:1], x.to("meta"), x.to_sparse(), 1.0],
    }
    for xx, w, b, eps, r in itertools.product(*tensors.values()):
        for n in (6, 4, 3):
            yield xx, n, w, b, eps, r


def test_the_common_case_shortcut_of_the_norm_checks_vouches_only_for_valid_arguments():
    """What the shortcut lets through (without the detailed checks) the detailed checks
    accept too, for every combination of argument variants; and it does let the common
    cases through, so the shortcut is taken."""
    accepted = 0
    for x, n, w, b, eps, r in _norm_argument_variants():
        if not functional._common_norm_args(x, n, w, b, eps, r):
            continue
        accepted += 1
        functional._validate_norm_in_detail(x, (n,), w, b, eps, r)  # raises if the shortcut was wrong
        functional._check_layer_norm_param_dtypes(x, w, b)
    assert accepted >= 20


# ---------------------------------------------------------------------------------------
# canonicalisation
# ---------------------------------------------------------------------------------------
def test_strided_inputs_and_broadcast_masks():
    base = torch.randn(2, 7, 4, 16)  # (B, L, H, 2D): q is a strided view, last stride 1
    q = base[..., :8].transpose(1, 2)  # (B, H, L, D)
    k = base[..., 8:].transpose(1, 2)
    v = torch.randn(2, 4, 8, 7).transpose(-1, -2)  # last stride != 1: copied explicitly
    mask = make_float_mask((7,), "cpu", neg_inf_frac=0.0)  # broadcast over (B, H, Lq)
    out = fasttrans.attention(q, k, v, attn_mask=mask)
    ref = reference.attention(q.contiguous(), k.contiguous(), v.contiguous(), attn_mask=mask.expand(2, 4, 7, 7))
    torch.testing.assert_close(out, ref)


def _grads_for(outputs, inputs, grads):
    return torch.autograd.grad(outputs, inputs, grads, retain_graph=True)


def _strided_grads(shape):
    """Output gradients as they arrive from autograd, none of them contiguous: a view with
    unit last stride (read in place), one transposed to a non-unit last stride and one
    expanded from a scalar (both copied)."""
    *lead, n = shape
    return {
        "view": torch.randn(*lead, 2 * n)[..., :n],
        "transposed": torch.randn(*reversed(shape)).permute(*reversed(range(len(shape)))),
        "expanded": torch.randn(()).expand(shape),
    }


@pytest.mark.parametrize("backend", backend_params("attention"))
def test_attention_backward_takes_strided_gradients(backend):
    q, k, v = (t.requires_grad_() for t in _qkv())
    with fasttrans.use_backend(backend):
        out = fasttrans.attention(q, k, v, is_causal=True)
        for name, g in _strided_grads(out.shape).items():
            assert not g.is_contiguous(), name
            got, want = _grads_for(out, (q, k, v), g), _grads_for(out, (q, k, v), g.contiguous())
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", backend_params("attention"))
def test_strided_int32_key_lengths(backend):
    """int32 key lengths that are views (a column of a table, an expanded scalar) keep their
    strides through a dtype conversion; every backend must read them as values, not memory."""
    q, k, v = (t.requires_grad_() for t in _qkv(B=4))
    table = torch.tensor([[7, 0], [3, 9], [5, 9], [1, 9]], dtype=torch.int32)
    cases = {"column": (table[:, 0], torch.tensor([7, 3, 5, 1])),
             "expanded": (torch.tensor([2], dtype=torch.int32).expand(4), torch.tensor([2, 2, 2, 2]))}
    g = torch.randn(4, 4, 5, 8)
    with fasttrans.use_backend(backend):
        for name, (view, dense) in cases.items():
            assert not view.is_contiguous(), name
            got, want = (_grads_for(fasttrans.attention(q, k, v, key_lengths=kl), (q, k, v), g) for kl in (view, dense))
            outs = [fasttrans.attention(q, k, v, key_lengths=kl).detach() for kl in (view, dense)]
            torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", backend_params("norm"))
def test_norm_backward_takes_strided_gradients(backend):
    x, r = torch.randn(3, 5, 8, requires_grad=True), torch.randn(3, 5, 8, requires_grad=True)
    w, b = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    with fasttrans.use_backend(backend):
        y, h = fasttrans.add_layer_norm(x, r, w, b)
        for name, g in _strided_grads(y.shape).items():
            for outputs, grads in (((y,), (g,)), ((y, h), (g, g))):  # with and without dh
                got = _grads_for(outputs, (x, r, w, b), grads)
                want = _grads_for(outputs, (x, r, w, b), tuple(t.contiguous() for t in grads))
                for a, c in zip(got, want):
                    torch.testing.assert_close(a, c, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", backend_params("norm"))
@pytest.mark.parametrize("N", [2, 3, 7, 4100])  # 4100: the Triton backward's column-split path
def test_norm_backward_on_rows_near_their_mean(backend, N):
    # Rows whose spread is small against their mean, var from ≪ eps to ≫ eps: dx is a near
    # cancellation there, and the rounding of the saved mean alone would shift it by more than
    # torch's own fp32 error. Checked row by row against the fp64 reference with flash-attention's
    # rule (≤ 2× torch's fp32 error + floor); before the backward re-centred xhat, rows at N = 2
    # and 3 failed it by up to 2.5×.
    M = 256 if N < 100 else 16
    g = torch.Generator().manual_seed(N)
    x = torch.randn(M, N, generator=g) * torch.rand(M, 1, generator=g) ** 4 + 3 * torch.randn(M, 1, generator=g)
    w, b, dy = torch.randn(N, generator=g), torch.randn(N, generator=g), torch.randn(M, N, generator=g)

    def dx(fn, dtype):
        x_ = x.to(dtype).requires_grad_()
        return torch.autograd.grad(fn(x_, (N,), w.to(dtype), b.to(dtype), 1e-5), x_, dy.to(dtype))[0].double()

    exact = dx(F.layer_norm, torch.float64)
    torch_err = (dx(F.layer_norm, torch.float32) - exact).abs().amax(-1)
    with fasttrans.use_backend(backend):
        err = (dx(fasttrans.layer_norm, torch.float32) - exact).abs().amax(-1)
    bound = 2 * torch_err + 2e-5 * exact.abs().amax(-1).clamp(min=1.0)
    worst = (err / bound).argmax()
    assert (err <= bound).all(), f"row {worst}: error {err[worst]:.3e} > bound {bound[worst]:.3e}"


def _grads_vs_reference(backend, inputs, **kw):
    """(out, grads) of fasttrans.attention on ``backend`` and of the reference, for the loss
    sum(out * g) with a fixed random g, w.r.t. every tensor of ``inputs`` (q, k, v[, mask])."""
    q, k, v, *mask = inputs
    kw = dict(kw, attn_mask=mask[0]) if mask else kw
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(q.device)
    with fasttrans.use_backend(backend):
        out = fasttrans.attention(q, k, v, **kw)
    want = reference.attention(q, k, v, **kw)
    return (out, torch.autograd.grad((out * g).sum(), inputs)), (want, torch.autograd.grad((want * g).sum(), inputs))


@pytest.mark.parametrize("backend", backend_params("attention"))
def test_nan_scores_give_nan_rows_as_in_the_reference(backend, device):
    # a row maximum that drops NaN (std::max, fmaxf, max.f32) would make a row whose scores
    # hold a NaN look fully masked (output 0): such rows are NaN, forward and backward, and
    # the others are the reference's numbers
    q, k, v = (t.to(device) for t in _qkv(Lq=6, Lk=40))
    q[0, 1, 2, 0] = float("nan")  # every score of row (0, 1, 2) is NaN ...
    mask = torch.zeros(6, 40, device=device)
    mask[2] = float("-inf")  # ... and stays NaN with -inf added (a float mask is added, not a
    # replacement), while row 2 of every other head is fully masked: 0
    mask[4, 33] = float("nan")  # one score of row 4, in the last key tile, in every head
    inputs = [t.requires_grad_() for t in (q, k, v, mask)]
    (out, grads), (want, want_grads) = _grads_vs_reference(backend, inputs)
    nan_rows = torch.zeros(2, 4, 6, dtype=torch.bool, device=device)
    nan_rows[0, 1, 2] = nan_rows[:, :, 4] = True
    assert torch.equal(out.isnan().all(-1), nan_rows) and torch.equal(out.isnan().any(-1), nan_rows)
    assert torch.equal(grads[0].isnan().any(-1), nan_rows)  # dq
    torch.testing.assert_close(out, want, equal_nan=True)
    for name, a, b in zip(("dq", "dk", "dv", "dmask"), grads, want_grads):
        assert torch.equal(a.isnan(), b.isnan()), name
        torch.testing.assert_close(a.nan_to_num(0), b.nan_to_num(0), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", backend_params("attention"))
def test_nan_keys_at_hidden_positions_stay_hidden(backend, device):
    # as the reference's masked_fill: a key hidden by a bool mask, by key_lengths or by the
    # causal mask changes neither the output nor dK, dV, even when its score is NaN (dQ takes
    # 0 * NaN from the bool-hidden one, as the reference's dS @ K does)
    q, k, v = (t.to(device) for t in _qkv(Lq=6, Lk=40))
    k[:, :, 5] = float("nan")  # hidden by the bool mask below
    k[1, :, 30:] = float("nan")  # past key_lengths[1]
    k[:, :, 39, 0] = float("nan")  # above the causal diagonal for every row (offset 30)
    mask = torch.ones(6, 40, dtype=torch.bool, device=device)
    mask[:, 5] = False
    kw = dict(attn_mask=mask, key_lengths=torch.tensor([40, 30], device=device), is_causal=True, causal_offset=30)
    (out, grads), (want, want_grads) = _grads_vs_reference(backend, [t.requires_grad_() for t in (q, k, v)], **kw)
    assert not out.isnan().any()
    torch.testing.assert_close(out, want)
    for name, a, b in zip(("dk", "dv"), grads[1:], want_grads[1:]):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")


def test_key_lengths_any_integer_dtype_and_mask_dtypes():
    q, k, v = _qkv()
    ref = reference.attention(q, k, v, key_lengths=torch.tensor([3, 7]))
    for kl in (torch.tensor([3, 7], dtype=torch.int64), torch.tensor([3, 7], dtype=torch.int32),
               torch.tensor([3, 7], dtype=torch.int16)):
        torch.testing.assert_close(fasttrans.attention(q, k, v, key_lengths=kl), ref)
    m64 = torch.randn(5, 7, dtype=torch.float64)  # a float mask of another float dtype is converted
    torch.testing.assert_close(fasttrans.attention(q, k, v, attn_mask=m64),
                               reference.attention(q, k, v, attn_mask=m64.float()))


def test_matches_sdpa_and_float_mask_gradient():
    q, k, v = (t.requires_grad_() for t in _qkv(Hkv=4))
    mask = torch.randn(1, 4, 5, 7, requires_grad=True)
    out = fasttrans.attention(q, k, v, attn_mask=mask, scale=0.3)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    torch.testing.assert_close(out, expected)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, mask), g)
    expected_grads = torch.autograd.grad(expected, (q, k, v, mask), g)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", backend_params("attention"))
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("Dv", [3, 13], ids=["smaller-v", "larger-v"])
def test_values_with_another_head_dim(Dv, with_sinks, backend):
    """Values whose head dim differs from the queries' and keys' (multi-head latent
    attention's 192 / 128): softmax(q k^T / sqrt(D) + masks) v, the output with v's head dim;
    outputs and the gradients of q, k, v, a float mask (and sinks), with grouped-query heads,
    key lengths and a causal offset, on every backend."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 5, 7, 8
    leaves = [torch.randn(B, H, Lq, D, generator=g), torch.randn(B, Hkv, Lk, D, generator=g),
              torch.randn(B, Hkv, Lk, Dv, generator=g), torch.randn(B, 1, Lq, Lk, generator=g),
              torch.randn(H, generator=g)]
    lengths = torch.tensor([7, 4])
    allowed = torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq) & (torch.arange(Lk) < lengths.view(B, 1, 1, 1))
    dy = torch.randn(B, H, Lq, Dv, generator=g)

    def ours(q, k, v, bias, sinks):
        return fasttrans.attention(q, k, v, attn_mask=bias, key_lengths=lengths, is_causal=True,
                                   causal_offset=Lk - Lq, sinks=sinks if with_sinks else None)

    def formula(q, k, v, bias, sinks):
        s = (q @ k.repeat_interleave(H // Hkv, 1).transpose(2, 3) / D ** 0.5 + bias).masked_fill(~allowed, -math.inf)
        if with_sinks:
            s = torch.cat([s, sinks.view(1, H, 1, 1).expand(B, H, Lq, 1)], -1)
        return s.softmax(-1)[..., :Lk] @ v.repeat_interleave(H // Hkv, 1)

    results = []
    for fn in (ours, formula):
        ts = [t.detach().clone().requires_grad_() for t in leaves]
        with fasttrans.use_backend(backend):
            out = fn(*ts)
        results.append((out, torch.autograd.grad(out, ts if with_sinks else ts[:4], dy)))
    (got, got_grads), (want, want_grads) = results
    assert got.shape == (B, H, Lq, Dv)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("q", "k", "v", "attn_mask", "sinks"), got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"grad of {name}: {m}")


# torch 2.11's SDPA kills the process (SIGFPE, an integer division by zero) given no heads at
# all; 2.13's returns empty outputs. Older torch gets its math form for that case instead.
_SDPA_TAKES_NO_HEADS = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)


def _torch_attention(q, k, v, **kw):
    if q.shape[1] == 0 and not _SDPA_TAKES_NO_HEADS and not kw:
        return torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1) @ v
    return F.scaled_dot_product_attention(q, k, v, **kw, enable_gqa=True)


def _sdpa_case(q, k, v, **kw):
    """fasttrans.attention and torch's SDPA on the same leaves: outputs and the gradients of
    q, k and v."""
    results = []
    for fn in (fasttrans.attention, _torch_attention):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, **kw)
        out.backward(torch.ones_like(out))
        results.append([out] + [t.grad for t in leaves])
    return results


@pytest.mark.parametrize("shape", [(0, 4, 2, 5, 7), (2, 0, 1, 5, 7), (2, 0, 0, 5, 7), (2, 4, 2, 0, 7)],
                         ids=["batch", "heads", "no-heads-at-all", "queries"])
def test_empty_attention_is_empty_as_in_torch(shape):
    """No batch, no head or no query: empty outputs and gradients of the inputs' shapes, as
    torch's SDPA gives (the output keeps its autograd graph)."""
    B, H, Hkv, Lq, Lk = shape
    q, k, v = _qkv(B=B, H=H, Hkv=Hkv, Lq=Lq, Lk=Lk)
    got, expected = _sdpa_case(q, k, v)
    for a, b in zip(got, expected):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)


def test_dropout_p_one_gives_zeros_as_in_torch():
    q, k, v = _qkv(Hkv=4)
    got, expected = _sdpa_case(q, k, v, dropout_p=1.0)
    for a, b in zip(got, expected):
        assert torch.equal(a, torch.zeros_like(a)) and torch.equal(b, torch.zeros_like(b))


@pytest.mark.parametrize("offset", [2**63, 2**80, -(2**63), 10**6, 7, 6, -5, -6])
def test_causal_offsets_past_the_sequences(offset):
    """Offsets beyond the sequences (even past int64) mean every key or no key: the same
    masks as the clamped offset, which is what the ops receive."""
    q, k, v = _qkv(Lq=5, Lk=7)
    allowed = torch.tensor([[j <= i + offset for j in range(7)] for i in range(5)])
    out = fasttrans.attention(q, k, v, is_causal=True, causal_offset=offset)
    expected = fasttrans.attention(q, k, v, attn_mask=allowed)
    torch.testing.assert_close(out, expected)


def test_head_dims_past_the_kernels_run_on_the_reference(monkeypatch):
    """Head dims above MAX_HEAD_DIM: automatic selection runs the reference (with a one-time
    warning that says why) and matches SDPA; a forced kernel backend raises."""
    monkeypatch.setattr(functional, "_reference_warned", set())
    D = functional.MAX_HEAD_DIM + 44
    q, k, v = _qkv(Lq=6, Lk=6, D=D)
    with pytest.warns(RuntimeWarning, match=f"head dim {D} runs on the reference"):
        got, expected = _sdpa_case(q, k, v, is_causal=True)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fasttrans.attention(q, k, v)  # warned once per head dim
    with fasttrans.use_backend("reference"), warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(fasttrans.attention(q, k, v), F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    with fasttrans.use_backend("extension"), pytest.raises(backends.BackendUnavailableError, match="head dims up to 256"):
        fasttrans.attention(q, k, v)


def test_fully_masked_rows_are_zero_with_zero_gradients():
    q, k, v = (t.requires_grad_() for t in _qkv())
    out = fasttrans.attention(q, k, v, key_lengths=torch.tensor([0, 7]), is_causal=True, causal_offset=-2)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(out[1, :, :2], torch.zeros_like(out[1, :, :2]))  # rows 0, 1 see no key
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[0], torch.zeros_like(q.grad[0]))


def test_dropout_debug_hook_reproduces_the_mask():
    q, k, v = _qkv()
    torch.manual_seed(3)
    keep = functional.attention_dropout_mask(q, k, 0.4)
    torch.manual_seed(3)
    out = fasttrans.attention(q, k, v, dropout_p=0.4)
    torch.testing.assert_close(out, reference.attention(q, k, v, dropout_p=0.4, dropout_mask=keep))
    assert abs((~keep).float().mean().item() - 0.4) < 0.1
    torch.manual_seed(4)
    assert not torch.equal(functional.attention_dropout_mask(q, k, 0.4), keep)


@pytest.mark.parametrize("backend", backend_params("attention"))
def test_every_backend_draws_the_same_attention_dropout_mask(backend):
    q, k, _ = _qkv(Lk=11)
    torch.manual_seed(8)
    with fasttrans.use_backend("reference"):
        want = functional.attention_dropout_mask(q, k, 0.3)
    torch.manual_seed(8)
    with fasttrans.use_backend(backend):
        assert torch.equal(functional.attention_dropout_mask(q, k, 0.3), want)
    torch.manual_seed(8)
    seed = functional._draw_seed(0.3)
    assert torch.equal(want, attention_keep(seed, 0.3, 2, 4, 5, 11))  # the definition (csrc/philox.h)


def test_attention_weights_are_the_softmax():
    q, k, _ = _qkv(Hkv=4)
    mask = torch.rand(5, 7) > 0.3
    w = functional.attention_weights(q, k, attn_mask=mask)
    s = (q @ k.transpose(-1, -2)) / 8**0.5
    expected = torch.softmax(s.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    torch.testing.assert_close(w, expected)


@pytest.mark.parametrize("shape,ns", [((3, 7), (7,)), ((2, 3, 4, 5), (4, 5)), ((3, 4), (3, 4)), ((6,), (6,))])
def test_norms_match_torch_with_gradients(shape, ns):
    x = torch.randn(shape, requires_grad=True)
    w = torch.randn(ns, requires_grad=True)
    b = torch.randn(ns, requires_grad=True)
    for ours, theirs, params in (
        (lambda: fasttrans.layer_norm(x, ns, w, b, 1e-5), lambda: F.layer_norm(x, ns, w, b, 1e-5), (x, w, b)),
        (lambda: fasttrans.rms_norm(x, ns, w), lambda: F.rms_norm(x, ns, w), (x, w)),
    ):
        y, expected = ours(), theirs()
        torch.testing.assert_close(y, expected)
        g = torch.randn_like(y)
        for a, e in zip(torch.autograd.grad(y, params, g), torch.autograd.grad(expected, params, g)):
            torch.testing.assert_close(a, e)


def test_add_layer_norm_gradients_flow_to_both_outputs():
    x, r = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    w, b = torch.randn(6, requires_grad=True), torch.randn(6, requires_grad=True)
    y, h = fasttrans.add_layer_norm(x, r, w, b)
    y2 = F.layer_norm(x + r, (6,), w, b)
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    ours = torch.autograd.grad((y, h), (x, r, w, b), (gy, gh))
    theirs = torch.autograd.grad((y2, x + r), (x, r, w, b), (gy, gh))
    for a, e in zip(ours, theirs):
        torch.testing.assert_close(a, e)


# ---------------------------------------------------------------------------------------
# backend selection
# ---------------------------------------------------------------------------------------
def test_use_backend_forces_and_restores(monkeypatch):
    monkeypatch.delenv("FASTTRANS_BACKEND", raising=False)
    with fasttrans.use_backend("reference"):
        assert backends.select_backend("attention", "cpu").name == "reference"
        assert backends.current_forced_backend() == "reference"
    assert backends.current_forced_backend() is None
    with pytest.raises(ValueError, match="unknown backend"):
        with fasttrans.use_backend("cuda-magic"):
            pass


def test_env_var_forces_a_backend(monkeypatch):
    monkeypatch.setenv("FASTTRANS_BACKEND", "reference")
    assert backends.select_backend("norm", "cpu").name == "reference"
    monkeypatch.setenv("FASTTRANS_BACKEND", "nope")
    with pytest.raises(ValueError, match="FASTTRANS_BACKEND"):
        backends.select_backend("norm", "cpu")


def test_use_backend_none_selects_automatically_over_the_env_var(monkeypatch):
    monkeypatch.setenv("FASTTRANS_BACKEND", "reference")
    with fasttrans.use_backend(None):
        assert backends.current_forced_backend() is None
        assert backends.select_backend("norm", "cpu").name == backends.registry._select_automatic(
            "norm", torch.device("cpu"), None).name
        with fasttrans.use_backend("extension"):
            assert backends.current_forced_backend() == "extension"
        assert backends.current_forced_backend() is None
    assert backends.current_forced_backend() == "reference"


def test_forced_backend_that_cannot_run_raises_with_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(backends.BACKENDS, "triton", backends.Backend(
        "triton", backends.registry._load_triton, backends.registry._triton_check))
    q, k, v = _qkv()
    with fasttrans.use_backend("triton"):
        with pytest.raises(backends.BackendUnavailableError, match="interpreter"):
            fasttrans.attention(q, k, v)


_INTERPRET_SET_LATE = """
import os
os.environ.pop("TRITON_INTERPRET", None)
import torch, triton, fasttrans
os.environ["TRITON_INTERPRET"] = "1"  # too late: triton.language is already built for the GPU
try:
    with fasttrans.use_backend("triton"):
        fasttrans.layer_norm(torch.randn(2, 8), (8,))
except fasttrans.backends.BackendUnavailableError as e:
    print("raised:", e)
"""


def test_interpreter_requested_after_importing_triton_is_named():
    """TRITON_INTERPRET=1 set after triton is imported cannot take effect (triton.language's
    own jit functions are already compiled-mode): a forced triton backend says so, instead of
    failing inside the interpreter."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _INTERPRET_SET_LATE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "raised:" in r.stdout and "set after triton was imported" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("triton_version, numpy_version, refused", [
    ("3.6.0", "2.4.6", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.6", False), ("3.9.0", "2.5.0", False),
])
def test_interpreter_that_cannot_run_with_this_numpy_is_named(monkeypatch, triton_version, numpy_version, refused):
    """Triton before 3.7 interprets a loop bound by int() of a one-element array, which numpy
    2.4 refuses: the Triton backend on CPU names both versions instead of failing in every
    kernel."""
    import numpy
    import triton

    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(numpy, "__version__", numpy_version)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(backends.registry, "_triton_language_interpreted", lambda: True)
    reason = backends.registry._triton_check(torch.device("cpu"))
    if refused:
        assert f"Triton {triton_version}'s interpreter" in reason and f"numpy {numpy_version}" in reason, reason
        assert "numpy < 2.4 or Triton >= 3.7" in reason
    else:
        assert reason is None
    assert backends.registry._triton_check(torch.device("cuda")) is None  # compiled kernels: no interpreter


def test_automatic_fallback_warns_once(monkeypatch):
    monkeypatch.delenv("FASTTRANS_BACKEND", raising=False)
    broken = backends.Backend("extension", lambda: (_ for _ in ()).throw(OSError("compiler missing")),
                              lambda device: None)
    monkeypatch.setitem(backends.BACKENDS, "extension", broken)
    monkeypatch.setattr(backends.registry, "_warned", set())
    q, k, v = _qkv()
    with pytest.warns(RuntimeWarning, match="compiler missing"):
        fasttrans.attention(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fasttrans.attention(q, k, v)  # the second call is silent
    with fasttrans.use_backend("extension"):
        with pytest.raises(backends.BackendUnavailableError, match="compiler missing"):
            fasttrans.attention(q, k, v)


def test_automatic_selection_is_memoised_until_a_backend_changes(monkeypatch):
    monkeypatch.delenv("FASTTRANS_BACKEND", raising=False)
    x = torch.randn(3, 8)
    first = backends.select_backend("norm", "cpu", torch.float32)
    assert backends.select_backend("norm", "cpu", torch.float32) is first
    calls = []

    def check(device):
        calls.append(device)
        return "switched off for this test"

    # a replaced registry entry is seen by the next call
    monkeypatch.setattr(backends.registry, "_warned", set())
    off = backends.Backend("extension", backends.BACKENDS["extension"]._load, check)
    monkeypatch.setitem(backends.BACKENDS, "extension", off)
    with pytest.warns(RuntimeWarning, match="switched off for this test"):
        torch.testing.assert_close(fasttrans.layer_norm(x, (8,)), F.layer_norm(x, (8,)))
    assert backends.select_backend("norm", "cpu", torch.float32).name == "reference"
    fasttrans.layer_norm(x, (8,))
    assert len(calls) == 1  # memoised: the check ran once for three calls
    # so is an attribute set on a Backend
    monkeypatch.setattr(off, "_check", lambda device: None)
    assert backends.select_backend("norm", "cpu", torch.float32).name == "extension"
    monkeypatch.undo()
    monkeypatch.delenv("FASTTRANS_BACKEND", raising=False)
    assert backends.select_backend("norm", "cpu", torch.float32) is first


def test_a_forced_backend_is_checked_on_every_call(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FASTTRANS_BACKEND", "triton")
    assert backends.select_backend("norm", "cpu", torch.float32).name == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(backends.BackendUnavailableError, match="interpreter"):
        backends.select_backend("norm", "cpu", torch.float32)


def test_a_forced_backend_memoised_as_usable_is_checked_again_when_a_backend_changes(monkeypatch):
    monkeypatch.setenv("FASTTRANS_BACKEND", "extension")
    assert backends.select_backend("norm", "cpu", torch.float32).name == "extension"
    monkeypatch.setitem(backends.BACKENDS, "extension", backends.Backend(
        "extension", backends.BACKENDS["extension"]._load, lambda device: "switched off for this test"))
    with pytest.raises(backends.BackendUnavailableError, match="switched off for this test"):
        fasttrans.layer_norm(torch.randn(3, 8), (8,))
    monkeypatch.setattr(backends.BACKENDS["extension"], "_check", lambda device: None)
    assert backends.select_backend("norm", "cpu", torch.float32).name == "extension"


def test_automatic_selection_skips_a_backend_without_kernels_for_the_dtype(monkeypatch):
    # as Triton and the CUDA extension for float64 on a GPU: the next backend runs it, with a
    # one-time warning; float32 stays on the preferred backend
    monkeypatch.delenv("FASTTRANS_BACKEND", raising=False)
    monkeypatch.setattr(backends.BACKENDS["extension"], "fp64_devices", ())
    monkeypatch.setattr(backends.registry, "_warned", set())
    q, k, v = _qkv(dtype=torch.float64)
    x = torch.randn(3, 8, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="no float64 kernels on cpu"):
        out = fasttrans.attention(q, k, v)
    torch.testing.assert_close(out, reference.attention(q, k, v))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(fasttrans.layer_norm(x, (8,)), F.layer_norm(x, (8,)))
    assert backends.select_backend("norm", "cpu", torch.float64).name == "reference"
    assert backends.select_backend("norm", "cpu", torch.float32).name == "extension"


# ---------------------------------------------------------------------------------------
# torch.library registration
# ---------------------------------------------------------------------------------------
def test_opcheck_reference_ops():
    fwd, bwd, nfwd, nbwd = backends.ops_for("reference")
    q, k, v = (t.requires_grad_() for t in _qkv())
    mask = torch.randn(1, 1, 5, 7).expand(2, 4, 5, 7).requires_grad_()
    kl = torch.tensor([7, 2], dtype=torch.int32)
    torch.library.opcheck(fwd, (q, k, v, mask, kl, True, 2, 0.0, 0.35, 0))
    torch.library.opcheck(fwd, (q, k, v, None, None, False, 0, 0.3, 0.35, 11))
    out, lse = fwd(q, k, v, mask, kl, True, 2, 0.0, 0.35, 0)
    # the backward ops are not differentiable themselves (no double backward): plain tensors
    qd, kd, vd, md = (t.detach() for t in (q, k, v, mask))
    torch.library.opcheck(bwd, (torch.randn_like(out), qd, kd, vd, out.detach(), lse.detach(), md, kl, True, 2, 0.0,
                                0.35, 0, True))
    x, r = torch.randn(6, 10, requires_grad=True), torch.randn(6, 10, requires_grad=True)
    w, b = torch.randn(10, requires_grad=True), torch.randn(10, requires_grad=True)
    torch.library.opcheck(nfwd, (x, r, w, b, 1e-5, False))
    torch.library.opcheck(nfwd, (x, None, None, None, 1e-5, False))
    torch.library.opcheck(nfwd, (x, None, w, None, 1e-6, True))
    y, h, mean, rstd = nfwd(x, r, w, b, 1e-5, False)
    torch.library.opcheck(nbwd, (torch.randn_like(y), torch.randn_like(h), h.detach(), w.detach(), b.detach(),
                                 mean.detach(), rstd.detach(), False))


def test_fp64_gradcheck_through_functional():
    q, k, v = (t.double().requires_grad_() for t in _qkv(B=2, H=2, Hkv=1, Lq=3, Lk=4, D=3))
    mask = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    kl = torch.tensor([4, 1])

    def f(q, k, v, mask):
        return fasttrans.attention(q, k, v, attn_mask=mask, key_lengths=kl, is_causal=True, causal_offset=1)

    assert torch.autograd.gradcheck(f, (q, k, v, mask))
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, r, w: fasttrans.add_layer_norm(x, r, w, None), (x, r, w))


def test_compile_fullgraph_matches_eager():
    q, k, v = _qkv()
    kl = torch.tensor([7, 3])

    def f(q, k, v, x, w, b):
        o = fasttrans.attention(q, k, v, key_lengths=kl, is_causal=True, causal_offset=2)
        y, h = fasttrans.add_layer_norm(x, o.sum(1), w, b)
        return o, y, h

    x, w, b = torch.randn(2, 5, 8), torch.randn(8), torch.randn(8)
    eager = f(q, k, v, x, w, b)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, x, w, b)
    for a, e in zip(compiled, eager):
        torch.testing.assert_close(a, e)

"""The Triton norms (kernels/layernorm.py): LayerNorm, Add & Norm and RMSNorm.

Without a GPU the kernels run through Triton's interpreter (tests/conftest.py switches it
on), so shapes are small and awkward rather than large; ``pytest -m gpu`` runs the same
checks on CUDA plus larger shapes. Every output and every gradient (x, residual, weight,
bias) is compared with fasttrans.reference under autograd: in fp64 on the fp32 inputs, in
fp32 on upcast fp16/bf16 inputs, the latter with the 2x rule against PyTorch's own norm in
the same low precision. Widths cover the fused path (one tile per row, several rows per
program), the split-row paths (rows longer than MAX_FUSED_N forward / MAX_FUSED_N_BWD
backward) and the boundaries between them.
"""

import pytest
import torch
import torch.nn.functional as F

import fasttrans
from fasttrans import backends, reference

from helpers import assert_close_lowp, assert_compile_targets_well_formed, norm_call

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_why = backends.BACKENDS["triton"].unavailable_reason(DEVICE, "norm")
if _why is not None and "not importable" in _why:
    pytest.skip(f"triton backend: {_why}", allow_module_level=True)

from fasttrans.kernels import layernorm as K  # noqa: E402  (after conftest chose the interpreter)

OPS = ("layer_norm", "add_layer_norm", "rms_norm")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EPS = 1e-5


# ---------------------------------------------------------------------------------------
# running one op three ways: the Triton backend, the reference, PyTorch itself
# ---------------------------------------------------------------------------------------
def _triton(op, x, r, w, b):
    with fasttrans.use_backend("triton"):
        return norm_call(op, fasttrans, x, r, w, b, EPS)


def _reference(op, x, r, w, b):
    return norm_call(op, reference, x, r, w, b, EPS)


def _torch(op, x, r, w, b):
    N = x.shape[-1]
    if op == "layer_norm":
        return (F.layer_norm(x, (N,), w, b, EPS),)
    if op == "add_layer_norm":
        h = x + r
        return F.layer_norm(h, (N,), w, b, EPS), h
    return (F.rms_norm(x, (N,), w, EPS),)


def _inputs(op, M, N, dtype, weight=True, bias=True, param_dtype=None, device=DEVICE):
    """x (M, N) with a non-zero mean, residual (add_layer_norm), weight/bias (or None)."""
    param_dtype = param_dtype or dtype
    x = (torch.randn(M, N, device=device) * 2 + 0.5).to(dtype)
    r = torch.randn(M, N, device=device).to(dtype) if op == "add_layer_norm" else None
    w = torch.randn(N, device=device).to(param_dtype) if weight else None
    b = torch.randn(N, device=device).to(param_dtype) if bias and op != "rms_norm" else None
    return x, r, w, b


def _run(fn, op, inputs, grads, cast=None):
    """Outputs and gradients {name: tensor} of ``fn`` under autograd, inputs cast to ``cast``."""
    names = ("x", "r", "w", "b")
    leaves = [None if t is None else (t.to(cast) if cast else t).detach().clone().requires_grad_() for t in inputs]
    outs = fn(op, *leaves)
    torch.autograd.backward(outs, [g.to(o.dtype) for o, g in zip(outs, grads)])
    result = {name: o.detach() for name, o in zip(("y", "h"), outs)}
    result.update({f"d{n}": t.grad for n, t in zip(names, leaves) if t is not None})
    return result


def _check(op, inputs, dtype, grads=None):
    """Triton against the reference (fp64 for fp32 inputs, fp32 for fp16/bf16) and the 2x rule."""
    x, r = inputs[0], inputs[1]
    if grads is None:
        n_out = 2 if op == "add_layer_norm" else 1
        # in the input dtype, so that the fp32/fp64 reference sees exactly the same values
        grads = [torch.randn_like(x, dtype=torch.float32).to(dtype) for _ in range(n_out)]
    out = _run(_triton, op, inputs, grads)
    ref = _run(_reference, op, inputs, grads, cast=torch.float64 if dtype == torch.float32 else torch.float32)
    base = _run(_torch, op, inputs, grads) if dtype != torch.float32 else {}
    assert out.keys() == ref.keys()
    for name in out:
        assert out[name].dtype == (inputs["xrwb".index(name[-1])].dtype if name.startswith("d") else dtype), name
        assert_close_lowp(name, out[name], ref[name], base.get(name), dtype=dtype)
    if op == "add_layer_norm":
        assert torch.equal(out["h"], _rounded_sum(x, r)), "h must be x + residual rounded to the input dtype"
    return out


def _rounded_sum(x, r):
    """x + r in x's dtype, rounded the way the Triton backend rounds on this device.

    Triton 3.9's interpreter converts fp32 to bf16 by truncation (runtime/interpreter.py:
    ``cast_impl`` calls ``_convert_float`` without a rounding mode); GPUs round to nearest
    even, as PyTorch does. fp32 and fp16 are rounded to nearest on both.
    """
    if x.dtype != torch.bfloat16 or x.is_cuda:
        return x + r
    bits = (x.float() + r.float()).view(torch.int32) & -65536  # clear the 16 bits bf16 drops
    return bits.view(torch.float32).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------
# forward and every gradient against the reference
# ---------------------------------------------------------------------------------------
# (rows, width): awkward row counts around several rows per program and several row blocks
# per dW/dB partial; widths 1, prime, 2^k - 1, and 4097 (fused forward, split backward)
SHAPES = [(1, 1), (3, 7), (17, 7), (33, 64), (1, 1023), (17, 1023), (3, 4097)]


@pytest.mark.parametrize("affine", ["weight+bias", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("op", OPS)
def test_matches_reference(op, shape, dtype, affine):
    M, N = shape
    _check(op, _inputs(op, M, N, dtype, weight=affine != "none", bias=affine != "none"), dtype)


@pytest.mark.parametrize("shape", [(3, 65537), (2, 9000)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_split_rows(op, dtype, shape):
    """Both split-row paths (chunked two-pass forward, row sums + column chunks backward);
    2 rows of 9000 give the backward two groups of column chunks (the interpreter's GPU
    holds 4 programs), each over several chunks, the last one ragged."""
    _check(op, _inputs(op, *shape, dtype), dtype)


@pytest.mark.parametrize("N", [100, K.MAX_FUSED_N + 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_of_one_repeated_value_normalise_to_the_bias(dtype, N):
    """xhat is exactly 0 for a row of one value (the mean is not sum / N, which would leave
    rounding noise times rstd = 1 / sqrt(eps)), on the fused and the split path, with and
    without the residual; torch gives exactly the bias too (in float32)."""
    w = torch.randn(N).to(dtype)
    b = torch.randn(N).to(dtype)
    rows = torch.tensor([[0.3], [123.456], [-7.1]]).to(dtype)
    x = rows.expand(3, N)  # stride 0 along the row
    r = torch.full((3, N), 0.5, dtype=dtype)
    with fasttrans.use_backend("triton"):
        y = fasttrans.layer_norm(x.contiguous(), (N,), w, b)
        y0 = fasttrans.layer_norm(x, (N,), w, b)
        ya, h = fasttrans.add_layer_norm(x.contiguous(), r, w, b)
    expected = b.expand(3, N)
    if dtype == torch.float32:  # (torch's bfloat16 CPU kernel is off by a rounding)
        assert torch.equal(F.layer_norm(x.contiguous(), (N,), w, b), expected)
    for name, got in (("layer_norm", y), ("layer_norm, stride 0", y0), ("add_layer_norm", ya)):
        assert torch.equal(got, expected), f"{name}: max |y - b| {(got.float() - expected.float()).abs().max()}"


@pytest.mark.parametrize("N", [64, 65, K.MAX_FUSED_N_BWD, K.MAX_FUSED_N_BWD + 1, K.MAX_FUSED_N, K.MAX_FUSED_N + 1])
@pytest.mark.parametrize("op", ["add_layer_norm", "rms_norm"])
def test_path_boundaries(op, N):
    """Widths on both sides of each change of configuration (tile packing, fused/split)."""
    _check(op, _inputs(op, 2, N, torch.float32), torch.float32)


AFFINE_VARIANTS = [  # (op, weight, bias, parameter dtype: None = the input's)
    pytest.param("add_layer_norm", True, False, None, id="add_layer_norm-weight-only"),
    pytest.param("add_layer_norm", False, True, None, id="add_layer_norm-bias-only"),
    pytest.param("add_layer_norm", True, True, torch.float32, id="add_layer_norm-fp32-params"),
    pytest.param("rms_norm", True, False, torch.float32, id="rms_norm-fp32-weight"),
]


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # PyTorch's baseline
@pytest.mark.parametrize("shape", [(17, 100), (3, 4097)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op, weight, bias, param_dtype", AFFINE_VARIANTS)
def test_affine_variants(op, weight, bias, param_dtype, dtype, shape):
    M, N = shape
    _check(op, _inputs(op, M, N, dtype, weight, bias, param_dtype), dtype)


def test_gradient_of_sum():
    """y.sum().backward() hands the backward an expanded (stride 0) gradient."""
    x, r, w, b = _inputs("add_layer_norm", 5, 33, torch.float32)
    out = []
    for fn in (_triton, _reference):
        leaves = [t.detach().clone().requires_grad_() for t in (x, r, w, b)]
        y, h = fn("add_layer_norm", *leaves)
        (y.sum() + h.sum()).backward()
        out.append([t.grad for t in leaves])
    for got, want in zip(*out):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# strides: rows are read with their own stride, never copied
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("N", [40, 4097])
def test_strided_rows(N):
    """x is every other row of a larger tensor; the residual a transpose of the batch dims."""
    base = torch.randn(2, 6, N, device=DEVICE, requires_grad=True)
    r_base = torch.randn(3, 2, N, device=DEVICE, requires_grad=True)
    w_base = torch.randn(2 * N, device=DEVICE, requires_grad=True)
    b = torch.randn(N, device=DEVICE, requires_grad=True)
    gy, gh = torch.randn(2, 3, N, device=DEVICE), torch.randn(2, 3, N, device=DEVICE)
    grads = []
    for fn in (_triton, _reference):
        for t in (base, r_base, w_base, b):
            t.grad = None
        x = base[:, ::2]  # (2, 3, N), row stride 2N: flattens to a strided (6, N) view
        assert x.reshape(-1, N).data_ptr() == base.data_ptr() and not x.is_contiguous()
        y, h = fn("add_layer_norm", x, r_base.transpose(0, 1), w_base[::2], b)
        torch.autograd.backward((y, h), (gy, gh))
        grads.append([y.detach(), h.detach()] + [t.grad.clone() for t in (base, r_base, w_base, b)])
    for name, got, want in zip(("y", "h", "dx", "dr", "dw", "db"), *grads):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=name)


@pytest.mark.parametrize("N", [7, 1023, 4097])
def test_launcher_row_strides(N):
    """The launchers directly: a strided h in the backward, and rows of stride 0 (expand)."""
    M = 5
    big = torch.randn(M, 3 * N, device=DEVICE)
    x = big[:, N : 2 * N]  # row stride 3N
    r = torch.randn(1, N, device=DEVICE).expand(M, N)  # row stride 0
    w, b = torch.randn(N, device=DEVICE), torch.randn(N, device=DEVICE)
    y, h, mean, rstd = K.norm_fwd(x, r, w, b, EPS, False)
    h_ref = x + r
    torch.testing.assert_close(h, h_ref, atol=0, rtol=0)
    torch.testing.assert_close(y, reference.layer_norm(h_ref, (N,), w, b, EPS), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(mean, h_ref.double().mean(-1).float(), atol=1e-6, rtol=1e-5)

    # backward of plain LayerNorm on x itself: the saved input is the strided x
    y, _, mean, rstd = K.norm_fwd(x, None, w, b, EPS, False)
    dy = torch.randn(M, N, device=DEVICE)
    dx, dw, db = K.norm_bwd(dy, None, x, w, b, mean, rstd, False)
    dx_ref, dw_ref, db_ref = reference.ReferenceImpl.norm_bwd(dy, None, x, w, b, mean, rstd, False)
    for name, got, want in (("dx", dx, dx_ref), ("dw", dw, dw_ref), ("db", db, db_ref)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=name)


# ---------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("N", [1023, K.MAX_FUSED_N + 1])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_saved_statistics(N, rms):
    """mean/rstd are fp32, one per row, equal to the fp64 statistics of the same values."""
    x = torch.randn(3, N, device=DEVICE, dtype=torch.bfloat16) * 3 + 1
    y, h, mean, rstd = K.norm_fwd(x, None, None, None, EPS, rms)
    xd = x.double()
    assert h is None and rstd.dtype == torch.float32 and rstd.shape == (3,)
    if rms:
        assert mean is None
        want = torch.rsqrt(xd.pow(2).mean(-1) + EPS)
    else:
        assert mean.dtype == torch.float32 and mean.shape == (3,)
        torch.testing.assert_close(mean.double(), xd.mean(-1), atol=1e-6, rtol=1e-6)
        want = torch.rsqrt(xd.var(-1, unbiased=False) + EPS)
    torch.testing.assert_close(rstd.double(), want, atol=0, rtol=1e-5)


@pytest.mark.parametrize("N", [1023, K.MAX_FUSED_N + 1])
def test_variance_without_cancellation(N):
    """|mean| >> std: E[x²] - E[x]² would lose every digit of the variance in fp32."""
    x = 3000.0 + 0.01 * torch.randn(2, N, device=DEVICE)
    _, _, mean, rstd = K.norm_fwd(x, None, None, None, 0.0, False)
    want = torch.rsqrt(x.double().var(-1, unbiased=False))
    torch.testing.assert_close(rstd.double(), want, atol=0, rtol=1e-4)
    torch.testing.assert_close(mean.double(), x.double().mean(-1), atol=1e-3, rtol=0)


# ---------------------------------------------------------------------------------------
# determinism, dtypes, compile-check protocol
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(37, 1023), (9, 4097)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_backward_is_deterministic(shape):
    """Two backward runs are bit-identical (dW/dB: fixed partials reduced in a fixed order)."""
    M, N = shape
    inputs = _inputs("add_layer_norm", M, N, torch.float16)
    grads = [torch.randn(M, N, device=DEVICE) for _ in range(2)]
    first = _run(_triton, "add_layer_norm", inputs, grads)
    second = _run(_triton, "add_layer_norm", inputs, grads)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_float64_is_rejected():
    x = torch.randn(3, 5, device=DEVICE, dtype=torch.float64)
    # a forced backend without kernels for the dtype is unavailable, as for any other reason
    with fasttrans.use_backend("triton"):
        for call in (lambda: fasttrans.layer_norm(x, (5,)), lambda: fasttrans.add_layer_norm(x, x),
                     lambda: fasttrans.attention(x[None, None], x[None, None], x[None, None]),
                     lambda: fasttrans.functional.dropout(x, 0.5)):
            with pytest.raises(fasttrans.BackendUnavailableError, match="'triton' has no float64 kernels"):
                call()
    with pytest.raises(TypeError, match=r"h: .*float64"):
        K.norm_bwd(x, None, x, None, None, x[:, 0], x[:, 0], False)


def test_launcher_rejects_strided_columns():
    x = torch.randn(4, 10, device=DEVICE)[:, ::2]
    with pytest.raises(ValueError, match="x: expected unit stride"):
        K.norm_fwd(x, None, None, None, EPS, False)


def test_opcheck():
    """torch.library's checks of the registered ops (schema, fake tensors, autograd)."""
    backends.ops_for("triton")
    x, r, w, b = _inputs("add_layer_norm", 3, 33, torch.float32)
    fwd = torch.ops.fasttrans.norm_fwd_triton
    torch.library.opcheck(fwd, (x, r, w.clone().requires_grad_(), b.clone().requires_grad_(), EPS, False))
    y, h, mean, rstd = fwd(x, r, w, b, EPS, False)  # inputs without grad: norm_bwd has no autograd
    dy, dh = torch.randn_like(y), torch.randn_like(h)
    torch.library.opcheck(torch.ops.fasttrans.norm_bwd_triton, (dy, dh, h, w, b, mean, rstd, False))


def test_compile_targets_cover_every_launch():
    """compile_targets() lists each configuration the launchers can pick, per dtype, well formed."""
    targets = K.compile_targets()
    assert_compile_targets_well_formed(targets, K.NUM_STAGES)
    covered = {(t["kernel"], t["constexprs"]["BLOCK_N"], t["constexprs"].get("BLOCK_M", 1), t["num_warps"],
                t["signature"].get("X", t["signature"].get("H"))) for t in targets}
    for N in [1, 7, 64, 65, 1000, 1023, 4096, 4097, 8193, 16384, 16385, 65537]:
        for dtype in ("*fp32", "*fp16", "*bf16"):
            f, bw = K.fwd_config(N), K.bwd_config(N)
            fwd_fn = "_norm_fwd_split_kernel" if f.split else "_norm_fwd_kernel"
            assert (fwd_fn, f.BLOCK_N, f.BLOCK_M, f.num_warps, dtype) in covered, (N, dtype, f)
            assert ("_norm_bwd_kernel", bw.BLOCK_N, bw.BLOCK_M, bw.num_warps, dtype) in covered, (N, dtype, bw)
            red = K.reduce_config(N)
            assert any(t["kernel"] == "_norm_bwd_reduce_kernel" and t["signature"]["DW"] == dtype
                       and t["constexprs"]["BLOCK_N"] == red.BLOCK_N and t["constexprs"]["BLOCK_P"] == red.BLOCK_M
                       and t["num_warps"] == red.num_warps for t in targets), (N, dtype, red)


def test_widest_forward_warps_follow_the_triton_version(monkeypatch):
    """The 16384-wide forward takes 16 warps, 32 under Triton 3.8 (whose build of it with a
    residual spills at 16: compile-check), as the module reads it under each version."""
    import importlib.util
    import sys

    import triton

    def warps_on(version: str) -> tuple[int, int]:  # at 16384 and 8192 columns
        monkeypatch.setattr(triton, "__version__", version)
        name = f"fasttrans.kernels._layernorm_as_on_{version.replace('.', '_')}"
        spec = importlib.util.spec_from_file_location(name, K.__file__)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)  # its dataclasses look their module up
        spec.loader.exec_module(module)
        return module.fwd_config(16384).num_warps, module.fwd_config(8192).num_warps

    assert warps_on("3.6.0") == warps_on("3.7.1") == warps_on("3.9.0") == (16, 32)
    assert warps_on("3.8.0") == (32, 32)


# ---------------------------------------------------------------------------------------
# CUDA: the same checks on larger shapes (pytest -m gpu)
# ---------------------------------------------------------------------------------------
GPU_SHAPES = [(4096, 1024), (1000, 768), (257, 4096), (64, 8192), (33, 16384), (16, 16385), (8, 65537)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("op", OPS)
def test_gpu_matches_reference(op, shape, dtype):
    M, N = shape
    _check(op, _inputs(op, M, N, dtype), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", [(8192, 1024), (512, 4097), (16, 65537)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_backward_is_deterministic(shape):
    M, N = shape
    inputs = _inputs("add_layer_norm", M, N, torch.bfloat16)
    grads = [torch.randn(M, N, device=DEVICE) for _ in range(2)]
    first = _run(_triton, "add_layer_norm", inputs, grads)
    for _ in range(3):
        again = _run(_triton, "add_layer_norm", inputs, grads)
        for name in first:
            assert torch.equal(first[name], again[name]), name


@pytest.mark.parametrize("route", ["inductor entry", "empty_strided"])
def test_site_outputs_are_allocated_in_the_layout_asked(monkeypatch, route):
    """The sites allocate through inductor's allocation entry points, or torch.empty_strided
    where a torch has none: either gives the size, strides and dtype asked, on the device."""
    from fasttrans.kernels import strided_allocator

    name = f"_empty_strided_{torch.device(DEVICE).type}"
    fast = getattr(torch._C._dynamo.guards, name)
    if route == "empty_strided":
        monkeypatch.delattr(torch._C._dynamo.guards, name)
    alloc = strided_allocator(torch.device(DEVICE))
    for size, stride, dtype in (((2, 3, 8), (24, 8, 1), torch.float16), ((5,), (1,), torch.float32),
                                ((1, 4), (4, 1), torch.bfloat16)):
        t = alloc(size, stride, dtype)
        assert (t.shape, t.stride(), t.dtype, t.device.type, t.requires_grad) == (
            size, stride, dtype, torch.device(DEVICE).type, False)
    # a fresh site, made with this route's allocator, launches the call below
    monkeypatch.setattr(K, "_NORM_SITES", {})
    x = torch.randn(3, 2, 40, device=DEVICE)
    with fasttrans.use_backend("triton"):
        y = fasttrans.layer_norm(x, 40, eps=EPS)
    (site,) = K._NORM_SITES.values()
    assert (site.alloc is fast) == (route == "inductor entry")
    assert y.shape == x.shape and y.is_contiguous()
    torch.testing.assert_close(y, F.layer_norm(x, (40,), eps=EPS))

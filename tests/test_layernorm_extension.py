"""The C++ extension's norms (csrc/layernorm_cpu.cpp) and the extension's build and loading.

layer_norm, add_layer_norm and rms_norm are compared with fasttrans.reference, forward and
every gradient (x, residual, weight, bias), over awkward widths, dtypes, strided rows,
missing weight/bias and large-mean rows; dW/dB must be bit-identical on any thread count.
The second half checks fasttrans.extension itself: the cached build, the cross-process
lock, and what the registry does when a build fails.
"""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import fasttrans
from fasttrans import extension, reference

from helpers import assert_close_lowp, norm_call, require_extension

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


# ---------------------------------------------------------------------------------------
# forward and every gradient against the reference
# ---------------------------------------------------------------------------------------
def _run(kind, module, x, r, w, b, eps, grads_out):
    leaves = {n: t.detach().clone().requires_grad_() for n, t in (("x", x), ("r", r), ("w", w), ("b", b))
              if t is not None}
    outs = norm_call(kind, module, leaves["x"], leaves.get("r"), leaves.get("w"), leaves.get("b"), eps)
    torch.autograd.backward(outs, grads_out[: len(outs)])
    return [o.detach() for o in outs] + [leaves[n].grad for n in ("x", "r", "w", "b") if n in leaves]


def _extension_module():
    class M:
        @staticmethod
        def layer_norm(*a):
            with fasttrans.use_backend("extension"):
                return fasttrans.layer_norm(*a)

        @staticmethod
        def add_layer_norm(*a):
            with fasttrans.use_backend("extension"):
                return fasttrans.add_layer_norm(*a)

        @staticmethod
        def rms_norm(*a):
            with fasttrans.use_backend("extension"):
                return fasttrans.rms_norm(*a)

    return M


def _check(kind, x, r, w, b, eps=1e-5):
    dtype = x.dtype
    grads_out = [torch.randn_like(x), torch.randn_like(x)]
    got = _run(kind, _extension_module(), x, r, w, b, eps, grads_out)
    if dtype in (torch.float32, torch.float64):
        # the oracle in float64: an fp32 reference has rounding errors of its own (with one
        # column, dx is exactly the incoming gradient, which fp32 autograd misses by 3e-5 to 7e-5)
        up = [t.double() if t is not None else None for t in (x, r, w, b)]
        ref = _run(kind, reference, *up, eps, [g.double() for g in grads_out])
        base = [None] * len(ref)
    else:
        up = [t.float() if t is not None else None for t in (x, r, w, b)]
        ref = _run(kind, reference, *up, eps, [g.float() for g in grads_out])
        base = _run(kind, _LowpReference, x, r, w, b, eps, grads_out)
    names = ["y", "h"][: 2 if kind == "add_layer_norm" else 1] + [
        n for n, t in (("dx", x), ("dresidual", r), ("dweight", w), ("dbias", b)) if t is not None]
    for name, g, rf, bs in zip(names, got, ref, base):
        assert g.shape == rf.shape, name
        assert_close_lowp(name, g, rf, bs, dtype=dtype)
    return got


class _LowpReference:
    """PyTorch in the input's low precision: the baseline of the 2x rule."""

    @staticmethod
    def layer_norm(x, shape, w, b, eps):
        return torch.nn.functional.layer_norm(x, shape, w.to(x.dtype) if w is not None else None,
                                              b.to(x.dtype) if b is not None else None, eps)

    @staticmethod
    def add_layer_norm(x, r, w, b, eps):
        h = x + r
        return _LowpReference.layer_norm(h, (h.shape[-1],), w, b, eps), h

    @staticmethod
    def rms_norm(x, shape, w, eps):
        return torch.nn.functional.rms_norm(x, shape, w.to(x.dtype) if w is not None else None, eps)


KINDS = ["layer_norm", "add_layer_norm", "rms_norm"]
WIDTHS = [1, 7, 256, 1023, 1025, 4100]


@pytest.mark.parametrize("N", WIDTHS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("device", DEVICES)
def test_matches_reference_fp32(ext, device, kind, N):
    require_extension(device, "norm")
    M = 37
    x = torch.randn(M, N, device=device) * 3 + 1
    r = torch.randn(M, N, device=device) if kind == "add_layer_norm" else None
    w, b = torch.randn(N, device=device), torch.randn(N, device=device)
    _check(kind, x, r, w, None if kind == "rms_norm" else b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("device", DEVICES)
def test_matches_reference_other_dtypes(ext, device, kind, dtype):
    require_extension(device, "norm")
    M, N = 70, 515
    x = torch.randn(M, N, device=device, dtype=dtype)
    r = torch.randn(M, N, device=device, dtype=dtype) if kind == "add_layer_norm" else None
    w, b = torch.randn(N, device=device, dtype=dtype), torch.randn(N, device=device, dtype=dtype)
    if device == "cuda" and dtype == torch.float64:  # float64 runs on the CPU kernels only (docs/design.md)
        with pytest.raises(RuntimeError, match=r"^x: the CUDA kernels support float32, float16 and bfloat16, got Double"):
            norm_call(kind, _extension_module(), x, r, w, None if kind == "rms_norm" else b, 1e-5)
        return
    _check(kind, x, r, w, None if kind == "rms_norm" else b)


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_parameters_with_bf16_input(ext, device):
    """Mixed precision: fp32 weight/bias with bf16 activations, gradients in fp32."""
    require_extension(device, "norm")
    x, r = torch.randn(33, 300, device=device, dtype=torch.bfloat16), torch.randn(33, 300, device=device,
                                                                                  dtype=torch.bfloat16)
    w, b = torch.randn(300, device=device), torch.randn(300, device=device)
    out = _check("add_layer_norm", x, r, w, b)
    assert out[4].dtype == torch.float32 and out[5].dtype == torch.float32


@pytest.mark.parametrize("affine", ["none", "weight", "bias"])
@pytest.mark.parametrize("kind", KINDS)
def test_without_weight_or_bias(ext, kind, affine):
    M, N = 19, 129
    x = torch.randn(M, N)
    r = torch.randn(M, N) if kind == "add_layer_norm" else None
    w = torch.randn(N) if affine == "weight" else None
    b = torch.randn(N) if affine == "bias" and kind != "rms_norm" else None
    _check(kind, x, r, w, b)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_and_leading_dims(ext, device):
    """Rows with stride(0) > N (a slice of a wider buffer) and 3-D inputs, without copies."""
    require_extension(device, "norm")
    base_x, base_r = torch.randn(3, 7, 300, device=device), torch.randn(3, 7, 400, device=device)
    x, r = base_x[..., 20:276], base_r[..., 100:356]
    assert not x.is_contiguous() and x.stride(-1) == 1
    w, b = torch.randn(256, device=device), torch.randn(256, device=device)
    _check("add_layer_norm", x, r, w, b)
    _check("layer_norm", x, None, w, b)
    _check("rms_norm", x, None, w, None)


LARGE_CASES = [(torch.float32, 1024), (torch.float32, 1040), (torch.float32, 1025), (torch.bfloat16, 1025)]


@pytest.mark.parametrize("kind", ["add_layer_norm", "layer_norm"])
@pytest.mark.parametrize("dtype,N", LARGE_CASES, ids=[f"{d}-{n}" for d, n in LARGE_CASES])
def test_large_outputs(ext, dtype, N, kind):
    """Outputs of 4 MiB and more take the CPU kernels' streaming-store paths: fp32 rows of
    1024 are streamed straight from registers (aligned), rows of 1025 start unaligned and go
    through a row buffer with a head and a tail; rows of 1040 are an odd number of vectors."""
    M = (4 << 20) // (N * dtype.itemsize) + 3
    x, r = torch.randn(M, N, dtype=dtype), torch.randn(M, N, dtype=dtype)
    w, b = torch.randn(N, dtype=dtype), torch.randn(N, dtype=dtype)
    _check(kind, x, r if kind == "add_layer_norm" else None, w, b)


@pytest.mark.parametrize("device", DEVICES)
def test_large_mean_rows_keep_their_variance(ext, device):
    """Rows of 1e4 + small noise: E[x^2] - E[x]^2 would cancel to garbage in fp32."""
    require_extension(device, "norm")
    x = (1e4 + 1e-2 * torch.randn(16, 1000, dtype=torch.float64, device=device))
    xf = x.float()
    with fasttrans.use_backend("extension"):
        y = fasttrans.layer_norm(xf, (1000,))
    # the reference on the fp32-rounded input, computed in fp64; the kernel carries the mean
    # as h[0] + d, so its error stays at fp32 rounding of y (torch's fp32 layer_norm: ~0.1 here)
    ref = reference.layer_norm(xf.double(), (1000,))
    assert (y.double() - ref).abs().max() < 1e-5


def _shifted_rows(family, M, N, g):
    """fp64 rows that stress a variance taken from moments about a point other than the mean."""
    z = torch.randn(M, N, dtype=torch.float64, generator=g)
    if family == "large_mean":  # the mean dwarfs the spread
        return 1e4 + z
    if family == "outlier_first":  # the first element is far from everything else
        z[:, 0] = 1e3
        return z
    if family == "huge_outlier_first":
        z[:, 0] = 1e6
        return z
    if family == "large_mean_low_first":
        x = 1e4 + z
        x[:, 0] = 0.0
        return x
    if family == "outlier_first_block":  # the whole first 16 / 32 elements are outliers
        z[:, :32] += 1e3
        return z
    if family == "heavy_tail":  # Cauchy rows: any element can be far out
        return torch.tan(torch.pi * (torch.rand(M, N, dtype=torch.float64, generator=g) - 0.5))
    raise KeyError(family)


SHIFTED_FAMILIES = ["large_mean", "outlier_first", "huge_outlier_first", "large_mean_low_first",
                    "outlier_first_block", "heavy_tail"]


@pytest.mark.parametrize("N", [256, 1023, 16384])
@pytest.mark.parametrize("family", SHIFTED_FAMILIES)
@pytest.mark.parametrize("kind", ["layer_norm", "add_layer_norm"])
def test_rows_far_from_their_first_elements(ext, kind, family, N):
    """The forward statistics are one pass of sums about a point near the row's start; rows
    whose start is far from their mean (outliers, a large mean, heavy tails) must still match
    the fp64 reference on the same fp32 rows within the fp32 tolerance."""
    g = torch.Generator().manual_seed(N)
    M = 8 if N > 4096 else 32
    x = _shifted_rows(family, M, N, g).float()
    w, b = torch.randn(N, generator=g), torch.randn(N, generator=g)
    with fasttrans.use_backend("extension"), torch.no_grad():
        if kind == "layer_norm":
            y, h = fasttrans.layer_norm(x, (N,), w, b, 1e-5), x
        else:
            r = torch.randn(M, N, generator=g)
            y, h = fasttrans.add_layer_norm(x - r, r, w, b, 1e-5)
    ref = reference.layer_norm(h.double(), (N,), w.double(), b.double(), 1e-5)
    # row by row, so that a row's error is measured against that row's own scale
    for i in range(M):
        assert_close_lowp(f"y[{i}]", y[i], ref[i], None, dtype=torch.float32)


def _near_overflow_rows(N):
    """fp32 rows whose squared deviations from the first element sum past float32's largest
    value (3.4e38) while N times their variance stays below it: a spike among zeros, and
    Gaussian rows with N * var = 1.2e38."""
    g = torch.Generator().manual_seed(N)
    spike = torch.zeros(3, N)
    spike[0, 0], spike[1, 0], spike[2, -1] = 1e19, -1.5e19, 1e19
    return torch.cat([spike, torch.randn(16, N, generator=g) * (1.2e38 / N) ** 0.5])


@pytest.mark.parametrize("N", [4, 8, 12, 17, 64, 1024])
@pytest.mark.parametrize("kind", ["layer_norm", "add_layer_norm"])
def test_rows_near_the_float32_range(ext, kind, N):
    """Rows whose one-pass sums about the first element overflow, while the variance of the
    row does not (torch's fp32 layer_norm normalises them): the statistics are taken again
    about the mean, and the result (forward and every gradient) matches float64 instead of
    being NaN."""
    x = _near_overflow_rows(N)
    w, b = torch.randn(N), torch.randn(N)
    y = _check(kind, x, torch.zeros_like(x) if kind == "add_layer_norm" else None, w, b)[0]
    ref = reference.layer_norm(x.double(), (N,), w.double(), b.double(), 1e-5)
    for i in range(x.shape[0]):  # each row against its own scale
        assert_close_lowp(f"y[{i}]", y[i], ref[i], None, dtype=torch.float32)


def test_rows_whose_variance_overflows_give_torchs_numbers(ext):
    """A variance past float32's range gives rstd = 0 and y = bias, as the reference computes
    and torch's fp32 layer_norm does for these rows, never NaN."""
    x = torch.zeros(2, 12)
    x[0, 0], x[1, 5] = 1e20, -3e19
    w, b = torch.randn(12), torch.randn(12)
    with fasttrans.use_backend("extension"):
        y = fasttrans.layer_norm(x, (12,), w, b)
    assert torch.equal(y, torch.nn.functional.layer_norm(x, (12,), w, b))
    assert torch.equal(y, b.expand(2, 12))


@pytest.mark.parametrize("kind", KINDS)
def test_very_wide_rows_are_as_accurate_as_torch(ext, kind):
    """Rows of 2^22 elements: the row sums (forward statistics, backward mean(g) and
    mean(g * xhat)) are taken in two levels (lanes, then per-lane totals of 8192-element
    chunks), so their error stays near torch's instead of growing with the width (it was
    50x torch's, 2e-5, at this width)."""
    g = torch.Generator().manual_seed(22)
    M, N = 2, 1 << 22
    x = torch.randn(M, N, generator=g) + 1
    r = torch.zeros(M, N) if kind == "add_layer_norm" else None
    w = torch.rand(N, generator=g) + 0.5
    grads_out = [torch.randn(M, N, generator=g), torch.randn(M, N, generator=g)]
    eps = 1e-6 if kind == "rms_norm" else 1e-5
    got = _run(kind, _extension_module(), x, r, w, None, eps, grads_out)
    torch_fp32 = _run(kind, _LowpReference, x, r, w, None, eps, grads_out)
    exact = _run(kind, reference, x.double(), None if r is None else r.double(), w.double(), None, eps,
                 [t.double() for t in grads_out])
    for i, (a, t, e) in enumerate(zip(got, torch_fp32, exact)):
        err, torch_err = ((u.double() - e).abs().max().item() for u in (a, t))
        assert err <= 4 * torch_err + 2e-7 * e.abs().max().item(), f"output {i}: error {err:.2e}, torch's {torch_err:.2e}"


def test_zero_eps_and_a_variance_that_underflows_give_torchs_infinities(ext):
    """eps = 0 with rows whose fp32 variance underflows to 0: rstd = inf and y = (h - mean) *
    inf, +-inf as torch and the reference give (not NaN from the kernel's 0 * inf)."""
    x = torch.randn(4, 24, generator=torch.Generator().manual_seed(3)) * 1e-30
    with fasttrans.use_backend("extension"):
        y = fasttrans.layer_norm(x, (24,), eps=0.0)
    expected = torch.nn.functional.layer_norm(x, (24,), eps=0.0)
    assert torch.isinf(expected).all()
    assert torch.equal(y, expected)


def test_rms_norm_default_eps_and_scalar_rows(ext):
    x = torch.randn(5, 1)
    _check("rms_norm", x, None, None, None, eps=torch.finfo(torch.float32).eps)
    _check("layer_norm", x, None, torch.randn(1), torch.randn(1))


@pytest.mark.parametrize("M,N", [(1000, 333), (64, 8192)], ids=["many-rows", "few-long-rows"])
def test_weight_bias_gradients_are_bitwise_deterministic(ext, M, N):
    # several row chunks either way: 64 rows per chunk, or 8 chunks of a few long rows
    x, w, b = torch.randn(M, N), torch.randn(N), torch.randn(N)
    dy = torch.randn(M, N)
    threads = torch.get_num_threads()

    def grads():
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        with fasttrans.use_backend("extension"):
            fasttrans.layer_norm(xs, (N,), ws, bs).backward(dy)
        return xs.grad, ws.grad, bs.grad

    try:
        torch.set_num_threads(1)
        first = grads()
        torch.set_num_threads(2)
        for _ in range(3):
            for a, c in zip(first, grads()):
                assert torch.equal(a, c)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_wants_gradients_in_the_dtype_of_h(ext, device):
    require_extension(device, "norm")
    _af, _ab, fwd, bwd = ext
    x, r = torch.randn(6, 20, device=device), torch.randn(6, 20, device=device)
    w = torch.randn(20, device=device)
    _, h, mean, rstd = fwd(x, r, w, None, 1e-5, False)
    dy = torch.randn(6, 20, device=device)
    with pytest.raises(RuntimeError, match="dy: expected the dtype"):
        bwd(dy.double(), None, h, w, None, mean, rstd, False)
    with pytest.raises(RuntimeError, match="dh: expected the dtype"):
        bwd(dy, dy.half(), h, w, None, mean, rstd, False)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["dy", "dh", "weight", "mean", "rstd"])
def test_cuda_backward_rejects_tensors_on_another_device(ext, name):
    require_extension("cuda", "norm")
    _af, _ab, fwd, bwd = ext
    x, r, w = torch.randn(6, 20, device="cuda"), torch.randn(6, 20, device="cuda"), torch.randn(20, device="cuda")
    _, h, mean, rstd = fwd(x, r, w, None, 1e-5, False)
    args = dict(dy=torch.randn(6, 20, device="cuda"), dh=torch.randn(6, 20, device="cuda"), weight=w, mean=mean,
                rstd=rstd)
    args[name] = args[name].cpu()
    with pytest.raises(RuntimeError, match=f"{name}: expected a tensor on cuda"):
        bwd(args["dy"], args["dh"], h, args["weight"], None, args["mean"], args["rstd"], False)


# ---------------------------------------------------------------------------------------
# torch.library
# ---------------------------------------------------------------------------------------
def test_opcheck(ext):
    _af, _ab, fwd, bwd = ext
    M, N = 6, 20
    x, r, w, b = torch.randn(M, N), torch.randn(M, N), torch.randn(N), torch.randn(N)
    for rms in (False, True):
        for res in (None, r):
            args = [x.clone().requires_grad_(), None if res is None else res.clone().requires_grad_(),
                    w.clone().requires_grad_(), None if rms else b.clone().requires_grad_(), 1e-5, rms]
            torch.library.opcheck(fwd, tuple(args))
            y, h, mean, rstd = fwd(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args])
            hh = h if res is not None else x
            dh = torch.randn(M, N) if res is not None else None
            torch.library.opcheck(bwd, (torch.randn(M, N), dh, hh, w, None if rms else b, mean, rstd, rms))
            if rms:
                assert mean.shape == (0,)


@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_fp64(ext, kind):
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    r = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, dtype=torch.float64, requires_grad=True)
    b = torch.randn(9, dtype=torch.float64, requires_grad=True)
    with fasttrans.use_backend("extension"):
        if kind == "layer_norm":
            assert torch.autograd.gradcheck(lambda x, w, b: fasttrans.layer_norm(x, (9,), w, b), (x, w, b))
        elif kind == "add_layer_norm":
            assert torch.autograd.gradcheck(lambda x, r, w, b: fasttrans.add_layer_norm(x, r, w, b), (x, r, w, b))
        else:
            assert torch.autograd.gradcheck(lambda x, w: fasttrans.rms_norm(x, (9,), w, 1e-6), (x, w))


def test_compiles_without_graph_breaks(ext):
    x, r = torch.randn(5, 16, requires_grad=True), torch.randn(5, 16)
    w, b = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)

    def f(x, r, w, b):
        y, h = fasttrans.add_layer_norm(x, r, w, b)
        return fasttrans.rms_norm(y + h, (16,), w)

    torch._dynamo.reset()
    with fasttrans.use_backend("extension"):
        out = torch.compile(f, fullgraph=True, backend="aot_eager")(x, r, w, b)
        out.sum().backward()
        ref = f(x.detach(), r, w.detach(), b.detach())
    torch.testing.assert_close(out, ref)
    assert x.grad is not None and w.grad is not None


# ---------------------------------------------------------------------------------------
# fasttrans.extension: the cached build, the lock, build failures
# ---------------------------------------------------------------------------------------
def test_build_info_describes_the_loaded_build(ext):
    info = extension.build_info()
    assert info["built"] and info["loaded"] and info["error"] is None
    assert os.path.isdir(info["build_dir"]) and "-O3" in info["cflags"]
    assert info["with_cuda"] == torch.cuda.is_available() or info["cuda_reason"]
    assert os.path.samefile(info["sources"], os.path.dirname(sys.modules["fasttrans.csrc"].__file__))


def test_cuda_plan_builds_for_the_visible_gpus_or_the_arch_list(monkeypatch, tmp_path):
    # a CUDA build of torch with nvcc: the architectures come from TORCH_CUDA_ARCH_LIST or the
    # visible GPUs; with neither, torch's build would fail on an empty list, so only the CPU
    # kernels are built (and say why)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").touch()
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.utils.cpp_extension, "CUDA_HOME", str(tmp_path))
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with_cuda, reason, archs = extension._cuda_plan()
    assert not with_cuda and "no GPU is visible" in reason and "TORCH_CUDA_ARCH_LIST" in reason
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: [(9, 0), (8, 0), (9, 0)][i])
    assert extension._cuda_plan() == (True, None, "8.0;9.0")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6+PTX")
    assert extension._cuda_plan() == (True, None, "8.6+PTX")
    monkeypatch.setattr(torch.version, "cuda", None)
    assert not extension._cuda_plan()[0]


def test_the_cache_key_holds_the_cuda_architectures(monkeypatch):
    dirs = set()
    for archs in ("8.0", "9.0", "8.0"):
        monkeypatch.setattr(extension, "_cuda_plan", lambda: (True, None, archs))
        dirs.add(extension._Plan().build_dir)
    assert len(dirs) == 2


def test_without_python_headers_the_build_leaves_out_the_eager_module(monkeypatch):
    """csrc/eager.cpp needs Python.h; the ops do not. Without the headers the plan builds the
    ops alone, in a directory of its own, and says why in its notes."""
    with_headers = extension._Plan()
    assert with_headers.with_eager == extension._python_headers()
    monkeypatch.setattr(extension, "_python_headers", lambda: False)
    without = extension._Plan()
    assert not without.with_eager
    assert "eager.cpp" in {s.name for s in extension._sources(False, True)}
    assert "eager.cpp" not in {s.name for s in extension._sources(False, False)}
    assert (without.build_dir != with_headers.build_dir) == with_headers.with_eager
    assert any("Python.h" in note for note in without.notes)


def test_without_the_eager_module_calls_take_the_python_route(ext):
    """A library built without its Python module (no Python.h): the norms and attention
    record the Python route's autograd.Function and give the registered op's numbers."""
    code = f"""
        import math
        import torch
        from fasttrans import backends, extension
        setattr(extension, {extension._python_module.__name__!r}, lambda library: None)
        import fasttrans
        x, w = torch.randn(3, 16, dtype=torch.float64, requires_grad=True), torch.randn(16, dtype=torch.float64)
        q = torch.randn(1, 2, 3, 8, dtype=torch.float64, requires_grad=True)
        assert extension.load().eager is None
        y = fasttrans.layer_norm(x, 16, w)
        out = fasttrans.attention(q, q, q, is_causal=True)
        assert y.grad_fn.name() == "norm_fwd_extension_eagerBackward", y.grad_fn.name()
        assert out.grad_fn.name() == "attention_fwd_extension_eagerBackward", out.grad_fn.name()
        y_op = backends.forward_op("extension", "norm")(x, None, w, None, 1e-5, False)[0]
        attention_op = backends.forward_op("extension", "attention")
        out_op = attention_op(q, q, q, None, None, True, 0, 0.0, 1 / math.sqrt(8), 0)[0]
        assert torch.equal(y, y_op) and torch.equal(out, out_op)
        assert torch.equal(torch.autograd.grad(y.sum(), x)[0], torch.autograd.grad(y_op.sum(), x)[0])
        print("ok")
    """
    proc = _python(code)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0 and stdout.strip() == "ok", stderr


def _python(code, env=None, **kw):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_other_processes_wait_for_the_build_lock_and_reuse_the_cache(ext):
    plan = extension._get_plan()
    library_mtime = plan.library.stat().st_mtime_ns
    lock = plan.build_dir.with_name(plan.build_dir.name + ".lock")
    code = """
        import time
        from fasttrans import extension
        extension._get_plan()
        print("waiting", flush=True)
        extension.load()
        print(f"loaded {time.time()!r}", flush=True)
    """
    with extension._file_lock(lock):
        proc = _python(code)
        assert proc.stdout.readline().strip() == "waiting", proc.communicate()
        time.sleep(1.0)
        assert proc.poll() is None, proc.communicate()  # blocked on the lock held here
        released = time.time()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert float(out.split()[-1]) >= released
    assert plan.library.stat().st_mtime_ns == library_mtime  # loaded from the cache, not rebuilt


def test_failed_build_falls_back_when_automatic_and_raises_when_forced(tmp_path):
    fake = tmp_path / "c++"
    fake.write_text("#!/bin/sh\necho 'fake compiler: refusing to compile' >&2\nexit 1\n")
    fake.chmod(0o755)
    code = """
        import warnings, pytest, torch, fasttrans
        from fasttrans import extension
        x = torch.randn(3, 8)
        with pytest.raises(extension.ExtensionBuildError, match="building the fasttrans extension failed"):
            extension.load()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = fasttrans.layer_norm(x, (8,))
        assert any("not using the 'extension' backend" in str(w.message) for w in caught), caught
        torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (8,)))
        with fasttrans.use_backend("extension"), pytest.raises(fasttrans.BackendUnavailableError,
                                                                 match="fake compiler|failed"):
            fasttrans.layer_norm(x, (8,))
        assert extension.build_info()["error"]
        print("ok")
    """
    proc = _python(code, env={"CXX": str(fake), "FASTTRANS_CACHE": str(tmp_path / "cache")})
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "ok" in out, err[-3000:]


def _shared_library(tmp_path, name, flags):
    """A one-function C++ shared library built with the extension's compiler and ``flags``."""
    src = tmp_path / "f.cpp"
    src.write_text("#include <sstream>\n#include <string>\n"
                   "std::string f(long x) { std::ostringstream s; s << x; return s.str(); }\n")
    out = tmp_path / name
    cxx = extension._compiler()[0]
    proc = subprocess.run([cxx, "-shared", "-fPIC", *flags, str(src), "-o", str(out)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"{cxx} {' '.join(flags)} cannot link a shared library here: {proc.stderr[-300:]}")
    return out


def test_a_static_cxx_runtime_in_the_library_is_detected(ext, tmp_path):
    # a second copy of libstdc++ in the library crashes the process when an error message
    # formats a number (seen with a toolchain whose link step found only libstdc++.a)
    plan = extension._get_plan()
    assert any(n.startswith("libstdc++.so") for n in extension._elf_needed(plan.library))
    assert extension._runtime_problem(plan.library, plan.cxx) is None
    shared = _shared_library(tmp_path, "shared.so", [])
    static = _shared_library(tmp_path, "static.so", ["-static-libstdc++"])
    assert "libstdc++.so.6" in extension._elf_needed(shared)
    assert not any(n.startswith("libstdc++") for n in extension._elf_needed(static))
    assert extension._runtime_problem(shared, "g++") is None
    why = extension._runtime_problem(static, "/opt/tc/g++")
    assert "/opt/tc/g++ linked a static copy of the C++ runtime (libstdc++)" in why and "CXX=" in why
    assert extension._elf_needed(tmp_path / "missing.so") is None
    assert extension._elf_needed(Path(__file__)) is None  # not ELF
    truncated = tmp_path / "truncated.so"
    truncated.write_bytes(shared.read_bytes()[:100])
    assert extension._elf_needed(truncated) is None


def test_a_library_with_its_own_cxx_runtime_is_never_loaded(ext):
    code = """
        import warnings, pytest, torch, fasttrans
        from fasttrans import extension
        extension._runtime_problem = lambda library, cxx: "a static copy of the C++ runtime (test)"
        with pytest.raises(extension.ExtensionBuildError, match=r"static copy of the C\\+\\+ runtime \\(test\\)"):
            extension.load()
        assert not extension._ops_defined()  # the cached library was not loaded
        x = torch.randn(3, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = fasttrans.layer_norm(x, (8,))
        assert any("static copy" in str(w.message) for w in caught), caught
        torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (8,)))
        with fasttrans.use_backend("extension"), pytest.raises(fasttrans.BackendUnavailableError, match="static copy"):
            fasttrans.layer_norm(x, (8,))
        print("ok")
    """
    proc = _python(code)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "ok" in out, err[-3000:]

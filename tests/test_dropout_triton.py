"""The Triton dropout kernels (kernels/dropout.py), called through their launchers.

Without a GPU the kernels run through Triton's interpreter (tests/conftest.py switches it
on), so sizes are small and awkward: empty, one element, odd, one past a block, 3-D. The
oracles are exact:

- the keep-mask against ``philox_keep`` (tests/helpers.py), a numpy transcription of csrc/philox.h
  (flat_dropout_words + dropout_keep_word), itself checked against the header compiled as
  C++; so the Triton mask is the CPU/CUDA extension's mask, bit for bit;
- y and dx against the contract's formula in torch: ``(x.float() * keep * scale)`` rounded
  once to x's dtype, with scale = fp32(1 / (1 - p)), compared exactly (NaN where the formula
  gives NaN); bf16 too, as the kernels round bf16 on the bits under the interpreter.

``pytest -m gpu`` runs the contract on CUDA at larger sizes, the CUDA extension's mask
against the CPU extension's, and a tensor beyond 2**31 elements (the int64-offset path).
"""

import shutil
import subprocess

import pytest
import torch

from fasttrans import backends
from fasttrans.extension import source_dir

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_why = backends.BACKENDS["triton"].unavailable_reason(DEVICE, "dropout")
if _why is not None and "not importable" in _why:
    pytest.skip(f"triton backend: {_why}", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fasttrans.kernels import dropout as K  # noqa: E402  (after conftest chose the interpreter)
from helpers import assert_compile_targets_well_formed, dropout_expected, philox_keep  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def assert_exact(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape, want.shape)
    torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True, msg=name)


# ---------------------------------------------------------------------------------------
# forward: mask and values
# ---------------------------------------------------------------------------------------
# empty, one element, fewer than a Philox group, odd, one past a block, 3-D (and 3-D empty)
SHAPES = [(0,), (1,), (3,), (5,), (1023,), (K.CONFIG.BLOCK + 1,), (3, 5, 7), (2, 0, 3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_matches_contract(shape, dtype):
    p, seed = 0.3, 20240611
    x = (torch.randn(shape, device=DEVICE) * 3).to(dtype)
    y, keep = K.dropout_fwd(x, p, seed)
    assert keep.dtype == torch.bool and keep.shape == x.shape and keep.is_contiguous()
    assert torch.equal(keep.flatten().cpu(), philox_keep(seed, p, x.numel()))
    assert_exact(y, dropout_expected(x, keep, p), "y")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, in the interpreter: inf * 0, 65504 * 2
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values(dtype):
    """y is x * keep * scale exactly: a dropped -x gives -0, a dropped inf or NaN gives NaN."""
    p, seed = 0.5, 7
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 0.0, -1.5, 2.0, 65504.0] * 8,
                     device=DEVICE).to(dtype)
    y, keep = K.dropout_fwd(x, p, seed)
    assert 0 < keep.sum() < keep.numel()
    want = dropout_expected(x, keep, p)
    assert_exact(y, want, "y")
    # the sign of zero, which assert_close does not see
    zero = want == 0
    assert torch.equal(torch.signbit(y[zero]), torch.signbit(want[zero]))


def test_seed_determines_the_mask():
    x = torch.randn(4097, device=DEVICE)
    first = K.dropout_fwd(x, 0.5, 99)
    again = K.dropout_fwd(x, 0.5, 99)
    assert torch.equal(first[1], again[1]) and torch.equal(first[0], again[0])
    # another seed, and seeds that differ only in the high key word, give other masks
    for other in (100, 99 + 2**32, 2**63 - 1):
        keep = K.dropout_fwd(x, 0.5, other)[1]
        assert not torch.equal(keep, first[1]), other
        assert torch.equal(keep.cpu(), philox_keep(other, 0.5, x.numel())), other


def test_mask_depends_on_the_flat_index_only():
    """Not on the dtype, the shape, or the values: element i of any tensor gets keep[i]."""
    seed, p = 31337, 0.25
    base = K.dropout_fwd(torch.randn(210, device=DEVICE), p, seed)[1]
    for dtype in (torch.float16, torch.bfloat16):
        keep = K.dropout_fwd(torch.ones(6, 5, 7, device=DEVICE, dtype=dtype), p, seed)[1]
        assert torch.equal(keep.flatten(), base), dtype
    prefix = K.dropout_fwd(torch.randn(13, device=DEVICE), p, seed)[1]
    assert torch.equal(prefix, base[:13])


@pytest.mark.parametrize("block, num_warps", [(16, 1), (64, 2), (256, 4), (8192, 8)])
def test_keep_independent_of_block_size(block, num_warps):
    """keep and y are the same for every launch configuration (here over 3 partial blocks and more)."""
    x = torch.randn(3, 333, device=DEVICE, dtype=torch.float16)
    y_ref, keep_ref = K.dropout_fwd(x, 0.4, 5)
    cfg = K.DropoutConfig(BLOCK=block, num_warps=num_warps)
    y, keep = K.dropout_fwd(x, 0.4, 5, config=cfg)
    assert torch.equal(keep, keep_ref) and torch.equal(y, y_ref)
    dy = torch.randn_like(x)
    assert torch.equal(K.dropout_bwd(dy, keep, 0.4, config=cfg), K.dropout_bwd(dy, keep, 0.4))


def test_int64_offsets_give_the_same_mask():
    """The INDEX_64 variant (numel beyond int32) computes the same mask and values.

    A tensor of 2**31 elements is too large for the interpreter: the variant is launched
    directly on a small one (the GPU suite runs a real one).
    """
    x = torch.randn(5000, device=DEVICE, dtype=torch.bfloat16)
    p, seed = 0.3, 2**40 + 3
    y_ref, keep_ref = K.dropout_fwd(x, p, seed)
    cfg = K.CONFIG
    y = torch.empty_like(x)
    keep = torch.empty(x.shape, dtype=torch.uint8, device=DEVICE)
    rne = K._rne_bf16(x.dtype)
    K._dropout_fwd_kernel[(-(-x.numel() // cfg.BLOCK),)](
        x, y, keep, x.numel(), seed, K.dropout_threshold(p), K.dropout_scale(p), BLOCK=cfg.BLOCK, INDEX_64=True,
        RNE_BF16=rne)
    assert torch.equal(keep.view(torch.bool), keep_ref) and torch.equal(y, y_ref)
    dx = torch.empty_like(x)
    K._dropout_bwd_kernel[(-(-x.numel() // cfg.BLOCK),)](
        x, keep, dx, x.numel(), K.dropout_scale(p), BLOCK=cfg.BLOCK, INDEX_64=True, RNE_BF16=rne)
    assert torch.equal(dx, K.dropout_bwd(x, keep_ref, p))
    assert K._index_64(2**31, cfg.BLOCK) is False and K._index_64(2**31 + 1, cfg.BLOCK) is True


def test_oracle_matches_philox_h(tmp_path):
    """philox_keep (and so the Triton mask) equals csrc/philox.h compiled as C++."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    src = tmp_path / "probe.cpp"
    src.write_text(
        '#include <cstdio>\n#include <cstdlib>\n#include "philox.h"\n'
        "int main(int argc, char** argv) {\n"
        "  const uint64_t seed = std::strtoull(argv[1], nullptr, 10);\n"
        "  const uint32_t t = fasttrans::dropout_threshold(std::atof(argv[2]));\n"
        "  const long n = std::atol(argv[3]);\n"
        "  for (long i = 0; i < n; ++i) {\n"
        "    const fasttrans::Philox4 r = fasttrans::flat_dropout_words(seed, static_cast<uint64_t>(i / 4));\n"
        "    std::putchar(fasttrans::dropout_keep_word(r.w[i % 4], t) ? '1' : '0');\n"
        "  }\n  return 0;\n}\n"
    )
    exe = tmp_path / "probe"
    subprocess.run([cxx, "-std=c++17", "-O1", "-I", str(source_dir()), str(src), "-o", str(exe)], check=True)
    for seed, p, n in ((0, 0.5, 64), (2**63 - 1, 0.1, 61), (123456789012, 0.9, 33)):
        bits = subprocess.run([str(exe), str(seed), repr(p), str(n)], capture_output=True, text=True,
                              check=True).stdout
        from_header = torch.tensor([c == "1" for c in bits])
        assert torch.equal(from_header, philox_keep(seed, p, n)), (seed, p)
        keep = K.dropout_fwd(torch.zeros(n, device=DEVICE), p, seed)[1]
        assert torch.equal(keep.cpu(), from_header), (seed, p)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_the_cpu_extension(dtype, ext):
    """The CPU extension (csrc/dropout_cpu.cpp) gives the same mask, values and gradient."""
    ops = torch.ops.fasttrans
    p, seed = 0.3, 2**50 + 1
    x = torch.randn(3, 1001, device=DEVICE).to(dtype)
    y, keep = K.dropout_fwd(x, p, seed)
    y_ext, keep_ext = ops.dropout_fwd_extension(x.cpu(), p, seed)
    assert torch.equal(keep.cpu(), keep_ext)
    assert torch.equal(y.cpu(), y_ext)
    dy = torch.randn_like(x)
    assert torch.equal(K.dropout_bwd(dy, keep, p).cpu(), ops.dropout_bwd_extension(dy.cpu(), keep_ext, p))


@triton.jit
def _round_probe_kernel(V, Out, n, RNE_BF16: tl.constexpr):
    offs = tl.arange(0, 64)
    v = tl.load(V + offs, mask=offs < n, other=0.0)
    tl.store(Out + offs, K._round_to_output(v, Out.dtype.element_ty, RNE_BF16), mask=offs < n)


def test_bf16_outputs_round_to_nearest_even():
    """The kernels' fp32 -> bf16 rounding equals torch's, ties, overflow and NaN included."""
    one = 1.0
    values = torch.tensor([
        one + 2**-8, one + 3 * 2**-8, -(one + 2**-8), one + 2**-8 + 2**-20,  # ties to even, just above
        3.3895314e38, 3.4e38, float("inf"), float("-inf"), float("nan"), -0.0, 0.0,  # overflow, specials
        1e-40, -3e-39, 2**-133, 0.1, -7.77, 65504.0,  # subnormals, ordinary values
    ], device=DEVICE)
    out = torch.empty(values.shape, dtype=torch.bfloat16, device=DEVICE)
    _round_probe_kernel[(1,)](values, out, values.numel(), RNE_BF16=K._rne_bf16(torch.bfloat16))
    assert_exact(out, values.to(torch.bfloat16), "bf16")
    number = ~values.isnan()  # a NaN's sign carries nothing (torch's conversion sets it here)
    assert torch.equal(torch.signbit(out[number]), torch.signbit(values[number].to(torch.bfloat16)))


def test_threshold_and_scale_follow_the_contract():
    assert K.dropout_threshold(0.5) == 2**23 and K.dropout_threshold(0.1) == round(0.1 * 2**24)
    assert K.dropout_threshold(1 - 2**-30) == 2**24  # p that rounds to 1: nothing is kept
    for p in (0.1, 0.3, 0.5, 0.9, 1 / 3):
        assert K.dropout_scale(p) == torch.tensor(1.0 / (1.0 - p), dtype=torch.float32).item()


# ---------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (K.CONFIG.BLOCK + 3,), (3, 5, 7)],
                         ids=lambda s: "x".join(map(str, s)))
def test_backward_matches_contract(shape, dtype):
    p = 0.6
    x = torch.randn(shape, device=DEVICE).to(dtype)
    _, keep = K.dropout_fwd(x, p, 4)
    dy = (torch.randn(shape, device=DEVICE) * 5).to(dtype)
    dx = K.dropout_bwd(dy, keep, p)
    assert_exact(dx, dropout_expected(dy, keep, p), "dx")


def test_backward_of_expanded_and_strided_gradients():
    """y.sum().backward() hands the backward a stride-0 gradient; others arrive transposed."""
    p = 0.5
    x = torch.randn(6, 9, device=DEVICE)
    _, keep = K.dropout_fwd(x, p, 11)
    for dy in (torch.ones((), device=DEVICE).expand(6, 9), torch.randn(9, 6, device=DEVICE).t()):
        assert not dy.is_contiguous()
        assert_exact(K.dropout_bwd(dy, keep, p), dropout_expected(dy.contiguous(), keep, p), "dx")


def test_float64_is_rejected():
    x = torch.randn(5, device=DEVICE, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"x: .*float64"):
        K.dropout_fwd(x, 0.5, 0)
    with pytest.raises(TypeError, match=r"dy: .*float64"):
        K.dropout_bwd(x, torch.ones(5, dtype=torch.bool, device=DEVICE), 0.5)


# ---------------------------------------------------------------------------------------
# compile-check protocol
# ---------------------------------------------------------------------------------------
def test_compile_targets_cover_every_launch():
    """compile_targets() lists each (kernel, configuration, dtype, offset width) the launchers use."""
    targets = K.compile_targets()
    assert_compile_targets_well_formed(targets, K.NUM_STAGES)
    covered = {(t["kernel"], t["constexprs"]["BLOCK"], t["constexprs"]["INDEX_64"], t["num_warps"],
                t["signature"].get("X", t["signature"].get("DY"))) for t in targets}
    cfg = K.CONFIG
    for kernel in ("_dropout_fwd_kernel", "_dropout_bwd_kernel"):
        for dtype in ("*fp32", "*fp16", "*bf16"):
            for numel in (1, 2**31, 2**31 + 1):
                key = (kernel, cfg.BLOCK, K._index_64(numel, cfg.BLOCK), cfg.num_warps, dtype)
                assert key in covered, key


# ---------------------------------------------------------------------------------------
# CUDA (pytest -m gpu): the Triton contract at size, and the CUDA extension's mask
# ---------------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def extension_ops(ext):
    """torch.ops.fasttrans with the extension loaded (its CPU and CUDA dropout kernels)."""
    why = backends.BACKENDS["extension"].unavailable_reason("cuda", "dropout")
    if why:
        pytest.fail(f"extension unavailable on cuda: {why}")
    return torch.ops.fasttrans


GPU_SHAPES = [(1,), (5,), (4096, 4097), (3, 1000, 999), (2**20 + 3,)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_triton_contract(shape, dtype, p):
    seed = 2**62 + 17
    x = torch.randn(shape, device="cuda").to(dtype)
    y, keep = K.dropout_fwd(x, p, seed)
    assert_exact(y, dropout_expected(x, keep, p), "y")
    n = x.numel()
    head = min(n, 2**16)  # the oracle is numpy: check a prefix of the big ones
    assert torch.equal(keep.flatten()[:head].cpu(), philox_keep(seed, p, head))
    if n > 10_000:
        mean, std = n * (1 - p), (n * p * (1 - p)) ** 0.5
        assert abs(keep.sum().item() - mean) <= 6 * std
    dy = torch.randn_like(x)
    assert_exact(K.dropout_bwd(dy, keep, p), dropout_expected(dy, keep, p), "dx")
    y2, keep2 = K.dropout_fwd(x, p, seed)
    assert torch.equal(keep2, keep) and torch.equal(y2, y)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 3, 4, 4097, 2**20 + 1])
def test_gpu_extension_mask_equals_cpu_extension(numel, dtype, extension_ops):
    """csrc/dropout_cuda.cu and dropout_cpu.cpp (and the Triton kernel): the same mask bit for bit."""
    p, seed = 0.35, 987654321
    x = torch.randn(numel, device="cuda").to(dtype)
    y, keep = extension_ops.dropout_fwd_extension(x, p, seed)
    y_cpu, keep_cpu = extension_ops.dropout_fwd_extension(x.cpu(), p, seed)
    assert keep.dtype == torch.bool and torch.equal(keep.cpu(), keep_cpu)
    assert torch.equal(keep, K.dropout_fwd(x, p, seed)[1])
    assert_exact(y, dropout_expected(x, keep, p), "y")
    dy = torch.randn_like(x)
    assert_exact(extension_ops.dropout_bwd_extension(dy, keep, p), dropout_expected(dy, keep, p), "dx")
    # an unaligned view (element offset 1) takes the scalar path: the same mask and values
    if numel > 1:
        view = torch.randn(numel + 1, device="cuda").to(dtype)[1:]
        y_v, keep_v = extension_ops.dropout_fwd_extension(view, p, seed)
        assert torch.equal(keep_v, keep)
        assert_exact(y_v, dropout_expected(view, keep, p), "y (unaligned)")
        assert_exact(extension_ops.dropout_bwd_extension(view, keep, p), dropout_expected(view, keep, p), "dx (unaligned)")


@pytest.mark.gpu
@pytest.mark.slow
@needs_gpu
def test_gpu_beyond_int32_offsets(extension_ops):
    """numel > 2**31 (about 11 GB of fp16 input, output and masks): the int64 paths agree."""
    n = 2**31 + 4099
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs about 16 GB of GPU memory")
    p, seed = 0.25, 42
    x = torch.ones(n, device="cuda", dtype=torch.float16)
    y, keep = K.dropout_fwd(x, p, seed)
    tail = 10_000
    want = philox_keep(seed, p, tail, start=n - tail)
    assert torch.equal(keep[-tail:].cpu(), want)
    assert_exact(y[-tail:].cpu(), dropout_expected(x[-tail:].cpu(), want, p), "y tail")
    del y
    keep_ext = extension_ops.dropout_fwd_extension(x, p, seed)[1]
    assert torch.equal(keep_ext, keep)

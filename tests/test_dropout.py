"""Elementwise dropout: the op contract on every backend, fasttrans.functional.dropout and
fasttrans.nn.Dropout.

The contract (fasttrans/backends/__init__.py): keep is a function of (seed, flat index) with
P(keep) = 1 - p; y = x * keep * scale with scale = 1/(1-p) rounded to fp32 (fp64 for fp64
inputs), the product in that precision, rounded once; backward is dy * keep * scale from
the saved mask. The extension's mask is also checked bit for bit against Philox4x32-10
evaluated in numpy (tests/helpers.py), which is the definition the CUDA kernel shares.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fasttrans
from fasttrans import backends
from fasttrans import functional as FT
from fasttrans.functional import DTypeError

from conftest import DEVICE, backend_params
from helpers import dropout_expected, dropout_scale, philox_keep


def dtypes_for(backend: str) -> list[torch.dtype]:
    fp64 = backend == "reference" or (backend == "extension" and DEVICE == "cpu")
    return [torch.float32, torch.float16, torch.bfloat16] + ([torch.float64] if fp64 else [])


def binomial_ok(kept: int, n: int, p: float, sigmas: float = 6.0) -> bool:
    mean, std = n * (1 - p), math.sqrt(n * p * (1 - p))
    return abs(kept - mean) <= sigmas * std + 1


# --------------------------------------------------------------------------------------
# the op contract, per backend
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", backend_params("dropout"))
@pytest.mark.parametrize("shape", [(0,), (1,), (63,), (64,), (65,), (3, 129), (2, 5, 67), (4096,)])
def test_forward_and_backward_follow_the_contract(backend, shape):
    fwd, bwd = backends.dropout_ops_for(backend)
    for dtype in dtypes_for(backend):
        x = torch.randn(shape, device=DEVICE).to(dtype)
        y, keep = fwd(x, 0.3, 1234)
        assert keep.dtype == torch.bool and keep.shape == x.shape and y.dtype == dtype and y.shape == x.shape
        torch.testing.assert_close(y, dropout_expected(x, keep, 0.3), rtol=0, atol=0)
        dy = torch.randn(shape, device=DEVICE).to(dtype)
        torch.testing.assert_close(bwd(dy, keep, 0.3), dropout_expected(dy, keep, 0.3), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply")  # numpy, in Triton's interpreter
@pytest.mark.parametrize("backend", backend_params("dropout"))
def test_dropped_inf_and_nan_give_nan_as_in_torch(backend):
    fwd, bwd = backends.dropout_ops_for(backend)
    x = torch.tensor([math.inf, -math.inf, math.nan, -1.0] * 64, device=DEVICE)
    y, keep = fwd(x, 0.5, 4)
    assert 0 < int(keep.sum()) < x.numel()
    torch.testing.assert_close(y, dropout_expected(x, keep, 0.5), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(bwd(x, keep, 0.5), dropout_expected(x, keep, 0.5), rtol=0, atol=0, equal_nan=True)
    dropped_inf = torch.isinf(x) & ~keep
    assert dropped_inf.any() and torch.isnan(y[dropped_inf]).all()


@pytest.mark.parametrize("backend", backend_params("dropout"))
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction_is_one_minus_p(backend, p):
    fwd, _ = backends.dropout_ops_for(backend)
    n = 200_003
    keep = fwd(torch.ones(n, device=DEVICE), p, 99)[1]
    assert binomial_ok(int(keep.sum()), n, p)
    # no position is favoured: the fraction holds within each residue mod 4 (one Philox word
    # per residue) and in both halves
    for part in (keep[0::4], keep[1::4], keep[2::4], keep[3::4], keep[: n // 2], keep[n // 2:]):
        assert binomial_ok(int(part.sum()), part.numel(), p)


@pytest.mark.parametrize("backend", backend_params("dropout"))
def test_mask_is_a_function_of_seed_and_index(backend):
    fwd, _ = backends.dropout_ops_for(backend)
    x = torch.randn(10_000, device=DEVICE)
    a, b, c = fwd(x, 0.5, 7)[1], fwd(x, 0.5, 7)[1], fwd(x, 0.5, 8)[1]
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # the mask of element i does not depend on the tensor's size or shape
    assert torch.equal(fwd(x[:777].clone(), 0.5, 7)[1], a[:777])
    assert torch.equal(fwd(x.view(100, 100), 0.5, 7)[1].view(-1), a)


@pytest.mark.parametrize("backend", backend_params("dropout"))
def test_opcheck(backend):
    fwd, bwd = backends.dropout_ops_for(backend)
    x = torch.randn(5, 70, device=DEVICE, requires_grad=True)
    torch.library.opcheck(fwd, (x, 0.25, 3))
    keep = torch.rand(5, 70, device=DEVICE) > 0.25
    torch.library.opcheck(bwd, (torch.randn(5, 70, device=DEVICE), keep, 0.25))


@pytest.mark.parametrize("backend", [b for b in ("reference", "extension")])
def test_fp64_gradcheck(backend):
    if not backends.get_backend(backend).is_available("cpu", "dropout"):
        pytest.skip(f"{backend}: {backends.get_backend(backend).unavailable_reason('cpu', 'dropout')}")
    fwd, _ = backends.dropout_ops_for(backend)
    x = torch.randn(3, 37, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: fwd(t, 0.4, 11)[0], (x,))


@pytest.mark.parametrize("shape", [(1,), (3, 7, 5), (4099,)])
@pytest.mark.parametrize("seed", [0, 12345, 2**40 + 17])
def test_reference_mask_is_philox_of_the_flat_index(shape, seed):
    keep = backends.dropout_ops_for("reference")[0](torch.randn(shape), 0.35, seed)[1]
    assert torch.equal(keep.flatten(), philox_keep(seed, 0.35, math.prod(shape)))


@pytest.mark.parametrize("backend", backend_params("dropout"))
def test_every_backend_draws_the_same_mask_for_a_seed(backend):
    x = torch.randn(6, 41, device=DEVICE)
    torch.manual_seed(9)
    want = FT.dropout_mask(x, 0.3, backend="reference")
    torch.manual_seed(9)
    assert torch.equal(FT.dropout_mask(x, 0.3, backend=backend), want)


# --------------------------------------------------------------------------------------
# the CPU extension's generator, bit for bit
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def extension_dropout(ext):
    return backends.dropout_ops_for("extension")


@pytest.mark.parametrize("n", [1, 5, 64, 1000, 4099])
@pytest.mark.parametrize("seed", [0, 12345, 2**40 + 17])
def test_extension_mask_is_philox_of_the_flat_index(extension_dropout, n, seed):
    fwd, _ = extension_dropout
    keep = fwd(torch.randn(n), 0.35, seed)[1]
    assert torch.equal(keep, philox_keep(seed, 0.35, n))


@pytest.mark.parametrize("p", [1e-9, 0.5, 1 - 1e-9])  # thresholds 0, 2^23 and 2^24: keep all, half, none
def test_extension_mask_at_the_thresholds_ends(extension_dropout, p):
    fwd, _ = extension_dropout
    keep = fwd(torch.randn(4099), p, 99)[1]
    assert torch.equal(keep, philox_keep(99, p, 4099))


def test_extension_mask_does_not_depend_on_the_thread_count(extension_dropout):
    fwd, _ = extension_dropout
    x = torch.randn(300_001)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fwd(x, 0.2, 5)
        torch.set_num_threads(max(2, threads))
        many = fwd(x, 0.2, 5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[1], many[1]) and torch.equal(one[0], many[0])


def test_extension_rejects_bad_arguments(extension_dropout):
    fwd, bwd = extension_dropout
    with pytest.raises(RuntimeError, match="p: expected a dropout probability"):
        fwd(torch.randn(4), 1.0, 0)
    with pytest.raises(RuntimeError, match="keep: expected a bool tensor"):
        bwd(torch.randn(4), torch.ones(4), 0.5)
    with pytest.raises(RuntimeError, match="keep: expected the shape of dy"):
        bwd(torch.randn(4), torch.ones(5, dtype=torch.bool), 0.5)


# --------------------------------------------------------------------------------------
# fasttrans.functional.dropout
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", backend_params("dropout"))
def test_functional_matches_its_mask_hook_and_gradient(backend):
    x = torch.randn(4, 33, 17, device=DEVICE, requires_grad=True)
    with fasttrans.use_backend(backend):
        torch.manual_seed(21)
        keep = FT.dropout_mask(x, 0.2)
        torch.manual_seed(21)
        y = FT.dropout(x, 0.2)
    torch.testing.assert_close(y, dropout_expected(x.detach(), keep, 0.2), rtol=0, atol=0)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad, dropout_expected(g, keep, 0.2), rtol=0, atol=0)


def test_functional_seed_follows_torch_manual_seed():
    x = torch.randn(1000, device=DEVICE)
    torch.manual_seed(3)
    a = FT.dropout(x, 0.5)
    b = FT.dropout(x, 0.5)
    torch.manual_seed(3)
    assert torch.equal(FT.dropout(x, 0.5), a)
    assert not torch.equal(a, b)  # each call draws a fresh mask


def test_functional_edge_cases():
    x = torch.randn(6, 7, device=DEVICE, requires_grad=True)
    assert FT.dropout(x, 0.0) is x
    assert FT.dropout(x, 0.7, training=False) is x
    z = FT.dropout(x, 1.0)
    assert torch.equal(z, torch.zeros_like(x))
    z.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    empty = torch.randn(0, 3, device=DEVICE)
    assert FT.dropout(empty, 0.5).shape == (0, 3)
    # non-contiguous input: the result has the input's values where kept
    t = torch.randn(8, 6, device=DEVICE).t()
    y = FT.dropout(t, 0.5)
    kept = y != 0
    torch.testing.assert_close(y[kept], t[kept] * 2.0, rtol=0, atol=0)


def test_functional_inplace():
    x = torch.randn(100, device=DEVICE)
    torch.manual_seed(1)
    out = FT.dropout(x.clone(), 0.5)
    torch.manual_seed(1)
    y = x.clone()
    res = FT.dropout(y, 0.5, inplace=True)
    assert res is y and torch.equal(y, out)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: FT.dropout(torch.randn(3), -0.1), ValueError, "between 0 and 1, but got -0.1"),
        (lambda: FT.dropout(torch.randn(3), 1.5), ValueError, "between 0 and 1, but got 1.5"),
        (lambda: FT.dropout(torch.randn(3), "0.1"), TypeError, "p: expected a float"),
        (lambda: FT.dropout(torch.arange(3), 0.1), DTypeError, "input: expected float16"),
        (lambda: FT.dropout([1.0, 2.0], 0.1), TypeError, "input: expected a torch.Tensor"),
        (lambda: FT.dropout_mask(torch.randn(3), 0.0), ValueError, r"p: expected a dropout probability in \(0, 1\)"),
    ],
)
def test_functional_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_torch_raises_the_same_error_type_for_p_out_of_range():
    with pytest.raises(ValueError, match="between 0 and 1"):
        F.dropout(torch.randn(3), 1.5)


# --------------------------------------------------------------------------------------
# fasttrans.nn.Dropout
# --------------------------------------------------------------------------------------
def test_module_is_a_drop_in_for_torch_dropout():
    m = fasttrans.nn.Dropout(0.25)
    t = torch.nn.Dropout(0.25)
    assert isinstance(m, torch.nn.Dropout)
    assert repr(m) == repr(t) and m.state_dict() == t.state_dict() == {}
    x = torch.randn(50_000)
    y = m(x)
    kept = y != 0
    assert binomial_ok(int(kept.sum()), x.numel(), 0.25)
    torch.testing.assert_close(y[kept], x[kept] * dropout_scale(0.25, x.dtype), rtol=0, atol=0)
    m.eval()
    assert m(x) is x


def test_transformer_layers_and_positional_encoding_use_it():
    layer = fasttrans.nn.TransformerEncoderLayer(16, 2, 32)
    dec = fasttrans.nn.TransformerDecoderLayer(16, 2, 32)
    pe = fasttrans.nn.PositionalEncoding(16)
    for m in (layer.dropout, layer.dropout1, layer.dropout2, dec.dropout, dec.dropout1, dec.dropout2,
              dec.dropout3, pe.dropout):
        assert type(m) is fasttrans.nn.Dropout


def test_module_compiles_without_graph_breaks_and_draws_fresh_masks():
    m = fasttrans.nn.Dropout(0.5)
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    x = torch.randn(256, device=DEVICE)
    a, b = compiled(x), compiled(x)
    assert set(torch.unique(a[a != 0] / x[a != 0]).tolist()) <= {2.0}
    assert not torch.equal(a, b)

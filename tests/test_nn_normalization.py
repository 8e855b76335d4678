"""fasttrans.nn.LayerNorm / RMSNorm against torch.nn.LayerNorm / RMSNorm.

Parameters, initialisation, repr and state_dicts must be interchangeable; outputs and every
gradient must match torch (fp64: 1e-10, fp32: 1e-5); errors must have torch's type.
"""

import re

import pytest
import torch

import fasttrans
import fasttrans.nn as fnn

TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=1e-5, rtol=1e-5)}


def _perturb(module: torch.nn.Module) -> None:
    """Random affine parameters, so that weight and bias gradients are not trivially symmetric."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))


def _assert_state_dict_round_trip(t, f, make_torch_twin) -> None:
    """f loads torch module t's (perturbed) state_dict strictly, and a fresh torch module
    loads f's back with every tensor unchanged."""
    _perturb(t)
    f.load_state_dict(t.state_dict(), strict=True)
    t2 = make_torch_twin()
    t2.load_state_dict(f.state_dict(), strict=True)
    for (n, pt), pf in zip(t.state_dict().items(), t2.state_dict().values()):
        assert torch.equal(pf, pt), n


def _check_grads_match(t_mod, f_mod, x, dtype):
    xt = x.clone().requires_grad_()
    xf = x.clone().requires_grad_()
    yt, yf = t_mod(xt), f_mod(xf)
    torch.testing.assert_close(yf, yt, **TOL[dtype])
    g = torch.randn_like(yt)
    (yt * g).sum().backward()
    (yf * g).sum().backward()
    torch.testing.assert_close(xf.grad, xt.grad, **TOL[dtype])
    for (nt, pt), (nf, pf) in zip(t_mod.named_parameters(), f_mod.named_parameters()):
        assert nt == nf
        torch.testing.assert_close(pf.grad, pt.grad, **TOL[dtype], msg=f"gradient of {nf}")


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------------------
# LayerNorm
# --------------------------------------------------------------------------------------
LN_CONFIGS = [
    dict(),
    dict(eps=1e-3),
    dict(bias=False),
    dict(elementwise_affine=False),
    dict(elementwise_affine=False, bias=False),
]


@pytest.mark.parametrize("kwargs", LN_CONFIGS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "default")
def test_layer_norm_parameters_and_state_dict(kwargs):
    t = torch.nn.LayerNorm(16, **kwargs, dtype=torch.float64)
    f = fnn.LayerNorm(16, **kwargs, dtype=torch.float64)
    assert f.normalized_shape == t.normalized_shape == (16,)
    assert f.eps == t.eps and f.elementwise_affine == t.elementwise_affine
    assert repr(f) == repr(t)
    assert [(n, p.shape, p.dtype) for n, p in f.named_parameters()] == [
        (n, p.shape, p.dtype) for n, p in t.named_parameters()
    ]
    for (n, pt), pf in zip(t.state_dict().items(), f.state_dict().values()):
        assert torch.equal(pf, pt), n
    _assert_state_dict_round_trip(t, f, lambda: torch.nn.LayerNorm(16, **kwargs, dtype=torch.float64))


def test_layer_norm_reset_parameters_and_factory_kwargs():
    f = fnn.LayerNorm((3, 4), device="meta", dtype=torch.float16)
    assert f.weight.device.type == "meta" and f.weight.dtype == torch.float16 and f.weight.shape == (3, 4)
    f = fnn.LayerNorm(8)
    _perturb(f)
    f.reset_parameters()
    assert torch.equal(f.weight, torch.ones(8)) and torch.equal(f.bias, torch.zeros(8))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("kwargs", LN_CONFIGS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "default")
@pytest.mark.parametrize("shape,normalized", [((3, 7, 16), 16), ((2, 5, 3, 7), (3, 7)), ((1, 1, 33), (33,))])
def test_layer_norm_matches_torch(shape, normalized, kwargs, dtype):
    t = torch.nn.LayerNorm(normalized, **kwargs, dtype=dtype)
    _perturb(t)
    f = fnn.LayerNorm(normalized, **kwargs, dtype=dtype)
    f.load_state_dict(t.state_dict())
    x = 3 * torch.randn(shape, dtype=dtype) + 1
    _check_grads_match(t, f, x, dtype)


def test_layer_norm_fp32_params_with_half_input():
    """torch's mixed precision: fp16/bf16 input with fp32 parameters gives output in the input dtype."""
    t = torch.nn.LayerNorm(16)
    _perturb(t)
    f = fnn.LayerNorm(16)
    f.load_state_dict(t.state_dict())
    x = torch.randn(3, 5, 16)
    for dtype in (torch.float16, torch.bfloat16):
        y = f(x.to(dtype))
        assert y.dtype == dtype
        ref = t(x.to(dtype).float())  # fp32 reference on the same (rounded) input
        tol = 2e-3 if dtype == torch.float16 else 1.6e-2
        torch.testing.assert_close(y.float(), ref, atol=tol * 4, rtol=tol)


# --------------------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------------------
RMS_CONFIGS = [dict(), dict(eps=1e-6), dict(elementwise_affine=False)]


@pytest.mark.parametrize("kwargs", RMS_CONFIGS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "default")
def test_rms_norm_parameters_and_state_dict(kwargs):
    t = torch.nn.RMSNorm(16, **kwargs, dtype=torch.float64)
    f = fnn.RMSNorm(16, **kwargs, dtype=torch.float64)
    assert f.normalized_shape == t.normalized_shape and f.eps == t.eps
    assert repr(f) == repr(t)
    assert [(n, p.shape) for n, p in f.named_parameters()] == [(n, p.shape) for n, p in t.named_parameters()]
    _assert_state_dict_round_trip(t, f, lambda: torch.nn.RMSNorm(16, **kwargs, dtype=torch.float64))
    f.reset_parameters()
    if f.weight is not None:
        assert torch.equal(f.weight, torch.ones(16, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("kwargs", RMS_CONFIGS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "default")
@pytest.mark.parametrize("shape,normalized", [((3, 7, 16), 16), ((2, 5, 3, 7), (3, 7))])
def test_rms_norm_matches_torch(shape, normalized, kwargs, dtype):
    t = torch.nn.RMSNorm(normalized, **kwargs, dtype=dtype)
    _perturb(t)
    f = fnn.RMSNorm(normalized, **kwargs, dtype=dtype)
    f.load_state_dict(t.state_dict())
    x = 3 * torch.randn(shape, dtype=dtype)
    _check_grads_match(t, f, x, dtype)


def test_norms_on_reference_backend_explicitly():
    """The modules never pick a backend: a forced one is used (and the result is torch's)."""
    t = torch.nn.LayerNorm(16, dtype=torch.float64)
    f = fnn.LayerNorm(16, dtype=torch.float64)
    x = torch.randn(4, 16, dtype=torch.float64)
    with fasttrans.use_backend("reference"):
        torch.testing.assert_close(f(x), t(x), **TOL[torch.float64])


# --------------------------------------------------------------------------------------
# errors: same type as torch.nn, message naming the argument
# --------------------------------------------------------------------------------------
def _f64(shape):
    return torch.randn(shape, dtype=torch.float64)


def _long(shape):
    return torch.ones(shape, dtype=torch.long)


ERROR_CASES = {
    # name: (module factory(cls), input factory)
    "LayerNorm wrong trailing dims": (lambda c: c(16, dtype=torch.float64), lambda: _f64((3, 15))),
    "LayerNorm 2-D shape on 1-D input": (lambda c: c((3, 16), dtype=torch.float64), lambda: _f64((16,))),
    "LayerNorm fp32 input, fp64 params": (lambda c: c(16, dtype=torch.float64), lambda: torch.randn(3, 16)),
    "LayerNorm fp64 input, fp32 params": (lambda c: c(16), lambda: _f64((3, 16))),
    "LayerNorm fp16 input, fp64 params": (lambda c: c(16, dtype=torch.float64), lambda: torch.randn(3, 16).half()),
    "LayerNorm long input": (lambda c: c(16), lambda: _long((3, 16))),
    "LayerNorm no params, long input": (lambda c: c(16, elementwise_affine=False), lambda: _long((3, 16))),
    "RMSNorm wrong trailing dims": (lambda c: c(16), lambda: torch.randn(3, 15)),
    "RMSNorm long input": (lambda c: c(16), lambda: _long((3, 16))),
    "RMSNorm no params, long input": (lambda c: c(16, elementwise_affine=False), lambda: _long((3, 16))),
}


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_have_torch_types(case):
    make, make_input = ERROR_CASES[case]
    name = case.split()[0]
    t_cls, f_cls = getattr(torch.nn, name), getattr(fnn, name)
    with pytest.raises(Exception) as t_err:
        make(t_cls)(make_input())
    with pytest.raises(Exception) as f_err:
        make(f_cls)(make_input())
    assert isinstance(f_err.value, t_err.type), (
        f"torch raised {t_err.type.__name__}, fasttrans {type(f_err.value).__name__}: {f_err.value}"
    )
    assert re.match(r"(x|input|normalized_shape|weight|bias): ", str(f_err.value)), str(f_err.value)

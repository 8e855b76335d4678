"""How calls that record a graph reach the ops.

Eager calls apply an autograd.Function holding the formulas that register_autograd gives
each forward op (backends.eager_autograd), instead of calling the op through the
dispatcher into its Python autograd kernel. torch.compile and torch.func transforms call
the registered op. These tests hold the two routes to the same outputs and gradients, on
every backend, and check which route each kind of call takes.
"""

import pytest
import torch

import fasttrans
from fasttrans import backends

from conftest import backend_params
from helpers import make_float_mask

pytestmark = pytest.mark.usefixtures("one_thread")

f64 = torch.float64


def _leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]


def _both_routes(op, args: list, n_outputs_used: int, grads: list):
    """Outputs and input gradients of op(*args) through the registered autograd kernel and
    through the eager autograd.Function, each on fresh leaves."""
    function = backends.eager_autograd(op)
    assert function is not None
    results = []
    for route in (op, function.apply):
        leaves = _leaves(*[a if isinstance(a, torch.Tensor) else None for a in args])
        call_args = [leaf if isinstance(a, torch.Tensor) else a for a, leaf in zip(args, leaves)]
        outputs = route(*call_args)
        used = outputs[:n_outputs_used]
        inputs = [leaf for leaf in leaves if leaf is not None and leaf.requires_grad]
        loss = sum((o * g).sum() for o, g in zip(used, grads) if g is not None)
        results.append(([o.detach() for o in used], torch.autograd.grad(loss, inputs, allow_unused=True)))
    return results


def _assert_same(registered, eager):
    (outs_a, grads_a), (outs_b, grads_b) = registered, eager
    for a, b in zip(outs_a, outs_b):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert len(grads_a) == len(grads_b)
    for a, b in zip(grads_a, grads_b):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("backend", backend_params("attention"))
@pytest.mark.parametrize("mask", ["float", "bool", "key_lengths_causal"])
def test_attention_routes_agree(backend, mask):
    fwd = backends.ops_for(backend)[0]
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 5, 7, 8
    q, k, v = torch.randn(B, H, Lq, D, dtype=f64), torch.randn(B, Hkv, Lk, D, dtype=f64), torch.randn(B, Hkv, Lk, D, dtype=f64)
    attn_mask = key_lengths = None
    if mask == "float":  # its gradient is computed only when it requires one
        attn_mask = make_float_mask((B, 1, Lq, Lk), "cpu", dtype=f64)
    elif mask == "bool":
        attn_mask = torch.rand(B, 1, Lq, Lk) < 0.7
    else:
        key_lengths = torch.tensor([Lk, 3], dtype=torch.int32)
    if attn_mask is not None:  # the backend interface takes masks at their full shape
        attn_mask = attn_mask.expand(B, H, Lq, Lk)
    dtype = f64 if backend != "triton" else torch.float32
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    attn_mask = attn_mask.to(dtype) if attn_mask is not None and attn_mask.is_floating_point() else attn_mask
    args = [q, k, v, attn_mask, key_lengths, mask == "key_lengths_causal", 2, 0.0, D ** -0.5, 0]
    registered, eager = _both_routes(fwd, args, 1, [torch.randn(B, H, Lq, D, dtype=dtype)])
    _assert_same(registered, eager)
    if mask == "float":
        assert eager[1][3] is not None and eager[1][3].abs().sum() > 0


@pytest.mark.parametrize("backend", backend_params("norm"))
@pytest.mark.parametrize("case", ["layer_norm", "add_layer_norm_y", "add_layer_norm_y_h", "rms_norm"])
def test_norm_routes_agree(backend, case):
    fwd = backends.ops_for(backend)[2]
    M, N = 6, 40
    dtype = f64 if backend != "triton" else torch.float32
    x, w, b = torch.randn(M, N, dtype=dtype), torch.randn(N, dtype=dtype), torch.randn(N, dtype=dtype)
    r = torch.randn(M, N, dtype=dtype) if case.startswith("add") else None
    rms = case == "rms_norm"
    args = [x, r, w, None if rms else b, 1e-5, rms]
    dy = torch.randn(M, N, dtype=dtype)
    # the h gradient is None unless h is used: both routes must take it that way
    grads = [dy, torch.randn(M, N, dtype=dtype) if case == "add_layer_norm_y_h" else None]
    registered, eager = _both_routes(fwd, args, 2, grads)
    _assert_same(registered, eager)


@pytest.mark.parametrize("backend", backend_params("dropout"))
def test_dropout_routes_agree(backend):
    fwd, _ = backends.dropout_ops_for(backend)
    x = torch.randn(64, 33)
    registered, eager = _both_routes(fwd, [x, 0.3, 1234], 1, [torch.randn(64, 33)])
    _assert_same(registered, eager)


def _graph_node(t: torch.Tensor) -> str:
    return type(t.grad_fn).__name__


def test_eager_calls_with_a_gradient_apply_the_eager_function():
    x = torch.randn(3, 16, requires_grad=True)
    q = torch.randn(1, 2, 3, 8, requires_grad=True)
    name = backends.select_backend("norm", "cpu", x.dtype).name
    assert _graph_node(fasttrans.layer_norm(x, 16)) == f"norm_fwd_{name}_eagerBackward"
    assert _graph_node(fasttrans.add_layer_norm(x, x.detach())[1]) == f"norm_fwd_{name}_eagerBackward"
    assert _graph_node(fasttrans.attention(q, q, q)) == f"attention_fwd_{name}_eagerBackward"
    assert _graph_node(fasttrans.functional.dropout(x, 0.5)) == f"dropout_fwd_{name}_eagerBackward"


def test_calls_under_vmap_keep_the_registered_op():
    x = torch.randn(4, 3, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    got = torch.func.vmap(lambda x: fasttrans.layer_norm(x, 16, w))(x)
    assert _graph_node(got) != f"norm_fwd_{backends.select_backend('norm', 'cpu', x.dtype).name}_eagerBackward"
    want = torch.nn.functional.layer_norm(x, (16,), w)
    torch.testing.assert_close(got, want)
    gx, gw = torch.autograd.grad(got.sum(), (x, w))
    wx, ww = torch.autograd.grad(want.sum(), (x, w))
    torch.testing.assert_close(gx, wx)
    torch.testing.assert_close(gw, ww)

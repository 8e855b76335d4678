"""How calls that record a graph reach the ops, and second-order gradients.

Eager calls take backends.eager_route: the backend's implementation called directly, and
with a gradient an autograd.Function holding the formulas that register_autograd gives
each forward op (the extension's norms and attention: C++ autograd nodes applying the same
backward ops, csrc/eager.cpp), instead of calling the op through the dispatcher. torch.compile, torch.func
transforms, dispatch modes and tensor subclasses call the registered op. These tests hold
the two routes to the same outputs and gradients, on every backend, and check which route
each kind of call takes.

Under backward(create_graph=True) the gradients are the reference forward's, taken by
autograd with a graph of their own, so they can be differentiated again: gradgradcheck in
fp64 through every mask kind, the norms and dropout.
"""

import contextlib
import sys
import warnings

import pytest
import torch
import torch._library.autograd as library_autograd
import torch.nn.functional as F

import fasttrans
from fasttrans import backends

from conftest import backend_params
from helpers import fasttrans_ops_run, make_float_mask

pytestmark = pytest.mark.usefixtures("one_thread")

f64 = torch.float64


def _leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]


def _both_routes(backend: str, kind: str, args: list, n_outputs_used: int, grads: list):
    """Outputs and input gradients of the backend's ``kind`` forward on args through the
    registered op (and its autograd kernel) and through the eager route's autograd.Function,
    each on fresh leaves; and the eager route's forward without a gradient matches both."""
    op = backends.forward_op(backend, kind)
    forward, function = backends.eager_route(backend, kind)
    with torch.no_grad():
        plain = forward(*args)[:n_outputs_used]
    results = []
    for route in (op, function):
        leaves = _leaves(*[a if isinstance(a, torch.Tensor) else None for a in args])
        call_args = [leaf if isinstance(a, torch.Tensor) else a for a, leaf in zip(args, leaves)]
        outputs = route(*call_args)
        used = outputs[:n_outputs_used]
        inputs = [leaf for leaf in leaves if leaf is not None and leaf.requires_grad]
        loss = sum((o * g).sum() for o, g in zip(used, grads) if g is not None and o is not None)
        results.append(([_absent_as_none(o) for o in used],
                        torch.autograd.grad(loss, inputs, allow_unused=True)))
    _assert_same_outputs(results[0][0], [_absent_as_none(o) for o in plain])
    return results


def _absent_as_none(t):
    """An output detached, and None for an absent one (the ops return those as empty (0,) tensors)."""
    return None if t is None or (t.dim() == 1 and t.numel() == 0) else t.detach()


def _assert_same_outputs(outs_a, outs_b):
    for a, b in zip(outs_a, outs_b):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=0, atol=0)


def _assert_same(registered, eager):
    (outs_a, grads_a), (outs_b, grads_b) = registered, eager
    _assert_same_outputs(outs_a, outs_b)
    assert len(grads_a) == len(grads_b)
    for a, b in zip(grads_a, grads_b):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("backend", backend_params("attention"))
@pytest.mark.parametrize("mask", ["float", "bool", "key_lengths_causal", "float_softcap"])
def test_attention_routes_agree(backend, mask):
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 5, 7, 8
    q, k, v = torch.randn(B, H, Lq, D, dtype=f64), torch.randn(B, Hkv, Lk, D, dtype=f64), torch.randn(B, Hkv, Lk, D, dtype=f64)
    attn_mask = key_lengths = None
    if mask.startswith("float"):  # its gradient is computed only when it requires one
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
    if mask == "float_softcap":  # the ops' trailing softcap, which the eager routes pass on
        args.append(0.5)
    registered, eager = _both_routes(backend, "attention", args, 1, [torch.randn(B, H, Lq, D, dtype=dtype)])
    _assert_same(registered, eager)
    if mask.startswith("float"):
        assert eager[1][3] is not None and eager[1][3].abs().sum() > 0


@pytest.mark.parametrize("backend", backend_params("norm"))
@pytest.mark.parametrize("case", ["layer_norm", "add_layer_norm_y", "add_layer_norm_y_h", "rms_norm"])
def test_norm_routes_agree(backend, case):
    M, N = 6, 40
    dtype = f64 if backend != "triton" else torch.float32
    x, w, b = torch.randn(M, N, dtype=dtype), torch.randn(N, dtype=dtype), torch.randn(N, dtype=dtype)
    r = torch.randn(M, N, dtype=dtype) if case.startswith("add") else None
    rms = case == "rms_norm"
    args = [x, r, w, None if rms else b, 1e-5, rms]
    dy = torch.randn(M, N, dtype=dtype)
    # the h gradient is None unless h is used: both routes must take it that way
    grads = [dy, torch.randn(M, N, dtype=dtype) if case == "add_layer_norm_y_h" else None]
    registered, eager = _both_routes(backend, "norm", args, 2, grads)
    _assert_same(registered, eager)


def _forced(backend: str | None):
    return contextlib.nullcontext() if backend is None else fasttrans.use_backend(backend)


# the backend selected on the CPU (the extension's native entries, csrc/eager.cpp), and the
# Triton kernels' launch sites (kernels/layernorm.py, norm_site) under the interpreter
def _common_case_backends(op: str, triton_dtypes: tuple) -> list:
    return [
        *[pytest.param(dtype, None, id=f"{dtype}-selected") for dtype in (torch.float32, torch.bfloat16, f64)],
        *[pytest.param(dtype, "triton", id=f"{dtype}-triton", marks=p.marks)
          for p in backend_params(op) if p.values[0] == "triton" for dtype in triton_dtypes],
    ]


@pytest.mark.parametrize("dtype, backend", _common_case_backends("norm", (torch.float32, torch.bfloat16)))
@pytest.mark.parametrize("case", ["layer_norm", "add_layer_norm", "rms_norm", "weight_only_grad", "no_grad",
                                  "rows"])
def test_public_norms_match_the_registered_op(case, dtype, backend):
    """The public norms in their common case (the selected backend's native entry on CPU;
    the Triton kernels' launch sites): outputs and gradients the registered op gives, bit
    for bit, on 3-D inputs that the call views as rows (2-D ones for "rows")."""
    with _forced(backend):
        _public_norms_match_the_registered_op(case, dtype)


def _public_norms_match_the_registered_op(case, dtype):
    backend = backends.select_backend("norm", "cpu", dtype).name
    op = backends.forward_op(backend, "norm")
    shape = (6, 40) if case == "rows" else (2, 3, 40)
    N = shape[-1]
    x, r = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    w, b = torch.randn(N, dtype=dtype), torch.randn(N, dtype=dtype)
    dy, dh = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    residual = case == "add_layer_norm"
    rms = case == "rms_norm"

    def public(x, r, w, b):
        if residual:
            return fasttrans.add_layer_norm(x, r, w, b)
        if rms:
            return (fasttrans.rms_norm(x, N, w, 1e-5),)
        return (fasttrans.layer_norm(x, (N,), w, b),)

    def registered(x, r, w, b):
        y, h, _, _ = op(x.view(-1, N), r.view(-1, N) if residual else None, w, None if rms else b, 1e-5, rms)
        return (y.view_as(x), h.view_as(x)) if residual else (y.view_as(x),)

    results = []
    for call in (registered, public, public):  # the second public call takes the launches its first made
        leaves = [t.clone().requires_grad_(case != "no_grad" and (case != "weight_only_grad" or t is w))
                  for t in (x, r, w, b)]
        outputs = call(*leaves)
        if case == "no_grad":
            assert all(o.grad_fn is None for o in outputs)
            results.append((outputs, ()))
            continue
        wrt = [t for t in leaves if t.requires_grad]
        loss = (outputs[0] * dy).sum() + ((outputs[1] * dh).sum() if residual else 0)
        results.append(([o.detach() for o in outputs], torch.autograd.grad(loss, wrt, allow_unused=True)))
    _assert_same(results[0], results[1])
    _assert_same(results[0], results[2])
    # the call was the backend's common case, not sent back to the general route
    common = backends.selected_route("norm", x.device, dtype)[4]
    assert common(x, r if residual else None, w, None if rms else b, 1e-5, rms, N) is not None
    if case != "no_grad":
        node = public(*[t.requires_grad_() for t in (x, r, w, b)])[0].grad_fn
        if backend == "extension":  # 3-D: the rows viewed as x
            assert (node if case == "rows" else node.next_functions[0][0]).name().endswith("NormFunction>")
        else:  # the kernels write x's shape: no view
            # the node's class: torch 2.11's Python Function nodes have no name()
            assert type(node).__name__ == f"norm_fwd_{backend}_eagerBackward"


@pytest.mark.parametrize("dtype, backend", _common_case_backends("norm", (torch.float16,)))
def test_rms_norm_default_eps_takes_the_common_case(monkeypatch, dtype, backend):
    """rms_norm(eps=None) is torch's default call: it takes the common case with the
    accumulation dtype's machine epsilon, not the general route."""
    x, w = torch.randn(3, 40, dtype=dtype), torch.randn(40, dtype=dtype)
    eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    with _forced(backend):
        expected = fasttrans.rms_norm(x, 40, w, eps)

        def general_route(*args, **kwargs):
            raise AssertionError("rms_norm(eps=None) took the general route")

        monkeypatch.setattr(fasttrans.functional, "_norm", general_route)
        assert torch.equal(fasttrans.rms_norm(x, 40, w), expected)


# the sites' code does not branch on the dtype: Triton in fp32 only (the interpreter is slow)
@pytest.mark.parametrize("dtype, backend", _common_case_backends("attention", (torch.float32,)))
@pytest.mark.parametrize("case", ["plain", "gqa_causal", "offset_past_int64", "negative_offset_scale",
                                  "head_major_views", "no_grad", "bool_mask", "float_mask", "float_mask_grad",
                                  "key_lengths_int64"])
def test_public_attention_matches_the_registered_op(case, dtype, backend):
    """The public attention in its common case (no dropout; the selected backend's native
    entry on CPU, see csrc/eager.cpp; the Triton kernels' launch sites): the output and
    gradients the registered op gives on the prepared arguments (mask expanded, key lengths
    in int32), bit for bit."""
    with _forced(backend):
        _public_attention_matches_the_registered_op(case, dtype)


def _public_attention_matches_the_registered_op(case, dtype):
    backend = backends.select_backend("attention", "cpu", dtype).name
    op = backends.forward_op(backend, "attention")
    B, H, Hkv, Lq, Lk, D = 2, 4, (2 if case == "gqa_causal" else 4), 5, 7, 16
    is_causal = case in ("gqa_causal", "offset_past_int64", "negative_offset_scale")
    offset = {"offset_past_int64": 2 ** 70, "negative_offset_scale": -3}.get(case, 0)
    scale = 0.3 if case == "negative_offset_scale" else None
    q = torch.randn(B, Lq, H, D, dtype=dtype).transpose(1, 2) if case == "head_major_views" else \
        torch.randn(B, H, Lq, D, dtype=dtype)
    k, v = torch.randn(B, Hkv, Lk, D, dtype=dtype), torch.randn(B, Hkv, Lk, D, dtype=dtype)
    dout = torch.randn(B, H, Lq, D, dtype=dtype)
    mask = key_lengths = None
    if case == "bool_mask":  # broadcast over batch and heads, one query with no key
        mask = torch.rand(Lq, Lk) > 0.4
        mask[1] = False
    if case in ("float_mask", "float_mask_grad"):
        mask = torch.randn(1, H, Lq, Lk, dtype=dtype)
    if case == "key_lengths_int64":
        key_lengths = torch.tensor([Lk - 2, 0])
    grad = case != "no_grad"
    op_offset = max(-Lq, min(offset, Lk))
    op_scale = D ** -0.5 if scale is None else scale
    results = []
    for call in ("registered", "public", "public"):  # the second public call takes the launches its first made
        leaves = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
        m = None if mask is None else mask.clone().requires_grad_(case == "float_mask_grad")
        if call == "registered":
            out = op(*leaves, None if m is None else m.expand(B, H, Lq, Lk),
                     None if key_lengths is None else key_lengths.int(), is_causal, op_offset, 0.0, op_scale, 0)[0]
        else:
            out = fasttrans.attention(*leaves, attn_mask=m, key_lengths=key_lengths, is_causal=is_causal,
                                      causal_offset=offset, scale=scale)
        assert (out.grad_fn is not None) == grad
        wrt = leaves + ([m] if case == "float_mask_grad" else [])
        grads = torch.autograd.grad((out * dout).sum(), wrt) if grad else ()
        results.append(([out.detach()], grads))
    _assert_same(results[0], results[1])
    _assert_same(results[0], results[2])
    # the call was the backend's common case, not sent back to the general route (a float
    # mask that needs a gradient takes it on the Triton sites)
    common = backends.selected_route("attention", q.device, dtype)[4]
    args = (q, k, v, mask, key_lengths, is_causal, offset, scale, fasttrans.functional.MAX_HEAD_DIM)
    assert common(*args) is not None
    if grad:
        out = fasttrans.attention(*[t.requires_grad_() for t in (q, k, v)], is_causal=is_causal)
        assert _node_name(out) == ("torch::autograd::CppNode<fasttrans::eager::AttentionFunction>"
                                   if backend == "extension" else f"attention_fwd_{backend}_eagerBackward")


def _seed_of_class(divisible: bool) -> int:
    """A torch.manual_seed value after which fasttrans draws a dropout seed that is (or is
    not) divisible by 16: an integer class Triton specialises on."""
    for s in range(1000):
        torch.manual_seed(s)
        if (fasttrans.functional._draw_seed(0.5) % 16 == 0) == divisible:
            return s
    raise AssertionError("no such seed in 1000 tries")


@pytest.mark.parametrize("dtype, backend", _common_case_backends("attention", (torch.float32,)))
@pytest.mark.parametrize("mask", ["none", "bool_causal"])
def test_public_attention_with_dropout_matches_the_registered_op(mask, dtype, backend, monkeypatch):
    """Dropout in a public attention call (the Triton launch sites take it; other backends
    the general route): the seed is drawn once, as the general route draws it, and output
    and gradients equal the registered op's with that seed, bit for bit, for seeds of
    both integer classes, on a site's first and later calls."""
    from fasttrans.kernels.attention import AttentionSite

    sited = []
    forward = AttentionSite.forward
    monkeypatch.setattr(AttentionSite, "forward", lambda site, *args: sited.append(args[-2:]) or forward(site, *args))
    p = 0.3
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 5, 7, 16
    q, k, v = torch.randn(B, H, Lq, D, dtype=dtype), torch.randn(B, Hkv, Lk, D, dtype=dtype), \
        torch.randn(B, Hkv, Lk, D, dtype=dtype)
    dout = torch.randn(B, H, Lq, D, dtype=dtype)
    attn_mask = None if mask == "none" else torch.rand(B, 1, Lq, Lk) > 0.3
    is_causal = mask == "bool_causal"
    with _forced(backend):
        op = backends.forward_op(backends.select_backend("attention", "cpu", dtype).name, "attention")
        for divisible in (False, True, False):
            manual = _seed_of_class(divisible)
            torch.manual_seed(manual)
            seed = fasttrans.functional._draw_seed(p)
            results = []
            for call in ("registered", "public"):
                leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                torch.manual_seed(manual)
                if call == "registered":
                    out = op(*leaves, None if attn_mask is None else attn_mask.expand(B, H, Lq, Lk), None, is_causal,
                             0, p, D ** -0.5, seed)[0]
                else:
                    out = fasttrans.attention(*leaves, attn_mask=attn_mask, is_causal=is_causal, dropout_p=p)
                    # one seed drawn: the generator stands where one draw leaves it
                    after = torch.randint(0, 2**31 - 1, (1,)).item()
                    torch.manual_seed(manual)
                    fasttrans.functional._draw_seed(p)
                    assert after == torch.randint(0, 2**31 - 1, (1,)).item()
                results.append(([out.detach()], torch.autograd.grad((out * dout).sum(), leaves)))
            _assert_same(*results)
            plain = fasttrans.attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
            assert not torch.allclose(results[0][0][0], plain)  # the dropout acted
    if backend == "triton":  # every public call launched from a site, with the drawn seed
        sited = [args for args in sited if args[0] != 0.0]  # not the calls without dropout
        assert len(sited) == 3 and all(args == (p, s) for args, s in zip(
            sited, [(torch.manual_seed(_seed_of_class(d)), fasttrans.functional._draw_seed(p))[1]
                    for d in (False, True, False)]))


@pytest.mark.parametrize("backend", [p for p in backend_params("dropout") if p.values[0] == "triton"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_public_dropout_from_the_triton_sites_matches_the_registered_op(backend, layout, monkeypatch):
    """A public dropout call takes the Triton kernels' launch sites (a contiguous input; a
    transposed one the general route): the seed is drawn once, as the general route draws
    it, and the output and gradient equal the registered op's with that seed, bit for bit,
    for seeds of both integer classes, on a site's first and later calls."""
    from fasttrans.kernels.dropout import DropoutSite

    sited = []
    forward = DropoutSite.forward
    monkeypatch.setattr(DropoutSite, "forward", lambda site, x, seed: sited.append(seed) or forward(site, x, seed))
    p = 0.3
    x = torch.randn(33, 64) if layout == "contiguous" else torch.randn(64, 33).t()
    dy = torch.randn(33, 64)
    with fasttrans.use_backend(backend):
        op = backends.forward_op(backend, "dropout")
        seeds = []
        for divisible in (False, True, False):
            manual = _seed_of_class(divisible)
            torch.manual_seed(manual)
            seeds.append(fasttrans.functional._draw_seed(p))
            results = []
            for call in ("registered", "public"):
                leaf = x.detach().clone().requires_grad_()
                torch.manual_seed(manual)
                if call == "registered":
                    out = op(leaf.contiguous(), p, seeds[-1])[0]
                else:
                    out = fasttrans.functional.dropout(leaf, p)
                results.append(([out.detach()], torch.autograd.grad((out * dy).sum(), leaf)))
            _assert_same(*results)
            with torch.no_grad():  # and without a gradient
                torch.manual_seed(manual)
                assert torch.equal(fasttrans.functional.dropout(x, p), results[0][0][0])
    assert sited == ([s for s in seeds for _ in range(2)] if layout == "contiguous" else [])


@pytest.mark.parametrize("backend", backend_params("dropout"))
def test_dropout_routes_agree(backend):
    x = torch.randn(64, 33)
    registered, eager = _both_routes(backend, "dropout", [x, 0.3, 1234], 1, [torch.randn(64, 33)])
    _assert_same(registered, eager)


def _graph_node(t: torch.Tensor) -> str:
    return type(t.grad_fn).__name__


def _node_name(t: torch.Tensor) -> str:
    """The name of t's node: a Python autograd.Function's backward class, a C++ node's type."""
    return t.grad_fn.name()


def _graph_nodes(t: torch.Tensor) -> set[str]:
    """The type names of every node of t's backward graph."""
    names, stack, seen = set(), [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return names


@contextlib.contextmanager
def _autograd_kernel_entries():
    """Names of the functions of torch/_library/autograd.py entered inside the block: the
    autograd kernel that register_autograd gives an op is its ``autograd_impl``."""
    entered = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == library_autograd.__file__:
            entered.append(frame.f_code.co_name)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield entered
    finally:
        sys.setprofile(previous)




def test_calls_without_gradients_record_no_graph_and_match():
    x, r = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16)
    w = torch.randn(16, requires_grad=True)
    q = torch.randn(1, 2, 3, 8, requires_grad=True)
    y, h = fasttrans.add_layer_norm(x, r, w, None)  # registers the ops: the spy below sees only calls
    with _autograd_kernel_entries() as entered:
        with torch.no_grad():
            y0, h0 = fasttrans.add_layer_norm(x, r, w, None)
            fasttrans.attention(q, q, q)
            fasttrans.functional.dropout(x, 0.5)
        fasttrans.layer_norm(x.detach(), (16,), w.detach())  # gradients enabled, none needed
    assert "autograd_impl" not in entered, f"calls without a gradient entered the ops' autograd kernel: {entered}"
    # the spy does see that kernel: the op itself, called through the dispatcher, enters it
    norm_fwd = backends.ops_for(backends.select_backend("norm", "cpu", x.dtype).name)[2]
    with _autograd_kernel_entries() as entered, torch.no_grad():
        norm_fwd(x, None, None, None, 1e-5, False)
    assert "autograd_impl" in entered
    assert y0.grad_fn is None and not y0.requires_grad and not h0.requires_grad
    torch.testing.assert_close(y0, y.detach())
    torch.testing.assert_close(h0, h.detach())
    # only the weight needs a gradient: the autograd kernel must still run
    y1 = fasttrans.layer_norm(x.detach(), (16,), w)
    (dw,) = torch.autograd.grad(y1.sum(), w)
    w_ref = w.detach().clone().requires_grad_()
    (dw_ref,) = torch.autograd.grad(F.layer_norm(x.detach(), (16,), w_ref).sum(), w_ref)
    torch.testing.assert_close(dw, dw_ref)


def test_eager_calls_with_a_gradient_apply_the_eager_function():
    x = torch.randn(3, 16, requires_grad=True)
    q = torch.randn(1, 2, 3, 8, requires_grad=True)
    name = backends.select_backend("norm", "cpu", x.dtype).name
    # the extension's norms and attention record their C++ autograd nodes (csrc/eager.cpp)
    native = "torch::autograd::CppNode<fasttrans::eager::{}Function>".format if name == "extension" else None
    norm_node = native("Norm") if native else f"norm_fwd_{name}_eagerBackward"
    assert _node_name(fasttrans.layer_norm(x, 16)) == norm_node
    assert _node_name(fasttrans.add_layer_norm(x, x.detach())[1]) == norm_node
    assert _node_name(fasttrans.rms_norm(x, 16)) == norm_node
    attention_node = native("Attention") if native else f"attention_fwd_{name}_eagerBackward"
    assert _node_name(fasttrans.attention(q, q, q)) == attention_node
    mask = torch.randn(3, 3, requires_grad=True)
    assert _node_name(fasttrans.attention(q, q, q, attn_mask=mask)) == attention_node
    assert _graph_node(fasttrans.functional.dropout(x, 0.5)) == f"dropout_fwd_{name}_eagerBackward"


def test_calls_under_vmap_keep_the_registered_op():
    x = torch.randn(4, 3, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    name = backends.select_backend("norm", "cpu", x.dtype).name
    with _autograd_kernel_entries() as entered:
        got, ops = fasttrans_ops_run(lambda: torch.func.vmap(lambda x: fasttrans.layer_norm(x, 16, w))(x))
    assert ops == {f"fasttrans::norm_fwd_{name}"}  # the kernels', not the reference's PyTorch ops
    assert "autograd_impl" in entered  # through the op's registered autograd ...
    nodes = _graph_nodes(got)
    assert any(f"fasttrans_norm_fwd_{name}" in n for n in nodes), nodes  # ... which recorded the graph
    assert f"norm_fwd_{name}_eagerBackward" not in nodes
    want = torch.nn.functional.layer_norm(x, (16,), w)
    torch.testing.assert_close(got, want)
    gx, gw = torch.autograd.grad(got.sum(), (x, w))
    wx, ww = torch.autograd.grad(want.sum(), (x, w))
    torch.testing.assert_close(gx, wx)
    torch.testing.assert_close(gw, ww)


def test_calls_under_vmap_record_the_gradient_of_a_batched_input():
    """Under vmap a batched input reports requires_grad=False: the call must still record its graph."""
    x = torch.randn(4, 3, 16, requires_grad=True)  # the only input that needs a gradient
    w = torch.randn(16)
    got = torch.func.vmap(lambda x: fasttrans.layer_norm(x, 16, w))(x)
    want = torch.nn.functional.layer_norm(x, (16,), w)
    assert got.requires_grad
    (gx,) = torch.autograd.grad((got * want.detach()).sum(), x)
    (wx,) = torch.autograd.grad((want * want.detach()).sum(), x)
    torch.testing.assert_close(gx, wx)

    q = torch.randn(4, 1, 2, 5, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    got = torch.func.vmap(lambda q: fasttrans.attention(q, k, v))(q)
    want = torch.func.vmap(lambda q: torch.nn.functional.scaled_dot_product_attention(q, k, v))(q)
    assert got.requires_grad
    (gq,) = torch.autograd.grad((got * want.detach()).sum(), q)
    (wq,) = torch.autograd.grad((want * want.detach()).sum(), q)
    torch.testing.assert_close(gq, wq)


@pytest.fixture
def _quiet_second_order(monkeypatch):
    # the one-time warning is tested on its own below
    monkeypatch.setattr(backends.autograd, "_double_backward_warned", {"attention", "norm"})
    monkeypatch.delenv("FASTTRANS_BACKEND", raising=False)


def _second_order_backends(op):
    """reference (forced) and extension (chosen automatically: forced kernels refuse a
    create_graph backward, tested below); triton runs on CPU only when forced."""
    return [p for p in backend_params(op) if p.values[0] != "triton"]


def _running_on(backend: str, op: str):
    if backend == "reference":
        return fasttrans.use_backend("reference")
    assert backends.select_backend(op, "cpu", f64).name == backend
    return contextlib.nullcontext()


_ATTENTION_CASES = {
    "float_mask": dict(mask="float"),
    "bool_mask_gqa": dict(mask="bool", Hkv=1),
    "key_lengths_causal": dict(key_lengths=True, is_causal=True),
    "dropout_causal_offset": dict(dropout_p=0.3, is_causal=True, causal_offset=2),
    "fully_masked_row": dict(mask="bool", empty_row=True),
    "float_mask_softcap": dict(mask="float", softcap=0.5),
}


def _attention_case(mask=None, Hkv=2, key_lengths=False, is_causal=False, causal_offset=0, dropout_p=0.0,
                    empty_row=False, softcap=None):
    B, H, Lq, Lk, D = 2, 2, 3, 5, 4
    q = torch.randn(B, H, Lq, D, dtype=f64, requires_grad=True)
    k = torch.randn(B, Hkv, Lk, D, dtype=f64, requires_grad=True)
    v = torch.randn(B, Hkv, Lk, D, dtype=f64, requires_grad=True)
    inputs, kwargs = [q, k, v], dict(is_causal=is_causal, causal_offset=causal_offset, dropout_p=dropout_p,
                                     softcap=softcap)
    if key_lengths:
        kwargs["key_lengths"] = torch.tensor([Lk, 2])
    if mask == "bool":
        m = torch.rand(B, 1, Lq, Lk) < 0.7
        m[..., 0] = True
        if empty_row:
            m[1, 0, 2] = False
        kwargs["attn_mask"] = m
    seed = 1234

    def call(q, k, v, *mask):
        if mask:
            kwargs["attn_mask"] = mask[0]
        torch.manual_seed(seed)  # dropout: the same keep-mask on every evaluation
        return fasttrans.attention(q, k, v, **kwargs)

    if mask == "float":
        inputs.append(make_float_mask((B, H, Lq, Lk), "cpu", dtype=f64, neg_inf_frac=0.0).requires_grad_())
    return inputs, call


@pytest.mark.usefixtures("_quiet_second_order")
@pytest.mark.parametrize("backend", _second_order_backends("attention"))
@pytest.mark.parametrize("case", list(_ATTENTION_CASES))
def test_attention_second_order_gradients(backend, case):
    inputs, call = _attention_case(**_ATTENTION_CASES[case])
    with _running_on(backend, "attention"):
        # the gradients recorded for a second order are those of a plain backward
        dy = torch.randn_like(call(*inputs))
        plain = torch.autograd.grad(call(*inputs), inputs, dy)
        for got, want in zip(torch.autograd.grad(call(*inputs), inputs, dy, create_graph=True), plain):
            torch.testing.assert_close(got, want)
        assert torch.autograd.gradgradcheck(call, inputs)


def _norm_call(case):
    if case == "layer_norm":
        return 1, lambda x, w, b: fasttrans.layer_norm(x, 10, w, b)
    if case == "add_layer_norm":  # both outputs used: h's gradient joins x's and residual's
        return 2, lambda x, r, w, b: torch.cat(fasttrans.add_layer_norm(x, r, w, b), -1)
    if case == "add_layer_norm_y":
        return 2, lambda x, r, w, b: fasttrans.add_layer_norm(x, r, w, b)[0]
    return 1, lambda x, w, b: fasttrans.rms_norm(x, 10, w)


@pytest.mark.usefixtures("_quiet_second_order")
@pytest.mark.parametrize("backend", _second_order_backends("norm"))
@pytest.mark.parametrize("case", ["layer_norm", "add_layer_norm", "add_layer_norm_y", "rms_norm"])
def test_norm_second_order_gradients(backend, case):
    n_x, call = _norm_call(case)
    inputs = [torch.randn(4, 10, dtype=f64, requires_grad=True) for _ in range(n_x)]
    inputs += [torch.randn(10, dtype=f64, requires_grad=True) for _ in range(2)]
    with _running_on(backend, "norm"):
        assert torch.autograd.gradgradcheck(call, inputs)


@pytest.mark.usefixtures("_quiet_second_order")
@pytest.mark.parametrize("backend", backend_params("dropout"))
def test_dropout_second_order_gradients(backend):
    x = torch.randn(8, 16, dtype=torch.float32 if backend == "triton" else f64, requires_grad=True)

    def call(x):
        torch.manual_seed(7)
        return fasttrans.functional.dropout(x, 0.4) ** 2

    with fasttrans.use_backend(backend):
        if backend != "triton":
            assert torch.autograd.gradgradcheck(call, (x,))
        # d/dx of (dropout(x)^2 . g) is 2 s^2 keep g (s = 1 / (1 - p)): the Hessian-vector product
        y = call(x)
        (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        (hv,) = torch.autograd.grad(gx.sum(), x)
        # the first-order gradient is the kernels' own, rounding included
        (want,) = torch.autograd.grad(call(x).sum(), x)
    torch.testing.assert_close(gx, want, rtol=0, atol=0)
    torch.manual_seed(7)
    keep = fasttrans.functional.dropout_mask(x, 0.4)
    torch.testing.assert_close(hv, 2 * keep.to(x.dtype) / 0.6 ** 2)


@pytest.mark.usefixtures("_quiet_second_order")
def test_create_graph_gradients_match_the_kernels():
    """The first-order gradients a create_graph backward returns equal the kernels' own."""
    inputs, call = _attention_case(mask="float", key_lengths=True, is_causal=True, dropout_p=0.2)
    x = torch.randn(3, 10, dtype=f64, requires_grad=True)
    assert backends.select_backend("attention", "cpu", f64).name == "extension"
    g = torch.randn(2, 2, 3, 4, dtype=f64)
    want = torch.autograd.grad((call(*inputs) * g).sum(), inputs)
    got = torch.autograd.grad((call(*inputs) * g).sum(), inputs, create_graph=True)
    want_x = torch.autograd.grad((fasttrans.layer_norm(x, 10) * x).sum(), x)
    got_x = torch.autograd.grad((fasttrans.layer_norm(x, 10) * x).sum(), x, create_graph=True)
    assert all(t.requires_grad for t in got + got_x)
    for a, b in zip(got + got_x, want + want_x):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", [p for p in backend_params("attention") if p.values[0] != "reference"])
def test_second_order_gradients_of_a_forced_kernel_backend_raise(monkeypatch, backend):
    monkeypatch.delenv("FASTTRANS_BACKEND", raising=False)
    dtype = torch.float32 if backend == "triton" else f64
    x = torch.randn(3, 16, dtype=dtype, requires_grad=True)
    inputs, call = _attention_case()
    with fasttrans.use_backend(backend):
        y = fasttrans.layer_norm(x, 16)
        inputs = [t.detach().to(dtype).requires_grad_() for t in inputs]
        out = call(*inputs)
    (gx,) = torch.autograd.grad(y.sum(), x, retain_graph=True)  # first order: the kernels
    assert gx.abs().max() < 1e-5
    with pytest.raises(backends.BackendUnavailableError, match=f"'{backend}'.*norm.*create_graph=True"):
        torch.autograd.grad((y * y).sum(), x, create_graph=True)
    with pytest.raises(backends.BackendUnavailableError, match=f"'{backend}'.*attention.*create_graph=True"):
        torch.autograd.grad((out * out).sum(), inputs, create_graph=True)


def test_second_order_fallback_warns_once(monkeypatch):
    monkeypatch.setattr(backends.autograd, "_double_backward_warned", set())
    monkeypatch.delenv("FASTTRANS_BACKEND", raising=False)
    x = torch.randn(3, 16, dtype=f64, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="norm's backward with create_graph=True"):
        torch.autograd.grad((fasttrans.layer_norm(x, 16) ** 2).sum(), x, create_graph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.autograd.grad((fasttrans.layer_norm(x, 16) ** 2).sum(), x, create_graph=True)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_recomputes_the_same_layer(use_reentrant):
    """torch.utils.checkpoint reruns the forward in backward: the dropout masks must come
    out the same (their seeds are drawn from torch's generator, whose state checkpoint
    restores), so outputs and gradients equal an uncheckpointed run exactly."""
    from torch.utils.checkpoint import checkpoint

    layer = fasttrans.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.2, batch_first=True)
    x = torch.randn(2, 5, 32, requires_grad=True)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])

    def run(call):
        layer.zero_grad()
        x.grad = None
        torch.manual_seed(1)
        y = call(x)
        y.square().sum().backward()
        return [y.detach(), x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]

    plain = run(lambda x: layer(x, src_key_padding_mask=pad))
    checkpointed = run(lambda x: checkpoint(lambda x: layer(x, src_key_padding_mask=pad), x,
                                            use_reentrant=use_reentrant))
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    torch.manual_seed(2)  # and the dropout did act: another seed gives other numbers
    assert not torch.equal(layer(x, src_key_padding_mask=pad).detach(), plain[0])


@pytest.mark.usefixtures("_quiet_second_order")
def test_gradient_penalty_through_an_encoder_layer_matches_torch():
    """A gradient penalty (the norm of d out / d x, itself differentiated for the weights)
    through a post-norm encoder layer with key padding gives torch.nn's numbers."""
    torch.manual_seed(0)
    kw = dict(d_model=16, nhead=4, dim_feedforward=32, dropout=0.0, batch_first=True, dtype=f64)
    ours, theirs = fasttrans.nn.TransformerEncoderLayer(**kw), torch.nn.TransformerEncoderLayer(**kw)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 5, 16, dtype=f64)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])

    def penalty_grads(layer):
        xi = x.clone().requires_grad_()
        # torch's CPU flash attention has no double backward: its math kernel has
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            out = layer(xi, src_key_padding_mask=pad)
            (gx,) = torch.autograd.grad(out.square().sum(), xi, create_graph=True)
            return torch.autograd.grad(gx.square().sum(), list(layer.parameters()))

    for name, a, b in zip([n for n, _ in ours.named_parameters()], penalty_grads(ours), penalty_grads(theirs)):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")


def test_calls_under_a_dispatch_mode_keep_the_registered_op():
    """A dispatch mode (FakeTensorMode, a user's TorchDispatchMode) must see the op itself:
    the eager route would hand the implementation tensors it cannot read."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func.name()))
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(3, 16), torch.randn(16)
    name = backends.select_backend("norm", "cpu", x.dtype).name
    with Seen() as seen:
        got = fasttrans.layer_norm(x, 16, w)
    assert f"fasttrans::norm_fwd_{name}" in seen.ops, seen.ops
    torch.testing.assert_close(got, F.layer_norm(x, (16,), w))


def test_calls_with_a_tensor_subclass_keep_the_registered_op():
    """A tensor subclass (DTensor, a wrapper) dispatches through the op like torch's own ops."""
    from torch.testing._internal.two_tensor import TwoTensor

    x = torch.randn(3, 16)
    name = backends.select_backend("norm", "cpu", x.dtype).name
    got, ops = fasttrans_ops_run(lambda: fasttrans.layer_norm(TwoTensor(x, x.clone()), 16))
    assert f"fasttrans::norm_fwd_{name}" in ops
    assert isinstance(got, TwoTensor)
    torch.testing.assert_close(got.a, F.layer_norm(x, (16,)))


@pytest.mark.parametrize("backend", [p for p in backend_params("attention") if p.values[0] == "triton"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_layers_launch_attention_from_the_triton_sites(backend, dropout, monkeypatch):
    """fasttrans.nn's attention (attention_prevalidated) takes the Triton kernels' launch
    sites too, with dropout or without, with the reference's outputs and gradients (the
    same keep decisions for the same seed), on a first and a later call."""
    from fasttrans.kernels.attention import AttentionSite

    launched = []
    forward = AttentionSite.forward
    monkeypatch.setattr(AttentionSite, "forward", lambda site, *args: launched.append(site) or forward(site, *args))
    layer = fasttrans.nn.MultiheadAttention(16, 2, dropout=dropout, batch_first=True)
    x = torch.randn(2, 5, 16)
    results = []
    for name in ("reference", backend, backend):
        torch.manual_seed(7)
        with fasttrans.use_backend(name):
            out = layer(x, x, x, need_weights=False)[0]
            grads = torch.autograd.grad(out.square().sum(), list(layer.parameters()))
        results.append((out.detach(), grads))
    for got in results[1:]:
        torch.testing.assert_close(got[0], results[0][0])
        for a, b in zip(got[1], results[0][1]):
            torch.testing.assert_close(a, b)
    assert len(launched) == 2 and launched[0] is launched[1]


@pytest.mark.parametrize("backend", [p for p in backend_params("attention") if p.values[0] == "triton"])
def test_triton_attention_site_serves_a_growing_key_cache(backend, monkeypatch):
    """Decoding over a key/value cache that grows a token per step (causal, bottom-right
    aligned): the steps of one key-length class keep one launch site, and every step gives
    the registered op's output and gradients bit for bit."""
    from fasttrans.kernels.attention import AttentionSite

    sites = []
    forward = AttentionSite.forward
    monkeypatch.setattr(AttentionSite, "forward", lambda site, *args: sites.append(site) or forward(site, *args))
    B, H, D, cache = 2, 2, 16, 8
    q = torch.randn(B, H, 1, D)
    keys, values = torch.randn(B, H, cache, D), torch.randn(B, H, cache, D)
    dout = torch.randn(B, H, 1, D)
    with fasttrans.use_backend(backend):
        op = backends.forward_op(backend, "attention")
        for Lk in (5, 6, 7, 8):  # one tuning bucket, one integer class
            results = []
            for call in ("registered", "public"):
                leaves = [t.detach().clone().requires_grad_() for t in (q, keys, values)]
                q_, k, v = leaves[0], leaves[1][:, :, :Lk], leaves[2][:, :, :Lk]  # views of the cache
                if call == "registered":
                    out = op(q_, k, v, None, None, True, Lk - 1, 0.0, D ** -0.5, 0)[0]
                else:
                    out = fasttrans.attention(q_, k, v, is_causal=True, causal_offset=Lk - 1)
                results.append(([out.detach()], torch.autograd.grad((out * dout).sum(), leaves)))
            _assert_same(*results)
    assert len(sites) == 4 and all(site is sites[0] for site in sites)

"""Autograd for the backends' ops: the formulas torch.library registers for each forward
op, second-order gradients through the reference, and the eager route that calls a
backend's implementation directly (see fasttrans.functional)."""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch

from .. import environ, reference
from .common_case import PLAIN_TENSORS, attention_tensors, norm_tensors
from .registry import (
    _FROM_ENV,
    BACKENDS,
    BackendUnavailableError,
    _dependent_memos,
    _forced,
    current_forced_backend,
    select_backend,
)


def last_dim_unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t itself when its innermost stride is 1 (every kernel takes the other strides as they
    are), else a contiguous copy: an expanded gradient (stride 0) or a column-major view."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


# The guard that sends an op call past the autograd dispatch key (to the device kernel), as
# an op's own autograd kernel does once it has recorded the graph; None on a torch without it.
BELOW_AUTOGRAD = getattr(torch._C, "_AutoDispatchBelowAutograd", None)


def _autograd_formulas(name: str, attention_bwd_op, norm_bwd_op, dropout_bwd_op) -> dict:
    """{kind: (setup_context, backward)} of backend ``name``'s forward ops, computing first-order
    gradients with the given backward callables: its registered backward ops, or its
    implementation's methods (the eager route, see :func:`eager_route`). Either takes what
    the matching forward returned (absent outputs as empty tensors or as None)."""


    def attention_setup(ctx, inputs, output):
        q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed, *softcap = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, attn_mask, key_lengths)
        ctx.args = (is_causal, causal_offset, dropout_p, scale, seed)
        ctx.softcap = tuple(softcap)  # the op's trailing softcap, where the call passed one
        ctx.mask_grad = attn_mask is not None and attn_mask.dtype != torch.bool and ctx.needs_input_grad[3]
        ctx.forced = current_forced_backend()

    def attention_backward(ctx, dout, dlse):
        q, k, v, out, lse, attn_mask, key_lengths = ctx.saved_tensors
        is_causal, causal_offset, dropout_p, scale, seed = ctx.args
        rest = (None,) * (6 + len(ctx.softcap))  # the arguments after attn_mask get no gradient
        if torch.is_grad_enabled():  # backward(create_graph=True): it must be differentiable itself
            _check_second_order("attention", name, ctx.forced)
            grads = _grad_with_graph(
                lambda q, k, v, m: reference.ReferenceImpl.attention_fwd(
                    q, k, v, m, key_lengths, is_causal, causal_offset, dropout_p, scale, seed, *ctx.softcap)[0],
                (q, k, v, attn_mask), ctx.needs_input_grad[:4], (dout,))
            return (*grads, *rest)
        # gradients often arrive as views (the heads of a merged (B, L, H*D) gradient) or
        # expanded (stride 0): only a non-unit innermost stride costs a copy
        dq, dk, dv, dmask = attention_bwd_op(
            last_dim_unit_stride(dout), q, k, v, out, lse, attn_mask, key_lengths, is_causal, causal_offset,
            dropout_p, scale, seed, ctx.mask_grad, *ctx.softcap,
        )
        dmask = dmask.to(attn_mask.dtype) if ctx.mask_grad else None
        return dq, dk, dv, dmask, *rest


    def norm_setup(ctx, inputs, output):
        x, residual, weight, bias, eps, rms = inputs
        y, h, mean, rstd = output
        ctx.has_residual = residual is not None
        ctx.save_for_backward(h if ctx.has_residual else x, weight, bias, mean, rstd)
        ctx.rms, ctx.eps = rms, eps
        ctx.forced = current_forced_backend()
        # when only y is used, h's gradient stays None instead of an all-zero (M, N) tensor
        ctx.set_materialize_grads(False)

    def norm_backward(ctx, dy, dh, dmean, drstd):
        h, weight, bias, mean, rstd = ctx.saved_tensors
        dh = dh if ctx.has_residual else None
        if torch.is_grad_enabled():  # backward(create_graph=True): it must be differentiable itself
            needs = ctx.needs_input_grad
            dx, dw, db = norm_grad_with_graph(name, ctx.forced, ctx.rms, ctx.eps,
                                              (needs[0] or needs[1], needs[2], needs[3]), h, weight, bias, dy, dh)
            return dx, (dx if ctx.has_residual else None), dw, db, None, None
        if dy is None:
            dy = torch.zeros_like(h)
        dh = last_dim_unit_stride(dh) if dh is not None else None
        dx, dw, db = norm_bwd_op(last_dim_unit_stride(dy), dh, h, weight, bias, mean, rstd, ctx.rms)
        dw = dw if weight is not None else None
        db = db if bias is not None else None
        return dx, (dx if ctx.has_residual else None), dw, db, None, None



    def dropout_setup(ctx, inputs, output):
        ctx.p = inputs[1]
        ctx.save_for_backward(output[1])

    def dropout_backward(ctx, dy, dkeep):
        (keep,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # backward(create_graph=True): linear in dy, in PyTorch ops
            return reference.ReferenceImpl.dropout_bwd(dy, keep, ctx.p), None, None
        return dropout_bwd_op(dy.contiguous(), keep, ctx.p), None, None

    return {"attention": (attention_setup, attention_backward), "norm": (norm_setup, norm_backward),
            "dropout": (dropout_setup, dropout_backward)}


# Second-order gradients. The kernels' backward is not itself differentiable: under
# backward(create_graph=True) (gradient penalties, Hessian-vector products) the attention and
# norm gradients are the reference forward's, taken by autograd with a graph of their own;
# dropout's backward, linear in its gradient, is computed in PyTorch ops.
_double_backward_warned: set[str] = set()


def _check_second_order(op: str, backend: str, forced: str | None) -> None:
    """Raise when the kernels were forced for op, else warn once that the reference computes it."""
    if backend == "reference":
        return
    if forced == backend:
        raise BackendUnavailableError(
            f"backend '{backend}' was requested for {op}, but a gradient with create_graph=True (a second-order "
            f"gradient) was asked of it, which its kernels do not provide; use the reference backend "
            f"(fasttrans.use_backend('reference')) for the forward of such a graph"
        )
    if op not in _double_backward_warned:
        _double_backward_warned.add(op)
        warnings.warn(
            f"fasttrans: {op}'s backward with create_graph=True runs on the reference (pure PyTorch) "
            "implementation: the fused kernels' backward is not differentiable itself",
            RuntimeWarning,
            stacklevel=2,
        )


def norm_grad_with_graph(name: str, forced: str | None, rms: bool, eps: float, needs: tuple, h, weight, bias, dy,
                         dh) -> tuple:
    """(dx, dweight, dbias) of backend ``name``'s norm under backward(create_graph=True), dx
    including dh (the gradient of h = x + residual); needs: whether x (or the residual),
    weight and bias need theirs. The reference forward's gradients, differentiable again."""
    _check_second_order("norm", name, forced)
    grads = (None, None, None)
    if dy is not None:
        grads = _grad_with_graph(lambda h, w, b: reference.ReferenceImpl.norm_fwd(h, None, w, b, eps, rms)[0],
                                 (h, weight, bias), needs, (dy,))
    dx = grads[0] if dh is None else (dh if grads[0] is None else grads[0] + dh)
    return dx, grads[1], grads[2]


def _extension_norm_second_order(forced: bool, rms, eps, needs, x, residual, weight, bias, dy, dh) -> tuple:
    """norm_grad_with_graph for the extension's C++ autograd node (csrc/eager.cpp). h is
    recomputed from x and the residual: the saved h leads back into the node, whose backward
    is running (a C++ node's backward holds its lock)."""
    if residual is not None:
        with torch.enable_grad():
            x = x + residual
    return norm_grad_with_graph("extension", "extension" if forced else None, rms, eps, needs, x, weight, bias, dy, dh)


def _extension_attention_second_order(forced: bool, needs, q, k, v, attn_mask, key_lengths, is_causal,
                                      causal_offset, dropout_p, scale, seed, dout, softcap=0.0) -> tuple:
    """(dq, dk, dv, dmask) under backward(create_graph=True) for the extension's C++
    autograd node (csrc/eager.cpp): the reference forward's, as the Python route computes them."""
    _check_second_order("attention", "extension", "extension" if forced else None)
    return _grad_with_graph(
        lambda q, k, v, m: reference.ReferenceImpl.attention_fwd(
            q, k, v, m, key_lengths, is_causal, causal_offset, dropout_p, scale, seed, softcap)[0],
        (q, k, v, attn_mask), needs, (dout,))


def _grad_with_graph(forward: Callable, inputs: tuple, needs: tuple, grad_outputs: tuple) -> tuple:
    """Gradients of forward(*inputs) against grad_outputs for the inputs in needs (None for
    the rest), recorded so that they can be differentiated again."""
    wanted = [t for t, n in zip(inputs, needs) if n and t is not None]
    if not wanted:
        return tuple(None for _ in inputs)
    with torch.enable_grad():
        output = forward(*inputs)
    grads = iter(torch.autograd.grad(output, wanted, grad_outputs, create_graph=True, allow_unused=True))
    return tuple(next(grads) if n and t is not None else None for t, n in zip(inputs, needs))


# The eager route. A call to a registered op, even below its autograd key, costs the host
# the dispatcher's trip into torch.library's Python wrappers: tens of microseconds, longer
# than a small kernel runs. Eager calls (functional._call decides which) instead call the
# backend's implementation directly: without a gradient as it is, with one through an
# autograd.Function holding the formulas register_autograd gives the op, whose backward
# calls the implementation's backward directly too. torch.compile, torch.func transforms,
# dispatch modes and tensor subclasses keep calling the registered ops.
#
# The autograd.Function returns only the outputs a caller can use (attention: out; norm: y,
# and h with a residual; dropout: y) and keeps the statistics (lse, mean, rstd, the keep
# mask) on its context: autograd's bookkeeping costs microseconds per output. ``call``
# puts its result back in the op's output structure, the unused outputs as None.
_USED_OUTPUTS = {
    "attention": lambda args, out: (out, None),
    "norm": lambda args, out: (*out, None, None) if args[1] is not None else (out, None, None, None),
    "dropout": lambda args, out: (out, None),
}


def _eager_function(name: str, kind: str, forward_impl, setup_context, backward) -> Callable:
    with_residual = kind == "norm"

    def forward(ctx, *inputs):
        output = forward_impl(*inputs)
        setup_context(ctx, inputs, output)
        if with_residual and inputs[1] is not None:
            return output[0], output[1]
        return output[0]

    def backward_used(ctx, *grads):
        # the gradients of the outputs returned, then None for the statistics
        return backward(ctx, *grads, *(None,) * (_OP_OUTPUTS[kind] - len(grads)))

    function = type(f"{kind}_fwd_{name}_eager", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward_used)})
    apply, used = _C_APPLY.__get__(None, function) if _C_APPLY is not None else function.apply, _USED_OUTPUTS[kind]

    def call(*args):
        return used(args, apply(*args))

    call.function = function
    return call


_OP_OUTPUTS = {"attention": 2, "norm": 4, "dropout": 2}
_eager_routes: dict[tuple[str, str], tuple] = {}  # see eager_route
_selected_routes: dict[tuple, tuple] = {}  # see selected_route
_dependent_memos.extend((_eager_routes, _selected_routes))  # cleared when BACKENDS changes
# autograd.Function.apply's C implementation, called without the Python preamble of
# Function.apply, which binds default arguments for functions
# with a separate setup_context and unwraps torch.func's dead wrappers: the eager functions
# define forward(ctx, ...) and run only while no torch.func transform is active.
_C_APPLY = getattr(torch._C, "_FunctionBase", object).__dict__.get("apply")


def eager_route(name: str, kind: str) -> tuple[Callable, Callable]:
    """(forward, call) of backend ``name``'s ``kind`` op ("attention", "norm", "dropout")
    for eager calls: its implementation's forward (its ``<kind>_infer`` where it has one),
    called as it is when nothing needs a gradient, and a function applying the forward
    through an autograd.Function (``call.function``) with the op's gradient formulas; the
    extension's norms and attention apply them through C++ autograd nodes instead
    (csrc/eager.cpp).
    Both take the registered forward op's arguments and return its outputs, absent ones
    (and, from ``call``, the statistics only a backward reads) as None where the op
    returns empty tensors."""
    route = _eager_routes.get((name, kind))
    if route is None:
        impl = BACKENDS[name].impl()
        methods = [getattr(impl, f"{k}_{d}", None) for k in ("attention", "norm", "dropout") for d in ("fwd", "bwd")]
        if name == "extension":  # C++ ops: skip their autograd key, whose Python kernel the route replaces
            methods = [_below_autograd(m) for m in methods]
        forward = methods[("attention", "norm", "dropout").index(kind) * 2]
        infer = getattr(impl, f"{kind}_infer", None)  # optional: the forward without what a backward reads
        eager = _native_eager(impl, kind)
        if eager is not None:
            native = getattr(eager, kind)

            def call(*args):
                return native(current_forced_backend() == name, *args)
            if kind == "attention":  # the native entry runs the forward alone when nothing needs a gradient
                forward = call
        else:
            formulas = _autograd_formulas(name, *methods[1::2])
            call = _eager_function(name, kind, forward, *formulas[kind])
        route = _eager_routes[(name, kind)] = (forward if infer is None else infer, call)
    return route


def _site_norm_common(name: str, forced: str | None, norm_site: Callable) -> Callable:
    """The common-case entry of a backend whose kernels keep a launch site per kind of
    public norm call (``norm_site``, the Triton kernels'): with a gradient through an
    autograd.Function that holds the site, so its backward reuses the forward's checks and
    keys only the gradients. Takes and returns what the extension's native entry does
    (fasttrans.functional calls either). ``forced``: the backend use_backend forced, if any,
    under which the route was selected (second-order gradients raise under it)."""

    def forward(ctx, site, x, residual, weight, bias, eps):
        y, h, mean, rstd = site.forward(x, residual, weight, bias, eps)
        ctx.save_for_backward(x if h is None else h, weight, bias, mean, rstd)
        ctx.site, ctx.eps = site, eps
        ctx.set_materialize_grads(False)  # an unused h gets no all-zero gradient
        return y if h is None else (y, h)

    def backward(ctx, dy, dh=None):
        h, weight, bias, mean, rstd = ctx.saved_tensors
        site, needs = ctx.site, ctx.needs_input_grad
        if torch.is_grad_enabled():  # backward(create_graph=True): it must be differentiable itself
            dx, dw, db = norm_grad_with_graph(name, forced, site.rms, ctx.eps, (needs[1] or needs[2], needs[3],
                                              needs[4]), h, weight, bias, dy, dh)
        else:
            dx, dw, db = site.backward(torch.zeros_like(h) if dy is None else dy, dh, h, weight, bias, mean, rstd)
        # the residual's gradient is dx (h = x + residual); None where there is no residual
        return None, dx, dx if needs[2] else None, dw if weight is not None else None, \
            db if bias is not None else None, None

    function = type(f"norm_fwd_{name}_eager", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    apply = _C_APPLY.__get__(None, function) if _C_APPLY is not None else function.apply
    grad_enabled = torch.is_grad_enabled

    def common(x, residual, weight, bias, eps, rms, n):
        if (residual is not None and type(residual) not in PLAIN_TENSORS
                or weight is not None and type(weight) not in PLAIN_TENSORS
                or bias is not None and type(bias) not in PLAIN_TENSORS):
            return None
        site = norm_site(x, residual, weight, bias, rms, n, norm_tensors)
        if site is None:
            return None
        if grad_enabled() and (x.requires_grad or (residual is not None and residual.requires_grad)
                               or (weight is not None and weight.requires_grad)
                               or (bias is not None and bias.requires_grad)):
            out = apply(site, x, residual, weight, bias, eps)
            return out if residual is not None else (out, None)
        return site.infer(x, residual, weight, bias, eps)

    common.function = function
    return common


_INF = float("inf")


def _site_attention_common(name: str, forced: str | None, attention_site: Callable) -> Callable:
    """:func:`_site_norm_common` for attention (``attention_site``, the Triton kernels'). A
    float mask that needs a gradient takes the general route. ``common.dropout`` takes the
    calls with dropout: the same arguments, then dropout_p (a float in (0, 1)) and the
    function that draws the seed, called only once the call is known to be of the site's
    kind, so the general route never draws a second one."""

    def forward(ctx, site, q, k, v, attn_mask, key_lengths, causal_offset, scale, dropout_p, seed):
        out, lse = site.forward(q, k, v, attn_mask, key_lengths, causal_offset, scale, dropout_p, seed)
        ctx.save_for_backward(q, k, v, out, lse, attn_mask, key_lengths)
        ctx.site, ctx.args = site, (causal_offset, scale, dropout_p, seed)
        return out

    def backward(ctx, dout):
        q, k, v, out, lse, attn_mask, key_lengths = ctx.saved_tensors
        site, (causal_offset, scale, dropout_p, seed) = ctx.site, ctx.args
        if torch.is_grad_enabled():  # backward(create_graph=True): it must be differentiable itself
            _check_second_order("attention", name, forced)
            Lk = k.shape[2]
            mask, lengths, offset = site.mask(attn_mask, Lk), site.lengths(key_lengths), site.offset(causal_offset, Lk)
            dq, dk, dv = _grad_with_graph(
                lambda q, k, v: reference.ReferenceImpl.attention_fwd(
                    q, k, v, mask, lengths, site.is_causal, offset, dropout_p,
                    site.scale if scale is None else scale, seed)[0],
                (q, k, v), ctx.needs_input_grad[1:4], (dout,))
        else:
            dq, dk, dv = site.backward(dout, q, k, v, out, lse, attn_mask, key_lengths, causal_offset, scale,
                                       dropout_p, seed)
        return None, dq, dk, dv, None, None, None, None, None, None

    function = type(f"attention_fwd_{name}_eager", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    apply = _C_APPLY.__get__(None, function) if _C_APPLY is not None else function.apply
    grad_enabled = torch.is_grad_enabled

    def site_of(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, scale, max_head_dim):
        if (type(k) not in PLAIN_TENSORS or type(v) not in PLAIN_TENSORS
                or (attn_mask is not None and type(attn_mask) not in PLAIN_TENSORS)
                or (key_lengths is not None and type(key_lengths) not in PLAIN_TENSORS)
                or type(is_causal) is not bool or type(causal_offset) is not int
                or (scale is not None and (type(scale) is not float or not -_INF < scale < _INF))):
            return None
        site = attention_site(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, scale, max_head_dim,
                              attention_tensors)
        if site is None:
            return None
        if key_lengths is not None and key_lengths.device.type == "cpu":  # on a GPU: not read, clamped
            lengths = key_lengths.tolist()
            if min(lengths) < 0 or max(lengths) > k.shape[2]:
                return None
        if grad_enabled() and attn_mask is not None and attn_mask.requires_grad:
            return None
        return site

    def run(site, q, k, v, attn_mask, key_lengths, causal_offset, scale, dropout_p, seed):
        if grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return apply(site, q, k, v, attn_mask, key_lengths, causal_offset, scale, dropout_p, seed), None
        return site.forward(q, k, v, attn_mask, key_lengths, causal_offset, scale, dropout_p, seed)

    def common(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, scale, max_head_dim):
        site = site_of(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, scale, max_head_dim)
        return None if site is None else run(site, q, k, v, attn_mask, key_lengths, causal_offset, scale, 0.0, 0)

    def dropout(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, scale, max_head_dim, dropout_p,
                draw_seed):
        site = site_of(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, scale, max_head_dim)
        if site is None:
            return None
        return run(site, q, k, v, attn_mask, key_lengths, causal_offset, scale, dropout_p, draw_seed(dropout_p))

    common.function = function
    common.dropout = dropout
    return common


def _site_dropout_common(name: str, forced: str | None, dropout_site: Callable) -> Callable:
    """:func:`_site_norm_common` for dropout (``dropout_site``, the Triton kernels'):
    ``common(x, p, draw_seed)`` with 0 < p < 1 returns (y, None), or None for a call of
    another kind; it draws the seed only once the site has accepted the call."""

    def forward(ctx, site, x, seed):
        y, keep = site.forward(x, seed)
        ctx.save_for_backward(keep)
        ctx.site = site
        return y

    def backward(ctx, dy):
        (keep,) = ctx.saved_tensors
        site = ctx.site
        if torch.is_grad_enabled():  # backward(create_graph=True): linear in dy, in PyTorch ops
            return None, reference.ReferenceImpl.dropout_bwd(dy, keep.view(torch.bool), site.p), None
        return None, site.backward(dy, keep), None

    function = type(f"dropout_fwd_{name}_eager", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    apply = _C_APPLY.__get__(None, function) if _C_APPLY is not None else function.apply
    grad_enabled = torch.is_grad_enabled

    def common(x, p, draw_seed):
        site = dropout_site(x, p)
        if site is None:
            return None
        seed = draw_seed(p)
        if grad_enabled() and x.requires_grad:
            return apply(site, x, seed), None
        return site.forward(x, seed)[0], None

    common.function = function
    return common


def _native_eager(impl, kind: str):
    """The implementation's native eager module for ``kind`` (the extension's norms and
    attention, see csrc/eager.cpp), ready to call; None where there is none."""
    eager = getattr(impl, "eager", None)
    if kind not in ("norm", "attention") or eager is None:
        return None
    eager.set_second_order(_extension_norm_second_order, _extension_attention_second_order)
    return eager


def selected_route(kind: str, device: torch.device, dtype: torch.dtype) -> tuple:
    """(name, forward, function, native, common): the backend :func:`select_backend` selects
    for ``kind`` on (device, dtype), its :func:`eager_route`, and, where the backend has
    them (else None): its native entry taking the registered forward op's arguments and
    recording the gradient when one is needed (the extension's norms and attention,
    csrc/eager.cpp), and its entry for the common case of a public call, which checks the
    rest of the call itself and returns None for any other (see fasttrans.functional): the
    extension's native ones, or the Triton kernels' launch sites (:func:`_site_norm_common`).
    One lookup per call: all are asked on every eager call. Memoised under the same key as
    the selection, with the environment variables that selection reads."""
    forced = _forced.get()
    if forced is _FROM_ENV:
        forced = environ.getenv("FASTTRANS_BACKEND") or None
    key = (forced, kind, device, dtype, forced and environ.getenv("TRITON_INTERPRET"))
    route = _selected_routes.get(key)
    if route is None:
        name = select_backend(kind, device, dtype).name  # raises where it cannot run: never memoised
        eager = _native_eager(BACKENDS[name].impl(), kind)
        native = common = None
        if eager is not None:
            native = functools.partial(getattr(eager, kind), forced == name)
            common = functools.partial(getattr(eager, f"{kind}_common"), forced == name)
        elif getattr(BACKENDS[name].impl(), f"{kind}_site", None) is not None:  # launch sites (the Triton kernels')
            make = {"norm": _site_norm_common, "attention": _site_attention_common,
                    "dropout": _site_dropout_common}[kind]
            common = make(name, name if forced == name else None, getattr(BACKENDS[name].impl(), f"{kind}_site"))
        route = _selected_routes[key] = (name, *eager_route(name, kind), native, common)
    return route


def _below_autograd(method):
    if method is None or BELOW_AUTOGRAD is None:
        return method

    def call(*args):
        with BELOW_AUTOGRAD():
            return method(*args)

    return call

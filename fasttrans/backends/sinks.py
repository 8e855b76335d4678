"""Attention sinks on any backend's attention kernels, which know nothing of them.

A sink is one logit per query head that joins every row's softmax and attends to no value
(gpt-oss's ``s_aux``). With ``lse`` the log-sum-exp of a row's scores and ``s`` its head's
sink, the keys keep the share ``c = exp(lse) / (exp(lse) + exp(s)) = sigmoid(lse - s)`` of
the row's weight, and the row's output is ``y = c out``, ``out`` being the kernels'
attention without the sink.

The backward needs no sink either. With ``P`` the kernels' probabilities (from ``lse``) the
sink attention's are ``c P``, and the kernels' backward, given ``dout = c dy`` and
``out = y``, computes ``dV = P^T (c dy)``, ``D = rowsum(c dy * y)`` and
``dS = P (c dy V^T - D) = (c P)(dy V^T - rowsum(dy * y))``: the sink attention's gradients of
q, k, v and a float mask, exactly. The sink's own is ``-sum_rows (1 - c) rowsum(dy * y)``.
A row with no allowed key has ``lse = +inf`` (the backend interface's convention), so
``c = 1``: its output and gradients stay the kernels' zeros, as in eager attention, where
the sink takes all of the row's weight. The kernels' own ``lse`` goes back to their
backward, so every backend's recomputation of a row's statistics stays consistent with it.
Soft-capped scores change none of this: the kernels cap them (their trailing ``softcap``) and
the sink, which is not a score of q and k, stays as it is.
"""

from __future__ import annotations

import torch

from .. import reference
from .autograd import _below_autograd, _check_second_order, _grad_with_graph, last_dim_unit_stride
from .registration import ops_for
from .registry import BACKENDS, current_forced_backend


def _rows(sinks: torch.Tensor) -> torch.Tensor:
    """The sinks as a tensor broadcastable to (B, H, Lq): (H,) is one per head."""
    return sinks.view(1, -1, 1) if sinks.dim() == 1 else sinks


def _fold(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """(y, c): the output with the sinks ((H,), or broadcastable to (B, H, Lq)), and the keys'
    share of each row's weight, (B, H, Lq) in lse's dtype (fp32, fp64 for fp64 inputs)."""
    # a row with no allowed key (lse = +inf) keeps c = 1 (zeros) even against a sink of +inf
    c = torch.sigmoid(lse.clamp(max=torch.finfo(lse.dtype).max) - _rows(sinks).to(lse.dtype))
    y = out * c.unsqueeze(-1)
    # no .to() to the dtype y has: it returns y itself, and torch 2.11's dynamo, given that
    # as an autograd.Function's output, gives its inputs zero gradients
    return (y if y.dtype == out.dtype else y.to(out.dtype)), c


def _ops(name: str):
    """(forward, backward) of backend ``name``'s attention, taking the registered ops'
    arguments: the registered ops under torch.compile, else the implementation's methods
    (the extension's below their autograd key, as the eager route calls them)."""
    if torch.compiler.is_compiling():
        fwd, bwd = ops_for(name)[:2]
        return fwd, bwd
    impl = BACKENDS[name].impl()
    fwd, bwd = impl.attention_fwd, impl.attention_bwd
    if name == "extension":
        fwd, bwd = _below_autograd(fwd), _below_autograd(bwd)
    return fwd, bwd


class _SinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, sinks, key_lengths, is_causal, causal_offset, dropout_p, scale, seed, name,
                forced, softcap):
        fwd, _ = _ops(name)
        cap = (softcap,) if softcap else ()  # the ops' trailing softcap, passed only when there is one
        out, lse = fwd(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed, *cap)
        y, c = _fold(out, lse, sinks)
        ctx.save_for_backward(q, k, v, y, lse, c, attn_mask, sinks, key_lengths)
        ctx.args = (is_causal, causal_offset, dropout_p, scale, seed)
        ctx.cap = cap
        ctx.name, ctx.forced = name, forced
        ctx.mask_grad = attn_mask is not None and attn_mask.dtype != torch.bool and ctx.needs_input_grad[3]
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, lse, c, attn_mask, sinks, key_lengths = ctx.saved_tensors
        is_causal, causal_offset, dropout_p, scale, seed = ctx.args
        nothing = (None,) * 9
        if torch.is_grad_enabled():  # backward(create_graph=True): the reference's, differentiable again
            _check_second_order("attention", ctx.name, ctx.forced)
            grads = _grad_with_graph(
                lambda q, k, v, m, s: reference.ReferenceImpl.attention_with_sinks(
                    q, k, v, m, s, key_lengths, is_causal, causal_offset, dropout_p, scale, seed, *ctx.cap),
                (q, k, v, attn_mask, sinks), ctx.needs_input_grad[:5], (dy,))
            return (*grads, *nothing)
        _, bwd = _ops(ctx.name)
        dout = last_dim_unit_stride((dy * c.unsqueeze(-1)).to(y.dtype))  # a view's layout, as the op formulas take it
        dq, dk, dv, dmask = bwd(dout, q, k, v, y, lse, attn_mask, key_lengths, is_causal, causal_offset,
                                dropout_p, scale, seed, ctx.mask_grad, *ctx.cap)
        dmask = dmask.to(attn_mask.dtype) if ctx.mask_grad else None
        dsinks = None
        if ctx.needs_input_grad[4]:
            delta = torch.linalg.vecdot(dy.to(c.dtype), y.to(c.dtype))  # (B, H, Lq): rowsum(dy * y)
            # 1 - c is the sink's weight; summed over the rows a sink serves
            dsinks = ((c - 1) * delta).sum_to_size(_rows(sinks).shape).view(sinks.shape).to(sinks.dtype)
        return dq, dk, dv, dmask, dsinks, *nothing


def attention_with_sinks(name: str, q, k, v, attn_mask, sinks, key_lengths, is_causal: bool, causal_offset: int,
                         dropout_p: float, scale: float, seed: int, softcap: float = 0.0) -> torch.Tensor:
    """Backend ``name``'s attention with sink logits ``sinks``, (H,) or broadcastable to
    (B, H, Lq); the other arguments are the registered forward op's, already valid (a softcap
    only for a backend whose kernels cap, registry.softcaps). Returns (B, H, Lq, D)."""
    if name == "reference":  # the oracle computes the sinks as eager attention does
        return reference.ReferenceImpl.attention_with_sinks(
            q, k, v, attn_mask, sinks, key_lengths, is_causal, causal_offset, dropout_p, scale, seed, softcap)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, attn_mask, sinks)):
        # the forced backend is read here: dynamo cannot trace a context variable's read
        forced = None if torch.compiler.is_compiling() else current_forced_backend()
        return _SinkAttention.apply(q, k, v, attn_mask, sinks, key_lengths, is_causal, causal_offset, dropout_p,
                                    scale, seed, name, forced, softcap)
    fwd, _ = _ops(name)
    cap = (softcap,) if softcap else ()
    out, lse = fwd(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed, *cap)
    return _fold(out, lse, sinks)[0]

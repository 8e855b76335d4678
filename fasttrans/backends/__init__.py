"""Backends: which implementation runs an op, and its torch.library registration.

Three backends implement the same *backend interface* (below): ``triton`` (kernels/*.py),
``extension`` (csrc/, JIT-built by fasttrans.extension) and ``reference`` (pure PyTorch).
Each backend's ops are registered under the ``fasttrans::`` namespace as

    fasttrans::attention_fwd_<backend>   fasttrans::attention_bwd_<backend>
    fasttrans::norm_fwd_<backend>        fasttrans::norm_bwd_<backend>
    fasttrans::dropout_fwd_<backend>     fasttrans::dropout_bwd_<backend>

with a fake (meta) implementation and autograd, so ``torch.compile(fullgraph=True)`` traces
through them and ``torch.library.opcheck`` can test them. Python backends are defined with
``torch.library.custom_op`` (``registration``); the extension defines the same schemas in C++
(``TORCH_LIBRARY(fasttrans, m)``) and ``registration`` adds the fake and autograd parts.

Backend interface (inputs are already validated by fasttrans.functional)
-----------------------------------------------------------------------
attention_fwd(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed)
    -> (out (B, H, Lq, D) in q.dtype, lse (B, H, Lq) fp32 [fp64 for fp64 inputs])
    q (B, H, Lq, D), k/v (B, Hkv, Lk, D), each with stride(-1) == 1 (other strides arbitrary).
    attn_mask: None, or (B, H, Lq, Lk) bool (True = may attend) or float (q.dtype or fp32,
    added to the scaled scores); broadcast dims have stride 0 and must be read as such.
    key_lengths: None or contiguous int32 (B,) on q.device; values outside [0, Lk] (unchecked on a
        GPU, where reading them would synchronise) are clamped to it.
    Rows with no allowed key: out = 0, lse = +inf.
    softcap (a trailing argument, 0 when absent; only on the backends and devices of
    registry.SOFTCAP_DEVICES): > 0 replaces the scaled scores s by softcap * tanh(s / softcap)
    before the masks are applied.
    Dropout (dropout_p > 0): keep(b, h, i, j) is a pure function of (seed, b, h, i, j);
    probabilities are multiplied by keep / (1 - dropout_p) after the softmax.
attention_bwd(dout, q, k, v, out, lse, attn_mask, key_lengths, is_causal, causal_offset,
              dropout_p, scale, seed, mask_grad[, softcap]) -> (dq, dk, dv, dmask or None)
    dout contiguous. dk/dv have k/v's shape (summed over the query heads of a kv group).
    dmask (B, H, Lq, Lk) in fp32 [fp64 for fp64 inputs] when mask_grad (the gradient w.r.t.
    a float attn_mask).
attention_dropout_mask(q, k, dropout_p, seed) -> bool (B, H, Lq, Lk) keep-mask
    The exact mask attention_fwd uses for that seed: the debug hook the tests feed to
    fasttrans.reference. Every backend draws fasttrans.reference.attention_dropout_keep.
norm_fwd(x, residual, weight, bias, eps, rms) -> (y, h or None, mean or None, rstd)
    x, residual (M, N) with stride(-1) == 1; weight/bias (N,) in x.dtype or fp32, or None.
    h = x + residual (None when residual is None); y = LayerNorm(h) (RMSNorm when rms,
    then mean is None); mean/rstd (M,) fp32 [fp64 for fp64 inputs].
norm_infer(x, residual, weight, bias, eps, rms) -> (y, h or None, None, None)    [optional]
    norm_fwd without the statistics, for calls that record no backward.
norm_bwd(dy, dh, h, weight, bias, mean, rstd, rms) -> (dx, dweight or None, dbias or None)
    h is x + residual (or x); dy, dh contiguous; dh None or the gradient flowing into h,
    added to dx. dx is also the gradient w.r.t. residual.
dropout_fwd(x, p, seed) -> (y, keep)
    x contiguous, any shape; 0 < p < 1. keep: bool, x's shape; keep[i] is a pure function of
    (seed, flat index i) with P(keep) = 1 - p: Philox4x32-10 as csrc/philox.h defines it,
    the same mask on every backend, bit for bit. y = x * keep * scale with scale = 1 / (1 - p)
    as an fp32 number (fp64 for fp64 x), the product in fp32 (fp64), rounded once to x.dtype.
dropout_bwd(dy, keep, p) -> dx
    dy contiguous; dx = dy * keep * scale with the same rounding (keep is saved by forward,
    so backward draws no random numbers).

The package's modules, each one concern:

    registry       BACKENDS, selection (select_backend, use_backend, FASTTRANS_BACKEND)
    autograd       the ops' gradient formulas, second-order gradients, the eager route
    registration   the fasttrans:: ops of each backend: torch.library definitions and fakes
    common_case    the common case of a public norm or attention call, which fast entries take
    sinks          attention sinks on any backend's attention ops, from their (out, lse)
"""

from __future__ import annotations

from .autograd import BELOW_AUTOGRAD, eager_route, last_dim_unit_stride, selected_route
from .common_case import attention_tensors, norm_tensors
from .registration import dropout_ops_for, forward_op, inference_ops, ops_for
from .registry import (
    BACKEND_NAMES,
    BACKENDS,
    OPS,
    Backend,
    BackendUnavailableError,
    available_backends,
    current_forced_backend,
    get_backend,
    mask_helpers,
    reference_impl,
    select_backend,
    softcaps,
    use_backend,
)
from .sinks import attention_with_sinks

__all__ = [
    # selection, for users and the layers above
    "BACKENDS", "BACKEND_NAMES", "OPS", "Backend", "BackendUnavailableError", "available_backends", "get_backend",
    "select_backend", "use_backend", "current_forced_backend", "mask_helpers", "reference_impl",
    # the ops and routes fasttrans.functional calls
    "ops_for", "forward_op", "dropout_ops_for", "inference_ops", "eager_route", "selected_route",
    "last_dim_unit_stride", "BELOW_AUTOGRAD", "norm_tensors", "attention_tensors", "attention_with_sinks", "softcaps",
]

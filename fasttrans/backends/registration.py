"""torch.library registration: one set of ops per backend, with fake implementations and
autograd, so that torch.compile, torch.func and opcheck see them (see fasttrans.backends)."""

from __future__ import annotations

import torch
from torch.library import custom_op, register_autograd, register_fake

from .. import reference
from .autograd import BELOW_AUTOGRAD, _autograd_formulas
from .registry import BACKENDS, SOFTCAP_DEVICES

# --------------------------------------------------------------------------------------
# torch.library registration: one set of ops per backend
# --------------------------------------------------------------------------------------
def _none_to_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0) if t is None else t


def _empty_to_none(t: torch.Tensor) -> torch.Tensor | None:
    return None if t.numel() == 0 and t.dim() == 1 else t


def _make_python_ops(name: str):
    """Define fasttrans::{attention,norm}_{fwd,bwd}_<name> with torch.library.custom_op."""
    backend = BACKENDS[name]

    def _softcap(softcap: float) -> tuple:
        """The extra argument of a soft-capped call, for the implementations that take one."""
        if not softcap:
            return ()
        if name not in SOFTCAP_DEVICES:
            raise NotImplementedError(f"softcap: the {name} backend's attention kernels do not soft-cap scores "
                                      f"(fasttrans.attention runs such calls on a backend that does)")
        return (softcap,)

    @custom_op(f"fasttrans::attention_fwd_{name}", mutates_args=())
    def attention_fwd(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
        key_lengths: torch.Tensor | None, is_causal: bool, causal_offset: int, dropout_p: float,
        scale: float, seed: int, softcap: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = backend.impl().attention_fwd(
            q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed, *_softcap(softcap)
        )
        return out, lse

    @custom_op(f"fasttrans::attention_bwd_{name}", mutates_args=())
    def attention_bwd(
        dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, attn_mask: torch.Tensor | None, key_lengths: torch.Tensor | None,
        is_causal: bool, causal_offset: int, dropout_p: float, scale: float, seed: int, mask_grad: bool,
        softcap: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv, dmask = backend.impl().attention_bwd(
            dout, q, k, v, out, lse, attn_mask, key_lengths, is_causal, causal_offset,
            dropout_p, scale, seed, mask_grad, *_softcap(softcap),
        )
        return dq, dk, dv, _none_to_empty(dmask, q.new_empty(0, dtype=torch.float32))

    @custom_op(f"fasttrans::norm_fwd_{name}", mutates_args=())
    def norm_fwd(
        x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
        bias: torch.Tensor | None, eps: float, rms: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        y, h, mean, rstd = backend.impl().norm_fwd(x, residual, weight, bias, eps, rms)
        stats = x.new_empty(0, dtype=reference.accumulation_dtype(x))
        return y, _none_to_empty(h, x), _none_to_empty(mean, stats), rstd

    @custom_op(f"fasttrans::norm_bwd_{name}", mutates_args=())
    def norm_bwd(
        dy: torch.Tensor, dh: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor | None,
        bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor, rms: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dx, dw, db = backend.impl().norm_bwd(dy, dh, h, weight, bias, _empty_to_none(mean), rstd, rms)
        return dx, _none_to_empty(dw, h), _none_to_empty(db, h)

    @custom_op(f"fasttrans::dropout_fwd_{name}", mutates_args=())
    def dropout_fwd(x: torch.Tensor, p: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        y, keep = backend.impl().dropout_fwd(x, p, seed)
        return y, keep

    @custom_op(f"fasttrans::dropout_bwd_{name}", mutates_args=())
    def dropout_bwd(dy: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
        return backend.impl().dropout_bwd(dy, keep, p)



# The backward ops have no autograd of their own (a create_graph backward takes the
# reference's route), and the backward runs with gradients off. For ops defined in Python
# (torch.library.custom_op: the triton and reference backends) the autograd dispatch key
# would only redispatch, through a Python layer that costs more than many small ops, so
# eager calls go below it; the C++ ops' autograd fallback is cheaper than the guard.


def _skipping_autograd_key(op, backend: str):
    """op, called below the autograd dispatch key in eager mode for Python-defined ops."""
    if backend == "extension" or BELOW_AUTOGRAD is None:
        return op

    def call(*args):
        if torch.compiler.is_compiling():
            return op(*args)
        with BELOW_AUTOGRAD():
            return op(*args)

    return call


def _check_fake_devices(**tensors) -> None:
    """The fake implementations also run for a real call when one of its inputs is a meta
    tensor (the dispatcher then picks the Meta kernel): outputs shaped like a CPU input would
    be uninitialised CPU memory. Meta tensors must come alone (under torch.compile the fake
    tensors report their real devices and pass)."""
    present = {name: t for name, t in tensors.items() if t is not None}
    meta = [name for name, t in present.items() if t.is_meta]
    if meta and len(meta) != len(present):
        other = next(t.device for t in present.values() if not t.is_meta)
        raise RuntimeError(f"{meta[0]}: expected a tensor on {other} (the device of the other inputs), got meta")


def _register_fake_and_autograd(name: str) -> None:
    """Fake implementations and autograd formulas for one backend's four ops."""
    ns = torch.ops.fasttrans

    @register_fake(f"fasttrans::attention_fwd_{name}")
    def _(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed, softcap=0.0):
        _check_fake_devices(q=q, k=k, v=v, attn_mask=attn_mask, key_lengths=key_lengths)
        B, H, Lq, D = q.shape
        return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
            (B, H, Lq), dtype=reference.accumulation_dtype(q)
        )

    @register_fake(f"fasttrans::attention_bwd_{name}")
    def _(dout, q, k, v, out, lse, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed,
          mask_grad, softcap=0.0):
        _check_fake_devices(q=q, dout=dout, k=k, v=v, out=out, lse=lse, attn_mask=attn_mask, key_lengths=key_lengths)
        B, H, Lq, _ = q.shape
        dmask = q.new_empty((B, H, Lq, k.shape[2]) if mask_grad else (0,), dtype=reference.accumulation_dtype(q))
        return (torch.empty_like(q, memory_format=torch.contiguous_format),
                torch.empty_like(k, memory_format=torch.contiguous_format),
                torch.empty_like(v, memory_format=torch.contiguous_format), dmask)

    @register_fake(f"fasttrans::norm_fwd_{name}")
    def _(x, residual, weight, bias, eps, rms):
        _check_fake_devices(x=x, residual=residual, weight=weight, bias=bias)
        M = x.shape[0]
        stats = reference.accumulation_dtype(x)
        return (torch.empty_like(x, memory_format=torch.contiguous_format),
                torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x.new_empty(0),
                x.new_empty((M,) if not rms else (0,), dtype=stats),
                x.new_empty((M,), dtype=stats))

    @register_fake(f"fasttrans::norm_bwd_{name}")
    def _(dy, dh, h, weight, bias, mean, rstd, rms):
        _check_fake_devices(h=h, dy=dy, dh=dh, weight=weight, bias=bias, mean=mean, rstd=rstd)
        return (torch.empty_like(h, memory_format=torch.contiguous_format),
                torch.empty_like(weight) if weight is not None else h.new_empty(0),
                torch.empty_like(bias) if bias is not None else h.new_empty(0))

    @register_fake(f"fasttrans::dropout_fwd_{name}")
    def _(x, p, seed):
        return (torch.empty_like(x, memory_format=torch.contiguous_format),
                torch.empty_like(x, dtype=torch.bool, memory_format=torch.contiguous_format))

    @register_fake(f"fasttrans::dropout_bwd_{name}")
    def _(dy, keep, p):
        _check_fake_devices(dy=dy, keep=keep)
        return torch.empty_like(dy, memory_format=torch.contiguous_format)

    formulas = _autograd_formulas(
        name, *(_skipping_autograd_key(getattr(ns, f"{kind}_bwd_{name}"), name)
                for kind in ("attention", "norm", "dropout")))
    for kind, (setup, backward) in formulas.items():
        register_autograd(f"fasttrans::{kind}_fwd_{name}", backward, setup_context=setup)


_op_handles: dict[str, tuple] = {}  # per backend, once its ops are registered


def ops_for(name: str):
    """The torch.ops handles (attention_fwd, attention_bwd, norm_fwd, norm_bwd) of a backend.

    Registers them on first use. The extension's ops come from its C++ library (loaded by
    BACKENDS['extension'].impl()); Python backends are defined here.
    """
    handles = _op_handles.get(name)
    if handles is not None:
        return handles
    if name == "extension":
        BACKENDS[name].impl()  # loads the compiled library that defines the schemas
    else:
        _make_python_ops(name)
    _register_fake_and_autograd(name)
    ns = torch.ops.fasttrans
    handles = (getattr(ns, f"attention_fwd_{name}"), getattr(ns, f"attention_bwd_{name}"),
               getattr(ns, f"norm_fwd_{name}"), getattr(ns, f"norm_bwd_{name}"))
    _op_handles[name] = handles
    return handles


def forward_op(name: str, kind: str):
    """The registered forward op of backend ``name`` for ``kind`` ("attention", "norm",
    "dropout"): ``torch.ops.fasttrans.<kind>_fwd_<name>``, registered on first use."""
    op = _forward_ops.get((name, kind))
    if op is None:
        ops_for(name)
        op = _forward_ops[(name, kind)] = getattr(torch.ops.fasttrans, f"{kind}_fwd_{name}")
    return op


_forward_ops: dict[tuple[str, str], object] = {}
_inference_ops: tuple = ()  # the extension's whole-module inference ops, once registered


def inference_ops() -> tuple:
    """(``transformer_layer_fwd_extension``, ``multihead_attention_fwd_extension``,
    ``decoder_layer_step_fwd_extension``): the extension's inference forwards of one encoder
    or decoder layer, of one MultiheadAttention, and of one decoder layer's step of
    incremental decoding with a key/value cache, on the CPU (csrc/layer_cpu.cpp). Loads the
    extension and gives them their fake implementations on first use. They have no autograd
    formulas: callers use them only when no input needs a gradient."""
    global _inference_ops
    if not _inference_ops:
        ops_for("extension")

        @register_fake("fasttrans::transformer_layer_fwd_extension")
        def _(x, memory, weights, biases, norm_weights, norm_biases, norm_eps, self_mask, self_key_lengths,
              self_is_causal, cross_mask, cross_key_lengths, cross_is_causal, num_heads, activation, norm_first,
              seq_first):
            _check_fake_devices(x=x, memory=memory, self_mask=self_mask, cross_mask=cross_mask)
            return torch.empty_like(x, memory_format=torch.contiguous_format)

        @register_fake("fasttrans::multihead_attention_fwd_extension")
        def _(query, kv, in_weight, in_bias, out_weight, out_bias, attn_mask, key_lengths, is_causal, num_heads,
              seq_first, need_weights, average_weights):
            _check_fake_devices(query=query, kv=kv, attn_mask=attn_mask, key_lengths=key_lengths)
            out = torch.empty_like(query, memory_format=torch.contiguous_format)
            if not need_weights:
                return out, query.new_empty(0)
            keys = query if kv is None else kv
            N, L, S = (query.shape[1], query.shape[0], keys.shape[0]) if seq_first else \
                (query.shape[0], query.shape[1], keys.shape[1])
            return out, query.new_empty((N, L, S) if average_weights else (N, num_heads, L, S))

        @register_fake("fasttrans::decoder_layer_step_fwd_extension")
        def _(x, self_k, self_v, start, cross_k, cross_v, cross_mask, cross_key_lengths, weights, biases,
              norm_weights, norm_biases, norm_eps, num_heads, activation, norm_first):
            _check_fake_devices(x=x, self_k=self_k, self_v=self_v, cross_k=cross_k, cross_v=cross_v,
                                cross_mask=cross_mask, cross_key_lengths=cross_key_lengths)
            return torch.empty_like(x, memory_format=torch.contiguous_format)

        ns = torch.ops.fasttrans
        _inference_ops = (ns.transformer_layer_fwd_extension, ns.multihead_attention_fwd_extension,
                          ns.decoder_layer_step_fwd_extension)
    return _inference_ops


def dropout_ops_for(name: str):
    """The torch.ops handles (dropout_fwd, dropout_bwd) of a backend, registered on first use."""
    ops_for(name)
    ns = torch.ops.fasttrans
    return getattr(ns, f"dropout_fwd_{name}"), getattr(ns, f"dropout_bwd_{name}")

"""The public ops: validate once, classify masks, pick a backend, call its torch.library op.

Every check on user input lives here; backends and kernels assume valid inputs. Errors
name the argument and what was expected. Shape/value errors are ``ShapeError`` (a
ValueError that is also a RuntimeError, the type torch raises for the same mistakes) and
dtype errors ``DTypeError`` (a TypeError that is also a RuntimeError).
"""

from __future__ import annotations

import math
import warnings
from typing import Sequence

import torch
import torch.autograd.forward_ad as _fwAD

from . import backends
from .backends import mask_helpers, use_backend  # for the layers above: mask checks, backend control

__all__ = [
    "attention",
    "attention_dropout_mask",
    "attention_weights",
    "layer_norm",
    "add_layer_norm",
    "rms_norm",
    "dropout",
    "dropout_mask",
    "use_backend",
    "ShapeError",
    "DTypeError",
    "DeviceError",
]


class ShapeError(ValueError, RuntimeError):
    """An argument has the wrong shape or value."""


class DTypeError(TypeError, RuntimeError):
    """An argument has the wrong dtype."""


class DeviceError(ValueError, RuntimeError):
    """Arguments live on different devices."""


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_STRIDED = torch.strided
MAX_HEAD_DIM = 256


_is_compiling = torch.compiler.is_compiling


def _check_tensor(name: str, t, ndim: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    if ndim is not None and t.dim() != ndim:
        raise ShapeError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise DTypeError(f"{name}: expected float16, bfloat16, float32 or float64, got {t.dtype}")


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise DeviceError(f"{name}: expected a tensor on {device} (the device of the input), got {t.device}")


@torch.compiler.assume_constant_result
def _selected_backend(op: str, device: str, dtype: torch.dtype | None = None) -> str:
    # Selection reads a context variable, the environment and the file system: under
    # torch.compile it runs once at trace time and its result is baked into the graph.
    name = backends.select_backend(op, device, dtype).name
    backends.ops_for(name)  # register now: registering a fake implementation inside a trace breaks the graph
    return name


# Eager calls skip the registered ops: reaching a torch.library op's Python implementation
# through the dispatcher costs more host time than a small kernel runs. Without a gradient
# they call the backend's implementation directly; with one, an autograd.Function holding
# the op's own formulas (backends.eager_route). torch.compile, torch.func transforms,
# dispatch modes (FakeTensorMode, ...) and tensor subclasses (DTensor, ...) see the
# registered ops, which stay what opcheck tests.
_functorch = torch._C._functorch
_current_level = _functorch.maybe_current_level  # the innermost torch.func transform's level, or None
_INF = math.inf
_dispatch_stack_len = getattr(torch._C, "_len_torch_dispatch_stack", None)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_grad_enabled = torch.is_grad_enabled


def _run(kind: str, device: torch.device, dtype: torch.dtype, grad_inputs: tuple, *args):
    """The ``kind`` forward ("attention", "norm", "dropout") of the backend selected for
    (device, dtype), on args (the registered op's arguments), recording its backward when
    one of grad_inputs needs a gradient. Absent outputs come back as None or empty tensors."""
    if _is_compiling():
        return backends.forward_op(_selected_backend(kind, str(device), dtype), kind)(*args)
    name, forward, function, _, _ = backends.selected_route(kind, device, dtype)
    # Under torch.func.vmap a batched input reports requires_grad=False even when the
    # tensor it wraps needs a gradient: only the op's own autograd kernel sees the truth.
    if _dispatch_stack_len is None or _functorch.maybe_current_level() is not None or _dispatch_stack_len():
        return backends.forward_op(name, kind)(*args)
    needs_grad = False
    grad = _grad_enabled()
    for t in grad_inputs:
        if t is not None:
            if type(t) not in _PLAIN_TENSORS:
                return backends.forward_op(name, kind)(*args)
            if grad and t.requires_grad:
                needs_grad = True
    return function(*args) if needs_grad else forward(*args)


# torch.func transforms and forward-mode AD. The ops' autograd is registered with
# torch.library, which serves torch.autograd only: a tangent passed through an op is dropped
# (it would read as a zero derivative), and torch.func.grad / jacrev raise inside it. Calls
# under such a transform are computed by the reference implementation instead, whose
# PyTorch ops every transform can differentiate (eager only; vmap alone keeps the kernels).
_reference = backends.reference_impl()  # the reference's whole-op forms, plain PyTorch
_reference_warned: set[str] = set()  # the keys of the fallbacks that have warned


def _fall_back_to_reference(key: str, what: str, why: str) -> None:
    """``what`` runs on the reference implementation because ``why``: automatic selection
    warns once per ``key``; a forced kernel backend raises instead."""
    forced = backends.current_forced_backend()
    if forced not in (None, "reference"):
        raise backends.BackendUnavailableError(
            f"backend '{forced}' was requested for {what}, but {why}; use the reference backend "
            "(fasttrans.use_backend('reference')) there"
        )
    if forced is None and key not in _reference_warned and not _is_compiling():
        _reference_warned.add(key)
        warnings.warn(f"fasttrans: {what} runs on the reference (pure PyTorch) implementation: {why}",
                      RuntimeWarning, stacklevel=4)


def _under_autodiff_transform(*tensors) -> bool:
    """Whether any of tensors is differentiated by torch.func (grad, jacrev, jvp, jacfwd) or carries a forward-mode tangent."""
    if _functorch.maybe_current_level() is None and getattr(_fwAD, "_current_level", 0) < 0:
        return False  # no transform and no dual level is active: the common case, kept cheap
    if _is_compiling():
        return False
    return any(
        t is not None and (_functorch.is_gradtrackingtensor(t) or _fwAD.unpack_dual(t).tangent is not None)
        for t in tensors
    )


def _on_reference_under_transform(op: str, *tensors) -> bool:
    """Whether ``op`` on these inputs runs on the reference because a transform differentiates them."""
    if _functorch.maybe_current_level() is None and getattr(_fwAD, "_current_level", 0) < 0:
        return False  # the common case, without a call
    if not _under_autodiff_transform(*tensors):
        return False
    _fall_back_to_reference(op, f"{op} under torch.func.grad/jacrev/jvp/jacfwd or forward-mode AD",
                            "the fused kernels' autograd serves torch.autograd only")
    return True


def _on_reference_for_head_dim(D: int) -> bool:
    """Whether attention with head dim ``D`` runs on the reference: the kernels stop at MAX_HEAD_DIM."""
    if D <= MAX_HEAD_DIM:
        return False
    _fall_back_to_reference(f"head dim {D}", f"attention with head dim {D}",
                            f"the fused kernels support head dims up to {MAX_HEAD_DIM} (the reference "
                            "materialises the (Lq, Lk) scores)")
    return True


def _draw_seed(dropout_p: float) -> int:
    """A dropout seed drawn from torch's default CPU generator (so torch.manual_seed governs it)."""
    if dropout_p == 0.0:
        return 0
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


# --------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------
def _common_attention_args(q, k, v, is_causal, causal_offset, dropout_p, scale) -> bool:
    """Whether q, k, v and the scalars are the common, valid case (strided 4-D float tensors
    of one dtype and device with matching shapes, plain bool/int/float scalars in range).
    Like :func:`_common_norm_args` it vouches only for what it checks; anything else takes
    the detailed checks, which say which argument is wrong."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return False
    if not (q.layout == torch.strided and k.layout == torch.strided and v.layout == torch.strided
            and q.dim() == 4 and k.dim() == 4):
        return False
    dtype, device = q.dtype, q.device
    if dtype not in _FLOAT_DTYPES or k.dtype != dtype or v.dtype != dtype or k.device != device or v.device != device:
        return False
    B, H, _, D = q.shape
    kshape = k.shape
    if v.shape != kshape or kshape[0] != B or kshape[3] != D or D < 1 or kshape[1] == 0 or H % kshape[1] != 0:
        return False
    return (type(is_causal) is bool and type(causal_offset) is int and type(dropout_p) in (float, int)
            and 0.0 <= dropout_p <= 1.0 and (scale is None or (type(scale) in (float, int) and math.isfinite(scale))))


def _validate_attention(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale):
    if not _common_attention_args(q, k, v, is_causal, causal_offset, dropout_p, scale):
        _validate_attention_operands(q, k, v)
        _validate_attention_scalars(is_causal, causal_offset, dropout_p, scale)
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    if attn_mask is not None:
        _check_tensor("attn_mask", attn_mask)
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            raise DTypeError(f"attn_mask: expected a bool or floating-point mask, got {attn_mask.dtype}")
        _check_device("attn_mask", attn_mask, q.device)
        target = (B, H, Lq, Lk)
        shape = tuple(attn_mask.shape)
        if len(shape) > 4 or any(s not in (1, t) for s, t in zip(shape[::-1], target[::-1])):
            raise ShapeError(f"attn_mask: expected a shape broadcastable to (B, H, Lq, Lk) = {target}, got {shape}")
    if key_lengths is not None:
        _check_tensor("key_lengths", key_lengths, 1)
        if key_lengths.dtype.is_floating_point or key_lengths.dtype in (torch.bool, torch.complex64, torch.complex128):
            raise DTypeError(f"key_lengths: expected an integer tensor, got {key_lengths.dtype}")
        if key_lengths.shape[0] != B:
            raise ShapeError(f"key_lengths: expected shape ({B},), got {tuple(key_lengths.shape)}")
        if key_lengths.device.type != "cpu":
            _check_device("key_lengths", key_lengths, q.device)
        # Lengths on the host are checked; lengths on a device are not read (that would
        # synchronise every call): the kernels clamp them to [0, Lk], as the reference's masks do.
        if not _is_compiling() and B > 0 and key_lengths.device.type == "cpu":
            if B <= 64:  # a few values: reading them is cheaper than a reduction
                values = key_lengths.tolist()
                lo, hi = min(values), max(values)
            else:
                lo, hi = (int(t) for t in torch.stack(torch.aminmax(key_lengths)).tolist())
            if lo < 0 or hi > Lk:
                raise ShapeError(f"key_lengths: expected values in [0, {Lk}] (the key length), got [{lo}, {hi}]")


def _validate_attention_operands(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 4)
        _check_float(name, t)
    B, H, _, D = q.shape
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise DTypeError(f"k, v: expected the dtype of q ({q.dtype}), got k {k.dtype} and v {v.dtype}")
    _check_device("k", k, q.device)
    _check_device("v", v, q.device)
    if k.shape[0] != B or v.shape[0] != B:
        raise ShapeError(f"k, v: expected batch size {B} (from q), got k {tuple(k.shape)} and v {tuple(v.shape)}")
    Hkv = k.shape[1]
    if tuple(v.shape[:3]) != tuple(k.shape[:3]) or v.shape[3] < 1:
        raise ShapeError(f"v: expected the shape of k {tuple(k.shape)} but for its head dim (at least 1), got "
                         f"{tuple(v.shape)}")
    if k.shape[3] != D:
        raise ShapeError(f"k: expected head dim {D} (from q), got shape {tuple(k.shape)}")
    if (Hkv == 0 and H != 0) or (Hkv != 0 and H % Hkv != 0):  # no heads at all (H = Hkv = 0) is empty
        raise ShapeError(f"k: number of kv heads ({Hkv}) must divide the number of query heads ({H})")
    if D < 1:
        raise ShapeError(f"q: expected a head dim of at least 1, got shape {tuple(q.shape)}")


def _type_name(value) -> str:
    """The type of value as an error message names it: ``numpy.bool``, not a bare ``bool``."""
    t = type(value)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _validate_attention_scalars(is_causal, causal_offset, dropout_p, scale) -> None:
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal: expected a bool, got {_type_name(is_causal)}")
    if isinstance(causal_offset, bool) or not isinstance(causal_offset, int):
        raise TypeError(f"causal_offset: expected an int, got {_type_name(causal_offset)}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= float(dropout_p) <= 1.0:
        raise ShapeError(f"dropout_p: expected a probability in [0, 1], got {dropout_p!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale: expected a finite float or None, got {_type_name(scale)}")
    if scale is not None and not math.isfinite(scale):
        raise ShapeError(f"scale: expected a finite float or None, got {scale!r}")


def _causal_offset(causal_offset: int, q: torch.Tensor, k: torch.Tensor) -> int:
    """causal_offset clamped to [-Lq, Lk]: the same masks (past Lk - 1 every query sees every
    key, at -Lq or below none sees any), in the int64 range the ops take."""
    return max(-q.shape[2], min(causal_offset, k.shape[2]))


def _prepare_attention(q, k, v, attn_mask, key_lengths, scale):
    """Canonical operands for the backend interface (see fasttrans.backends)."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    unit = backends.last_dim_unit_stride
    q, k, v = unit(q), unit(k), unit(v)
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in (q.dtype, torch.float32):
            attn_mask = attn_mask.to(q.dtype)
        # a view with stride 0 on broadcast dims: never materialised
        attn_mask = attn_mask.expand(B, H, Lq, Lk)
    if key_lengths is not None and (key_lengths.dtype != torch.int32 or key_lengths.device != q.device
                                    or not key_lengths.is_contiguous()):
        # contiguous: an int32 view (a column of a table, an expanded scalar) keeps its strides through .to
        key_lengths = key_lengths.to(device=q.device, dtype=torch.int32).contiguous()
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    return q, k, v, attn_mask, key_lengths, scale


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    key_lengths: torch.Tensor | None = None,
    is_causal: bool = False,
    causal_offset: int = 0,
    dropout_p: float = 0.0,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with every mask kind, fused where a kernel exists.

    Args:
        q: (B, H, Lq, D) queries.
        k, v: (B, Hkv, Lk, D) keys and values; H must be a multiple of Hkv (grouped-query).
            v may have another head dim Dv (multi-head latent attention's 192 / 128): the
            smaller side is padded with zeros to the larger (one copy; the scores and the
            default scale stay those of D), and the output has Dv (then a view of the
            padded result).
        attn_mask: bool (True = may attend, as in F.scaled_dot_product_attention) or float
            (added to the scores), broadcastable to (B, H, Lq, Lk).
        key_lengths: (B,) integers; key positions >= key_lengths[b] are masked. Values
            must lie in [0, Lk]: on the CPU they are checked (``ShapeError``); on a GPU they
            are not read on the host, which would synchronise, and the kernels clamp them
            to [0, Lk].
        is_causal: query i attends keys j <= i + causal_offset.
        causal_offset: diagonal offset; Lk - Lq gives bottom-right alignment (decoding).
        dropout_p: dropout probability on the attention weights (1 drops every weight: zeros).
        scale: score scale; default 1/sqrt(D).
        sinks: (H,) float, one attention-sink logit per query head (gpt-oss's), or one per
            query row, broadcastable to (B, H, Lq): it joins the row's softmax, after the
            scale and the masks, and its weight goes to no value; it gets a gradient. Any
            backend: the kernels' output and log-sum-exp are rescaled by the sink's share,
            and their backward takes the rescaled gradient.
        softcap: > 0 soft-caps the scaled scores before the masks, as Gemma 2 does:
            softcap * tanh(s / softcap); None or 0 leaves them as they are. Every backend's
            kernels compute it, forward and backward, with sinks too.

    Returns:
        (B, H, Lq, Dv) in q's dtype. A query with no allowed key gets 0 (and zero gradients).
    """
    if softcap is not None:
        softcap = _validated_softcap(softcap)
    if sinks is not None or softcap:
        _validate_attention(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale)
        if sinks is not None:
            _validate_sinks(sinks, q)
        if v.shape[3] != k.shape[3]:
            return _attention_other_value_dim(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p,
                                              scale, sinks, softcap)
        return attention_prevalidated(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale,
                                      sinks, softcap)
    if (type(dropout_p) is float and 0.0 <= dropout_p < 1.0 and type(q) in _PLAIN_TENSORS and not _is_compiling()
            and _functorch.maybe_current_level() is None and getattr(_fwAD, "_current_level", 0) < 0
            and _dispatch_stack_len is not None and not _dispatch_stack_len() and q.dtype in _FLOAT_DTYPES):
        try:
            common = backends.selected_route("attention", q.device, q.dtype)[4]
        except (backends.BackendUnavailableError, ValueError):  # the general route says so, after its checks
            common = None
        if common is not None:  # the backend checks the rest of the common case and runs it natively
            if dropout_p == 0.0:
                out = common(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, scale, MAX_HEAD_DIM)
            else:  # where the backend takes dropout there (the Triton sites), it draws the seed once it runs
                with_dropout = getattr(common, "dropout", None)
                out = None if with_dropout is None else with_dropout(
                    q, k, v, attn_mask, key_lengths, is_causal, causal_offset, scale, MAX_HEAD_DIM, dropout_p,
                    _draw_seed)
            if out is not None:
                return out[0]
    _validate_attention(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale)
    if v.shape[3] != k.shape[3]:  # the common entries above take one head dim and refuse this call
        return _attention_other_value_dim(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p,
                                          scale, None, None)
    return attention_prevalidated(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale)


def _attention_other_value_dim(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, sinks,
                               softcap):
    """Attention whose values have another head dim than the queries and keys: the kernels
    take one head dim, so the smaller side gets zeros up to the larger, which change no score
    (the scale stays that of q's head dim) and no output column kept."""
    D, Dv = q.shape[3], v.shape[3]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if Dv < D:
        v = torch.nn.functional.pad(v, (0, D - Dv))
    else:
        q, k = torch.nn.functional.pad(q, (0, Dv - D)), torch.nn.functional.pad(k, (0, Dv - D))
    out = attention_prevalidated(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, sinks,
                                 softcap)
    return out[..., :Dv] if Dv < D else out  # a view: callers that merge the heads copy it once anyway


def _validated_softcap(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap: expected a finite float > 0, 0 or None, got {_type_name(softcap)}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ShapeError(f"softcap: expected a finite float > 0, 0 or None, got {softcap!r}")
    return float(softcap)


def _validate_sinks(sinks, q) -> None:
    _check_tensor("sinks", sinks)
    _check_float("sinks", sinks)
    _check_device("sinks", sinks, q.device)
    B, H, Lq, _ = q.shape
    rows = sinks.dim() == 3 and all(s in (1, t) for s, t in zip(sinks.shape, (B, H, Lq)))
    if not (rows or tuple(sinks.shape) == (H,)):
        raise ShapeError(f"sinks: expected one logit per query head, shape ({H},), or per query row, a shape "
                         f"broadcastable to (B, H, Lq) = {(B, H, Lq)}, got {tuple(sinks.shape)}")


def attention_prevalidated(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, sinks=None,
                           softcap=None):
    """:func:`attention` with positional arguments that are valid by construction, without
    the checks that would cost every call again: the entry point of the layers above
    (``fasttrans.nn`` and ``fasttrans.models`` build the arguments after their own checks).
    Not for users: invalid arguments here are not reported."""
    if dropout_p == 1.0:  # every weight dropped, as torch allows: zeros that keep the graph (zero gradients)
        return attention_prevalidated(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, 0.0, scale,
                                      sinks, softcap) * 0.0
    B, H, Lq, D = q.shape
    # clamped to [-Lq, Lk]: the same masks (past Lk - 1 every query sees every key, at -Lq
    # or below none sees any), in the int64 range the ops take
    causal_offset = max(-Lq, min(causal_offset, k.shape[2]))
    if softcap:
        return _attention_softcapped(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale,
                                     sinks, softcap)
    if sinks is not None:
        return _attention_with_sinks(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale,
                                     sinks)
    if (attn_mask is None and type(q) in _PLAIN_TENSORS and type(k) in _PLAIN_TENSORS and type(v) in _PLAIN_TENSORS
            and B and H and Lq and D <= MAX_HEAD_DIM and q.stride(3) == 1 and k.stride(3) == 1 and v.stride(3) == 1
            and not _is_compiling() and _functorch.maybe_current_level() is None
            and getattr(_fwAD, "_current_level", 0) < 0 and _dispatch_stack_len is not None
            and not _dispatch_stack_len()):
        # the common eager call without a dense mask, in one frame (the general route below
        # gives the same result through its preparation, fallbacks and _run)
        device = q.device
        if key_lengths is None or (key_lengths.dtype == torch.int32 and key_lengths.device == device
                                   and key_lengths.is_contiguous() and type(key_lengths) in _PLAIN_TENSORS):
            scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
            seed = 0 if dropout_p == 0.0 else _draw_seed(dropout_p)
            _, forward, function, native, common = backends.selected_route("attention", device, q.dtype)
            args = (q, k, v, None, key_lengths, is_causal, causal_offset, float(dropout_p), scale, seed)
            if native is not None:  # the backend's native entry records the gradient when one is needed
                return native(*args)[0]
            if common is not None:  # launch sites (the Triton kernels')
                if dropout_p == 0.0:
                    out = common(q, k, v, None, key_lengths, is_causal, causal_offset, scale, MAX_HEAD_DIM)
                else:  # the seed drawn above: the route below uses it too if the site refuses the call
                    with_dropout = getattr(common, "dropout", None)
                    out = None if with_dropout is None else with_dropout(
                        q, k, v, None, key_lengths, is_causal, causal_offset, scale, MAX_HEAD_DIM, float(dropout_p),
                        lambda p: seed)
                if out is not None:
                    return out[0]
            if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
                return function(*args)[0]
            return forward(*args)[0]
    if attn_mask is None and key_lengths is None and q.stride(3) == 1 and k.stride(3) == 1 and v.stride(3) == 1:
        scale = 1.0 / math.sqrt(D) if scale is None else float(scale)  # nothing else to prepare
    else:
        q, k, v, attn_mask, key_lengths, scale = _prepare_attention(q, k, v, attn_mask, key_lengths, scale)
    seed = 0 if dropout_p == 0.0 else _draw_seed(dropout_p)
    # empty outputs (no batch, head or query) need no kernel; the reference's PyTorch ops
    # give them, and their (zero) gradients, for any input shape
    if (q.numel() == 0 or _on_reference_for_head_dim(D)
            or _on_reference_under_transform("attention", q, k, v, attn_mask)):
        return backends.reference_impl().attention_fwd(
            q, k, v, attn_mask, key_lengths, is_causal, causal_offset, float(dropout_p), scale, seed)[0]
    return _run("attention", q.device, q.dtype, (q, k, v, attn_mask), q, k, v, attn_mask, key_lengths, is_causal,
                causal_offset, float(dropout_p), scale, seed)[0]


def _attention_softcapped(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, sinks,
                          softcap):
    """Attention with soft-capped scores on a backend whose kernels cap them (backends.softcaps),
    through its eager route as any call (:func:`_run`; with sinks, backends.attention_with_sinks),
    else on the reference's PyTorch ops."""
    q, k, v, attn_mask, key_lengths, scale = _prepare_attention(q, k, v, attn_mask, key_lengths, scale)
    seed = 0 if dropout_p == 0.0 else _draw_seed(dropout_p)
    args = (q, k, v, attn_mask, key_lengths, is_causal, causal_offset, float(dropout_p), scale, seed)
    name = (_selected_backend("attention", str(q.device), q.dtype) if _is_compiling()
            else backends.select_backend("attention", q.device, q.dtype).name)
    fused = backends.softcaps(name, q.device)
    if not fused and name != "reference":
        _fall_back_to_reference("soft-capped attention", f"soft-capped attention on {q.device.type}",
                                f"the {name} backend's kernels do not soft-cap scores")
    # sinks under any torch.func transform: the reference, as _attention_with_sinks decides
    if (not fused or q.numel() == 0 or _on_reference_for_head_dim(q.shape[3])
            or (sinks is not None and _functorch.maybe_current_level() is not None)
            or _on_reference_under_transform("attention", q, k, v, attn_mask, sinks)):
        if sinks is not None:
            return backends.reference_impl().attention_with_sinks(q, k, v, attn_mask, sinks, *args[4:], softcap)
        return backends.reference_impl().attention_fwd(*args, softcap)[0]
    if sinks is not None:
        return backends.attention_with_sinks(name, q, k, v, attn_mask, sinks, *args[4:], softcap)
    return _run("attention", q.device, q.dtype, (q, k, v, attn_mask), *args, softcap)[0]


def _attention_with_sinks(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, sinks):
    q, k, v, attn_mask, key_lengths, scale = _prepare_attention(q, k, v, attn_mask, key_lengths, scale)
    seed = 0 if dropout_p == 0.0 else _draw_seed(dropout_p)
    args = (q, k, v, attn_mask, sinks, key_lengths, is_causal, causal_offset, float(dropout_p), scale, seed)
    # under any torch.func transform (vmap too, where a batched input hides its requires_grad
    # from the route below) the reference's PyTorch ops keep the graph
    if (q.numel() == 0 or _on_reference_for_head_dim(q.shape[3]) or _functorch.maybe_current_level() is not None
            or _on_reference_under_transform("attention", q, k, v, attn_mask, sinks)):
        return backends.reference_impl().attention_with_sinks(*args)
    name = (_selected_backend("attention", str(q.device), q.dtype) if _is_compiling()
            else backends.select_backend("attention", q.device, q.dtype).name)
    return backends.attention_with_sinks(name, *args)


def attention_dropout_mask(
    q: torch.Tensor,
    k: torch.Tensor,
    dropout_p: float,
) -> torch.Tensor:
    """Debug hook: the (B, H, Lq, Lk) keep-mask the next ``attention`` call would use.

    Draws the dropout seed exactly as :func:`attention` does, so
    ``torch.manual_seed(s); keep = attention_dropout_mask(q, k, p)`` followed by
    ``torch.manual_seed(s); out = attention(q, k, v, dropout_p=p)`` gives the mask that
    ``out`` was computed with, on the backend the call selects.
    """
    _check_tensor("q", q, 4)
    _check_tensor("k", k, 4)
    if not 0.0 < float(dropout_p) < 1.0:
        raise ShapeError(f"dropout_p: expected a probability in (0, 1), got {dropout_p!r}")
    name = (_selected_backend("attention", str(q.device), q.dtype) if _is_compiling()
            else backends.select_backend("attention", q.device, q.dtype).name)
    return backends.get_backend(name).impl().attention_dropout_mask(q, k, float(dropout_p), _draw_seed(dropout_p))


def attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    key_lengths: torch.Tensor | None = None,
    is_causal: bool = False,
    causal_offset: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """The (B, H, Lq, Lk) softmax weights, materialised, for callers that ask for them.

    This is the unfused path (``need_weights=True`` in MultiheadAttention): it allocates the
    full score matrix. Fully masked rows are 0. Differentiable through autograd.
    """
    v = k  # only k's shape matters here
    _validate_attention(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, 0.0, scale)
    causal_offset = _causal_offset(causal_offset, q, k)
    q, k, _, attn_mask, key_lengths, scale = _prepare_attention(q, k, v, attn_mask, key_lengths, scale)
    return _reference.attention_probs(
        q, k, attn_mask=attn_mask, key_lengths=key_lengths, is_causal=is_causal,
        causal_offset=causal_offset, scale=scale,
    ).to(q.dtype)


# --------------------------------------------------------------------------------------
# norms
# --------------------------------------------------------------------------------------
def _normalized_shape(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, int) and not isinstance(normalized_shape, bool):
        return (normalized_shape,)
    if isinstance(normalized_shape, Sequence) and not isinstance(normalized_shape, str):
        if all(isinstance(s, int) and not isinstance(s, bool) for s in normalized_shape):
            return tuple(normalized_shape)
    raise TypeError(f"normalized_shape: expected an int or a sequence of ints, got {type(normalized_shape).__name__}")


def _single_dim(normalized_shape) -> int | None:
    """normalized_shape's one size when it names a single (last) dim, else None."""
    if type(normalized_shape) is int:
        return normalized_shape
    if type(normalized_shape) in (tuple, list, torch.Size) and len(normalized_shape) == 1:
        n = normalized_shape[0]
        return n if type(n) is int else None
    return None


def _common_norm_args(x, n, weight, bias, eps, residual) -> bool:
    """Whether the arguments are the common, valid case: a strided float x whose last dim is
    n, 1-D (n,) weight/bias on x's device in x's dtype (or float32 with a float16/bfloat16
    x), a residual like x and a float eps. It vouches only for what it checks: anything else
    takes the detailed checks (:func:`_validate_norm_in_detail`), which say which argument is wrong.
    Those cost several microseconds, as much as normalising a short row."""
    if not (isinstance(x, torch.Tensor) and x.layout is _STRIDED and x.dim() >= 1 and x.shape[-1] == n
            and type(eps) is float and 0.0 <= eps < math.inf):
        return False
    dtype = x.dtype
    if dtype not in _FLOAT_DTYPES:
        return False
    if weight is None and bias is None and residual is None:
        return True
    device = x.device
    if weight is not None and not _common_param(weight, n, dtype, device):
        return False
    if bias is not None and not (_common_param(bias, n, dtype, device)
                                 and (weight is None or weight.dtype == bias.dtype)):
        return False
    return residual is None or (
        isinstance(residual, torch.Tensor) and residual.layout is _STRIDED and residual.dtype == dtype
        and residual.shape == x.shape and residual.device == device)


def _common_param(p, n: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a norm's weight or bias is a strided (n,) tensor on device in dtype (or float32
    with a float16/bfloat16 x)."""
    return (isinstance(p, torch.Tensor) and p.layout is _STRIDED and p.dim() == 1 and p.shape[0] == n
            and (p.dtype == dtype or (p.dtype == torch.float32 and dtype in _LOW_PRECISION)) and p.device == device)


def _validate_norm(x, normalized_shape, weight, bias, eps, residual=None, eps_may_be_none=False,
                   layer_norm_dtypes=True):
    """The normalized shape, once the arguments are checked: the common case through
    :func:`_common_norm_args`, anything else in detail. ``layer_norm_dtypes``: the
    parameters follow F.layer_norm's dtype rule (layer_norm, add_layer_norm)."""
    n = _single_dim(normalized_shape)
    if n is not None and _common_norm_args(x, n, weight, bias, eps, residual):
        return (n,)
    shape = _validate_norm_in_detail(x, normalized_shape, weight, bias, eps, residual, eps_may_be_none)
    if layer_norm_dtypes:
        _check_layer_norm_param_dtypes(x, weight, bias)
    return shape


def _validate_norm_in_detail(x, normalized_shape, weight, bias, eps, residual=None, eps_may_be_none=False):
    _check_tensor("x", x)
    _check_float("x", x)
    shape = _normalized_shape(normalized_shape)
    if len(shape) == 0 or x.dim() < len(shape) or tuple(x.shape[-len(shape):]) != shape:
        raise ShapeError(
            f"normalized_shape: expected the trailing dims of x, got {shape} for x of shape {tuple(x.shape)}"
        )
    if residual is not None:
        _check_tensor("residual", residual)
        if tuple(residual.shape) != tuple(x.shape):
            raise ShapeError(f"residual: expected the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
        if residual.dtype != x.dtype:
            raise DTypeError(f"residual: expected the dtype of x ({x.dtype}), got {residual.dtype}")
        _check_device("residual", residual, x.device)
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        _check_tensor(name, p)
        _check_float(name, p)
        if tuple(p.shape) != shape:
            raise ShapeError(f"{name}: expected shape {shape} (normalized_shape), got {tuple(p.shape)}")
        _check_device(name, p, x.device)
    if eps is None:
        if not eps_may_be_none:
            raise TypeError("eps: expected a finite non-negative float, got None")
    elif isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or not math.isfinite(eps):
        raise ShapeError(f"eps: expected a finite non-negative float, got {eps!r}")
    return shape


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_layer_norm_param_dtypes(x, weight, bias, x_name: str = "x") -> None:
    """The dtypes F.layer_norm accepts: parameters in x's dtype, or float32 ones with a
    float16/bfloat16 x (mixed precision), weight and bias alike."""
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.dtype != x.dtype and not (p.dtype == torch.float32 and x.dtype in _LOW_PRECISION):
            allowed = f"{x.dtype}{' or torch.float32' if x.dtype in _LOW_PRECISION else ''}"
            raise DTypeError(f"{name}: expected dtype {allowed} (from {x_name}), got {p.dtype}")
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise DTypeError(f"bias: expected the dtype of weight ({weight.dtype}), got {bias.dtype}")


# The norms are called once per layer with small rows in decoding loops: the glue below
# skips the reshapes and views that would be identities (each costs about a microsecond).
def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """(M, N) view of t (a copy only when the trailing dims cannot be flattened)."""
    if t.dim() != 2 or t.shape[1] != n:
        t = t.reshape(-1, n)
    return backends.last_dim_unit_stride(t)


def _param(p: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    if p is None:
        return None
    if p.dim() != 1:
        p = p.reshape(-1)
    return p if p.dtype in (x.dtype, torch.float32) else p.to(x.dtype)


def _norm(x, residual, weight, bias, eps, rms, n):
    rows = x.dim() == 2 and x.shape[1] == n  # x is its own (M, N) view
    dtype = x.dtype
    y, h, _mean, _rstd = _run(
        "norm", x.device, dtype, (x, residual, weight, bias),
        x if rows and x.stride(1) == 1 else _rows(x, n), None if residual is None else _rows(residual, n),
        weight if weight is None or (weight.dtype == dtype and weight.dim() == 1) else _param(weight, x),
        bias if bias is None or (bias.dtype == dtype and bias.dim() == 1) else _param(bias, x),
        float(eps), rms,
    )
    return _norm_outputs(y, h, residual, rows, x)


def _norm_outputs(y, h, residual, rows: bool, x):
    """(y, h or None) in x's shape, from the (M, N) rows a norm op returned."""
    if residual is None:
        h = None
    if not rows:
        # view_as: a view to a torch.Size costs several times as much
        y = y.view_as(x)
        h = None if h is None else h.view_as(x)
    return y, h


def _norm_fast(x, residual, weight, bias, eps, rms: bool, n):
    """(y, h or None) of a norm call in the common case, or None for any other call, which
    the general route takes (and reports, when it is invalid). The common case: plain
    contiguous tensors of one float dtype and device with x's last dim n, (n,) parameters, a
    float eps, eager mode with no torch.func transform, forward-AD level or dispatch mode
    (the tensors as fasttrans.backends.norm_tensors takes them). Its result is the general
    route's. A backend with an entry for the common case (the extension's in
    csrc/eager.cpp, the Triton kernels' launch sites) checks the tensors itself. ``n``: the
    size, or a normalized_shape that must name one dim."""
    if (type(x) not in _PLAIN_TENSORS or type(eps) is not float or not 0.0 <= eps < _INF or _is_compiling()
            or _current_level() is not None or _fwAD._current_level >= 0
            or _dispatch_stack_len is None or _dispatch_stack_len()):
        return None
    if type(n) is not int:
        n = _single_dim(n)
        if n is None:
            return None
    dtype = x.dtype
    if dtype not in _FLOAT_DTYPES:
        return None
    device = x.device
    try:
        _, forward, function, _, common = backends.selected_route("norm", device, dtype)
    except (backends.BackendUnavailableError, ValueError):  # the general route says so, after its checks
        return None
    if common is not None:  # the backend checks the rest and runs the call natively
        return common(x, residual, weight, bias, eps, rms, n)
    if not backends.norm_tensors(x, residual, weight, bias, n):
        return None
    rows = x.dim() == 2
    x_rows, r_rows = x, residual
    if not rows:
        x_rows = x.view(-1, n)
        r_rows = None if residual is None else residual.view(-1, n)
    if _grad_enabled() and (x.requires_grad or (residual is not None and residual.requires_grad)
                            or (weight is not None and weight.requires_grad)
                            or (bias is not None and bias.requires_grad)):
        y, h, _, _ = function(x_rows, r_rows, weight, bias, eps, rms)
    else:
        y, h, _, _ = forward(x_rows, r_rows, weight, bias, eps, rms)
    return _norm_outputs(y, h, residual, rows, x)


def layer_norm(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Same as ``torch.nn.functional.layer_norm``; statistics in fp32."""
    out = _norm_fast(x, None, weight, bias, eps, False, normalized_shape)
    if out is not None:
        return out[0]
    shape = _validate_norm(x, normalized_shape, weight, bias, eps)
    if x.numel() == 0:  # nothing to normalise: empty outputs, as torch returns
        return _reference.layer_norm(x, shape, weight, bias, eps)
    if _on_reference_under_transform("layer_norm", x, weight, bias):
        return _reference.layer_norm(x, shape, weight, bias, eps)
    return _norm(x, None, weight, bias, eps, False, shape[0] if len(shape) == 1 else math.prod(shape))[0]


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual and y = LayerNorm(h) over the last dim, in one pass. Returns (y, h).

    Post-norm (Add & Norm) blocks use y; pre-norm blocks keep h as the residual stream.
    """
    if type(x) in _PLAIN_TENSORS and type(residual) in _PLAIN_TENSORS and x.dim():
        out = _norm_fast(x, residual, weight, bias, eps, False, x.shape[-1])
        if out is not None:
            return out
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual: expected a torch.Tensor, got {type(residual).__name__}")
    _check_tensor("x", x)
    if x.dim() == 0:
        raise ShapeError("x: expected at least one dimension, got a scalar")
    shape = _validate_norm(x, (x.shape[-1],), weight, bias, eps, residual)
    if x.numel() == 0:  # nothing to normalise: empty outputs, as torch returns
        return _reference.add_layer_norm(x, residual, weight, bias, eps)
    if _on_reference_under_transform("add_layer_norm", x, residual, weight, bias):
        return _reference.add_layer_norm(x, residual, weight, bias, eps)
    return _norm(x, residual, weight, bias, eps, False, shape[0])


# rms_norm's eps=None: the machine epsilon of the accumulation dtype, per input dtype
_RMS_DEFAULT_EPS = {dtype: torch.finfo(_reference.accumulation_dtype(torch.empty(0, dtype=dtype))).eps
                    for dtype in _FLOAT_DTYPES}


def rms_norm(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """Same as ``torch.nn.functional.rms_norm``.

    eps=None means the machine epsilon of the accumulation dtype, as torch computes it:
    ``torch.finfo(x.dtype).eps`` for float32/float64, float32's for float16/bfloat16.
    """
    fast_eps = _RMS_DEFAULT_EPS.get(x.dtype) if eps is None and type(x) in _PLAIN_TENSORS else eps
    out = None if fast_eps is None else _norm_fast(x, None, weight, None, fast_eps, True, normalized_shape)
    if out is not None:
        return out[0]
    shape = _validate_norm(x, normalized_shape, weight, None, eps, eps_may_be_none=True, layer_norm_dtypes=False)
    if eps is None:
        eps = torch.finfo(_reference.accumulation_dtype(x)).eps
    if x.numel() == 0:  # nothing to normalise: empty outputs, as torch returns
        return _reference.rms_norm(x, shape, weight, eps)
    if _on_reference_under_transform("rms_norm", x, weight):
        return _reference.rms_norm(x, shape, weight, eps)
    return _norm(x, None, weight, None, eps, True, shape[0] if len(shape) == 1 else math.prod(shape))[0]


# --------------------------------------------------------------------------------------
# whole layers, inference
# --------------------------------------------------------------------------------------
def _inference_ops_allowed(x: torch.Tensor, ops: tuple[str, ...]) -> bool:
    """Whether the extension's whole-module inference ops (csrc/layer_cpu.cpp) may run a
    module on ``x``: eager mode outside torch.func transforms and forward-mode AD, a CPU
    tensor, and the extension backend chosen (automatically or forced) for each of ``ops``
    (the functional ops the module would call) in ``x``'s dtype. Where not, the module calls
    the ops one by one.

    Those ops compute what the module's op calls compute (the same kernels in the same
    order), saving the Python work between them; they have no autograd, and fasttrans.nn
    calls them only when nothing needs a gradient (see fasttrans/nn/fused_inference.py)."""
    if (x.device.type != "cpu" or _is_compiling() or _functorch.maybe_current_level() is not None
            or getattr(_fwAD, "_current_level", 0) >= 0):
        return False
    return all(backends.select_backend(op, "cpu", x.dtype).name == "extension" for op in ops)


_INFERENCE_OPS = {  # kind -> (index in backends.inference_ops(), the functional ops it stands for)
    "layer": (0, ("attention", "norm")),
    "attention": (1, ("attention",)),
    "decoder_step": (2, ("attention", "norm")),
}


def inference_op(kind: str, x: torch.Tensor):
    """The extension's whole-module inference op of ``kind`` where it may run on ``x``
    (:func:`_inference_ops_allowed`), else None. Kinds:

    - ``"layer"``: ``fasttrans::transformer_layer_fwd_extension``, one encoder or decoder
      layer's forward (attention and norms);
    - ``"attention"``: ``fasttrans::multihead_attention_fwd_extension``, one
      MultiheadAttention's forward;
    - ``"decoder_step"``: ``fasttrans::decoder_layer_step_fwd_extension``, one decoder
      layer's step of incremental decoding.

    They have no autograd: fasttrans.nn.fused_inference calls them only when nothing needs
    a gradient, with arguments it has checked."""
    if kind not in _INFERENCE_OPS:
        raise ValueError(f"kind: expected one of {sorted(_INFERENCE_OPS)}, got {kind!r}")
    index, ops = _INFERENCE_OPS[kind]
    return backends.inference_ops()[index] if _inference_ops_allowed(x, ops) else None


# --------------------------------------------------------------------------------------
# dropout
# --------------------------------------------------------------------------------------
def _validate_dropout(x, p) -> float:
    _check_tensor("input", x)
    _check_float("input", x)
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"p: expected a float dropout probability, got {type(p).__name__}")
    if not 0.0 <= p <= 1.0:  # torch's wording and type (ValueError) for the same mistake
        raise ShapeError(f"dropout probability has to be between 0 and 1, but got {p}")
    return float(p)


def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """Same as ``torch.nn.functional.dropout``, in one fused pass of a fasttrans kernel.

    Elements are zeroed with probability ``p`` and the rest scaled by 1 / (1 - p). The keep
    decisions come from a counter-based generator keyed by a seed drawn from torch's default
    generator, so ``torch.manual_seed`` makes a run repeatable (the masks differ from
    torch's own). Forward saves a one-byte keep mask; backward draws no random numbers.
    ``p == 0`` or ``training=False`` return the input; ``p == 1`` zeroes it.
    """
    if (type(input) in _PLAIN_TENSORS and type(p) is float and 0.0 < p < 1.0 and training is True
            and not inplace and not _is_compiling() and _functorch.maybe_current_level() is None
            and getattr(_fwAD, "_current_level", 0) < 0 and _dispatch_stack_len is not None
            and not _dispatch_stack_len() and input.dtype in _FLOAT_DTYPES):
        try:
            common = backends.selected_route("dropout", input.device, input.dtype)[4]
        except (backends.BackendUnavailableError, ValueError):  # the general route says so, after its checks
            common = None
        if common is not None:  # the backend's launch sites (the Triton kernels'), which draw the seed
            out = common(input, p, _draw_seed)
            if out is not None:
                return out[0]
    p = _validate_dropout(input, p)
    if not training or p == 0.0:
        return input
    if p == 1.0 or input.numel() == 0:
        out = input * 0.0
    elif _on_reference_under_transform("dropout", input):
        out = backends.reference_impl().dropout_fwd(input, p, _draw_seed(p))[0]
    else:
        out, _keep = _run("dropout", input.device, input.dtype, (input,), input.contiguous(), p, _draw_seed(p))
    if inplace:
        return input.copy_(out)
    return out


def dropout_mask(input: torch.Tensor, p: float, backend: str | None = None) -> torch.Tensor:
    """The bool keep-mask :func:`dropout` applies to ``input`` (debug hook for tests).

    Draws the seed exactly as :func:`dropout` does: ``torch.manual_seed(s)`` before each of
    ``dropout_mask(x, p)`` and ``dropout(x, p)`` gives the mask and the output that used it.
    """
    p = _validate_dropout(input, p)
    if not 0.0 < p < 1.0:
        raise ShapeError(f"p: expected a dropout probability in (0, 1) for a keep-mask, got {p}")
    name = backend or _selected_backend("dropout", str(input.device), input.dtype)
    fwd, _ = backends.dropout_ops_for(name)
    with torch.no_grad():
        return fwd(input.contiguous(), p, _draw_seed(p))[1]

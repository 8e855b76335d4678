"""Backend registry: which implementation runs an op, and its torch.library registration.

Three backends implement the same *backend interface* (below): ``triton`` (kernels/*.py),
``extension`` (csrc/, JIT-built by fasttrans.extension) and ``reference`` (pure PyTorch).
Each backend's ops are registered under the ``fasttrans::`` namespace as

    fasttrans::attention_fwd_<backend>   fasttrans::attention_bwd_<backend>
    fasttrans::norm_fwd_<backend>        fasttrans::norm_bwd_<backend>
    fasttrans::dropout_fwd_<backend>     fasttrans::dropout_bwd_<backend>

with a fake (meta) implementation and autograd, so ``torch.compile(fullgraph=True)`` traces
through them and ``torch.library.opcheck`` can test them. Python backends are defined here
with ``torch.library.custom_op``; the extension defines the same schemas in C++
(``TORCH_LIBRARY(fasttrans, m)``) and this module adds the fake and autograd parts.

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
    Dropout (dropout_p > 0): keep(b, h, i, j) is a pure function of (seed, b, h, i, j);
    probabilities are multiplied by keep / (1 - dropout_p) after the softmax.
attention_bwd(dout, q, k, v, out, lse, attn_mask, key_lengths, is_causal, causal_offset,
              dropout_p, scale, seed, mask_grad) -> (dq, dk, dv, dmask or None)
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
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import os
import warnings
from typing import Callable

import torch
from torch.library import custom_op, register_autograd, register_fake

from . import extension, reference

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "Backend",
    "available_backends",
    "get_backend",
    "select_backend",
    "use_backend",
    "current_forced_backend",
]

BACKEND_NAMES = ("triton", "extension", "reference")
OPS = ("attention", "norm", "dropout")


class BackendUnavailableError(RuntimeError):
    """A backend that was asked for explicitly cannot run the op; the message says why."""


# --------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------
# Selections are memoised per (op, device, dtype), forced ones per forced backend as well:
# every fasttrans call selects a backend, and the checks behind a selection (device,
# implementation, dtype) cost a few microseconds of Python per call. Anything that changes
# what they would answer (a backend replaced in BACKENDS, a Backend's attribute set, a load
# attempted) clears the memos.
_auto_selection: dict[tuple, "Backend"] = {}
_forced_selection: dict[tuple, "Backend"] = {}  # forced backends that passed their checks
_eager_routes: dict[tuple[str, str], tuple] = {}  # see eager_route
_selected_routes: dict[tuple, tuple] = {}  # see selected_route


def _backends_changed() -> None:
    _auto_selection.clear()
    _forced_selection.clear()
    _eager_routes.clear()
    _selected_routes.clear()


def reference_impl():
    """The reference backend's implementation of the backend interface, called directly: pure
    PyTorch ops, so autograd (forward mode included) sees through it."""
    return reference.ReferenceImpl


class _Registry(dict):
    """BACKENDS: a dict that clears the selection memo when an entry changes."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        _backends_changed()

    def __delitem__(self, key):
        super().__delitem__(key)
        _backends_changed()

    def _changing(method):  # noqa: N805 - wraps the other mutating dict methods
        def wrapper(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            finally:
                _backends_changed()

        wrapper.__name__ = method.__name__
        return wrapper

    update = _changing(dict.update)
    pop = _changing(dict.pop)
    popitem = _changing(dict.popitem)
    setdefault = _changing(dict.setdefault)
    clear = _changing(dict.clear)
    __ior__ = _changing(dict.__ior__)
    del _changing


@dataclasses.dataclass
class Backend:
    """One backend: how to find its implementation and whether it can run on a device."""

    name: str
    _load: Callable[[], object]  # returns the object implementing the backend interface
    _check: Callable[[torch.device], str | None]  # None when usable on the device, else why not
    fp64_devices: tuple[str, ...] | None = None  # device types with float64 kernels; None: all
    _impl: object | None = None
    _load_error: str | None = None

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        _backends_changed()

    def impl(self):
        """The implementation object; raises BackendUnavailableError if it cannot be loaded."""
        if self._impl is None and self._load_error is None:
            try:
                self._impl = self._load()
            except Exception as e:  # import or build failure: remember why
                self._load_error = f"{type(e).__name__}: {e}"
        if self._impl is None:
            raise BackendUnavailableError(f"backend '{self.name}' could not be loaded: {self._load_error}")
        return self._impl

    def unavailable_reason(self, device: torch.device | str, op: str | None = None) -> str | None:
        """None when this backend can run ``op`` (or every op) on ``device``, else the reason."""
        device = torch.device(device)
        why = self._check(device)
        if why is not None:
            return why
        try:
            impl = self.impl()
        except BackendUnavailableError as e:
            return str(e)
        # an implementation may know more (a module that failed to import, a CPU-only build)
        check = getattr(impl, "unavailable_reason", None)
        why = check(device, op) if check is not None else None
        if why is not None:
            return why
        for name in (op,) if op else OPS:
            if not hasattr(impl, f"{name}_fwd"):
                return f"backend '{self.name}' does not implement {name}"
        return None

    def is_available(self, device: torch.device | str, op: str | None = None) -> bool:
        return self.unavailable_reason(device, op) is None

    def dtype_reason(self, device: torch.device | str, dtype: torch.dtype | None) -> str | None:
        """None when this backend has kernels for ``dtype`` on ``device``, else the reason."""
        device = torch.device(device)
        if dtype == torch.float64 and self.fp64_devices is not None and device.type not in self.fp64_devices:
            return f"backend '{self.name}' has no float64 kernels on {device.type}"
        return None


def _triton_check(device: torch.device) -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as e:
        return f"triton is not importable ({type(e).__name__}: {e})"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "Triton runs on CPU only through its interpreter (set TRITON_INTERPRET=1 before importing triton)"
        if not _triton_language_interpreted():
            return ("TRITON_INTERPRET=1 was set after triton was imported, so triton.language was built for the "
                    "GPU and its functions cannot run in the interpreter; set it before importing triton (and fasttrans)")
        return None
    return f"Triton does not support device type '{device.type}'"


def _triton_language_interpreted() -> bool:
    """Whether triton.language's own jit functions were made for the interpreter (Triton
    decides once, when they are defined; the kernels call them)."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    probe = getattr(tl, "zeros", None)
    if not isinstance(probe, JITFunction):  # a Triton whose builtins are not jit functions
        return True
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(probe, InterpretedFunction)


def _load_triton():
    return _TritonImpl()


class _TritonImpl:
    """Backend interface from kernels/attention.py and kernels/layernorm.py.

    Each kernel module is imported on its own: one that fails to import makes only its op
    unavailable, and the reason is kept for ``python -m fasttrans info``.
    """

    def __init__(self):
        self.errors: dict[str, str] = {}
        for module, names in (
            ("attention", ("attention_fwd", "attention_bwd", "attention_dropout_mask")),
            ("layernorm", ("norm_fwd", "norm_infer", "norm_bwd")),
            ("dropout", ("dropout_fwd", "dropout_bwd")),
        ):
            try:
                mod = importlib.import_module(f"fasttrans.kernels.{module}")
                for n in names:
                    setattr(self, n, getattr(mod, n))
            except Exception as e:
                self.errors[module] = f"{type(e).__name__}: {e}"

    def unavailable_reason(self, device: torch.device, op: str | None) -> str | None:
        module = {"attention": "attention", "norm": "layernorm", "dropout": "dropout"}
        for name in (op,) if op else OPS:
            if module[name] in self.errors:
                return f"kernels/{module[name]}.py failed to import: {self.errors[module[name]]}"
        return None


def _extension_check(device: torch.device) -> str | None:
    if device.type not in ("cpu", "cuda"):
        return f"the extension does not support device type '{device.type}'"
    return None


def _load_extension():
    ext = importlib.import_module("fasttrans.extension")
    return ext.load()


BACKENDS: dict[str, Backend] = _Registry({
    "triton": Backend("triton", _load_triton, _triton_check, fp64_devices=()),
    "extension": Backend("extension", _load_extension, _extension_check, fp64_devices=("cpu",)),
    "reference": Backend("reference", lambda: reference.ReferenceImpl(), lambda device: None),
})


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}: expected one of {', '.join(BACKEND_NAMES)}")
    return BACKENDS[name]


def available_backends(device: torch.device | str = "cpu", op: str | None = None) -> list[str]:
    """Names of the backends that can run ``op`` (or every op) on ``device``."""
    return [n for n, b in BACKENDS.items() if b.is_available(device, op)]


# --------------------------------------------------------------------------------------
# Selection
# --------------------------------------------------------------------------------------
_FROM_ENV = "<FASTTRANS_BACKEND>"  # no use_backend block: the environment decides
_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("fasttrans_backend", default=_FROM_ENV)
_warned: set[tuple[str, str]] = set()


class use_backend(contextlib.ContextDecorator):
    """Force every fasttrans op inside the block to run on backend ``name``.

    ``None`` selects automatically inside the block, whatever FASTTRANS_BACKEND says. A
    forced backend that cannot run an op raises
    BackendUnavailableError saying why; it never falls back silently. Usable as a context
    manager or a decorator; entering it is cheap enough to wrap a single small call (a class,
    not a generator-based context manager, which costs several times as much).
    """

    __slots__ = ("name", "_tokens")

    def __init__(self, name: str | None):
        if name is not None:
            get_backend(name)
        self.name = name
        self._tokens: list = []  # one per nested entry of this same object

    def __enter__(self) -> None:
        self._tokens.append(_forced.set(self.name))

    def __exit__(self, *exc) -> None:
        _forced.reset(self._tokens.pop())


def mask_helpers() -> tuple | None:
    """The extension's one-pass answers about a CPU mask's values (fasttrans.extension.
    mask_helpers) once the extension is loaded in this process; None before."""
    return extension.mask_helpers()


# Environment reads on the hot path (each call reads FASTTRANS_BACKEND, a forced call also
# TRITON_INTERPRET): os.environ decodes its key and value on every read, a plain dict
# lookup in its byte-keyed store is several times cheaper and sees the same updates.
_environ_data = getattr(os.environ, "_data", None) if os.name == "posix" else None  # bytes keys there
if not isinstance(_environ_data, dict):
    _environ_data = None


def _getenv(name: str, key: bytes) -> str | None:
    if _environ_data is None:
        return os.environ.get(name)
    value = _environ_data.get(key)
    return None if value is None else os.fsdecode(value)


def current_forced_backend() -> str | None:
    """The backend forced by use_backend(...) or FASTTRANS_BACKEND, or None for automatic."""
    name = _forced.get()
    if name is _FROM_ENV:
        name = _getenv("FASTTRANS_BACKEND", b"FASTTRANS_BACKEND") or None
        if name is not None and name not in BACKENDS:
            raise ValueError(f"FASTTRANS_BACKEND={name!r}: expected one of {', '.join(BACKEND_NAMES)}")
    return name


def _preference(device: torch.device) -> tuple[str, ...]:
    if device.type == "cuda":
        return ("triton", "extension", "reference")
    if device.type == "cpu":
        # Triton on CPU is the interpreter: a correctness tool, never chosen automatically.
        return ("extension", "reference")
    return ("reference",)


def select_backend(op: str, device: torch.device | str, dtype: torch.dtype | None = None) -> Backend:
    """The backend that runs ``op`` on ``device`` for inputs of ``dtype``: the forced one, or
    the best available. A forced backend that cannot run ``op`` on ``device``, or has no
    kernels for ``dtype`` there, raises BackendUnavailableError saying why."""
    forced = current_forced_backend()
    if forced is not None:
        # Checked again whenever the environment its checks read changes: the one variable
        # they read (TRITON_INTERPRET) is part of the memo key; a failure is never memoised.
        key = (forced, op, device, dtype, _getenv("TRITON_INTERPRET", b"TRITON_INTERPRET"))
        backend = _forced_selection.get(key)
        if backend is None:
            backend = BACKENDS[forced]
            why = backend.unavailable_reason(device, op) or backend.dtype_reason(device, dtype)
            if why is not None:
                raise BackendUnavailableError(
                    f"backend '{forced}' was requested for {op} on {device} but cannot run: {why}")
            _forced_selection[key] = backend
        return backend
    key = (op, device, dtype)
    backend = _auto_selection.get(key)
    if backend is None:
        # one selection per device however it is named (a torch.device or its string)
        canonical = (op, str(device), dtype)
        backend = _auto_selection.get(canonical)
        if backend is None:
            backend = _auto_selection[canonical] = _select_automatic(op, torch.device(device), dtype)
        _auto_selection[key] = backend
    return backend


def _select_automatic(op: str, device: torch.device, dtype: torch.dtype | None) -> Backend:
    preference = _preference(device)
    for name in preference:
        backend = BACKENDS[name]
        why = backend.unavailable_reason(device, op) or backend.dtype_reason(device, dtype)
        if why is None:
            return backend
        if name != "reference" and (name, why) not in _warned:
            _warned.add((name, why))
            warnings.warn(
                f"fasttrans: {op} on {device} is not using the '{name}' backend: {why}; falling back",
                RuntimeWarning,
                stacklevel=3,
            )
    raise BackendUnavailableError(f"no backend can run {op} on {device}")  # unreachable: reference runs anywhere


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

    @custom_op(f"fasttrans::attention_fwd_{name}", mutates_args=())
    def attention_fwd(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
        key_lengths: torch.Tensor | None, is_causal: bool, causal_offset: int, dropout_p: float,
        scale: float, seed: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = backend.impl().attention_fwd(
            q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed
        )
        return out, lse

    @custom_op(f"fasttrans::attention_bwd_{name}", mutates_args=())
    def attention_bwd(
        dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, attn_mask: torch.Tensor | None, key_lengths: torch.Tensor | None,
        is_causal: bool, causal_offset: int, dropout_p: float, scale: float, seed: int, mask_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv, dmask = backend.impl().attention_bwd(
            dout, q, k, v, out, lse, attn_mask, key_lengths, is_causal, causal_offset,
            dropout_p, scale, seed, mask_grad,
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


def last_dim_unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t itself when its innermost stride is 1 (every kernel takes the other strides as they
    are), else a contiguous copy: an expanded gradient (stride 0) or a column-major view."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


# The guard that sends an op call past the autograd dispatch key (to the device kernel), as
# an op's own autograd kernel does once it has recorded the graph; None on a torch without it.
BELOW_AUTOGRAD = getattr(torch._C, "_AutoDispatchBelowAutograd", None)


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
    def _(q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed):
        _check_fake_devices(q=q, k=k, v=v, attn_mask=attn_mask, key_lengths=key_lengths)
        B, H, Lq, D = q.shape
        return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
            (B, H, Lq), dtype=reference.accumulation_dtype(q)
        )

    @register_fake(f"fasttrans::attention_bwd_{name}")
    def _(dout, q, k, v, out, lse, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed,
          mask_grad):
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


def _autograd_formulas(name: str, attention_bwd_op, norm_bwd_op, dropout_bwd_op) -> dict:
    """{kind: (setup_context, backward)} of backend ``name``'s forward ops, computing first-order
    gradients with the given backward callables: its registered backward ops, or its
    implementation's methods (the eager route, see :func:`eager_route`). Either takes what
    the matching forward returned (absent outputs as empty tensors or as None)."""


    def attention_setup(ctx, inputs, output):
        q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, attn_mask, key_lengths)
        ctx.args = (is_causal, causal_offset, dropout_p, scale, seed)
        ctx.mask_grad = attn_mask is not None and attn_mask.dtype != torch.bool and ctx.needs_input_grad[3]
        ctx.forced = current_forced_backend()

    def attention_backward(ctx, dout, dlse):
        q, k, v, out, lse, attn_mask, key_lengths = ctx.saved_tensors
        is_causal, causal_offset, dropout_p, scale, seed = ctx.args
        if torch.is_grad_enabled():  # backward(create_graph=True): it must be differentiable itself
            _check_second_order("attention", name, ctx.forced)
            grads = _grad_with_graph(
                lambda q, k, v, m: reference.ReferenceImpl.attention_fwd(
                    q, k, v, m, key_lengths, is_causal, causal_offset, dropout_p, scale, seed)[0],
                (q, k, v, attn_mask), ctx.needs_input_grad[:4], (dout,))
            return (*grads, None, None, None, None, None, None)
        # gradients often arrive as views (the heads of a merged (B, L, H*D) gradient) or
        # expanded (stride 0): only a non-unit innermost stride costs a copy
        dq, dk, dv, dmask = attention_bwd_op(
            last_dim_unit_stride(dout), q, k, v, out, lse, attn_mask, key_lengths, is_causal, causal_offset,
            dropout_p, scale, seed, ctx.mask_grad,
        )
        dmask = dmask.to(attn_mask.dtype) if ctx.mask_grad else None
        return dq, dk, dv, dmask, None, None, None, None, None, None


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
            _check_second_order("norm", name, ctx.forced)
            needs = ctx.needs_input_grad
            grads = (None, None, None)
            if dy is not None:
                grads = _grad_with_graph(
                    lambda h, w, b: reference.ReferenceImpl.norm_fwd(h, None, w, b, ctx.eps, ctx.rms)[0],
                    (h, weight, bias), (needs[0] or needs[1], needs[2], needs[3]), (dy,))
            dx = grads[0] if dh is None else (dh if grads[0] is None else grads[0] + dh)
            return dx, (dx if ctx.has_residual else None), grads[1], grads[2], None, None
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
# autograd.Function.apply's C implementation, called without the Python preamble of
# Function.apply (a third of its host cost), which binds default arguments for functions
# with a separate setup_context and unwraps torch.func's dead wrappers: the eager functions
# define forward(ctx, ...) and run only while no torch.func transform is active.
_C_APPLY = getattr(torch._C, "_FunctionBase", object).__dict__.get("apply")


def eager_route(name: str, kind: str) -> tuple[Callable, Callable]:
    """(forward, call) of backend ``name``'s ``kind`` op ("attention", "norm", "dropout")
    for eager calls: its implementation's forward (its ``<kind>_infer`` where it has one),
    called as it is when nothing needs a gradient, and a function applying the forward
    through an autograd.Function (``call.function``) with the op's gradient formulas.
    Both take the registered forward op's arguments and return its outputs, absent ones
    (and, from ``call``, the statistics only a backward reads) as None where the op
    returns empty tensors."""
    route = _eager_routes.get((name, kind))
    if route is None:
        impl = BACKENDS[name].impl()
        methods = [getattr(impl, f"{k}_{d}", None) for k in ("attention", "norm", "dropout") for d in ("fwd", "bwd")]
        if name == "extension":  # C++ ops: skip their autograd key, whose Python kernel the route replaces
            methods = [_below_autograd(m) for m in methods]
        formulas = _autograd_formulas(name, *methods[1::2])
        forward = methods[("attention", "norm", "dropout").index(kind) * 2]
        call = _eager_function(name, kind, forward, *formulas[kind])
        infer = getattr(impl, f"{kind}_infer", None)  # optional: the forward without what a backward reads
        route = _eager_routes[(name, kind)] = (forward if infer is None else infer, call)
    return route


def selected_route(kind: str, device: torch.device, dtype: torch.dtype) -> tuple:
    """(name, forward, function): the backend :func:`select_backend` selects for ``kind`` on
    (device, dtype) and its :func:`eager_route`, in one lookup per call (both are asked on
    every eager call). Memoised under the same key as the selection, with the environment
    variables that selection reads."""
    forced = _forced.get()
    if forced is _FROM_ENV:
        forced = _getenv("FASTTRANS_BACKEND", b"FASTTRANS_BACKEND") or None
    key = (forced, kind, device, dtype, forced and _getenv("TRITON_INTERPRET", b"TRITON_INTERPRET"))
    route = _selected_routes.get(key)
    if route is None:
        name = select_backend(kind, device, dtype).name  # raises where it cannot run: never memoised
        route = _selected_routes[key] = (name, *eager_route(name, kind))
    return route


def _below_autograd(method):
    if method is None or BELOW_AUTOGRAD is None:
        return method

    def call(*args):
        with BELOW_AUTOGRAD():
            return method(*args)

    return call


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

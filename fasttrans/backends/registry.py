"""The backends and the choice among them: ``BACKENDS``, ``select_backend`` and
``use_backend`` (see fasttrans.backends for the interface every backend implements)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import os
import warnings
from typing import Callable

import torch
from torch.torch_version import TorchVersion

from .. import environ, extension, reference

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
# memos kept elsewhere that depend on the selection (backends.autograd's routes)
_dependent_memos: list[dict] = []


def _backends_changed() -> None:
    _auto_selection.clear()
    _forced_selection.clear()
    for memo in _dependent_memos:
        memo.clear()


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
        return _interpreter_numpy_conflict()
    return f"Triton does not support device type '{device.type}'"


def _interpreter_numpy_conflict() -> str | None:
    """Why this Triton's interpreter cannot run the kernels with the installed numpy, or None.
    Before Triton 3.7 the interpreter turns a loop bound into an int by int() of a one-element
    array, which numpy 2.4 refuses, so every kernel with such a loop would fail inside it."""
    import triton

    if TorchVersion(triton.__version__) >= (3, 7):
        return None
    try:
        import numpy
    except ImportError:  # the interpreter needs numpy: Triton's own import error says so
        return None
    if TorchVersion(numpy.__version__) < (2, 4):
        return None
    return (f"Triton {triton.__version__}'s interpreter cannot run with numpy {numpy.__version__} (it converts "
            "one-element arrays to int, which numpy 2.4 refuses): install numpy < 2.4 or Triton >= 3.7")


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
            ("attention", ("attention_fwd", "attention_bwd", "attention_dropout_mask", "attention_site")),
            ("layernorm", ("norm_fwd", "norm_infer", "norm_bwd", "norm_site")),
            ("dropout", ("dropout_fwd", "dropout_bwd", "dropout_site")),
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


# {backend: the device types on which its attention soft-caps scores (attention_fwd's softcap)}
SOFTCAP_DEVICES = {"reference": ("cpu", "cuda", "meta"), "extension": ("cpu", "cuda"), "triton": ("cuda", "cpu")}


def softcaps(name: str, device: torch.device) -> bool:
    """Whether backend ``name``'s attention kernels soft-cap scores on ``device``."""
    return device.type in SOFTCAP_DEVICES.get(name, ())


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


def current_forced_backend() -> str | None:
    """The backend forced by use_backend(...) or FASTTRANS_BACKEND, or None for automatic."""
    name = _forced.get()
    if name is _FROM_ENV:
        name = environ.getenv("FASTTRANS_BACKEND") or None
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
        key = (forced, op, device, dtype, environ.getenv("TRITON_INTERPRET"))
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

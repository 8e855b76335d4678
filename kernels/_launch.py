"""Kernel launches through cached launch plans.

``kernel[grid](*args, **constexprs)`` makes Triton bind and specialise every argument, hash
the result and look the compiled kernel up, on every call (an autotuned kernel adds its
own lookup): more host time than many of these kernels run on a GPU (benchmarks/README.md,
"Host cost"). A :class:`Launcher` does that once per *specialisation key* and keeps a
plan: the compiled kernel's C launcher, its function handle and metadata, the constexpr
values that complete the argument list and, for an autotuned kernel, the configuration it
picked. Later calls with the same key call the C launcher directly.

The key holds everything Triton specialises on, or more: the constexprs, and per runtime
argument its dtype and 16-byte alignment (tensors), or whether it is 1, divisible by 16 and
within int32 (integers), and the values of an autotuner's key arguments. Two calls with one
key get the same binary from Triton; a finer key only costs an extra plan.

Plans use ``CompiledKernel.run``'s calling convention, a Triton internal, on the Triton
versions it was read in (``PLANNED_VERSIONS``); other versions, the interpreter and
launches with Triton's launch hooks installed (a profiler) take the public
``kernel[grid](...)`` route, chosen once at import (the hooks: per call). Set
``FASTTRANS_TRITON_PLANS=0`` to force the public route.
"""

from __future__ import annotations

import operator
import os
from itertools import chain

import torch
import triton
from triton import knobs
from triton.runtime.autotuner import Autotuner

from . import LAUNCH_OPTIONS

__all__ = ["Launcher", "Spec", "PLANNED_VERSIONS", "plans_enabled"]

# Triton versions whose JITFunction.run launches as ``kernel.run(grid_0, grid_1, grid_2,
# stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *all_args)``
# with the constexprs among all_args, which is how plans launch.
PLANNED_VERSIONS = ("3.6", "3.9")


def _version_planned() -> bool:
    return ".".join(triton.__version__.split(".")[:2]) in PLANNED_VERSIONS


_PLANS = (os.environ.get("FASTTRANS_TRITON_PLANS", "1") != "0" and _version_planned()
          and os.environ.get("TRITON_INTERPRET") != "1")


def plans_enabled() -> bool:
    """Whether launches use cached plans in this process (see the module docstring)."""
    return _PLANS and os.environ.get("TRITON_INTERPRET") != "1"


_INT32_MIN, _INT32_END = -(2**31), 2**31
_data_ptr = torch.Tensor.data_ptr
_dtype_of = operator.attrgetter("dtype")


def _getter(indices: list[int]):
    """A C-level picker of args[i] for i in indices, always returning a tuple."""
    if not indices:
        return lambda args: ()
    if len(indices) == 1:  # itemgetter of one index returns the item itself
        index = indices[0]
        return lambda args: (args[index],)
    return operator.itemgetter(*indices)


class _Layout:
    """Where the tensors and integers sit among a call's runtime arguments (one per
    pattern of argument types), to key a call with C-level maps instead of a Python loop."""

    __slots__ = ("tensors", "ints")

    def __init__(self, types: tuple, fresh: set[int]):
        self.tensors = _getter([i for i, t in enumerate(types) if issubclass(t, torch.Tensor) and i not in fresh])
        self.ints = _getter([i for i, t in enumerate(types) if t is int])

    def key(self, args: tuple) -> tuple:
        tensors, ints = self.tensors(args), self.ints(args)
        # per tensor: dtype and 16-byte alignment; per integer: divisible by 16, == 1, and
        # (for the set, per integer when not all are) within int32. Floats and bools are
        # typed by the type pattern.
        residues = map(_mod16, chain(ints, map(_data_ptr, tensors)))
        return (tuple(map(_dtype_of, tensors)), tuple(map(operator.not_, residues)),
                tuple(map(_is_one, ints)),
                not ints or (_INT32_MIN <= min(ints) and max(ints) < _INT32_END)
                or tuple(_INT32_MIN <= v < _INT32_END for v in ints))


_mod16 = (15).__and__
_is_one = (1).__eq__


class _Plan:
    __slots__ = ("run", "function", "metadata", "tail", "meta")

    def __init__(self, run, function, metadata, tail, meta):
        self.run, self.function, self.metadata, self.tail, self.meta = run, function, metadata, tail, meta


class Spec:
    """The constexprs and options (num_warps, num_stages) of one launch configuration. Made
    once per configuration and reused: plans are looked up by a spec's identity, which costs
    nothing per call, where its contents would have to be hashed."""

    __slots__ = ("constexprs", "options")

    def __init__(self, constexprs: dict, **options):
        self.constexprs, self.options = dict(constexprs), options

    def __repr__(self) -> str:
        return f"Spec({self.constexprs}, {self.options})"


class Launcher:
    """Launches one ``@triton.jit`` kernel, or a ``triton.autotune`` of one, through plans.

    ``launcher(grid, args, spec, device_index)``: ``grid`` is a tuple, or a function of the
    launch meta-parameters (the constexprs and the chosen configuration) returning one;
    ``args`` are the kernel's runtime arguments, in order, and must be its leading
    parameters; ``spec`` a :class:`Spec` (or a dict of constexprs, looked up by its contents
    at some cost per call). Returns nothing. ``fresh`` names tensor parameters that always
    get a whole new allocation (so aligned) in a dtype that the other arguments' keys and the
    constexprs fix: they are not keyed.
    """

    def __init__(self, kernel, fresh: tuple[str, ...] = ()):
        self.kernel = kernel
        self.tuned = isinstance(kernel, Autotuner)
        jit = kernel
        while isinstance(jit, Autotuner):
            jit = jit.fn
        self.jit = jit  # a JITFunction (an InterpretedFunction under the interpreter)
        # the autotuner's key arguments among the runtime ones (constexprs are keyed anyway)
        params = getattr(jit, "params", None)
        self.tune_key = _getter([i for i in (kernel.arg_names.index(k) for k in kernel.keys)
                                 if params is None or not params[i].is_constexpr] if self.tuned else [])
        self.fresh = {kernel.arg_names.index(n) for n in fresh}
        self.plans: dict = {}
        self.layouts: dict[tuple, _Layout] = {}
        self.specs: dict[tuple, Spec] = {}

    def spec(self, constexprs: dict, **options) -> Spec:
        """The one Spec of these constexprs and options (insertion order counts)."""
        key = (tuple(constexprs.items()), tuple(options.items()))
        spec = self.specs.get(key)
        if spec is None:
            spec = self.specs[key] = Spec(constexprs, **options)
        return spec

    def __call__(self, grid, args: tuple, spec, device_index: int | None = None, **options):
        if type(spec) is not Spec:
            spec = self.spec(spec, **options)
        if not _PLANS or knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls:
            self._public(grid, args, spec)
            return
        types = tuple(map(type, args))
        layout = self.layouts.get(types)
        if layout is None:
            layout = self.layouts[types] = _Layout(types, self.fresh)
        key = (spec, types, layout.key(args), self.tune_key(args), device_index)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = self._plan(grid, args, spec)
            return  # _plan launched it
        g = grid(plan.meta) if callable(grid) else grid
        g1 = g[1] if len(g) > 1 else 1
        g2 = g[2] if len(g) > 2 else 1
        stream = _get_stream(device_index if device_index is not None else 0)
        plan.run(g[0], g1, g2, stream, plan.function, plan.metadata, None, None, None, *args, *plan.tail)

    def _public(self, grid, args, spec: Spec):
        return self.kernel[grid](*args, **spec.constexprs, **spec.options, **LAUNCH_OPTIONS)

    def _plan(self, grid, args, spec: Spec) -> _Plan:
        params = self.jit.params
        if any(p.is_constexpr for p in params[:len(args)]):
            # a constexpr's value would be keyed by its alignment class only
            raise TypeError(f"{self.jit.__name__}: pass constexpr parameters by name, not among args")
        compiled = self._public(grid, args, spec)
        meta = dict(spec.constexprs)
        if self.tuned:
            meta.update(self.kernel.best_config.kwargs)
        tail = []
        for p in params[len(args):]:
            if p.name in meta:
                tail.append(meta[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                raise TypeError(f"{self.jit.__name__}: no value for parameter {p.name}")
        return _Plan(compiled.run, compiled.function, compiled.packed_metadata, tuple(tail), meta)


def _get_stream(device_index: int):
    """The current stream of a device, as Triton's launch reads it (the active driver's)."""
    return triton.runtime.driver.active.get_current_stream(device_index)

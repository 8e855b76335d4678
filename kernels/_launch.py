"""Kernel launches through cached launch plans and bound call sites.

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

Call sites go further (``Launcher.bind``, "Call sites" below): a launcher function keys its
call by what fixes every launch's arguments (its inputs' signatures), binds the plan and the
grid once, and later calls only allocate outputs and call Triton's C launch function.

Plans use ``CompiledKernel.run``'s calling convention, and bound sites the C launch
function's beneath it, Triton internals, on the Triton versions they were read in
(``PLANNED_VERSIONS``); other versions, the interpreter and launches with Triton's launch
hooks installed (a profiler) take the public ``kernel[grid](...)`` route, chosen once at
import (the hooks: per call). Set ``FASTTRANS_TRITON_PLANS=0`` to force the public route.
"""

from __future__ import annotations

import contextvars
import operator
import os
from collections.abc import Callable

import torch
import triton
from triton import knobs
from triton.runtime.autotuner import Autotuner

from . import LAUNCH_OPTIONS

__all__ = ["Launcher", "Spec", "PLANNED_VERSIONS", "plans_enabled", "signature", "int_class", "remember"]

# Triton versions whose JITFunction.run launches as ``kernel.run(grid_0, grid_1, grid_2,
# stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *all_args)``
# with the constexprs among all_args, which is how plans launch.
PLANNED_VERSIONS = ("3.6", "3.7", "3.8", "3.9")


def _version_planned() -> bool:
    return ".".join(triton.__version__.split(".")[:2]) in PLANNED_VERSIONS


_PLANS = (os.environ.get("FASTTRANS_TRITON_PLANS", "1") != "0" and _version_planned()
          and os.environ.get("TRITON_INTERPRET") != "1")


def plans_enabled() -> bool:
    """Whether launches use cached plans in this process (see the module docstring)."""
    return _PLANS and os.environ.get("TRITON_INTERPRET") != "1"


_INT32_MIN, _INT32_END = -(2**31), 2**31
_data_ptr = torch.Tensor.data_ptr
_TRITON_MINOR = ".".join(triton.__version__.split(".")[:2])
# The C launch function beneath a kernel's launcher takes the kernel's arguments as one tuple
# from Triton 3.7 on, spread out in 3.6 (see _direct_launch).
_ARGS_AS_TUPLE = _TRITON_MINOR in ("3.7", "3.8", "3.9")


def _getter(indices: list[int]):
    """A C-level picker of args[i] for i in indices, always returning a tuple."""
    if not indices:
        return lambda args: ()
    if len(indices) == 1:  # itemgetter of one index returns the item itself
        index = indices[0]
        return lambda args: (args[index],)
    return operator.itemgetter(*indices)


def _layout_keyer(types: tuple, fresh: set[int]):
    """A function of a call's runtime arguments returning what Triton specialises them on,
    for one pattern of argument types: per tensor (but the fresh ones) its dtype and whether
    its address is 16-byte aligned; per integer whether it is divisible by 16, whether it is 1
    and whether it is within int32. Floats and bools are typed by the pattern. Generated as
    straight-line code: a generic loop over the arguments costs several times as much."""
    tensors = [i for i, t in enumerate(types) if issubclass(t, torch.Tensor) and i not in fresh]
    ints = [i for i, t in enumerate(types) if t is int]
    parts = [f"a[{i}].dtype" for i in tensors]
    parts += [f"(_data_ptr(a[{i}]) & 15) == 0" for i in tensors]
    parts += [f"(a[{i}] & 15) == 0, a[{i}] == 1, {_INT32_MIN} <= a[{i}] < {_INT32_END}" for i in ints]
    namespace = {"_data_ptr": _data_ptr}
    exec(f"def key(a):\n    return ({', '.join(parts)}{',' if len(parts) == 1 else ''})\n", namespace)
    return namespace["key"]


class _Plan:
    """One specialisation's launch: ``run`` is the compiled kernel's launcher (called as
    Triton's JITFunction.run calls it), or, where :func:`_direct_launch` applies, the C
    launch function beneath it, with ``head`` the arguments it takes before the grid's
    stream-independent part and ``tail`` the constexprs that complete the argument list."""

    __slots__ = ("run", "function", "metadata", "tail", "meta", "direct", "head", "scratch")

    def __init__(self, compiled, tail, meta):
        self.run, self.function, self.metadata = compiled.run, compiled.function, compiled.packed_metadata
        self.tail, self.meta = tail, meta
        self.direct, self.head, self.scratch = _direct_launch(compiled)


def _direct_launch(compiled) -> tuple:
    """(C launch function, its leading arguments, global scratch bytes per program) for a
    kernel whose launcher would only forward to it, or (None, None, 0). Triton's
    CudaLauncher.__call__ allocates the scratch buffers a kernel declares (global scratch
    through the allocator of ``triton.set_allocator``) and then calls its C ``launch``. A
    kernel with no scratch needs only the C call; one with global scratch (tensor
    descriptors made on the device) needs a buffer of that many bytes per program, passed
    where the leading arguments hold ``_SCRATCH``. The calling convention differs between the
    Triton versions read (see PLANNED_VERSIONS), and any other launcher class, or a kernel
    with profiling scratch, keeps the full route."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher
    except ImportError:
        return None, None, 0
    run = compiled.run
    if type(run) is not CudaLauncher or getattr(run, "gsan_enabled", False) or run.profile_scratch_size:
        return None, None, 0
    scratch = run.global_scratch_size * run.num_ctas
    slot = _SCRATCH if scratch else None
    if _ARGS_AS_TUPLE:
        # launch(gx, gy, gz, stream, function, cooperative, pdl, metadata, launch_metadata,
        #        enter_hook, exit_hook, global_scratch, profile_scratch, annotations, signature, args)
        return run.launch, (compiled.function, run.launch_cooperative_grid, run.launch_pdl,
                            compiled.packed_metadata, None, None, None, slot, None,
                            run.arg_annotations, run.kernel_signature), scratch
    if _TRITON_MINOR == "3.6":
        # launch(gx, gy, gz, stream, function, cooperative, pdl, global_scratch, profile_scratch,
        #        metadata, launch_metadata, enter_hook, exit_hook, *args)
        return run.launch, (compiled.function, run.launch_cooperative_grid, run.launch_pdl, slot, None,
                            compiled.packed_metadata, None, None, None), scratch
    return None, None, 0


_SCRATCH = object()  # where a launch's global scratch buffer goes among a plan's head
_set_allocator = getattr(triton, "set_allocator", None)  # Triton 3.3 and later


def _scratch_head(head: tuple, nbytes: int, device: torch.device) -> tuple:
    """A plan's head with a fresh global scratch buffer of ``nbytes`` in its slot. Allocated
    per launch from torch's caching allocator, so that launches on different streams never
    share one."""
    buffer = torch.empty((nbytes,), dtype=torch.int8, device=device)
    return tuple(buffer if h is _SCRATCH else h for h in head)


def _allocating(device: torch.device, launch: Callable[[], object]):
    """``launch()`` with Triton's scratch allocator (``triton.set_allocator``) giving torch
    tensors on ``device``, set in a copy of the caller's context: the caller's own setting,
    if any, is untouched. For launches that go through Triton's launcher (the public route,
    and plans without a direct launch) of kernels that may make tensor descriptors."""
    def run():
        _set_allocator(lambda size, alignment, stream: torch.empty((size,), dtype=torch.int8, device=device))
        return launch()

    return contextvars.copy_context().run(run)


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
    constexprs fix: they are not keyed. ``scratch``: the kernel may make tensor descriptors
    on the device, which take global scratch memory, allocated on the device of the first
    argument (a tensor) for each launch.
    """

    def __init__(self, kernel, fresh: tuple[str, ...] = (), scratch: bool = False):
        self.kernel = kernel
        self.scratch = scratch
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
        self.keyers: dict[tuple, object] = {}
        self.specs: dict[tuple, Spec] = {}

    def spec(self, constexprs: dict, **options) -> Spec:
        """The one Spec of these constexprs and options (insertion order counts)."""
        key = (tuple(constexprs.items()), tuple(options.items()))
        spec = self.specs.get(key)
        if spec is None:
            spec = self.specs[key] = Spec(constexprs, **options)
        return spec

    def __call__(self, grid, args: tuple, spec, device_index: int | None = None, **options):
        """Launch; returns the plan it used (None on the public route)."""
        if type(spec) is not Spec:
            spec = self.spec(spec, **options)
        if not _PLANS or knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls:
            self._public(grid, args, spec)
            return None
        types = tuple(map(type, args))
        keyer = self.keyers.get(types)
        if keyer is None:
            keyer = self.keyers[types] = _layout_keyer(types, self.fresh)
        key = (spec, types, keyer(args), self.tune_key(args), device_index)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = self._plan(grid, args, spec)
            return plan  # _plan launched it
        g = grid(plan.meta) if callable(grid) else grid
        g1 = g[1] if len(g) > 1 else 1
        g2 = g[2] if len(g) > 2 else 1
        stream = _get_stream(device_index if device_index is not None else 0)
        if plan.direct is None:
            if self.scratch and _set_allocator is not None:
                _allocating(args[0].device, lambda: plan.run(g[0], g1, g2, stream, plan.function, plan.metadata,
                                                             None, None, None, *args, *plan.tail))
            else:
                plan.run(g[0], g1, g2, stream, plan.function, plan.metadata, None, None, None, *args, *plan.tail)
        elif plan.scratch:
            head = _scratch_head(plan.head, g[0] * g1 * g2 * plan.scratch, args[0].device)
            if _ARGS_AS_TUPLE:
                plan.direct(g[0], g1, g2, stream, *head, args + plan.tail)
            else:
                plan.direct(g[0], g1, g2, stream, *head, *args, *plan.tail)
        elif _ARGS_AS_TUPLE:
            plan.direct(g[0], g1, g2, stream, *plan.head, args + plan.tail)
        else:
            plan.direct(g[0], g1, g2, stream, *plan.head, *args, *plan.tail)
        return plan

    def bind(self, grid, args: tuple, spec, device_index: int | None = None) -> Callable[[tuple], None]:
        """Launch once, as ``self(grid, args, spec, device_index)``, and return a function
        ``launch(args)`` that launches the same compiled kernel with the same grid on new
        arguments, skipping the key. Only for arguments that Triton would specialise
        exactly as these (same types, dtypes, integers' classes, tensors' alignment; the
        autotuner's key values): the caller keys the returned function by what determines
        them. Launch hooks installed later (a profiler) still get every launch, and with
        plans turned off every launch takes the public route."""
        if type(spec) is not Spec:
            spec = self.spec(spec)
        plan = self(grid, args, spec, device_index)
        if plan is None or plan.direct is None:
            return lambda args: self(grid, args, spec, device_index)
        g = grid(plan.meta) if callable(grid) else grid
        g0, g1, g2 = g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1
        direct, head, tail, index = plan.direct, plan.head, plan.tail, device_index if device_index is not None else 0
        enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        stream_of = triton.runtime.driver.active.get_current_stream  # the driver that compiled the kernel

        if plan.scratch:  # a fresh buffer per launch, allocated like the launchers' outputs
            slot = head.index(_SCRATCH)
            before, after = head[:slot], head[slot + 1:]
            buffer_like = torch.empty((1,), dtype=torch.int8, device=args[0].device).expand(g0 * g1 * g2 * plan.scratch)
            empty_like = torch.empty_like
            if _ARGS_AS_TUPLE:
                def launch(args):
                    if not _PLANS or enter.calls or exit_.calls:
                        return self(grid, args, spec, device_index)
                    direct(g0, g1, g2, stream_of(index), *before, empty_like(buffer_like), *after, args + tail)
            else:
                def launch(args):
                    if not _PLANS or enter.calls or exit_.calls:
                        return self(grid, args, spec, device_index)
                    direct(g0, g1, g2, stream_of(index), *before, empty_like(buffer_like), *after, *args, *tail)
        elif _ARGS_AS_TUPLE:
            def launch(args):
                if not _PLANS or enter.calls or exit_.calls:
                    return self(grid, args, spec, device_index)
                direct(g0, g1, g2, stream_of(index), *head, args + tail)
        else:
            def launch(args):
                if not _PLANS or enter.calls or exit_.calls:
                    return self(grid, args, spec, device_index)
                direct(g0, g1, g2, stream_of(index), *head, *args, *tail)
        return launch

    def _public(self, grid, args, spec: Spec):
        if self.scratch and _set_allocator is not None:  # unused by the interpreter, harmless there
            return _allocating(args[0].device, lambda: self.kernel[grid](*args, **spec.constexprs, **spec.options,
                                                                         **LAUNCH_OPTIONS))
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
        return _Plan(compiled, tuple(tail), meta)


# Call sites. A launch's arguments are fixed by a few properties of its inputs: shapes,
# strides, dtypes, devices, whether each address is 16-byte aligned, and the classes of its
# integer arguments. A launcher function keys a dict by them (``signature`` per tensor): the
# first call with a given key runs every check and binds its launches (Launcher.bind); later
# calls with the same key only allocate their outputs and launch.
SITES_MAX = 4096  # keys kept per site: a dict past it starts afresh


def signature(t: torch.Tensor | None):
    """What a launch's arguments can depend on in one input tensor (None for an absent one)."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.get_device(), _data_ptr(t) & 15


def int_class(v: int) -> tuple:
    """What Triton specialises an integer argument on: divisible by 16, equal to 1, within int32."""
    return (v & 15) == 0, v == 1, _INT32_MIN <= v < _INT32_END


def remember(sites: dict, key, value) -> None:
    """sites[key] = value, the dict emptied first once it holds SITES_MAX keys."""
    if len(sites) >= SITES_MAX:
        sites.clear()
    sites[key] = value


def _get_stream(device_index: int):
    """The current stream of a device, as Triton's launch reads it (the active driver's)."""
    return triton.runtime.driver.active.get_current_stream(device_index)

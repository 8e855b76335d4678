"""The Triton kernels, one module per op: attention, layernorm, dropout."""

import contextlib
import functools

import torch
import triton

# Every launch names its FMA contraction explicitly. The kernels are compiled and checked
# (compile-check) with contraction on; left unnamed, Triton 3.9 warns at the first compile
# that its default changes in 3.10, which would change the kernels' numerics with it.
LAUNCH_OPTIONS = {"enable_fp_fusion": True}


# Host-side integer helpers for the launchers. triton.cdiv and triton.next_power_of_2 are
# constexpr functions: called from host code they go through Triton's wrapper, which costs
# far more than the arithmetic, and a norm forward + backward made eight such calls.
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative a and positive b, as triton.cdiv."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for n >= 1, as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


# Device queries go through Triton's active driver, not torch.cuda: they then answer for
# whatever driver launches the kernels (the stand-in one of benchmarks/standin_cuda.py too).
def device_index(device: torch.device) -> int:
    """The GPU index of ``device`` (the current device when it names none)."""
    return device.index if device.index is not None else triton.runtime.driver.active.get_current_device()


@functools.lru_cache(maxsize=None)  # asked at every launch; a device never changes
def capability(index: int) -> tuple[int, int]:
    """(major, minor) compute capability of GPU ``index``."""
    return tuple(triton.runtime.driver.active.get_device_capability(index))


@functools.lru_cache(maxsize=None)
def multiprocessors(index: int) -> int:
    """The number of SMs of GPU ``index``."""
    return triton.runtime.driver.active.utils.get_device_properties(index)["multiprocessor_count"]


def expansion(dtype: torch.dtype, device: torch.device, shape: tuple) -> torch.Tensor:
    """A one-element tensor expanded to ``shape``: ``torch.empty_like`` of it allocates a
    contiguous tensor of that shape for less host time than ``torch.empty(shape, dtype=,
    device=)``, which launchers use for their outputs and workspaces."""
    return torch.empty((1,), dtype=dtype, device=device).expand(shape)


def strided_allocator(device: torch.device):
    """A function ``(size, stride, dtype) -> uninitialised tensor`` on ``device``'s type, sizes
    and strides as tuples of ints: the entry points torch's inductor allocates the outputs of
    its generated code with, which skip the dispatcher (cheaper than ``torch.empty_like`` of
    an :func:`expansion`), else ``torch.empty_strided``. On CUDA it allocates on the current
    device: call it where ``device`` is current (see on_device). The launch sites allocate
    their outputs with it; the workspaces still come from expansions."""
    fast = getattr(getattr(getattr(torch._C, "_dynamo", None), "guards", None), f"_empty_strided_{device.type}", None)
    if fast is not None:
        return fast
    return lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype, device=device)


_NO_GUARD = contextlib.nullcontext()
_current_cuda_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def on_device(t: torch.Tensor):
    """The device guard a launch on ``t`` needs: ``torch.cuda.device`` for a CUDA tensor not
    on the current device (entering one costs microseconds; most launches need none)."""
    if not t.is_cuda or t.device.index == _current_cuda_device():
        return _NO_GUARD
    return torch.cuda.device(t.device)

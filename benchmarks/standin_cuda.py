"""Triton's real CUDA launcher on a machine without a GPU, through a stand-in driver library.

``activate()`` builds ``standin_cuda.c`` (a ``libcuda.so.1`` whose every entry point returns
success and does nothing), loads it in place of the driver, and makes Triton's CUDA driver
the active one with device 0, stream 0 and an sm_90 target. Kernels then compile for sm_90
(ptxas runs; nothing executes) and every launch runs all of its host-side code: fasttrans's
checks and glue, Triton's binder, cache lookup and C launcher. Tensors stay on the CPU and
their pointers pass through as device pointers, so outputs hold garbage: this measures host
cost only (subnormal floats are flushed to zero in this process, so that CPU ops reading
that garbage take their usual time).

fasttrans's Triton backend is told it may take CPU tensors (its check refuses them without
the interpreter), and the Triton autotuners time every configuration as equal, so each picks
its first; since that is the pick, the autotuners are also pruned to their first remaining
configuration, so the others are never compiled. Call ``activate()`` before any fasttrans
op runs, in a process that never sets ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("standin_cuda.c")


def build(cache_dir: Path | None = None) -> Path:
    """The directory holding the built ``libcuda.so.1`` (built once per source version)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    root = cache_dir or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fasttrans"
    out = root / f"standin-cuda-{digest}"
    lib = out / "libcuda.so.1"
    if not lib.exists():
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None:
            raise RuntimeError("the stand-in CUDA driver needs a C compiler (cc or gcc) on PATH")
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f"libcuda.so.1.{os.getpid()}"
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(tmp), str(SOURCE)],
                       check=True)
        tmp.replace(lib)  # atomic: concurrent builders each write their own file
    return out


def _equal_timings(fn, *args, quantiles=None, **kwargs):
    fn()  # one launch, as the benchmarker's warm-up would (compiles the configuration)
    return [1.0] * len(quantiles) if quantiles else 1.0


def _prune_to_first() -> None:
    """Autotuners keep only the first configuration their own pruning leaves: with equal
    timings that is the one they pick, and compiling the rest (ptxas for each) only costs time."""
    from triton.runtime.autotuner import Autotuner

    if getattr(Autotuner.prune_configs, "_standin", False):
        return
    prune = Autotuner.prune_configs

    def first_only(self, *args, **kwargs):
        return prune(self, *args, **kwargs)[:1]

    first_only._standin = True
    Autotuner.prune_configs = first_only


def activate() -> None:
    """Make Triton launch through the stand-in driver (see the module docstring)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("the stand-in CUDA driver measures compiled launches: unset TRITON_INTERPRET")
    libdir = build()
    os.environ["TRITON_LIBCUDA_PATH"] = str(libdir)
    # loaded first and globally: Triton's dlopen("libcuda.so.1") finds it by its soname
    ctypes.CDLL(str(libdir / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver

    # Outputs hold whatever memory they were given; where that reads as subnormal floats, the
    # CPU ops that consume them (a layer's next matmul) run many times slower. Flushing
    # subnormals keeps the time of those ops independent of the garbage.
    torch.set_flush_denormal(True)

    driver = CudaDriver()
    driver.get_current_device = lambda: 0
    driver.set_current_device = lambda device: None
    driver.get_current_stream = lambda device=None: 0
    driver.get_device_capability = lambda device=None: (9, 0)
    driver.get_current_target = lambda: GPUTarget("cuda", 90, 32)
    driver.get_active_torch_device = lambda: torch.device("cpu")
    driver.get_benchmarker = lambda: _equal_timings
    triton.runtime.driver.set_active(driver)
    _prune_to_first()

    from fasttrans import backends

    triton_backend = backends.BACKENDS["triton"]
    backends.BACKENDS["triton"] = backends.Backend(
        "triton", triton_backend._load, lambda device: None, fp64_devices=triton_backend.fp64_devices)

"""JIT build and load of the C++/CUDA extension (the ``extension`` backend).

The sources live in the package ``fasttrans.csrc`` (``csrc/`` in the source tree), so an
installed wheel builds outside the source tree. The first ``load()`` compiles them with
``torch.utils.cpp_extension`` and ninja into a cache directory; later processes load the
cached library directly. The directory name is a hash of everything that makes a build
different: fasttrans, torch and Python versions, the compiler and its version, the flags,
the target CPU features the compiler sees, CUDA settings and the source text. So a changed
source, compiler or machine gets its own build, and a stale one is never loaded.

    cache root   $FASTTRANS_CACHE, else $XDG_CACHE_HOME/fasttrans, else ~/.cache/fasttrans
    build dir    <root>/ext-<fasttrans version>-torch<torch version>-<hash>

Concurrent first uses (several test workers, several ranks) are serialised by a file lock
next to the build directory: one process compiles, the others wait and load its result.

The library defines the ops ``fasttrans::{attention,norm}_{fwd,bwd}_extension`` and
``fasttrans::attention_dropout_mask_extension`` in C++ (``TORCH_LIBRARY``) with CPU kernels
and, when torch has CUDA and nvcc is found, CUDA kernels; fasttrans.backends adds their fake
implementations and autograd. ``load()`` returns an object implementing the backend
interface of fasttrans.backends on top of those ops.

Environment:
    FASTTRANS_CACHE              cache root (see above)
    FASTTRANS_CPU_ATTENTION_BWD  fused | split | auto: the CPU attention backward schedule
                                 (read by the kernel at every call; auto by default)
    FASTTRANS_CPU_ARCH           the -march target of the CPU code (default: native)
    FASTTRANS_CPU_ATTENTION_TILES  FMxFN,BMxBN: the CPU attention tiles, forward and backward
                                 (rows x keys; read at the first call; by default chosen from
                                 the L2 size and head dim, see cpu_attention_tiles())
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import torch

from .version import __version__

__all__ = ["load", "build_info", "ExtensionBuildError", "source_dir", "cache_root"]

_NAME = "fasttrans_ext"
_CPU_SOURCES = ("registration.cpp", "cpu_allocator.cpp", "attention_cpu.cpp", "layernorm_cpu.cpp", "dropout_cpu.cpp",
                "masks_cpu.cpp", "layer_cpu.cpp")
# the Python module of the eager route (built where Python's C headers are installed)
_EAGER_SOURCES = ("eager.cpp",)
_CUDA_SOURCES = ("cuda_binding.cpp", "attention_cuda.cu", "layernorm_cuda.cu", "dropout_cuda.cu")
_OPS = (
    "attention_fwd_extension",
    "attention_bwd_extension",
    "attention_dropout_mask_extension",
    "norm_fwd_extension",
    "norm_bwd_extension",
    "dropout_fwd_extension",
    "dropout_bwd_extension",
    "padding_key_lengths",
    "is_causal_mask",
    "transformer_layer_fwd_extension",
    "decoder_layer_step_fwd_extension",
    "multihead_attention_fwd_extension",
)


class ExtensionBuildError(RuntimeError):
    """The extension could not be compiled or loaded; the message says why and where."""


# --------------------------------------------------------------------------------------
# Where things are
# --------------------------------------------------------------------------------------
def source_dir() -> Path:
    """The directory holding the C++/CUDA sources (the installed fasttrans.csrc package)."""
    import fasttrans.csrc

    return Path(fasttrans.csrc.__file__).resolve().parent


def cache_root() -> Path:
    if os.environ.get("FASTTRANS_CACHE"):
        return Path(os.environ["FASTTRANS_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "fasttrans"


# --------------------------------------------------------------------------------------
# Toolchain probing
# --------------------------------------------------------------------------------------
def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)


def _compiler() -> tuple[str, str]:
    """(path, first line of --version) of the C++ compiler torch's cpp_extension will use."""
    from torch.utils.cpp_extension import get_cxx_compiler

    cxx = get_cxx_compiler()
    path = shutil.which(cxx)
    if path is None:
        raise ExtensionBuildError(f"no C++ compiler found: '{cxx}' is not on PATH (set CXX to choose one)")
    out = _run([path, "--version"])
    version = (out.stdout or out.stderr).strip().splitlines()
    return path, version[0] if version else "unknown"


def _predefined_macros(cxx: str, flags: list[str]) -> str | None:
    """The compiler's predefined macros under ``flags`` (None if it rejects the flags)."""
    out = _run([cxx, *flags, "-dM", "-E", "-x", "c++", os.devnull])
    return out.stdout if out.returncode == 0 else None


def _host_flags(cxx: str) -> tuple[list[str], str, list[str]]:
    """Optimisation flags for this host: (cflags, the macros they define, notes).

    Tries ``-march=native`` then ``-mcpu=native`` (some non-x86 compilers), else builds
    for the compiler's default target; ``FASTTRANS_CPU_ARCH`` names the ``-march`` target
    instead (tests/test_cpu_isa.py builds x86-64-v3, AVX2 without AVX-512, to run the code
    path of other CPUs). When the target has AVX-512 (F, BW, VL, DQ) or
    AVX2 + FMA, defines CPU_CAPABILITY so ATen's Vectorized<float> uses those registers
    (ATen itself sets this per kernel file; without it Vectorized is a scalar fallback).
    """
    notes = []
    arch: list[str] = []
    macros = None
    forced = os.environ.get("FASTTRANS_CPU_ARCH", "").strip()
    if forced:
        arch = [f"-march={forced}"]
        macros = _predefined_macros(cxx, arch)
        if macros is None:
            raise ExtensionBuildError(f"FASTTRANS_CPU_ARCH: the compiler {cxx} rejects -march={forced}; expected "
                                      "a target it knows, such as native, x86-64-v3 (AVX2) or x86-64")
    for candidate in () if forced else (["-march=native"], ["-mcpu=native"]):
        macros = _predefined_macros(cxx, candidate)
        if macros is not None:
            arch = candidate
            break
        notes.append(f"compiler rejected {candidate[0]}")
    if macros is None:
        macros = _predefined_macros(cxx, []) or ""
    defined = {line.split()[1] for line in macros.splitlines() if line.startswith("#define ")}
    if {"__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__AVX512DQ__"} <= defined:
        isa = ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    elif {"__AVX2__", "__FMA__"} <= defined:
        isa = ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    else:
        isa = []
        notes.append("no AVX2/AVX-512 target: ATen vectors fall back to scalar code")
    openmp = ["-fopenmp"] if _predefined_macros(cxx, ["-fopenmp"]) is not None else []
    if not openmp:
        notes.append("compiler rejected -fopenmp: the kernels run on one thread")
    # Scalar expressions are evaluated as written (the vector code uses explicit FMAs): a
    # contracted a * b - c in one place and an uncontracted one elsewhere would make
    # quantities that must cancel exactly (the LayerNorm backward of a width-1 row) differ.
    contract = ["-ffp-contract=off"] if _predefined_macros(cxx, ["-ffp-contract=off"]) is not None else []
    return ["-O3", *arch, *isa, *openmp, *contract], macros, notes


def _cuda_plan() -> tuple[bool, str | None, str]:
    """(build the CUDA kernels?, why not, the architectures they are built for).

    The architectures are TORCH_CUDA_ARCH_LIST when set, else those of the visible GPUs
    (what torch's build picks): they are part of the cache key, so that a build for one GPU
    found in a shared cache is not loaded on another. With no GPU visible and no list, torch's
    build has no architecture to compile for (it fails on an empty list): the CPU kernels are
    built alone.
    """
    if torch.version.cuda is None:
        if torch.version.hip is not None:
            return False, "ROCm builds of torch are not supported by the CUDA kernels", ""
        return False, "torch was built without CUDA", ""
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None or not (Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc").exists():
        return False, "nvcc was not found (set CUDA_HOME to a CUDA toolkit)", ""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if archs and archs != "native":
        return True, None, archs
    n = torch.cuda.device_count()
    if n == 0:
        return False, ("torch has CUDA but no GPU is visible, so there is no architecture to build the CUDA "
                       "kernels for (set TORCH_CUDA_ARCH_LIST, e.g. '8.0;9.0', to build them anyway)"), ""
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(n)})
    return True, None, ";".join(f"{major}.{minor}" for major, minor in caps)


def _sources(with_cuda: bool, with_eager: bool = True) -> list[Path]:
    src = source_dir()
    names = _CPU_SOURCES + (_EAGER_SOURCES if with_eager else ()) + (_CUDA_SOURCES if with_cuda else ())
    return [src / n for n in names]


def _python_headers() -> bool:
    """Whether Python's C headers are installed: the eager module (csrc/eager.cpp) needs them;
    the ops do not."""
    import sysconfig

    return (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()


def _source_hash(with_cuda: bool, with_eager: bool = True) -> str:
    src = source_dir()
    h = hashlib.sha256()
    files = sorted(set(_sources(with_cuda, with_eager)) | set(src.glob("*.h")) | set(src.glob("*.cuh")))
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


# --------------------------------------------------------------------------------------
# The C++ runtime the library links
# --------------------------------------------------------------------------------------
def _elf_needed(path: Path) -> list[str] | None:
    """The shared libraries a 64-bit little-endian ELF file names as needed (DT_NEEDED), in
    order; None when the file is missing, in another format or malformed."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if data[:4] != b"\x7fELF" or data[4:6] != b"\x02\x01":  # ELFCLASS64, ELFDATA2LSB
        return None
    try:
        return _dynamic_needed(data)
    except (struct.error, ValueError):  # truncated tables, a name without its NUL, bad UTF-8
        return None


def _dynamic_needed(data: bytes) -> list[str]:
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if p_type == 1:  # PT_LOAD
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 2:  # PT_DYNAMIC
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return []
    names, strtab = [], None
    for off in range(dynamic[0], dynamic[0] + dynamic[1] - 15, 16):
        tag, value = struct.unpack_from("<qQ", data, off)
        if tag == 0:  # DT_NULL
            break
        if tag == 1:  # DT_NEEDED: an offset into the string table
            names.append(value)
        elif tag == 5:  # DT_STRTAB: the string table's address
            strtab = value
    base = next((off + strtab - vaddr for vaddr, off, size in loads
                 if strtab is not None and vaddr <= strtab < vaddr + size), None)
    if base is None:
        if names:
            raise ValueError("DT_NEEDED entries without a string table")
        return []
    return [data[base + n: data.index(b"\0", base + n)].decode() for n in names]


def _runtime_problem(library: Path, cxx: str) -> str | None:
    """Why ``library`` cannot share a process with torch, else None.

    torch's libraries use the shared C++ runtime (libstdc++.so). A compiler that links the
    static libstdc++ (seen with a relocated g++) puts a second copy of the runtime into the
    library; the two copies' stream state then meets when an error message formats a number,
    and there the process died of a segmentation fault. Detected
    from the libraries each file needs; formats other than 64-bit little-endian ELF are not
    checked.
    """
    torch_needs = _elf_needed(Path(torch.__file__).parent / "lib" / "libc10.so")
    ours = _elf_needed(library)
    if not torch_needs or ours is None or not any(n.startswith("libstdc++.so") for n in torch_needs):
        return None
    if any(n.startswith("libstdc++.so") for n in ours):
        return None
    source = f" (from CXX={os.environ['CXX']})" if os.environ.get("CXX") else ""
    return (
        f"the C++ compiler {cxx}{source} linked a static copy of the C++ runtime (libstdc++) into {library}, "
        "while torch uses the shared libstdc++.so; two copies of the runtime in one process crash it. "
        "Point CXX at a compiler that links libstdc++ dynamically (e.g. CXX=/usr/bin/g++), or give this one "
        "its libstdc++.so"
    )


# --------------------------------------------------------------------------------------
# The build plan (computed once per process)
# --------------------------------------------------------------------------------------
class _Plan:
    def __init__(self):
        self.cxx, self.cxx_version = _compiler()
        self.cflags, macros, self.notes = _host_flags(self.cxx)
        self.ldflags = ["-fopenmp"] if "-fopenmp" in self.cflags else []
        self.with_cuda, self.cuda_reason, self.cuda_archs = _cuda_plan()
        self.with_eager = _python_headers()
        if not self.with_eager:
            self.notes.append("Python's C headers (Python.h) are not installed: eager calls take the Python route "
                              "to the ops, at a higher host cost per call (install the python3-dev package to "
                              "build the native one)")
        self.cuda_cflags = ["-O3", "-lineinfo"] if self.with_cuda else []
        key = {
            "fasttrans": __version__,
            "torch": torch.__version__,
            "torch_git": getattr(torch.version, "git_version", ""),
            "cuda": torch.version.cuda,
            "python": sys.version_info[:2],
            "machine": platform.machine(),
            "cxx": [self.cxx, self.cxx_version],
            "cflags": self.cflags,
            "macros": hashlib.sha256(macros.encode()).hexdigest(),
            "cuda_cflags": self.cuda_cflags,
            "cuda_arch": self.cuda_archs,
            "sources": _source_hash(self.with_cuda, self.with_eager),
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.build_dir = cache_root() / f"ext-{__version__}-torch{torch.__version__}-{digest}"
        self.library = self.build_dir / f"{_NAME}.so"
        self.marker = self.build_dir / "build.json"  # written last: its presence means "complete"

    def describe(self) -> dict:
        return {
            "build_dir": str(self.build_dir),
            "compiler": f"{self.cxx} ({self.cxx_version})",
            "cflags": self.cflags,
            "cuda_cflags": self.cuda_cflags,
            "with_cuda": self.with_cuda,
            "cuda_reason": self.cuda_reason,
            "cuda_archs": self.cuda_archs,
            "notes": self.notes,
        }


_lock = threading.Lock()
_plan: _Plan | None = None
_impl: "_ExtensionImpl | None" = None
_error: str | None = None


def _get_plan() -> _Plan:
    global _plan
    if _plan is None:
        _plan = _Plan()
    return _plan


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock across processes.

    POSIX: flock, released by the OS even if the holder dies. Elsewhere: torch's FileBaton
    (a file created exclusively; a holder that dies leaves it behind, to be deleted by hand).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        from torch.utils.file_baton import FileBaton

        baton = FileBaton(str(path) + ".baton")
        while not baton.try_acquire():
            baton.wait()
        try:
            yield
        finally:
            baton.release()
        return
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(plan: _Plan, verbose: bool) -> None:
    from torch.utils import cpp_extension

    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError as e:
        raise ExtensionBuildError(f"building the fasttrans extension needs ninja ({e}); pip install ninja") from None
    plan.build_dir.mkdir(parents=True, exist_ok=True)
    if verbose:
        print(f"fasttrans: building the C++{'/CUDA' if plan.with_cuda else ''} extension in {plan.build_dir}",
              file=sys.stderr)
    try:
        cpp_extension.load(
            name=_NAME,
            sources=[str(s) for s in _sources(plan.with_cuda, plan.with_eager)],
            extra_cflags=plan.cflags,
            extra_cuda_cflags=plan.cuda_cflags,
            extra_ldflags=plan.ldflags,
            extra_include_paths=[str(source_dir())],
            build_directory=str(plan.build_dir),
            with_cuda=plan.with_cuda,
            is_python_module=False,  # TORCH_LIBRARY ops only: no pybind11 module to compile
            verbose=verbose,
        )
    except Exception as e:
        raise ExtensionBuildError(
            f"building the fasttrans extension failed (compiler {plan.cxx}, {plan.cxx_version}; build dir "
            f"{plan.build_dir}): {e}"
        ) from e
    info = plan.describe()
    info["torch"] = torch.__version__
    info["fasttrans"] = __version__
    plan.marker.write_text(json.dumps(info, indent=2))


def load(verbose: bool = False) -> "_ExtensionImpl":
    """Build (first use only) and load the extension; returns the backend implementation.

    Raises ExtensionBuildError with the reason when the extension cannot be built or
    loaded. The outcome is remembered for the process: a failed build is not retried.
    """
    global _impl, _error, _mask_helpers
    with _lock:
        if _impl is not None:
            return _impl
        _check_cache_setting()
        if _error is not None:
            raise ExtensionBuildError(_error)
        try:
            plan = _get_plan()
            lock_path = plan.build_dir.with_name(plan.build_dir.name + ".lock")
            with _file_lock(lock_path):
                cached = plan.marker.exists() and plan.library.exists()
                if not cached:
                    _build(plan, verbose)  # also loads the library into this process
                # checked before a cached library is loaded; a fresh build is loaded already, but
                # the backend never calls its ops
                problem = _runtime_problem(plan.library, plan.cxx)
                if problem is not None:
                    raise ExtensionBuildError(problem)
                if cached and not _ops_defined():
                    torch.ops.load_library(str(plan.library))
            if not _ops_defined():
                raise ExtensionBuildError(f"{plan.library} loaded but did not define the fasttrans::*_extension ops")
        except ExtensionBuildError as e:
            _error = str(e)
            raise
        except Exception as e:  # compiler probing, file system, dlopen
            _error = f"{type(e).__name__}: {e}"
            raise ExtensionBuildError(_error) from e
        _register_debug_fake()
        eager = _python_module(plan.library) if plan.with_eager else None
        _impl = _ExtensionImpl(plan.with_cuda, plan.cuda_reason, eager)
        _mask_helpers = (torch.ops.fasttrans.padding_key_lengths.default, torch.ops.fasttrans.is_causal_mask.default)
        return _impl


def _python_module(library: Path):
    """The library's Python module (csrc/eager.cpp), imported from the file already loaded."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(_NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_mask_helpers: tuple | None = None


def mask_helpers() -> tuple | None:
    """(padding_key_lengths, is_causal_mask): the ops that answer fasttrans.nn's questions
    about a CPU mask's values in one pass (csrc/masks_cpu.cpp), once the extension is loaded
    in this process; None before. Never starts a build. Eager only: they have no fake
    implementation (the mask translation does not inspect values while compiling)."""
    return _mask_helpers


_CACHE_FIELDS = ("cached_bytes", "cached_blocks", "in_use_bytes", "hits", "misses", "limit_bytes")


def _check_cache_setting() -> None:
    value = os.environ.get("FASTTRANS_CPU_CACHE_MB", "").strip()
    if value and not (value.isdigit() and value.isascii()):
        raise ValueError(f"FASTTRANS_CPU_CACHE_MB: expected a non-negative whole number of MiB "
                         f"(0 turns the CPU output cache off), got {value!r}")


def cpu_cache_info() -> dict[str, int]:
    """The CPU kernels' cache of freed output blocks (csrc/cpu_allocator.h): bytes and
    blocks held for reuse, bytes of cached-size blocks held by live tensors, reuse hits and
    fresh allocations, and the limit (``FASTTRANS_CPU_CACHE_MB``, default 256 MiB). All
    zero while the extension is not loaded in this process; never starts a build."""
    if _impl is None:
        return dict.fromkeys(_CACHE_FIELDS, 0)
    return dict(zip(_CACHE_FIELDS, torch.ops.fasttrans.cpu_cache_stats()))


def cpu_cache_clear() -> None:
    """Return every cached block to the system; outputs still alive are not affected."""
    if _impl is not None:
        torch.ops.fasttrans.cpu_cache_clear()


def cpu_attention_tiles(head_dim: int = 64, dtype: torch.dtype = torch.float32,
                        l2_bytes: int | None = None) -> dict | None:
    """The CPU attention kernels' tiles for ``head_dim`` and inputs of ``dtype``:
    ``{"forward": (rows, keys), "backward": (rows, keys), "l2_bytes": n}``, where n is the
    L2 size per core they were chosen for (0 when ``FASTTRANS_CPU_ATTENTION_TILES`` sets
    them). With ``l2_bytes``, the rule's choice for that L2 size instead (csrc/attention_cpu.cpp).
    None while the extension is not loaded in this process; never starts a build."""
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
        raise ValueError(f"head_dim: expected a positive int, got {head_dim!r}")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise ValueError(f"dtype: expected float32, float16, bfloat16 or float64, got {dtype}")
    if l2_bytes is not None and (not isinstance(l2_bytes, int) or isinstance(l2_bytes, bool) or l2_bytes < 0):
        raise ValueError(f"l2_bytes: expected a non-negative int or None, got {l2_bytes!r}")
    if _impl is None:
        return None
    element_size = 8 if dtype == torch.float64 else 4  # the accumulation dtype's
    fm, fn, bm, bn, l2 = torch.ops.fasttrans.cpu_attention_tiles(
        head_dim, element_size, -1 if l2_bytes is None else l2_bytes)
    return {"forward": (fm, fn), "backward": (bm, bn), "l2_bytes": l2}


def _ops_defined() -> bool:
    try:
        return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"fasttrans::{op}", "CPU") for op in _OPS)
    except RuntimeError:  # an op that is not registered at all
        return False


def _register_debug_fake() -> None:
    """Fake implementation of the dropout keep-mask hook (the four main ops get theirs from
    fasttrans.backends), so it also traces under torch.compile and passes opcheck."""

    @torch.library.register_fake("fasttrans::attention_dropout_mask_extension")
    def _(q, k, dropout_p, seed):
        return q.new_empty((q.shape[0], q.shape[1], q.shape[2], k.shape[2]), dtype=torch.bool)


def build_info() -> dict:
    """The extension's state for ``python -m fasttrans info``; never starts a build.

    Keys: built (a complete build for this configuration is cached), loaded (in this
    process), build_dir, compiler, cflags, cuda_cflags, with_cuda, cuda_reason (why the
    CUDA kernels are not built, else None), notes, error (the load/build error, else None).
    """
    info: dict = {"built": False, "loaded": _impl is not None, "error": _error, "sources": None}
    try:
        info["sources"] = str(source_dir())
        plan = _get_plan()
    except Exception as e:
        info["error"] = info["error"] or f"{type(e).__name__}: {e}"
        return info
    info.update(plan.describe())
    info["built"] = plan.marker.exists() and plan.library.exists()
    return info


# --------------------------------------------------------------------------------------
# The backend interface (fasttrans.backends) on top of the C++ ops
# --------------------------------------------------------------------------------------
class _ExtensionImpl:
    """Backend interface of fasttrans.backends implemented by the compiled ops.

    The ops return absent optional outputs as empty (0,) tensors; these methods turn them
    back into None as the interface says. ``eager`` is the library's Python module, whose
    entry points run the norm and attention ops and their autograd in C++ (csrc/eager.cpp; used by
    fasttrans.backends' eager route).
    """

    def __init__(self, with_cuda: bool, cuda_reason: str | None, eager=None):
        self.with_cuda = with_cuda
        self.cuda_reason = cuda_reason
        self.eager = eager
        self._ops = torch.ops.fasttrans

    def unavailable_reason(self, device: torch.device, op: str | None = None) -> str | None:
        if device.type == "cuda" and not self.with_cuda:
            return f"the extension was built without its CUDA kernels: {self.cuda_reason}"
        return None

    def attention_fwd(self, q, k, v, attn_mask, key_lengths, is_causal, causal_offset, dropout_p, scale, seed,
                      softcap=0.0):
        return self._ops.attention_fwd_extension(
            q, k, v, attn_mask, key_lengths, is_causal, causal_offset, float(dropout_p), float(scale), int(seed),
            float(softcap),
        )

    def attention_bwd(self, dout, q, k, v, out, lse, attn_mask, key_lengths, is_causal, causal_offset, dropout_p,
                      scale, seed, mask_grad, softcap=0.0):
        dq, dk, dv, dmask = self._ops.attention_bwd_extension(
            dout, q, k, v, out, lse, attn_mask, key_lengths, is_causal, causal_offset, float(dropout_p),
            float(scale), int(seed), bool(mask_grad), float(softcap),
        )
        return dq, dk, dv, (dmask if mask_grad else None)

    def attention_dropout_mask(self, q, k, dropout_p, seed):
        return self._ops.attention_dropout_mask_extension(q, k, float(dropout_p), int(seed))

    def norm_fwd(self, x, residual, weight, bias, eps, rms):
        y, h, mean, rstd = self._ops.norm_fwd_extension(x, residual, weight, bias, float(eps), bool(rms))
        return y, (h if residual is not None else None), (None if rms else mean), rstd

    def norm_bwd(self, dy, dh, h, weight, bias, mean, rstd, rms):
        if mean is None:
            mean = rstd.new_empty(0)
        dx, dw, db = self._ops.norm_bwd_extension(dy, dh, h, weight, bias, mean, rstd, bool(rms))
        return dx, (dw if weight is not None else None), (db if bias is not None else None)

    def dropout_fwd(self, x, p, seed):
        return self._ops.dropout_fwd_extension(x, float(p), int(seed))

    def dropout_bwd(self, dy, keep, p):
        return self._ops.dropout_bwd_extension(dy, keep, float(p))

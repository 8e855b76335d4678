"""What every benchmark script shares: CLI, providers, interleaved timing, peak memory, CSV, plots.

A script describes its measurements as ``Config`` objects (one shape/mask/mode each) holding
one ``Entry`` per provider, and hands them to ``Bench.run``. For each configuration the
runner builds the inputs once, times every provider *interleaved* (A, B, C, then B, C, A,
...), so that machine noise hits all of them alike and the ratio against torch computed in
the same run is meaningful, and writes one CSV row per provider, whatever happened to it:

    status ok           timed (and/or measured), numbers filled in
    status error        the provider raised; the message is in ``error``, numbers are empty
    status unavailable  the backend cannot run here; ``error`` says why
    status skipped      deliberately not run for this configuration; ``error`` says why

Timing
    CUDA: ``triton.testing.do_bench`` (events, L2 flushed between calls), once per provider
    and round, all per-call samples pooled.
    CPU: ``torch.utils.benchmark.Timer.timeit`` on blocks of back-to-back calls (Timer
    disables the garbage collector, pins the thread count and warms up before each block),
    the block size chosen, like ``Timer.blocked_autorange`` does, so one block lasts
    ``block_s``; one sample per provider and round.
    Reported: the median of the samples and their 20% / 80% quantiles.

CPU caches (``--cache``, default ``warm``; the ``cache`` column of the CSV)
    ``warm``: back-to-back calls, as above. Inputs and outputs larger than the last-level
    cache then stay in it in part from one call to the next, and how large that part is
    depends on what else runs on the machine (other processes share the L3), so on a
    shared machine a memory-bound op at tens of MiB can time at either of two speeds from
    one run to the next.
    ``cold``: every call is preceded, outside the timed region, by a read of a buffer twice
    the size of the last-level cache (from sysfs), so its inputs come from DRAM; each call
    is timed alone with ``time.perf_counter`` (``Timer.timeit`` would warm the cache with
    calls of its own first). One sample per provider and round is the mean of a block of
    such calls. This is what ``do_bench`` does on CUDA, where every row is ``cold``: it
    overwrites a buffer larger than the L2 before each call.

CPU allocator (``--malloc``, default ``default``)
    torch's CPU tensors come from glibc's malloc, which returns the top of its heap to the
    system whenever more than a moving threshold is free and maps big blocks afresh: a
    16 MiB output is then page-faulted again on the next call (~4000 faults, ~5 ms, more
    than the op itself). Whether that happens depends on byte-level details of what else
    is allocated, so the same torch op can time at 1 ms in one process and 10 ms in the
    next. ``default`` leaves glibc as it is, which is the process a user has (fasttrans's
    CPU kernels keep their own freed output blocks for reuse, see docs/backends.md);
    ``steady`` (``mallopt``: no trimming, no mmap-ed blocks, for every provider of the run)
    measures the ops without the allocator, as a long-running process that has tuned
    malloc would. The ``malloc`` column says which a CPU row used.

Peak memory (bytes allocated above what was live before the call: inputs are excluded)
    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
    CPU: ``torch.profiler`` with ``profile_memory=True`` records every allocation and free
    of torch's CPU allocator with a timestamp; the running sum of those events, in time
    order, peaks at the answer. (``tracemalloc`` does not see torch's allocations, and
    ``ru_maxrss`` cannot be reset between measurements.)
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import fnmatch
import gc
import math
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.utils.benchmark

import fasttrans
from fasttrans import backends

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"

FIELDS = (
    "run_id", "run", "cache", "malloc", "date", "benchmark", "sweep", "case", "op", "mode", "dtype", "params",
    "provider", "variant", "status", "median_ms", "q20_ms", "q80_ms", "samples",
    "work", "work_unit", "throughput", "throughput_unit", "speedup_vs_torch",
    "peak_mem_bytes", "mem_vs_torch", "error",
    "device", "device_name", "threads", "torch", "triton", "fasttrans", "cuda", "python", "git_commit",
)

STATUSES = ("ok", "error", "unavailable", "skipped")


# --------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------
def make_parser(description: str) -> argparse.ArgumentParser:
    """The options every script takes; scripts add their own filters."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="device to benchmark (default: cuda when available, else cpu)")
    p.add_argument("--quick", action="store_true",
                   help="a few small configurations: checks that everything runs, measures nothing worth keeping")
    p.add_argument("--provider", action="append", default=[], metavar="NAME",
                   help="run only these providers (repeat or comma-separate; 'fasttrans' selects every "
                        "fasttrans-<backend>, 'torch' selects torch and torch-compile; glob patterns work)")
    p.add_argument("--sweep", action="append", default=[], metavar="NAME",
                   help="run only these sweeps (repeat or comma-separate), e.g. 'headline'")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="dtype of the sweeps (default: float32 on cpu, float16 on cuda); "
                        "the headline cases are float32 always")
    p.add_argument("--list", action="store_true",
                   help="print the configurations and providers that would run, run nothing, write nothing")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's own choice, one per core)")
    p.add_argument("--malloc", choices=("default", "steady"), default="default",
                   help="CPU: glibc's malloc as it is (default) or kept from trimming its heap for the "
                        "whole run (steady; see the module docstring)")
    p.add_argument("--cache", choices=("warm", "cold"), default=None,
                   help="CPU: time back-to-back calls (warm, the default) or evict the caches before each "
                        "call (cold); CUDA rows are always cold (see the module docstring)")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR,
                   help="where <device>.csv is appended to and the PNGs are written (default: benchmarks/results)")
    return p


def split_values(values: Sequence[str], kind: Callable[[str], Any] = str, choices: Sequence | None = None,
                 option: str = "") -> list:
    """Flatten repeated and comma-separated option values; check them against ``choices``."""
    out = []
    for value in values:
        for part in str(value).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                item = kind(part)
            except ValueError:
                raise SystemExit(f"{option}: expected {getattr(kind, '__name__', 'a value')} values, got {part!r}")
            if choices is not None and item not in choices:
                raise SystemExit(f"{option}: expected one of {', '.join(map(str, choices))}, got {part!r}")
            out.append(item)
    return out


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: no CUDA device is available (torch {torch.__version__}, "
                     f"CUDA build {torch.version.cuda or 'none'})")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads: expected a positive number, got {args.threads}")
        torch.set_num_threads(args.threads)
    args.dtype = getattr(torch, args.dtype or ("float16" if args.device == "cuda" else "float32"))
    if args.device == "cuda" and args.cache == "warm":
        parser.error("--cache warm: CUDA timings come from triton.testing.do_bench, which flushes the L2 "
                     "before every call; only --cache cold applies to --device cuda")
    args.cache = args.cache or ("cold" if args.device == "cuda" else "warm")
    if args.device == "cpu" and args.malloc == "steady":
        steady_allocator()
    args.provider = split_values(args.provider, option="--provider")
    args.sweep = split_values(args.sweep, option="--sweep")
    return args


def steady_allocator() -> bool:
    """Make glibc's malloc keep freed memory for reuse (see "CPU allocator" above).

    Returns whether the setting took effect (False on a C library without ``mallopt``).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # <malloc.h>
    return bool(mallopt(M_TRIM_THRESHOLD, 1 << 30)) and bool(mallopt(M_MMAP_MAX, 0))


# --------------------------------------------------------------------------------------
# environment: what produced the numbers
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Environment:
    device: str
    device_name: str
    slug: str  # file-name form of device_name
    threads: int
    torch: str
    triton: str
    fasttrans: str
    cuda: str
    python: str
    git_commit: str


def slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _cpu_vector_suffix(cpuinfo: str = "/proc/cpuinfo") -> str:
    """' AVX2' for an x86 CPU without AVX-512, else ''.

    One model name covers CPUs of different vector widths ("AMD EPYC" is reported by Zen 3,
    AVX2 only, and by Zen 4, with AVX-512), and the extension's kernels differ between them.
    AVX-512 machines keep the bare name, which earlier results files are named by.
    """
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.lower().startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return " AVX2" if "avx2" in flags and "avx512f" not in flags else ""
    except OSError:
        pass
    return ""


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may use (containers restrict it)
    except AttributeError:
        return os.cpu_count() or 1


def _triton_version() -> str:
    try:
        import triton
    except Exception as e:  # a missing or broken triton is recorded, not fatal
        return f"unavailable ({type(e).__name__})"
    return triton.__version__


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def environment(device: str) -> Environment:
    if device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = f"{_cpu_model_name()}{_cpu_vector_suffix()} {_cpu_count()} cores"
    return Environment(
        device=device, device_name=name, slug=slugify(name), threads=torch.get_num_threads(),
        torch=torch.__version__, triton=_triton_version(), fasttrans=fasttrans.__version__,
        cuda=torch.version.cuda or "", python=platform.python_version(), git_commit=_git_commit(),
    )


# --------------------------------------------------------------------------------------
# providers
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Provider:
    """Something that computes the benchmarked op: a fasttrans backend, or torch itself."""

    name: str  # "fasttrans-<backend>", "torch" or "torch-compile"
    backend: str | None = None  # the fasttrans backend forced with fasttrans.use_backend
    unavailable: str | None = None  # why it cannot run here; None when it can


def fasttrans_providers(device: str, op: str | None) -> list[Provider]:
    """One provider per registered backend, in registry order, with the reason when unavailable.

    ``op`` is "attention", "norm", or None for code that needs every op (the modules).
    """
    out = []
    for name, backend in backends.BACKENDS.items():
        why = backend.unavailable_reason(device, op)
        if why is None and name == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
            why = "TRITON_INTERPRET=1: Triton would run in its interpreter, a correctness tool that is not timed"
        out.append(Provider(f"fasttrans-{name}", backend=name, unavailable=why))
    return out


def torch_providers(device: str) -> list[Provider]:
    """torch eager everywhere; torch.compile'd torch on CUDA."""
    providers = [Provider("torch")]
    if device == "cuda":
        providers.append(Provider("torch-compile"))
    return providers


def provider_selected(name: str, filters: Sequence[str]) -> bool:
    """No filter selects all; 'fasttrans' selects 'fasttrans-<backend>'; globs work."""
    return not filters or any(name == f or name.startswith(f + "-") or fnmatch.fnmatchcase(name, f) for f in filters)


def backend_context(backend: str | None):
    """``fasttrans.use_backend(backend)``, or nothing for torch's own providers."""
    return fasttrans.use_backend(backend) if backend is not None else contextlib.nullcontext()


def fresh_compile(fn: Callable) -> Callable:
    """torch.compile(fn) with dynamo's caches cleared first.

    Every configuration compiles anew: without the reset, the recompilations of one
    function across many shapes hit dynamo's recompile limit and silently run eagerly.
    """
    torch._dynamo.reset()
    return torch.compile(fn)


# --------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TimingPlan:
    warmup_s: float  # CPU: warm-up length per provider (at least one call)
    block_s: float  # CPU: target length of one timed block of calls
    min_rounds: int  # every provider is timed at least this many times
    max_rounds: int
    min_time_s: float  # CPU: add rounds until every provider was timed this long ...
    max_time_s: float  # ... or the configuration has taken this long
    cuda_warmup_ms: float  # CUDA: do_bench warm-up per round
    cuda_rep_ms: float  # CUDA: do_bench repetition time per round


FULL_PLAN = TimingPlan(warmup_s=0.1, block_s=0.02, min_rounds=5, max_rounds=50, min_time_s=0.2, max_time_s=8.0,
                       cuda_warmup_ms=10, cuda_rep_ms=25)
QUICK_PLAN = TimingPlan(warmup_s=0.01, block_s=0.005, min_rounds=3, max_rounds=10, min_time_s=0.02,
                        max_time_s=0.5, cuda_warmup_ms=2, cuda_rep_ms=5)


@dataclasses.dataclass
class Timing:
    samples: list[float]  # seconds per call: one per timed block (CPU) or per call (CUDA)

    def quantile(self, q: float) -> float:
        """Linear-interpolated quantile (numpy's default method)."""
        s = sorted(self.samples)
        pos = q * (len(s) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    @property
    def median(self) -> float:
        return self.quantile(0.5)


def _time_block(fn: Callable[[], Any], calls: int) -> float:
    """Seconds per call over a block of ``calls`` back-to-back calls, timed by torch.utils.benchmark."""
    timer = torch.utils.benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.timeit(calls).mean


def _cpu_block_size(fn: Callable[[], Any], plan: TimingPlan) -> int:
    """Warm ``fn`` up and return how many calls make one block of about ``plan.block_s``."""
    first = _time_block(fn, 1)  # the first call may compile, build or allocate: never a sample
    per_call = first
    if first < plan.warmup_s:
        per_call = _time_block(fn, max(1, min(100_000, int((plan.warmup_s - first) / max(first, 1e-7)))))
    return max(1, round(plan.block_s / max(per_call, 1e-9)))


def last_level_cache_bytes(sysfs: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The size of CPU 0's largest cache, from sysfs (``index*/size``: "32768K"); None where it is not said."""
    sizes = []
    for f in sysfs.glob("index*/size"):
        m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*", f.read_text())
        if m:
            sizes.append(int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)])
    return max(sizes) if sizes else None


class CacheFlush:
    """Evicts the CPU caches: reads (``sum``, on every torch thread) a buffer twice the last-level cache.

    A read leaves only clean lines behind, so the timed call that follows pays no write-back
    for the flush; dirty lines of the previous call are written back during the flush.
    """

    FALLBACK_BYTES = 64 * 2**20  # where sysfs does not give the cache size

    def __init__(self, cache_bytes: int | None = None):
        cache_bytes = cache_bytes or last_level_cache_bytes() or self.FALLBACK_BYTES
        self.nbytes = 2 * cache_bytes
        self.buffer = torch.ones(self.nbytes // 4, dtype=torch.float32)

    def __call__(self) -> None:
        self.buffer.sum()


def _time_cold(fn: Callable[[], Any], calls: int, flush: Callable[[], None]) -> float:
    """Seconds per call over ``calls`` calls, each after ``flush()`` and timed alone."""
    total = 0.0
    gc_enabled = gc.isenabled()
    gc.disable()  # as Timer does
    try:
        for _ in range(calls):
            flush()
            start = time.perf_counter()
            fn()
            total += time.perf_counter() - start
    finally:
        if gc_enabled:
            gc.enable()
    return total / calls


def cuda_kernel_events(fn: Callable[[], Any], calls: int) -> list:
    """torch.profiler's averages of the GPU kernels that ``calls`` calls of ``fn`` launch
    (after one call outside the profile), longest summed time first; memsets left out."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sorted((e for e in prof.key_averages() if e.device_time_total > 0 and e.key != "Memset (Device)"),
                  key=lambda e: -e.device_time_total)


def kernel_profile(fn: Callable[[], Any], top: int, calls: int = 3) -> list[str]:
    """The ``top`` GPU kernels of one call of ``fn`` by their summed time (torch.profiler),
    as lines "ms per call, launches per call, name", then the total of every kernel."""
    kernels = cuda_kernel_events(fn, calls)
    lines = [f"{e.device_time_total / calls / 1e3:9.3f} ms {e.count / calls:6.1f}x  {e.key[:90]}"
             for e in kernels[:top]]
    total = sum(e.device_time_total for e in kernels) / calls / 1e3
    lines.append(f"{total:9.3f} ms in {sum(e.count for e in kernels) / calls:.0f} kernel launches per call in all")
    return lines


def measure_interleaved(fns: dict[Any, Callable[[], Any]], device: str, plan: TimingPlan,
                        flush: Callable[[], None] | None = None) -> dict[Any, Timing | BaseException]:
    """Time every function in ``fns`` in interleaved rounds; a function that raises gets its exception.

    On CPU, ``flush`` (a ``CacheFlush``) makes the timing cold: it runs before every timed
    call, outside the timed region. A block then holds at most as many calls as the flush
    fits into ``block_s``, so that tiny ops do not spend a round flushing.
    """
    out: dict[Any, Timing | BaseException] = {}
    cuda = device == "cuda"
    blocks: dict[Any, int] = {}
    most_calls = None
    if flush is not None and not cuda:
        flush()
        start = time.perf_counter()
        flush()
        most_calls = max(1, int(plan.block_s / max(time.perf_counter() - start, 1e-9)))
    for key, fn in fns.items():  # warm-up (and CPU block sizes), one provider at a time
        try:
            if cuda:
                fn()
                torch.cuda.synchronize()
            else:
                blocks[key] = _cpu_block_size(fn, plan)
                if most_calls is not None:
                    blocks[key] = min(blocks[key], most_calls)
        except Exception as e:
            out[key] = e
            _after_failure(device)
    alive = [k for k in fns if k not in out]
    samples: dict[Any, list[float]] = {k: [] for k in alive}
    spent = dict.fromkeys(alive, 0.0)
    start = time.perf_counter()
    rounds = 0
    while alive and rounds < plan.max_rounds:
        shift = rounds % len(alive)
        for key in alive[shift:] + alive[:shift]:  # rotate the order: nobody is always first
            try:
                if cuda:
                    from triton.testing import do_bench

                    times_ms = do_bench(fns[key], warmup=plan.cuda_warmup_ms, rep=plan.cuda_rep_ms, return_mode="all")
                    samples[key].extend(t / 1e3 for t in times_ms)
                    spent[key] += sum(times_ms) / 1e3
                elif most_calls is not None:
                    t = _time_cold(fns[key], blocks[key], flush)
                    samples[key].append(t)
                    spent[key] += t * blocks[key]
                else:
                    t = _time_block(fns[key], blocks[key])
                    samples[key].append(t)
                    spent[key] += t * blocks[key]
            except Exception as e:
                out[key] = e
                _after_failure(device)
        alive = [k for k in alive if k not in out]
        rounds += 1
        if rounds >= plan.min_rounds and (
            cuda or all(spent[k] >= plan.min_time_s for k in alive) or time.perf_counter() - start >= plan.max_time_s
        ):
            break
    for key in alive:
        out[key] = Timing(samples[key])
    return out


def _after_failure(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------
# peak memory
# --------------------------------------------------------------------------------------
def peak_memory_bytes(fn: Callable[[], Any], device: str) -> int:
    """Peak bytes allocated by torch during ``fn()`` above what was live before it.

    What ``fn`` returns stays alive until the end, so its outputs count, as they would for
    a caller that keeps them. On CPU, memory allocated before the measurement and freed
    during it is not seen (the profiler only records frees of blocks it saw allocated), so
    functions measured here should not free state they did not allocate.
    """
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del result
        return peak
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    del result
    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError as e:
        raise RuntimeError(f"CPU memory tracking needs torch.profiler's kineto events, not found in torch "
                           f"{torch.__version__}: {e}") from e
    cpu = torch.autograd.DeviceType.CPU
    # "[memory]" events: +bytes on allocation, -bytes on free, on the allocating thread
    deltas = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() == cpu)
    live = peak = 0
    for _, nbytes in deltas:
        live += nbytes
        peak = max(peak, live)
    return peak


# --------------------------------------------------------------------------------------
# configurations and results
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Entry:
    """One provider's part in a configuration."""

    provider: Provider
    make: Callable[[Any], Callable[[], Any]] | None  # inputs -> the zero-argument function to time
    variant: str = ""  # distinguishes two entries of one provider (e.g. "kv-cache")
    skip: str | None = None  # a reason not to run it for this configuration

    @property
    def key(self) -> tuple[str, str]:
        return self.provider.name, self.variant

    @property
    def label(self) -> str:
        return self.provider.name + (f" [{self.variant}]" if self.variant else "")


@dataclasses.dataclass
class Config:
    """One measured configuration: shape, mask, mode and dtype, with every provider's entry."""

    sweep: str  # "sweep", "headline", "memory", "train", "decode", ...
    op: str
    mode: str  # "fwd", "fwd+bwd", "train step", "decode"
    dtype: torch.dtype
    params: dict[str, Any]
    inputs: Callable[[], Any]  # builds the inputs all providers share, once
    entries: list[Entry]
    work: float | None = None  # FLOPs, bytes or tokens of one call
    work_unit: str = ""  # "FLOP", "B" or "token"
    case: str = ""  # a name for the headline table
    measure: str = "time"  # "time", "memory" or "time+memory"
    baseline: tuple[str, str] = ("torch", "")  # the (provider, variant) ratios are taken against

    @property
    def params_text(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.params.items())

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)


@dataclasses.dataclass
class Result:
    config: Config
    provider: str
    variant: str
    status: str
    timing: Timing | None = None
    peak_mem: int | None = None
    error: str = ""
    speedup: float | None = None  # baseline median / this median: > 1 is faster than torch
    mem_ratio: float | None = None  # this peak / baseline peak: < 1 uses less than torch

    @property
    def label(self) -> str:
        return self.provider + (f" [{self.variant}]" if self.variant else "")


def _format_error(e: BaseException) -> str:
    text = " ".join(str(e).split())
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def throughput_unit(work_unit: str, device: str) -> tuple[str, float]:
    """(unit, divisor) for the work unit: FLOP/s in G on CPU and T on CUDA, bytes in GB/s."""
    if work_unit == "FLOP":
        return ("TFLOP/s", 1e12) if device == "cuda" else ("GFLOP/s", 1e9)
    if work_unit == "B":
        return "GB/s", 1e9
    if work_unit == "token":
        return "tokens/s", 1.0
    return "", 1.0


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# --------------------------------------------------------------------------------------
# the runner
# --------------------------------------------------------------------------------------
class Bench:
    """Runs configurations, prints them, appends them to the CSV, and draws the plots."""

    def __init__(self, benchmark: str, args: argparse.Namespace):
        self.benchmark = benchmark
        self.args = args
        self.device: str = args.device
        self.quick: bool = args.quick
        self.plan = QUICK_PLAN if args.quick else FULL_PLAN
        self.env = environment(self.device)
        now = datetime.datetime.now(datetime.timezone.utc)
        self.date = now.isoformat(timespec="seconds")
        self.run_id = f"{now.strftime('%Y%m%dT%H%M%SZ')}-{benchmark}-{os.getpid()}"
        self.out_dir: Path = args.out_dir
        self.csv_path = self.out_dir / f"{self.env.slug}.csv"
        self.results: list[Result] = []
        self.listed = 0  # configurations printed by --list
        self._sweeps: set[str] = set()  # sweeps of the configurations the script-level filters kept
        self._providers: dict[Any, list[Provider]] = {}
        self._start = time.perf_counter()
        # the CPU cache flush of a --cache cold run (CUDA's do_bench flushes its own L2)
        self.flush = CacheFlush() if self.device == "cpu" and args.cache == "cold" else None
        e = self.env
        print(f"fasttrans {benchmark} benchmark{' (--quick: smoke run, not a measurement)' if self.quick else ''}")
        print(f"  device   {e.device_name} ({e.device}), {e.threads} torch threads")
        print(f"  versions torch {e.torch}, triton {e.triton}, fasttrans {e.fasttrans}"
              f"{', CUDA ' + e.cuda if e.cuda else ''}, python {e.python}, commit {e.git_commit or '?'}")
        how = "back-to-back calls" if args.cache == "warm" else "caches flushed before every call"
        print(f"  caches   {args.cache} ({how})")
        if self.device == "cpu":
            print(f"  malloc   {args.malloc} ({'glibc as it is' if args.malloc == 'default' else 'heap never trimmed'})")
        print(f"  results  {self.csv_path}")

    # providers --------------------------------------------------------------------
    def providers(self, op: str | None) -> list[Provider]:
        """fasttrans per backend, then torch; availability printed once per op."""
        if op not in self._providers:
            found = fasttrans_providers(self.device, op) + torch_providers(self.device)
            print(f"providers ({op or 'every op'} on {self.device}):")
            for p in found:
                if not provider_selected(p.name, self.args.provider):
                    state = "not selected (--provider)"
                else:
                    state = f"UNAVAILABLE: {p.unavailable}" if p.unavailable else "available"
                print(f"  {p.name:22s} {state}")
            self._providers[op] = found
        return self._providers[op]

    def wants(self, sweep: str) -> bool:
        self._sweeps.add(sweep)
        return not self.args.sweep or sweep in self.args.sweep

    # running ----------------------------------------------------------------------
    def run(self, cfg: Config) -> list[Result]:
        if not self.wants(cfg.sweep):
            return []
        entries = [e for e in cfg.entries if provider_selected(e.provider.name, self.args.provider)]
        if self.args.list:
            self.listed += 1
            print(f"{self._header(cfg)}\n  " + ", ".join(
                e.label + (" (unavailable)" if e.provider.unavailable else f" (skipped: {e.skip})" if e.skip else "")
                for e in entries))
            return []
        results: dict[tuple[str, str], Result] = {}
        pending: list[Entry] = []
        for e in entries:
            if e.provider.unavailable:
                results[e.key] = Result(cfg, *e.key, "unavailable", error=e.provider.unavailable)
            elif e.skip:
                results[e.key] = Result(cfg, *e.key, "skipped", error=e.skip)
            else:
                pending.append(e)
        fns: dict[tuple[str, str], Callable[[], Any]] = {}
        inputs = None
        if pending:
            try:
                inputs = cfg.inputs()
            except Exception as err:
                self._traceback(cfg, "inputs", err)
                for e in pending:
                    results[e.key] = Result(cfg, *e.key, "error", error=f"building the inputs: {_format_error(err)}")
                pending = []
        for e in pending:
            try:
                fns[e.key] = e.make(inputs)
            except Exception as err:
                self._traceback(cfg, e.label, err)
                results[e.key] = Result(cfg, *e.key, "error", error=_format_error(err))
        timings: dict = {}
        if fns and "time" in cfg.measure:
            timings = measure_interleaved(fns, self.device, self.plan, self.flush)
        for key, fn in fns.items():
            outcome = timings.get(key)
            if isinstance(outcome, BaseException):
                self._traceback(cfg, key[0], outcome)
                results[key] = Result(cfg, *key, "error", error=_format_error(outcome))
                continue
            result = Result(cfg, *key, "ok", timing=outcome)
            if "memory" in cfg.measure:
                try:
                    if outcome is None:  # not timed, so not warm yet: one call first
                        fn()
                    result.peak_mem = peak_memory_bytes(fn, self.device)
                except Exception as err:
                    self._traceback(cfg, key[0], err)
                    result = Result(cfg, *key, "error", error=_format_error(err))
                    _after_failure(self.device)
            results[key] = result
        del fns, inputs
        _release(self.device)
        ordered = [results[e.key] for e in entries]
        self._ratios(cfg, ordered)
        self._print(cfg, ordered)
        self._append_csv(ordered)
        self.results.extend(ordered)
        return ordered

    @staticmethod
    def _ratios(cfg: Config, results: list[Result]) -> None:
        base = next((r for r in results if (r.provider, r.variant) == cfg.baseline and r.status == "ok"), None)
        if base is None:
            return
        for r in results:
            if r.status != "ok":
                continue
            if r.timing is not None and base.timing is not None:
                r.speedup = base.timing.median / r.timing.median
            if r.peak_mem is not None and base.peak_mem:
                r.mem_ratio = r.peak_mem / base.peak_mem

    def _traceback(self, cfg: Config, who: str, err: BaseException) -> None:
        print(f"--- {who} failed on {cfg.op} {cfg.mode} {cfg.params_text}:", file=sys.stderr)
        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)

    # reporting --------------------------------------------------------------------
    def throughput(self, r: Result) -> float | None:
        c = r.config
        if r.timing is None or c.work is None:
            return None
        _, div = throughput_unit(c.work_unit, self.device)
        return c.work / r.timing.median / div

    def describe(self, r: Result) -> str:
        """One human line for a result (numbers, or why there are none)."""
        if r.status != "ok":
            return f"{r.status.upper()}: {r.error}"
        parts = []
        if r.timing is not None:
            t = r.timing
            parts.append(f"{t.median * 1e3:10.3f} ms [{t.quantile(0.2) * 1e3:.3f}, {t.quantile(0.8) * 1e3:.3f}]")
            tp = self.throughput(r)
            if tp is not None:
                unit, _ = throughput_unit(r.config.work_unit, self.device)
                parts.append(f"{tp:10.4g} {unit}")
            if r.speedup is not None:
                parts.append(f"{r.speedup:6.2f}x vs torch")
        if r.peak_mem is not None:
            parts.append(f"peak {_mib(r.peak_mem)}")
            if r.mem_ratio is not None:
                parts.append(f"{r.mem_ratio:.2f}x torch's memory")
        return "   ".join(parts)

    def _header(self, cfg: Config) -> str:
        return (f"[{self.benchmark} {cfg.sweep}{' ' + cfg.case if cfg.case else ''}] {cfg.op} {cfg.mode} "
                f"{cfg.dtype_name} {cfg.params_text}")

    def _print(self, cfg: Config, results: list[Result]) -> None:
        print(self._header(cfg))
        for r in results:
            if r.status == "unavailable":
                continue  # listed once, with its reason, under "providers"
            print(f"  {r.label:34s} {self.describe(r)}")
        sys.stdout.flush()

    def csv_row(self, r: Result) -> dict[str, Any]:
        c, e = r.config, self.env
        t = r.timing
        unit, _ = throughput_unit(c.work_unit, self.device)
        tp = self.throughput(r)
        return {
            "run_id": self.run_id, "run": "quick" if self.quick else "full", "cache": self.args.cache,
            "malloc": self.args.malloc if self.device == "cpu" else "",
            "date": self.date,
            "benchmark": self.benchmark, "sweep": c.sweep, "case": c.case, "op": c.op, "mode": c.mode,
            "dtype": c.dtype_name, "params": c.params_text, "provider": r.provider, "variant": r.variant,
            "status": r.status,
            "median_ms": f"{t.median * 1e3:.6g}" if t else "",
            "q20_ms": f"{t.quantile(0.2) * 1e3:.6g}" if t else "",
            "q80_ms": f"{t.quantile(0.8) * 1e3:.6g}" if t else "",
            "samples": len(t.samples) if t else "",
            "work": f"{c.work:.6g}" if c.work is not None else "", "work_unit": c.work_unit,
            "throughput": f"{tp:.6g}" if tp is not None else "", "throughput_unit": unit if tp is not None else "",
            "speedup_vs_torch": f"{r.speedup:.4f}" if r.speedup is not None else "",
            "peak_mem_bytes": r.peak_mem if r.peak_mem is not None else "",
            "mem_vs_torch": f"{r.mem_ratio:.4f}" if r.mem_ratio is not None else "",
            "error": r.error,
            "device": e.device, "device_name": e.device_name, "threads": e.threads, "torch": e.torch,
            "triton": e.triton, "fasttrans": e.fasttrans, "cuda": e.cuda, "python": e.python,
            "git_commit": e.git_commit,
        }

    def _append_csv(self, results: list[Result]) -> None:
        if not results:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        new = not self.csv_path.exists() or self.csv_path.stat().st_size == 0
        if not new:
            with open(self.csv_path, newline="") as f:
                header = next(csv.reader(f), [])
            if tuple(header) != FIELDS:
                raise SystemExit(f"{self.csv_path}: written with other columns than this version's; move it "
                                 f"away (or pass --out-dir) so the rows are not mixed up")
        with open(self.csv_path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            if new:
                writer.writeheader()
            for r in results:
                writer.writerow(self.csv_row(r))

    def headline_table(self, sweeps: Iterable[str] = ("headline", "memory")) -> None:
        rows = [r for r in self.results if r.config.sweep in sweeps and r.status != "unavailable"]
        if not rows:
            return
        title = "Headline: the goal configurations" + (" (--quick: REDUCED sizes)" if self.quick else "")
        print(f"\n{title}, {self.env.device_name}")
        width = max(len(f"{r.config.case}") for r in rows) + 2
        print(f"  {'case':{width}s} {'provider':34s} result")
        last = None
        for r in rows:
            case = r.config.case if r.config.case != last else ""
            last = r.config.case
            print(f"  {case:{width}s} {r.label:34s} {self.describe(r)}")

    def finish(self) -> int:
        """Print the summary; 1 when any provider failed (their rows say why), else 0."""
        unknown = sorted(set(self.args.sweep) - self._sweeps)
        if unknown:
            print(f"--sweep: nothing selected in {', '.join(unknown)} (sweeps with configurations matching the "
                  f"other filters: {', '.join(sorted(self._sweeps)) or 'none'})", file=sys.stderr)
            return 2
        if not self.results and not self.listed:
            print("nothing was run: no configuration matched the filters", file=sys.stderr)
            return 2
        if self.args.list:
            print(f"\n{self.listed} configurations (--list: nothing was run)")
            return 0
        errors = [r for r in self.results if r.status == "error"]
        minutes = (time.perf_counter() - self._start) / 60
        print(f"\n{len(self.results)} results appended to {self.csv_path} in {minutes:.1f} min")
        if errors:
            print(f"{len(errors)} FAILED measurements (status=error in the CSV):")
            for r in errors:
                print(f"  {r.label} {r.config.op} {r.config.mode} {r.config.params_text}: {r.error}")
        return 1 if errors else 0

    # plots ------------------------------------------------------------------------
    def png_path(self, name: str) -> Path:
        return self.out_dir / f"{self.env.slug}_{self.benchmark}_{name}{'_quick' if self.quick else ''}.png"

    def _title(self, what: str) -> str:
        e = self.env
        quick = " (--quick: not a measurement)" if self.quick else ""
        return (f"{what}{quick}\n{e.device_name} | torch {e.torch} | triton {e.triton} | "
                f"fasttrans {e.fasttrans} | {self.date[:10]}")

    def plot_lines(self, name: str, sweep: str, x: str, panels: Sequence[str], series: Sequence[str] = (),
                   title: str = "") -> Path | None:
        """Throughput against the sweep variable ``x`` (a params key), one panel per value of
        the ``panels`` keys, one line per provider (and per value of the ``series`` keys).

        Failed providers are named in their panel instead of being drawn.
        """
        rows = [r for r in self.results if r.config.sweep == sweep]
        if not rows:
            return None
        plt = _pyplot()
        # a grid: one row per value of the first panel keys, one column per value of the last,
        # values in the order the sweep ran them
        seen = [list(dict.fromkeys(_field(r, k) for r in rows)) for k in panels]
        keys = sorted({tuple(_field(r, k) for k in panels) for r in rows},
                      key=lambda key: tuple(seen[i].index(v) for i, v in enumerate(key)))
        ncols = min(len(seen[-1]), 5) if seen else 1
        nrows = math.ceil(len(keys) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
        unit = ""
        for ax, key in zip(axes.flat, keys):
            in_panel = [r for r in rows if tuple(_field(r, k) for k in panels) == key]
            lines: dict[str, list[tuple[float, float]]] = {}
            failed: dict[str, int] = {}
            for r in in_panel:
                label = r.label + "".join(f" {k}={_field(r, k)}" for k in series)
                tp = self.throughput(r) if r.status == "ok" else None
                if tp is None:
                    if r.status in ("error", "skipped"):
                        failed[f"{r.label} ({r.status})"] = failed.get(f"{r.label} ({r.status})", 0) + 1
                    continue
                unit, _ = throughput_unit(r.config.work_unit, self.device)
                lines.setdefault(label, []).append((float(_field(r, x)), tp))
            for label, pts in sorted(lines.items()):
                pts.sort()
                style = "--" if "torch" in label.split(" ")[0] else "-"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3, label=label)
            ax.set_xscale("log", base=2)
            ax.set_title(", ".join(f"{k}={v}" for k, v in zip(panels, key)), fontsize=9)
            ax.set_xlabel(x)
            ax.set_ylabel(unit)
            ax.grid(True, alpha=0.3)
            if lines:
                ax.legend(fontsize=6)
            if failed:
                note = "not drawn: " + ", ".join(f"{k} x{n}" for k, n in sorted(failed.items()))
                ax.text(0.01, 0.01, note, transform=ax.transAxes, fontsize=6, color="red", va="bottom", wrap=True)
        for ax in list(axes.flat)[len(keys):]:
            ax.axis("off")
        fig.suptitle(self._title(title or f"{self.benchmark} {sweep}"), fontsize=10)
        return self._save(fig, name, rows)

    def plot_bars(self, name: str, panels: Sequence[tuple[str, Sequence[Result], str]], title: str = "") -> Path | None:
        """Grouped bars: per panel (title, results, value) with value "speedup", "throughput"
        or "memory"; groups by configuration, one bar per provider. Results without a value
        get a labelled empty slot (error / skipped) rather than disappearing.
        """
        panels = [p for p in panels if p[1]]
        if not panels:
            return None
        plt = _pyplot()
        fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.6 * len(panels)), squeeze=False)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for ax, (panel_title, results, value) in zip(axes.flat, panels):
            results = [r for r in results if r.status != "unavailable"]  # listed under the figure
            ax.set_title(panel_title, fontsize=9)
            if not results:
                ax.text(0.5, 0.5, "no provider could run", ha="center", transform=ax.transAxes, color="red")
                continue
            groups = list(dict.fromkeys(_group_label(r) for r in results))
            labels = list(dict.fromkeys(r.label for r in results))
            color = {label: colors[i % len(colors)] for i, label in enumerate(labels)}
            per_group = {g: [r for r in results if _group_label(r) == g] for g in groups}
            width = 0.8 / max(len(rs) for rs in per_group.values())
            unit, drawn = "", set()
            for g, group in enumerate(groups):
                in_group = per_group[group]
                for i, r in enumerate(in_group):  # the group's own bars, centred on its tick
                    x = g + (i - (len(in_group) - 1) / 2) * width
                    v, unit = self._bar_value(r, value)
                    if v is None:
                        ax.text(x, 0, r.status if r.status != "ok" else "n/a", rotation=90, fontsize=7, color="red",
                                ha="center", va="bottom")
                        continue
                    ax.bar([x], [v], width=width * 0.95, color=color[r.label],
                           label=r.label if r.label not in drawn else "_nolegend_")
                    drawn.add(r.label)
            if value == "speedup":
                ax.axhline(1.0, color="black", lw=0.8, ls="--")
            ax.set_xticks(range(len(groups)))
            ax.set_xticklabels(groups, fontsize=7)
            ax.set_ylabel(unit)
            ax.grid(True, axis="y", alpha=0.3)
            if drawn:
                ax.legend(fontsize=7)
        fig.suptitle(self._title(title or f"{self.benchmark} {name}"), fontsize=10)
        return self._save(fig, name, [r for p in panels for r in p[1]])

    def _bar_value(self, r: Result, value: str) -> tuple[float | None, str]:
        if value == "speedup":
            return r.speedup, "speedup vs torch (x)"
        if value == "memory":
            return (r.peak_mem / 2**20 if r.peak_mem is not None else None), "peak memory above inputs (MiB)"
        unit, _ = throughput_unit(r.config.work_unit, self.device)
        return self.throughput(r) if r.status == "ok" else None, unit

    def _save(self, fig, name: str, results: Sequence[Result]) -> Path:
        path = self.png_path(name)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        unavailable = dict.fromkeys(f"{r.provider}: {r.error}" for r in results if r.status == "unavailable")
        if unavailable:  # listed, not silently missing from the picture
            note = "unavailable here: " + " | ".join(t if len(t) < 110 else t[:107] + "..." for t in unavailable)
            fig.text(0.01, 0.002, note, fontsize=6, color="gray", va="bottom", wrap=True)
        fig.tight_layout(rect=(0, 0.03 if unavailable else 0, 1, 1))
        fig.savefig(path, dpi=110)
        _pyplot().close(fig)
        print(f"plot: {path}")
        return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on benchmark machines
    import matplotlib.pyplot as plt

    return plt


def _field(r: Result, key: str) -> Any:
    if key in ("op", "mode", "sweep", "case"):
        return getattr(r.config, key)
    if key == "dtype":
        return r.config.dtype_name
    return r.config.params[key]


def _group_label(r: Result) -> str:
    c = r.config
    text = c.case or c.params_text
    return text.replace(" ", "\n", 2) if len(text) > 24 else text


def _release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------
# small helpers shared by the scripts
# --------------------------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def available_memory_bytes(device: str) -> int:
    """Memory that can still be allocated: free device memory on CUDA, MemAvailable on CPU."""
    if device == "cuda":
        free, _total = torch.cuda.mem_get_info()
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30  # unknown: assume a small machine


def grads(out: torch.Tensor, inputs: Sequence[torch.Tensor], grad_out: torch.Tensor) -> tuple:
    """Backward of ``out`` into ``inputs`` without accumulating into ``.grad`` (no state between calls)."""
    return torch.autograd.grad(out, inputs, grad_out)


def timed_call(forward: Callable, args: Sequence, mode: str, backend: str | None,
               wrt: Sequence[torch.Tensor] = (), grad_out: torch.Tensor | None = None) -> Callable[[], Any]:
    """The function timed for one provider: ``forward(*args)`` on ``backend`` (None: torch's
    own code), and for mode "fwd+bwd" also the backward of its output into ``wrt``.
    """
    if mode == "fwd":
        def run():
            with backend_context(backend):
                return forward(*args)
    elif mode == "fwd+bwd":
        def run():
            with backend_context(backend):
                return grads(forward(*args), wrt, grad_out)
    else:
        raise ValueError(f"mode: expected 'fwd' or 'fwd+bwd', got {mode!r}")
    return run

"""Where the host time of one call goes: cProfile over many back-to-back calls of one op.

A GPU call whose host-side work (argument checks, backend selection, the custom-op layer,
the kernel launcher) outlasts its kernels is bound by that work, and the timings of the
other scripts then measure the host, not the kernel. This script answers where that time
goes, per provider:

    wall       time per call, N calls back to back (torch.utils.benchmark.Timer, which
               synchronises CUDA): the real cost, host and device together
    profiled   the same calls under cProfile, host time per call split by where the code
               lives (fasttrans, fasttrans.kernels, triton, torch's Python, calls into C:
               torch ops, kernel launches, builtins); cProfile inflates Python-heavy code, so
               read the split, not the total
    top        the functions with the most time of their own per call

    python benchmarks/profile_call.py --op layer_norm --shape 1,1024
    python benchmarks/profile_call.py --op attention --shape 1,1,4,8 --mode fwd+bwd --provider fasttrans-triton,torch
    python benchmarks/profile_call.py --op dropout --shape 4096,1024 --device cuda --calls 2000

--standin-driver (CPU) launches the Triton kernels through a stand-in CUDA driver
(benchmarks/standin_cuda.py) that does nothing, so the fasttrans-triton provider measures
everything the host does per call of the Triton path without a GPU, Triton's own launcher
included. Run it in a process without TRITON_INTERPRET=1.

    python benchmarks/profile_call.py --standin-driver --provider fasttrans-triton --mode fwd+bwd

Nothing is written; the report goes to stdout.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch.utils import benchmark as torch_benchmark

sys.path.append(str(Path(__file__).resolve().parent.parent))  # last: see tests/conftest.py
import fasttrans  # noqa: E402
import fasttrans.kernels  # noqa: E402
from benchmarks import bench_attention, common  # noqa: E402

OPS = ("attention", "layer_norm", "add_layer_norm", "rms_norm", "dropout")
MODES = ("fwd", "fwd+bwd")
_BACKEND_OP = {"attention": "attention", "dropout": "dropout"}  # the others are "norm"


def _areas() -> list[tuple[str, str]]:
    """(label, directory) for the Python code of fasttrans, its kernels, triton and torch."""
    out = [("fasttrans.kernels", os.path.dirname(fasttrans.kernels.__file__)),
           ("fasttrans", os.path.dirname(fasttrans.__file__))]
    try:
        import triton

        out.append(("triton", os.path.dirname(triton.__file__)))
    except ImportError:
        pass
    out.append(("torch (Python)", os.path.dirname(torch.__file__)))
    return [(label, os.path.realpath(d) + os.sep) for label, d in out]


def area_of(filename: str, areas: Sequence[tuple[str, str]]) -> str:
    """Where a profiled function lives; '~' is cProfile's file name for functions in C."""
    if filename == "~":
        return "C (torch ops, launches, builtins)"
    path = os.path.realpath(filename)
    for label, directory in areas:
        if path.startswith(directory):
            return label
    return "other Python"


def make_call(op: str, shape: Sequence[int], mask: str, mode: str, dtype: torch.dtype, device: str,
              backend: str | None) -> Callable[[], object]:
    """The call the benchmark scripts time for ``op``: fasttrans on ``backend``, or torch when
    None; their inputs, masks and forward(+backward) functions, reused as they are."""
    from benchmarks import bench_dropout, bench_layernorm

    if op == "attention":
        if len(shape) != 4:
            raise SystemExit(f"--shape: attention takes B,H,L,D, got {','.join(map(str, shape))}")
        B, H, L, D = shape
        inp = bench_attention.attention_inputs(B, H, L, L, D, mask, mode, dtype, device)()
        make = (bench_attention.torch_attention(mode, compiled=False) if backend is None
                else bench_attention.fasttrans_attention(backend, mode))
        return make(inp)
    if len(shape) != 2:
        raise SystemExit(f"--shape: {op} takes M,N, got {','.join(map(str, shape))}")
    M, N = shape
    if op == "dropout":
        inp = bench_dropout.dropout_inputs(M, N, mode, dtype, device)()
        make = (bench_dropout.torch_dropout(mode, False, bench_dropout.P) if backend is None
                else bench_dropout.fasttrans_dropout(mode, backend, bench_dropout.P))
        return make(inp)
    inp = bench_layernorm.norm_inputs(op, M, N, mode, dtype, device)()
    make = (bench_layernorm.torch_norm(op, mode, compiled=False) if backend is None
            else bench_layernorm.fasttrans_norm(op, mode, backend))
    return make(inp)


def wall_us(call: Callable[[], object], calls: int) -> float:
    """Microseconds per call over ``calls`` back-to-back calls, CUDA synchronised."""
    timer = torch_benchmark.Timer(stmt="call()", globals={"call": call})
    return timer.timeit(calls).median * 1e6  # a Measurement's times are per call


def profile(call: Callable[[], object], calls: int, device: str) -> pstats.Stats:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    if device == "cuda":
        torch.cuda.synchronize()
    profiler.disable()
    return pstats.Stats(profiler)


def split(stats: pstats.Stats, calls: int) -> dict[str, float]:
    """Host microseconds per call spent in each area (own time of its functions)."""
    areas = _areas()
    out: dict[str, float] = {}
    for (filename, _line, _name), (_cc, _nc, own, _cum, _callers) in stats.stats.items():
        label = area_of(filename, areas)
        out[label] = out.get(label, 0.0) + own / calls * 1e6
    return out


def top(stats: pstats.Stats, calls: int, count: int) -> list[tuple[float, str]]:
    rows = []
    for (filename, line, name), (_cc, ncalls, own, _cum, _callers) in stats.stats.items():
        where = name if filename == "~" else f"{name} ({Path(filename).name}:{line})"
        rows.append((own / calls * 1e6, f"{where}  [{ncalls / calls:g} per call]"))
    return sorted(rows, reverse=True)[:count]


def providers(device: str, op: str, selected: Sequence[str]) -> list[common.Provider]:
    found = [p for p in common.fasttrans_providers(device, _BACKEND_OP.get(op, "norm")) + [common.Provider("torch")]
             if common.provider_selected(p.name, selected)]
    if not found:
        raise SystemExit(f"--provider: nothing matches {', '.join(selected)}")
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", choices=OPS, default="layer_norm")
    parser.add_argument("--shape", default=None,
                        help="comma-separated: B,H,L,D for attention, M,N for the others (default: 1,1,4,8 or 1,1024)")
    parser.add_argument("--mask", choices=bench_attention.MASKS, default="none", help="attention only")
    parser.add_argument("--mode", choices=MODES, default="fwd")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    parser.add_argument("--provider", action="append", default=[], metavar="NAME",
                        help="fasttrans-<backend> or torch (repeat or comma-separate; default: every one available)")
    parser.add_argument("--calls", type=int, default=1000, help="calls per measurement (default 1000)")
    parser.add_argument("--top", type=int, default=12, help="functions listed per provider (default 12)")
    parser.add_argument("--standin-driver", action="store_true",
                        help="CPU: Triton launches through a stand-in CUDA driver that does nothing, so "
                             "fasttrans-triton measures host work (see above)")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.calls < 1:
        parser.error(f"--calls: expected a positive number, got {args.calls}")
    shape = common.split_values([args.shape or ("1,1,4,8" if args.op == "attention" else "1,1024")], int,
                                option="--shape")
    dtype = getattr(torch, args.dtype)
    if args.standin_driver:
        if device != "cpu":
            parser.error("--standin-driver: CPU only (on a GPU, profile the real launches)")
        from benchmarks import standin_cuda

        try:
            standin_cuda.activate()
        except RuntimeError as e:
            parser.error(f"--standin-driver: {e}")
    selected = providers(device, args.op, common.split_values(args.provider, option="--provider"))
    report(args, shape, dtype, device, selected)
    return 0


def report(args: argparse.Namespace, shape: Sequence[int], dtype: torch.dtype, device: str,
           selected: Sequence[common.Provider]) -> None:
    """Wall time, host-time split and top functions of each selected provider, to stdout."""
    print(f"{args.op} {args.mode} shape={tuple(shape)}"
          + (f" mask={args.mask}" if args.op == "attention" else "")
          + f" {args.dtype} on {device}, {args.calls} calls; torch {torch.__version__}, fasttrans {fasttrans.__version__}"
          + ("; Triton launches through the stand-in driver (host work only)" if args.standin_driver else ""))
    for p in selected:
        print(f"\n== {p.name}")
        if p.unavailable:
            print(f"   unavailable: {p.unavailable}")
            continue
        call = make_call(args.op, shape, args.mask, args.mode, dtype, device, p.backend)
        for _ in range(min(args.calls, 50)):  # warm-up: compilation, autotuning, caches
            call()
        print(f"   wall      {wall_us(call, args.calls):9.1f} us per call")
        stats = profile(call, args.calls, device)
        parts = split(stats, args.calls)
        print(f"   profiled  {sum(parts.values()):9.1f} us per call of host time, of which:")
        for label, us in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"     {us:9.1f}  {label}")
        print("   top functions (own time, us per call):")
        for us, what in top(stats, args.calls, args.top):
            print(f"     {us:9.1f}  {what}")


if __name__ == "__main__":
    sys.exit(main())

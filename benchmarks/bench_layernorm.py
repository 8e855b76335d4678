"""Norm benchmark: fasttrans.layer_norm / add_layer_norm / rms_norm on every backend against torch.

Sweeps (select with --sweep):
    headline  the project's CPU goal configurations, float32, 4096 x 1024: layer_norm forward
              vs F.layer_norm; add_layer_norm forward+backward vs F.layer_norm(x + r).
    sweep     hidden size N from 256 to 65536 for each op, forward and forward+backward;
              CPU: M*N = 2^22 elements (16 MiB per fp32 tensor), N = 256, 1024, ..., 65536;
              CUDA: M = 4096 rows, every power of two.
    small     one row of 1024 (a decoding step's norm, batch 1), layer_norm and
              add_layer_norm, forward (no gradient recorded) and forward+backward: the
              per-call cost of the Python glue, the autograd route and the kernel launch.

Providers: fasttrans-<backend> for every registered backend, torch (F.layer_norm,
F.layer_norm(x + r), F.rms_norm) and, on CUDA, torch-compile.

Bytes (the (M, N) tensors a fused implementation must read and write; the (N,) parameters
and the per-row statistics are left out):
    layer_norm, rms_norm   forward 2*M*N*s (x in, y out); forward+backward 5*M*N*s
                           (backward reads x and dy, writes dx)
    add_layer_norm         forward 4*M*N*s (x, r in; y, h out); forward+backward 7*M*N*s
                           (backward reads h and dy, writes dx, which is also dr)
with s the element size.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

import fasttrans

if __package__ in (None, ""):  # run as a file: make the repository root importable for `benchmarks`
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: see tests/conftest.py

from benchmarks import common  # noqa: E402
from benchmarks.common import Config, Entry  # noqa: E402

OPS = ("layer_norm", "add_layer_norm", "rms_norm")
MODES = ("fwd", "fwd+bwd")
EPS = 1e-5

# (M, N) tensors moved per call, see the module docstring
_TENSORS_MOVED = {
    ("layer_norm", "fwd"): 2, ("rms_norm", "fwd"): 2, ("add_layer_norm", "fwd"): 4,
    ("layer_norm", "fwd+bwd"): 5, ("rms_norm", "fwd+bwd"): 5, ("add_layer_norm", "fwd+bwd"): 7,
}


def norm_bytes(op: str, M: int, N: int, dtype: torch.dtype, mode: str) -> float:
    element = torch.empty((), dtype=dtype).element_size()
    return float(_TENSORS_MOVED[(op, mode)] * M * N * element)


def norm_inputs(op: str, M: int, N: int, mode: str, dtype: torch.dtype, device: str):
    def build():
        torch.manual_seed(0)
        grad = mode == "fwd+bwd"

        def tensor(*shape, scale=1.0, shift=0.0):
            return (torch.randn(*shape, device=device, dtype=dtype) * scale + shift).requires_grad_(grad)

        x = tensor(M, N)
        residual = tensor(M, N) if op == "add_layer_norm" else None
        weight = tensor(N, scale=0.1, shift=1.0)
        bias = tensor(N, scale=0.1) if op != "rms_norm" else None
        wrt = [t for t in (x, residual, weight, bias) if t is not None]  # what the backward differentiates
        dy = torch.randn(M, N, device=device, dtype=dtype) if grad else None
        return types.SimpleNamespace(x=x, residual=residual, weight=weight, bias=bias, wrt=wrt, dy=dy)

    return build


def _forward(op: str, library: str):
    """f(x, residual, weight, bias) -> y for the op, as fasttrans or torch computes it.

    Plain tensor arguments, so torch.compile traces the torch version without guards on
    anything else.
    """
    if library == "fasttrans":
        if op == "layer_norm":
            return lambda x, r, w, b: fasttrans.layer_norm(x, (x.shape[-1],), w, b, EPS)
        if op == "add_layer_norm":
            return lambda x, r, w, b: fasttrans.add_layer_norm(x, r, w, b, EPS)[0]
        return lambda x, r, w, b: fasttrans.rms_norm(x, (x.shape[-1],), w, EPS)
    if op == "layer_norm":
        return lambda x, r, w, b: F.layer_norm(x, (x.shape[-1],), w, b, EPS)
    if op == "add_layer_norm":
        return lambda x, r, w, b: F.layer_norm(x + r, (x.shape[-1],), w, b, EPS)
    return lambda x, r, w, b: F.rms_norm(x, (x.shape[-1],), w, EPS)


def _timed(forward, inp, mode: str, backend: str | None):
    return common.timed_call(forward, (inp.x, inp.residual, inp.weight, inp.bias), mode, backend, inp.wrt, inp.dy)


def fasttrans_norm(op: str, mode: str, backend: str):
    return lambda inp: _timed(_forward(op, "fasttrans"), inp, mode, backend)


def torch_norm(op: str, mode: str, compiled: bool):
    def make(inp):
        forward = _forward(op, "torch")
        return _timed(common.fresh_compile(forward) if compiled else forward, inp, mode, None)

    return make


def norm_config(bench: common.Bench, sweep: str, op: str, M: int, N: int, mode: str, dtype: torch.dtype,
                case: str = "") -> Config:
    entries = []
    for p in bench.providers("norm"):
        if p.backend is not None:
            entries.append(Entry(p, fasttrans_norm(op, mode, p.backend)))
        else:
            entries.append(Entry(p, torch_norm(op, mode, compiled=p.name == "torch-compile")))
    return Config(
        sweep=sweep, case=case, op=op, mode=mode, dtype=dtype, params={"M": M, "N": N},
        inputs=norm_inputs(op, M, N, mode, dtype, bench.device), entries=entries,
        work=norm_bytes(op, M, N, dtype, mode), work_unit="B",
    )


def sweep_shapes(device: str, quick: bool) -> list[tuple[int, int]]:
    """(M, N) of the sweep."""
    if device == "cuda":
        hidden = (1024, 8192) if quick else tuple(2**k for k in range(8, 17))
        return [(4096, N) for N in hidden]
    hidden = (256, 4096) if quick else (256, 1024, 4096, 16384, 65536)
    elements = 2**16 if quick else 2**22
    return [(max(1, elements // N), N) for N in hidden]


def configs(bench: common.Bench, ops, modes, hidden):
    def keep(op, N, mode):
        return op in ops and mode in modes and (not hidden or N in hidden)

    M, N = (512, 1024) if bench.quick else (4096, 1024)
    for op, mode in (("layer_norm", "fwd"), ("add_layer_norm", "fwd+bwd")):
        if keep(op, N, mode):
            yield norm_config(bench, "headline", op, M, N, mode, torch.float32, case=f"{op} {mode}")
    for M, N in sweep_shapes(bench.device, bench.quick):
        for op in OPS:
            for mode in MODES:
                if keep(op, N, mode):
                    yield norm_config(bench, "sweep", op, M, N, mode, bench.args.dtype)
    for op in ("layer_norm", "add_layer_norm"):
        for mode in MODES:
            if keep(op, 1024, mode):
                yield norm_config(bench, "small", op, 1, 1024, mode, torch.float32, case=f"{op} 1 x 1024 {mode}")


def main(argv=None) -> int:
    parser = common.make_parser(__doc__)
    parser.add_argument("--op", action="append", default=[], help=f"ops: {', '.join(OPS)}")
    parser.add_argument("--mode", action="append", default=[], help="fwd, fwd+bwd")
    parser.add_argument("--hidden", action="append", default=[], help="hidden sizes N to keep")
    args = common.parse_args(parser, argv)
    ops = common.split_values(args.op, choices=OPS, option="--op") or OPS
    modes = common.split_values(args.mode, choices=MODES, option="--mode") or MODES
    hidden = common.split_values(args.hidden, int, option="--hidden")

    bench = common.Bench("layernorm", args)
    for cfg in configs(bench, ops, modes, hidden):
        bench.run(cfg)

    bench.plot_lines("sweep", "sweep", x="N", panels=("mode", "op"),
                     title=f"norm throughput ({common.dtype_name(args.dtype)}, higher is better)")
    small = [r for r in bench.results if r.config.sweep == "small"]
    bench.plot_bars("small", [
        ("speedup vs torch (median / median, providers interleaved in one run)", small, "speedup"),
    ], title="norms: one row of 1024 (float32)")
    timed = [r for r in bench.results if r.config.sweep == "headline"]
    bench.plot_bars("headline", [
        ("speedup vs torch (median / median, providers interleaved in one run)", timed, "speedup"),
        ("throughput", timed, "throughput"),
    ], title="norms: goal configurations (float32)")
    bench.headline_table()
    return bench.finish()


if __name__ == "__main__":
    sys.exit(main())

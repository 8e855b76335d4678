"""Dropout benchmark: fasttrans.functional.dropout on every backend against torch's F.dropout.

Sweeps (select with --sweep):
    headline  the feed-forward hidden activation of the seq2seq training step (batch 64,
              91 source tokens, FFN 512), float32, 5824 x 512: forward and forward+backward.
    sweep     n = 2^16, 2^18, ..., 2^24 elements as (n / 1024, 1024), forward and
              forward+backward.

Both call dropout(x, p, training=True), p = 0.1 unless --p says otherwise; forward+backward
is the forward, then the backward of its output into x with a fixed random gradient.

Providers: fasttrans-<backend> for every registered backend, torch (F.dropout) and, on CUDA,
torch-compile.

Bytes (what a fused implementation must read and write, the keep mask counted at one byte
per element):
    forward           2*n*s + n   (x in; y and the mask out)
    forward+backward  4*n*s + 2*n (the backward reads dy and the mask, writes dx)
with n the number of elements and s the element size.
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

OP = "dropout"
MODES = ("fwd", "fwd+bwd")
P = 0.1
HEADLINE = (64 * 91, 512)  # (batch * source tokens, FFN hidden) of bench_model's training step


def dropout_bytes(M: int, N: int, dtype: torch.dtype, mode: str) -> float:
    n = M * N
    element = torch.empty((), dtype=dtype).element_size()
    once = 2 * n * element + n  # one tensor in, one out, and the one-byte mask
    return float(once if mode == "fwd" else 2 * once)


def dropout_inputs(M: int, N: int, mode: str, dtype: torch.dtype, device: str):
    def build():
        torch.manual_seed(0)
        grad = mode == "fwd+bwd"
        x = torch.randn(M, N, device=device, dtype=dtype).requires_grad_(grad)
        dy = torch.randn(M, N, device=device, dtype=dtype) if grad else None
        return types.SimpleNamespace(x=x, wrt=[x], dy=dy)

    return build


def _forward(library: str, p: float):
    """f(x) -> y, dropout in training mode as fasttrans or torch computes it."""
    if library == "fasttrans":
        return lambda x: fasttrans.functional.dropout(x, p, training=True)
    return lambda x: F.dropout(x, p, training=True)


def _timed(forward, inp, mode: str, backend: str | None):
    return common.timed_call(forward, (inp.x,), mode, backend, inp.wrt, inp.dy)


def fasttrans_dropout(mode: str, backend: str, p: float):
    return lambda inp: _timed(_forward("fasttrans", p), inp, mode, backend)


def torch_dropout(mode: str, compiled: bool, p: float):
    def make(inp):
        forward = _forward("torch", p)
        return _timed(common.fresh_compile(forward) if compiled else forward, inp, mode, None)

    return make


def dropout_config(bench: common.Bench, sweep: str, M: int, N: int, mode: str, dtype: torch.dtype, p: float,
                   case: str = "") -> Config:
    entries = []
    for prov in bench.providers(OP):
        if prov.backend is not None:
            entries.append(Entry(prov, fasttrans_dropout(mode, prov.backend, p)))
        else:
            entries.append(Entry(prov, torch_dropout(mode, compiled=prov.name == "torch-compile", p=p)))
    return Config(
        sweep=sweep, case=case, op=OP, mode=mode, dtype=dtype,
        params={"M": M, "N": N, "elements": M * N, "p": p},
        inputs=dropout_inputs(M, N, mode, dtype, bench.device), entries=entries,
        work=dropout_bytes(M, N, dtype, mode), work_unit="B",
    )


def sweep_shapes(quick: bool) -> list[tuple[int, int]]:
    """(M, N) of the sweep: n elements as (n / 1024, 1024)."""
    elements = (2**14, 2**16) if quick else tuple(4**k for k in range(8, 13))
    return [(n // 1024, 1024) for n in elements]


def configs(bench: common.Bench, modes, p: float):
    M, N = (4 * 91, 512) if bench.quick else HEADLINE
    for mode in MODES:
        if mode in modes:
            yield dropout_config(bench, "headline", M, N, mode, torch.float32, p, case=f"{OP} {mode}")
    for M, N in sweep_shapes(bench.quick):
        for mode in MODES:
            if mode in modes:
                yield dropout_config(bench, "sweep", M, N, mode, bench.args.dtype, p)


def main(argv=None) -> int:
    parser = common.make_parser(__doc__)
    parser.add_argument("--mode", action="append", default=[], help="fwd, fwd+bwd")
    parser.add_argument("--p", type=float, default=P, help=f"dropout probability (default: {P})")
    args = common.parse_args(parser, argv)
    modes = common.split_values(args.mode, choices=MODES, option="--mode") or MODES
    if not 0.0 < args.p < 1.0:
        parser.error(f"--p: expected a probability in (0, 1), got {args.p}")

    bench = common.Bench("dropout", args)
    for cfg in configs(bench, modes, args.p):
        bench.run(cfg)

    bench.plot_lines("sweep", "sweep", x="elements", panels=("mode",),
                     title=f"dropout throughput ({common.dtype_name(args.dtype)}, p={args.p}, higher is better)")
    timed = [r for r in bench.results if r.config.sweep == "headline"]
    bench.plot_bars("headline", [
        ("speedup vs torch (median / median, providers interleaved in one run)", timed, "speedup"),
        ("throughput", timed, "throughput"),
    ], title=f"dropout: FFN hidden activation of the training step (float32, p={args.p})")
    bench.headline_table()
    return bench.finish()


if __name__ == "__main__":
    sys.exit(main())

"""Attention benchmark: fasttrans.attention on every backend against torch's SDPA.

Sweeps (select with --sweep):
    headline  the project's CPU goal configurations, float32: B=4 H=8 L=1024 D=64 with 25%
              of the keys padded (fasttrans key_lengths vs SDPA with the equivalent bool
              mask) and causal, forward and forward+backward; fasttrans.nn.MultiheadAttention
              vs torch.nn.MultiheadAttention forward+backward with a key padding mask at
              B=4 L=512 E=512 H=8 (need_weights=False).
    memory    peak memory of forward+backward at B=1 H=8 L=8192 D=64 float32, bytes above
              the inputs.
    sweep     sequence length x head dim (64, 128) x mask kind x {fwd, fwd+bwd}; CPU goes to
              L=2048 (B*L = 1024 tokens, H=4), CUDA to L=8192 (B*L = 16384, H*D = 2048).
    short     short queries, float32, D=64: the seq2seq model's attention in training (B=64
              H=4: encoder 91 x 91 with key padding, decoder 9 x 9 causal, cross-attention
              9 x 91) and incremental decoding (one query against 100 and 1024 cached keys),
              forward and forward+backward (decoding: forward only); a call of B=1 H=1
              with 4 queries and 8 keys, forward and forward+backward, where the per-call
              costs outside the kernel are most of the time; and the digits model's
              MultiheadAttention on one sequence of 8 tokens with key padding (B=1 L=8
              E=256 H=4): inference (eval mode, no gradients, where torch.nn takes its fused
              fast path) and forward+backward (train mode, dropout 0).

Mask kinds: none, causal, key_padding (the last 25% of the keys), dense_padding (the same
keys as a dense (B, 1, Lq, Lk) bool mask for both: whole tiles are allowed or masked, the case
a tile-classifying kernel should run near its unmasked speed), sliding_window (each query
sees itself and the 255 keys before it, as a dense (B, 1, Lq, Lk) bool mask for both: the
local layers of Mistral-, Gemma- and gpt-oss-style models, where a tile-skipping kernel does
O(L x 256) work), dense_bool (10% of the pairs masked at random), dense_float (a random bias).

Loads (--loads): "tma" (default) lets the Triton forward read keys and values through tensor
descriptors where it can (compute capability >= 9, 16-bit, 16-byte rows); "pointer" makes it
read them by pointer loads everywhere (as FASTTRANS_TMA=0 does), its sweep rows marked
"pointer loads", to compare the two routes by their speedup against torch.

Providers: fasttrans-<backend> for every registered backend (forced with
fasttrans.use_backend), torch (F.scaled_dot_product_attention with the equivalent mask:
key padding as a bool (B, 1, 1, Lk) mask, causal as is_causal=True; torch.nn.MultiheadAttention
for the module case) and, on CUDA, torch-compile.

FLOPs: 4*B*H*Lq*Lk*D for the forward (the two matmuls), x0.5 when causal, x3.5 for
forward+backward (the backward is 2.5 forwards). Key padding and dense masks count every
(query, key) pair, so a kernel that skips padded tiles shows a higher effective rate.
MultiheadAttention adds its projections: 8*B*L*E^2 forward, x3 for forward+backward.
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

MASKS = ("none", "causal", "key_padding", "dense_padding", "sliding_window", "dense_bool", "dense_float")
MODES = ("fwd", "fwd+bwd")
PAD_FRACTION = 0.25  # share of the keys that are padding in the key_padding cases
WINDOW = 256  # keys a query sees in the sliding_window cases, itself included
DENSE_MASKED_FRACTION = 0.1  # share of (query, key) pairs masked out by the dense masks

# The reference backend materialises (B, H, Lq, Lk) tensors: measured peak ~6 fp32 score
# matrices for forward+backward. On CPU it also runs at a few GFLOP/s (an unfused oracle),
# so the timed sweeps run it only up to this many scores.
REFERENCE_SCORE_MATRICES = 6
REFERENCE_MAX_SCORES_CPU = 2**20


def attention_flops(B: int, H: int, Lq: int, Lk: int, D: int, causal: bool, mode: str) -> float:
    flops = 4.0 * B * H * Lq * Lk * D
    if causal:
        flops *= 0.5
    return flops * (3.5 if mode == "fwd+bwd" else 1.0)


def mha_flops(B: int, L: int, E: int, mode: str) -> float:
    projections = 8.0 * B * L * E * E  # q, k, v and output projections: 4 GEMMs of 2*B*L*E*E
    attention = 4.0 * B * L * L * E  # H heads of D = E / H
    return projections * 3 + attention * 3.5 if mode == "fwd+bwd" else projections + attention


# --------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------
def mask_arguments(mask: str, B: int, Lq: int, Lk: int, dtype: torch.dtype, device: str) -> tuple[dict, dict]:
    """(fasttrans.attention kwargs, F.scaled_dot_product_attention kwargs) for one mask kind."""
    if mask == "none":
        return {}, {}
    if mask == "causal":
        return {"is_causal": True}, {"is_causal": True}
    if mask == "key_padding":
        lengths = torch.full((B,), Lk - int(Lk * PAD_FRACTION), dtype=torch.int32, device=device)
        allowed = torch.arange(Lk, device=device) < lengths[:, None]  # (B, Lk), True = may attend
        return {"key_lengths": lengths}, {"attn_mask": allowed.view(B, 1, 1, Lk)}
    if mask == "dense_padding":  # key_padding's keys written as a dense mask: whole tiles allowed or not
        allowed = torch.arange(Lk, device=device) < Lk - int(Lk * PAD_FRACTION)
        allowed = allowed.expand(B, 1, Lq, Lk).contiguous()
        return {"attn_mask": allowed}, {"attn_mask": allowed}
    if mask == "sliding_window":  # bottom-right aligned, as a decoder's local layer
        i, j = torch.arange(Lq, device=device)[:, None] + (Lk - Lq), torch.arange(Lk, device=device)
        allowed = ((j <= i) & (j > i - WINDOW)).expand(B, 1, Lq, Lk).contiguous()
        return {"attn_mask": allowed}, {"attn_mask": allowed}
    if mask == "dense_bool":
        allowed = torch.rand(B, 1, Lq, Lk, device=device) >= DENSE_MASKED_FRACTION
        diagonal = torch.arange(min(Lq, Lk), device=device)
        allowed[..., diagonal, diagonal] = True  # no query without a key
        return {"attn_mask": allowed}, {"attn_mask": allowed}
    if mask == "dense_float":
        bias = torch.randn(B, 1, Lq, Lk, device=device, dtype=dtype)
        return {"attn_mask": bias}, {"attn_mask": bias}
    raise ValueError(f"mask: expected one of {', '.join(MASKS)}, got {mask!r}")


def attention_inputs(B, H, Lq, Lk, D, mask, mode, dtype, device):
    def build():
        torch.manual_seed(0)
        grad = mode == "fwd+bwd"
        q = torch.randn(B, H, Lq, D, device=device, dtype=dtype, requires_grad=grad)
        k, v = (torch.randn(B, H, Lk, D, device=device, dtype=dtype, requires_grad=grad) for _ in range(2))
        ft, th = mask_arguments(mask, B, Lq, Lk, dtype, device)
        dout = torch.randn(B, H, Lq, D, device=device, dtype=dtype) if grad else None
        return types.SimpleNamespace(q=q, k=k, v=v, dout=dout, ft=ft, torch=th)

    return build


def reference_skip(device: str, B: int, H: int, Lq: int, Lk: int, dtype: torch.dtype, quick: bool) -> str | None:
    """Why the reference backend is not run for this size, or None."""
    scores = B * H * Lq * Lk
    need = REFERENCE_SCORE_MATRICES * scores * (8 if dtype == torch.float64 else 4)
    available = common.available_memory_bytes(device)
    if need > available / 4:
        return (f"the reference materialises (B, H, Lq, Lk) scores: ~{need / 2**30:.1f} GiB, more than a quarter "
                f"of the {available / 2**30:.1f} GiB available")
    if device == "cpu" and not quick and scores > REFERENCE_MAX_SCORES_CPU:
        return (f"the reference (unfused oracle, a few GFLOP/s on CPU) runs only up to B*H*Lq*Lk = 2^20 scores on "
                f"CPU, to keep the sweep within its time budget ({scores} here)")
    return None


# --------------------------------------------------------------------------------------
# providers
# --------------------------------------------------------------------------------------
def _timed(forward, inp, mode: str, backend: str | None):
    return common.timed_call(forward, (inp.q, inp.k, inp.v), mode, backend, (inp.q, inp.k, inp.v), inp.dout)


def fasttrans_attention(backend: str, mode: str):
    def make(inp):
        kw = inp.ft
        return _timed(lambda q, k, v: fasttrans.attention(q, k, v, **kw), inp, mode, backend)

    return make


def torch_attention(mode: str, compiled: bool):
    def make(inp):
        kw = inp.torch

        def sdpa(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, **kw)

        return _timed(common.fresh_compile(sdpa) if compiled else sdpa, inp, mode, None)

    return make


def attention_entries(bench: common.Bench, mode: str, ref_skip: str | None) -> list[Entry]:
    entries = []
    for p in bench.providers("attention"):
        if p.backend is not None:
            skip = ref_skip if p.backend == "reference" else None
            entries.append(Entry(p, fasttrans_attention(p.backend, mode), skip=skip))
        else:
            entries.append(Entry(p, torch_attention(mode, compiled=p.name == "torch-compile")))
    return entries


def attention_config(bench, sweep, B, H, L, D, mask, mode, dtype, case="", measure="time", Lk=None) -> Config:
    """Lq = L queries against Lk (default L) keys; causal masks need Lq == Lk (SDPA's is_causal
    and fasttrans' causal_offset=0 then mean the same)."""
    Lk = L if Lk is None else Lk
    if mask == "causal" and Lk != L:
        raise ValueError(f"causal: expected Lq == Lk, got {L} and {Lk}")
    return Config(
        sweep=sweep, case=case, op="attention", mode=mode, dtype=dtype,
        params={"B": B, "H": H, "Lq": L, "Lk": Lk, "D": D, "mask": mask},
        inputs=attention_inputs(B, H, L, Lk, D, mask, mode, dtype, bench.device),
        entries=attention_entries(bench, mode, reference_skip(bench.device, B, H, L, Lk, dtype, bench.quick)),
        work=attention_flops(B, H, L, Lk, D, mask == "causal", mode) if measure != "memory" else None,
        work_unit="FLOP", measure=measure,
    )


# --------------------------------------------------------------------------------------
# MultiheadAttention (module) case
# --------------------------------------------------------------------------------------
def _fasttrans_mha_class():
    cls = getattr(fasttrans.nn, "MultiheadAttention", None)
    if cls is None:
        raise RuntimeError("fasttrans.nn.MultiheadAttention is still a placeholder (None): not implemented yet")
    return cls


def mha_inputs(B, L, E, H, dtype, device):
    def build():
        torch.manual_seed(0)
        module = torch.nn.MultiheadAttention(E, H, batch_first=True, device=device, dtype=dtype)
        x = torch.randn(B, L, E, device=device, dtype=dtype, requires_grad=True)
        pad = torch.arange(L, device=device) >= L - int(L * PAD_FRACTION)  # right padding, True = pad
        return types.SimpleNamespace(torch_module=module, x=x, key_padding_mask=pad.expand(B, L).contiguous(),
                                     dout=torch.randn(B, L, E, device=device, dtype=dtype))

    return build


def _mha_step(module, inp, backend: str | None, mode: str = "fwd+bwd", need_weights: bool = False):
    """The module's forward+backward in train mode, or ("infer") its forward in eval mode
    without gradients; need_weights: the weights are asked for as well (and returned)."""
    x, params = inp.x, list(module.parameters())

    def forward(x):
        out, weights = module(x, x, x, key_padding_mask=inp.key_padding_mask, need_weights=need_weights)
        return out if weights is None else (out, weights)

    if mode == "infer":
        module.eval()

        def infer(x):
            with torch.no_grad():
                return forward(x)

        return common.timed_call(infer, (x.detach(),), "fwd", backend)
    module.train()
    return common.timed_call(forward, (x,), "fwd+bwd", backend, [x, *params], inp.dout)


def mha_config(bench, B, L, E, H, dtype, sweep: str = "headline", mode: str = "fwd+bwd", case: str = "",
               need_weights: bool = False) -> Config:
    """fasttrans.nn.MultiheadAttention against torch.nn's with the same weights, self-attention
    with a right-padding key_padding_mask; mode "fwd+bwd" (train mode) or "infer";
    need_weights=True also asks for the (head-averaged) attention weights."""
    entries = []
    for p in bench.providers("attention"):
        if p.backend is not None:
            def make(inp, backend=p.backend):
                t = inp.torch_module
                module = _fasttrans_mha_class()(t.embed_dim, t.num_heads, batch_first=True,
                                                device=inp.x.device, dtype=inp.x.dtype)
                module.load_state_dict(t.state_dict())  # the same weights as torch's module
                return _mha_step(module, inp, backend, mode, need_weights)

            skip = reference_skip(bench.device, B, H, L, L, dtype, bench.quick) if p.backend == "reference" else None
            entries.append(Entry(p, make, skip=skip))
        elif p.name == "torch":
            entries.append(Entry(p, lambda inp: _mha_step(inp.torch_module, inp, None, mode, need_weights)))
        elif p.name == "torch-compile":
            entries.append(Entry(p, lambda inp: _mha_step(common.fresh_compile(inp.torch_module), inp, None, mode,
                                                          need_weights)))
    return Config(
        sweep=sweep, case=case or f"MultiheadAttention key_padding {mode}", op="multihead_attention", mode=mode,
        dtype=dtype, params={"B": B, "L": L, "E": E, "H": H, "mask": "key_padding",
                             **({"need_weights": True} if need_weights else {})},
        inputs=mha_inputs(B, L, E, H, dtype, bench.device), entries=entries,
        work=mha_flops(B, L, E, mode), work_unit="FLOP",
    )


# --------------------------------------------------------------------------------------
# what runs
# --------------------------------------------------------------------------------------
def short_shapes(quick: bool) -> list[tuple]:
    """(case, B, H, Lq, Lk, mask, modes) of the short-query sweep (D = 64)."""
    if quick:
        return [("decode 1 x 100", 2, 4, 1, 100, "none", ("fwd",)),
                ("cross 9 x 91", 2, 4, 9, 91, "none", MODES)]
    return [
        ("encoder 91 x 91", 64, 4, 91, 91, "key_padding", MODES),
        ("decoder 9 x 9", 64, 4, 9, 9, "causal", MODES),
        ("cross 9 x 91", 64, 4, 9, 91, "key_padding", MODES),
        ("decode 1 x 100", 8, 4, 1, 100, "none", ("fwd",)),
        ("decode 1 x 1024", 4, 8, 1, 1024, "none", ("fwd",)),
        ("tiny 4 x 8", 1, 1, 4, 8, "none", MODES),
    ]


def sweep_shapes(device: str, quick: bool) -> list[tuple[int, int, int, int]]:
    """(B, H, L, D) of the sweep."""
    if device == "cuda":
        lengths = (512, 2048) if quick else (128, 256, 512, 1024, 2048, 4096, 8192)
        dims = (64,) if quick else (64, 128)
        return [(max(1, (2048 if quick else 16384) // L), 2048 // D, L, D) for D in dims for L in lengths]
    # two cores: up to L = 2048 (the memory case alone goes to 8192), 4 heads, 1024 tokens
    lengths = (128, 256) if quick else (128, 256, 512, 1024, 2048)
    dims = (64,) if quick else (64, 128)
    if quick:
        return [(1, 2, L, D) for D in dims for L in lengths]
    return [(max(1, 1024 // L), 4, L, D) for D in dims for L in lengths]


def configs(bench: common.Bench, masks, modes, seq_lens, head_dims):
    def keep(L, D, mask, mode):
        return mask in masks and mode in modes and (not seq_lens or L in seq_lens) and (not head_dims or D in head_dims)

    quick = bench.quick
    fp32 = torch.float32
    # headline: the goal configurations (reduced with --quick)
    B, H, L, D = (1, 2, 256, 64) if quick else (4, 8, 1024, 64)
    for mask in ("key_padding", "causal"):
        for mode in MODES:
            if keep(L, D, mask, mode):
                yield attention_config(bench, "headline", B, H, L, D, mask, mode, fp32, case=f"attention {mask} {mode}")
    B, L, E, H = (2, 128, 128, 2) if quick else (4, 512, 512, 8)
    if keep(L, E // H, "key_padding", "fwd+bwd"):
        yield mha_config(bench, B, L, E, H, fp32)
    B, H, L, D = (1, 2, 1024, 64) if quick else (1, 8, 8192, 64)
    if keep(L, D, "none", "fwd+bwd"):
        yield attention_config(bench, "memory", B, H, L, D, "none", "fwd+bwd", fp32,
                               case="attention peak memory fwd+bwd", measure="memory")
    for B, H, L, D in sweep_shapes(bench.device, quick):
        for mode in MODES:
            for mask in MASKS:
                if keep(L, D, mask, mode):
                    yield attention_config(bench, "sweep", B, H, L, D, mask, mode, bench.args.dtype,
                                           case="pointer loads" if bench.args.loads == "pointer" else "")
    for case, B, H, Lq, Lk, mask, modes_of_case in short_shapes(quick):
        for mode in modes_of_case:
            if keep(Lq, 64, mask, mode):
                yield attention_config(bench, "short", B, H, Lq, 64, mask, mode, fp32, case=f"{case} {mode}", Lk=Lk)
    B, L, E, H = 1, 8, 256, 4  # the digits model's attention, one short sequence
    for mode in ("infer", "fwd+bwd"):
        if keep(L, E // H, "key_padding", "fwd" if mode == "infer" else mode):
            yield mha_config(bench, B, L, E, H, fp32, sweep="short", mode=mode, case=f"module 1 x 8 {mode}")
    for L in (8, 91):  # need_weights=True, torch's default: the weights are materialised and returned
        if keep(L, E // H, "key_padding", "fwd"):
            yield mha_config(bench, B, L, E, H, fp32, sweep="short", mode="infer", need_weights=True,
                             case=f"module 1 x {L} infer, weights")


def main(argv=None) -> int:
    parser = common.make_parser(__doc__)
    parser.add_argument("--mask", action="append", default=[], help=f"mask kinds: {', '.join(MASKS)}")
    parser.add_argument("--mode", action="append", default=[], help="fwd, fwd+bwd")
    parser.add_argument("--seq-len", action="append", default=[], help="sequence lengths to keep")
    parser.add_argument("--head-dim", action="append", default=[], help="head dims to keep")
    parser.add_argument("--loads", choices=("tma", "pointer"), default="tma",
                        help="the Triton forward's key/value loads (see above)")
    args = common.parse_args(parser, argv)
    if args.loads == "pointer":
        try:
            from fasttrans.kernels import attention as triton_attention
        except ImportError:  # no Triton: nothing to switch
            pass
        else:
            triton_attention.TMA_ENABLED = False
    masks = common.split_values(args.mask, choices=MASKS, option="--mask") or MASKS
    modes = common.split_values(args.mode, choices=MODES, option="--mode") or MODES
    seq_lens = common.split_values(args.seq_len, int, option="--seq-len")
    head_dims = common.split_values(args.head_dim, int, option="--head-dim")

    bench = common.Bench("attention", args)
    for cfg in configs(bench, masks, modes, seq_lens, head_dims):
        bench.run(cfg)

    bench.plot_lines("sweep", "sweep", x="Lq", panels=("mode", "mask"), series=("D",),
                     title=f"attention throughput ({common.dtype_name(args.dtype)}, higher is better)")
    short = [r for r in bench.results if r.config.sweep == "short"]
    bench.plot_bars("short", [
        ("speedup vs torch (median / median, providers interleaved in one run)", short, "speedup"),
    ], title="attention: short queries (float32, D=64)")
    timed = [r for r in bench.results if r.config.sweep == "headline"]
    memory = [r for r in bench.results if r.config.sweep == "memory"]
    bench.plot_bars("headline", [
        ("speedup vs torch (median / median, providers interleaved in one run)", timed, "speedup"),
        ("throughput", timed, "throughput"),
        ("peak memory of forward+backward above the inputs", memory, "memory"),
    ], title="attention: goal configurations (float32)")
    bench.headline_table()
    return bench.finish()


if __name__ == "__main__":
    sys.exit(main())

"""Host cost per call: what Python, torch and the launchers spend on one fasttrans call.

At the shapes of a decoding step or a small layer a GPU kernel finishes long before the host
has launched it, and the call costs what the host spends on it. This script times tiny calls
back to back, per backend, against torch's eager op at the same shape:

    norms       layer_norm, add_layer_norm, rms_norm on one row of 1024
    attention   (B, H, L, D) = (1, 1, 16, 64): no mask, causal, key lengths, a dense bool mask
    layer       a TransformerEncoderLayer (d_model 256, 4 heads, batch 1, 8 tokens), fasttrans.nn
                against torch.nn
    hf          a Hugging Face BERT (hidden 64, 4 heads, 2 layers, batch 2, 16 tokens, 25% right
                padding, dropout 0.1 in training), its masked-LM loss, fasttrans's apply() against
                attn_implementation "sdpa"; needs transformers
each forward without gradients (fwd) and forward+backward (fwd+bwd).

On a machine without a GPU (--device cpu, the default there) the Triton provider launches
through a stand-in CUDA driver (benchmarks/standin_cuda.py): Triton's real launcher and every
line of fasttrans's host code run, the driver does nothing, and tensors stay on the CPU. Its
ratio against torch's eager CPU op (which also computes its tiny result) is the host-cost
ratio. The extension provider runs its real CPU kernels.

On a GPU (--device cuda) each provider is timed as back-to-back calls (wall time, what a
launch-bound loop costs), and a second row per provider (variant "gpu kernels") gives the
summed time of the GPU kernels of one call from torch.profiler: a wall time far above it
means the call is bound by the host.

    python benchmarks/bench_host.py                   # stand-in driver on CPU
    python benchmarks/bench_host.py --quick           # a few cases: checks that everything runs
    python benchmarks/bench_host.py --device cuda
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import sys
import types
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a file: make the repository root importable for `benchmarks`
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: see tests/conftest.py

from benchmarks import common  # noqa: E402
from benchmarks.common import Config, Entry  # noqa: E402

SWEEPS = ("norms", "attention", "layer", "hf")
MODES = ("fwd", "fwd+bwd")
# "softcap": Gemma 2's capped scores, against torch's ops for them (SDPA has no cap)
MASKS = ("none", "causal", "key_lengths", "bool", "softcap")
SOFTCAP = 2.0
NORM_OPS = ("layer_norm", "add_layer_norm", "rms_norm")
N = 1024
ATTN_SHAPE = (1, 1, 16, 64)
LAYER = dict(d_model=256, nhead=4, batch=1, tokens=8)
HF_BERT = dict(name="bert", vocab=256, hidden=64, heads=4, kv_heads=4, ffn=128, layers=2)
HF_BATCH, HF_TOKENS = 2, 16


def _pinned(backend: str, fn):
    """fn, called with ``backend`` forced, at the cost of one Context.run per call (a
    ``with use_backend(...)`` per call would be timed too)."""
    import fasttrans

    ctx = contextvars.copy_context()
    manager = fasttrans.use_backend(backend)
    ctx.run(manager.__enter__)

    def call():
        return ctx.run(fn)

    # left inside ctx, where it was entered, once the timed function is dropped
    weakref.finalize(call, ctx.run, manager.__exit__, None, None, None)
    return call


def _timed(forward, args, mode: str, wrt=(), grad_out=None):
    if mode == "fwd":
        return lambda: forward(*args)
    return lambda: torch.autograd.grad(forward(*args), wrt, grad_out)


# --------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------
def _norm_forward(op: str, library: str):
    """f(x, r, w, b) -> y for the op, as fasttrans or torch computes it."""
    import fasttrans

    if library == "fasttrans":
        return {"layer_norm": lambda x, r, w, b: fasttrans.layer_norm(x, (N,), w, b),
                "add_layer_norm": lambda x, r, w, b: fasttrans.add_layer_norm(x, r, w, b)[0],
                "rms_norm": lambda x, r, w, b: fasttrans.rms_norm(x, (N,), w)}[op]
    return {"layer_norm": lambda x, r, w, b: F.layer_norm(x, (N,), w, b),
            "add_layer_norm": lambda x, r, w, b: F.layer_norm(x + r, (N,), w, b),
            "rms_norm": lambda x, r, w, b: F.rms_norm(x, (N,), w)}[op]


def norm_config(bench, op: str, mode: str, dtype: torch.dtype) -> Config:
    device = bench.device

    def inputs():
        grad = mode == "fwd+bwd"
        x = torch.randn(1, N, device=device, dtype=dtype, requires_grad=grad)
        r = torch.randn(1, N, device=device, dtype=dtype, requires_grad=grad) if op == "add_layer_norm" else None
        w = torch.randn(N, device=device, dtype=dtype, requires_grad=grad)
        b = torch.randn(N, device=device, dtype=dtype, requires_grad=grad) if op != "rms_norm" else None
        wrt = [t for t in (x, r, w, b) if t is not None]
        return dict(args=(x, r, w, b), wrt=wrt, dy=torch.randn(1, N, device=device, dtype=dtype))

    def make(library, backend=None):
        def build(inp):
            fn = _timed(_norm_forward(op, library), inp["args"], mode, inp["wrt"], inp["dy"])
            return _pinned(backend, fn) if backend else fn
        return build

    return _config(bench, "norms", "norm", op, mode, dtype, {"M": 1, "N": N}, inputs, make)


def attention_config(bench, mask: str, mode: str, dtype: torch.dtype) -> Config:
    import fasttrans

    device = bench.device
    B, H, L, D = ATTN_SHAPE

    def inputs():
        grad = mode == "fwd+bwd"
        q, k, v = (torch.randn(B, H, L, D, device=device, dtype=dtype, requires_grad=grad) for _ in range(3))
        lengths = torch.full((B,), L - 3, dtype=torch.int32, device=device)
        allowed = torch.rand(B, 1, L, L, device=device) < 0.8
        allowed[..., 0] = True
        padding = torch.arange(L, device=device)[None, :] < lengths[:, None]  # (B, L) keys kept
        return dict(q=q, k=k, v=v, lengths=lengths, allowed=allowed, padding=padding,
                    dy=torch.randn(B, H, L, D, device=device, dtype=dtype))

    def forward(library, inp):
        q, k, v = inp["q"], inp["k"], inp["v"]
        if library == "fasttrans":
            kwargs = {"none": {}, "causal": dict(is_causal=True), "key_lengths": dict(key_lengths=inp["lengths"]),
                      "bool": dict(attn_mask=inp["allowed"]), "softcap": dict(softcap=SOFTCAP)}[mask]
            return lambda: fasttrans.attention(q, k, v, **kwargs)
        if mask == "softcap":  # eager attention as the models that cap write it
            def capped():
                s = torch.matmul(q, k.transpose(-2, -1)) * D ** -0.5
                return torch.matmul(torch.softmax(torch.tanh(s / SOFTCAP) * SOFTCAP, dim=-1), v)
            return capped
        kwargs = {"none": {}, "causal": dict(is_causal=True),
                  "key_lengths": dict(attn_mask=inp["padding"][:, None, None, :]),
                  "bool": dict(attn_mask=inp["allowed"])}[mask]
        return lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)

    def make(library, backend=None):
        def build(inp):
            fn = _timed(forward(library, inp), (), mode, (inp["q"], inp["k"], inp["v"]), inp["dy"])
            return _pinned(backend, fn) if backend else fn
        return build

    params = dict(zip("BHLD", ATTN_SHAPE), mask=mask)
    return _config(bench, "attention", "attention", "attention", mode, dtype, params, inputs, make)


def layer_config(bench, mode: str, dtype: torch.dtype) -> Config:
    import fasttrans.nn

    device = bench.device
    d, nhead, batch, tokens = LAYER["d_model"], LAYER["nhead"], LAYER["batch"], LAYER["tokens"]

    def inputs():
        torch.manual_seed(0)
        theirs = torch.nn.TransformerEncoderLayer(d, nhead, 4 * d, batch_first=True).to(device, dtype)
        ours = fasttrans.nn.TransformerEncoderLayer(d, nhead, 4 * d, batch_first=True).to(device, dtype)
        ours.load_state_dict(theirs.state_dict())
        if mode == "fwd":
            theirs.eval(), ours.eval()
        x = torch.randn(batch, tokens, d, device=device, dtype=dtype, requires_grad=mode == "fwd+bwd")
        return dict(ours=ours, theirs=theirs, x=x, dy=torch.randn(batch, tokens, d, device=device, dtype=dtype))

    def make(library, backend=None):
        def build(inp):
            layer = inp["ours"] if library == "fasttrans" else inp["theirs"]
            x = inp["x"]
            if mode == "fwd":
                def fn():
                    with torch.no_grad():
                        return layer(x)
            else:
                params = [x, *layer.parameters()]
                fn = _timed(layer, (x,), mode, params, inp["dy"])
            return _pinned(backend, fn) if backend else fn
        return build

    params = dict(d_model=d, nhead=nhead, batch=batch, tokens=tokens)
    return _config(bench, "layer", None, "TransformerEncoderLayer", mode, dtype, params, inputs, make)


def hf_config(bench, mode: str, dtype: torch.dtype, unavailable: str | None) -> Config:
    from benchmarks import bench_model

    spec = types.SimpleNamespace(**HF_BERT)
    shared = bench_model.hf_inputs(spec, HF_BATCH, HF_TOKENS, bench.device, dtype, padding=bench_model.HF_PADDING)

    def inputs():
        import fasttrans.integrations.transformers as ftt

        data = shared()
        ours, skipped = ftt.apply(copy.deepcopy(data.model))
        if skipped:
            raise RuntimeError(f"apply() left modules as they were: {skipped}")
        for model in (ours, data.model):
            model.train(mode == "fwd+bwd")  # training: with dropout, as a training step runs
        return dict(data=data, ours=ours, theirs=data.model)

    def make(library, backend=None):
        def build(inp):
            model, data = inp["ours"] if library == "fasttrans" else inp["theirs"], inp["data"]
            if mode == "fwd":
                def fn():
                    with torch.no_grad():
                        return bench_model.hf_loss(model, data)
            else:
                params = list(model.parameters())

                def fn():
                    return torch.autograd.grad(bench_model.hf_loss(model, data), params, allow_unused=True)
            return _pinned(backend, fn) if backend else fn
        return build

    params = dict(model="bert", hidden=spec.hidden, heads=spec.heads, layers=spec.layers, batch=HF_BATCH,
                  tokens=HF_TOKENS, padding=f"{bench_model.HF_PADDING:.0%}")
    cfg = _config(bench, "hf", None, "BertForMaskedLM", mode, dtype, params, inputs, make)
    if unavailable:  # every row says why: transformers is missing
        cfg.entries[:] = [dataclasses.replace(e, provider=dataclasses.replace(e.provider, unavailable=unavailable))
                          for e in cfg.entries]
    return cfg


def _config(bench, sweep, backend_op, op, mode, dtype, params, inputs, make) -> Config:
    entries = []
    for p in bench.providers(backend_op):
        if p.backend == "reference":
            continue  # pure PyTorch: its host cost is torch's, plus ours
        entries.append(Entry(p, make("fasttrans", p.backend) if p.backend else make("torch")))
    return Config(sweep=sweep, case=f"{op} {mode}" + (f" {params['mask']}" if "mask" in params else ""),
                  op=op, mode=mode, dtype=dtype, params=params, inputs=inputs, entries=entries)


def configs(bench, sweeps, modes, masks, dtype):
    quick = bench.quick
    if "norms" in sweeps:
        for op in NORM_OPS[:1] if quick else NORM_OPS:
            for mode in modes:
                yield norm_config(bench, op, mode, dtype)
    if "attention" in sweeps:
        for mask in masks[:1] if quick else masks:
            for mode in modes:
                yield attention_config(bench, mask, mode, dtype)
    if "layer" in sweeps:
        for mode in modes[-1:] if quick else modes:
            yield layer_config(bench, mode, dtype)
    if "hf" in sweeps:
        from benchmarks import bench_model

        unavailable = bench_model.hf_unavailable()
        for mode in modes[-1:] if quick else modes:
            yield hf_config(bench, mode, dtype, unavailable)


# --------------------------------------------------------------------------------------
# GPU: the kernels' own time
# --------------------------------------------------------------------------------------
def kernel_time_s(fn, calls: int = 20) -> float:
    """Summed duration of the GPU kernels one call of fn launches (torch.profiler), per call."""
    return sum(e.device_time_total for e in common.cuda_kernel_events(fn, calls)) / calls / 1e6


def add_kernel_rows(bench, cfg: Config, results) -> None:
    rows = []
    inputs = cfg.inputs()
    for r in results:
        if r.status != "ok":
            continue
        entry = next(e for e in cfg.entries if e.key == (r.provider, r.variant))
        try:
            seconds = kernel_time_s(entry.make(inputs))
            rows.append(common.Result(cfg, r.provider, "gpu kernels", "ok", timing=common.Timing([seconds])))
        except Exception as e:
            rows.append(common.Result(cfg, r.provider, "gpu kernels", "error", error=f"{type(e).__name__}: {e}"))
    for row in rows:
        wall = next(r for r in results if r.provider == row.provider)
        if row.timing is not None:
            share = row.timing.median / wall.timing.median
            print(f"  {row.label:34s} {row.timing.median * 1e3:10.4f} ms of GPU kernels per call "
                  f"({share:.0%} of its wall time)")
    bench._append_csv(rows)
    bench.results.extend(rows)


def main(argv=None) -> int:
    parser = common.make_parser(__doc__)
    parser.add_argument("--mode", action="append", default=[], help="fwd, fwd+bwd")
    parser.add_argument("--mask", action="append", default=[], help=f"attention masks: {', '.join(MASKS)}")
    args = common.parse_args(parser, argv)
    modes = tuple(common.split_values(args.mode, choices=MODES, option="--mode") or MODES)
    masks = tuple(common.split_values(args.mask, choices=MASKS, option="--mask") or MASKS)
    sweeps = tuple(s for s in SWEEPS if not args.sweep or s in args.sweep)
    if args.device == "cpu" and not args.list:
        from benchmarks import standin_cuda

        try:
            standin_cuda.activate()
        except Exception as e:  # no C compiler, no triton: the triton rows say why
            print(f"stand-in CUDA driver not active ({type(e).__name__}: {e}); the triton provider is unavailable")
    dtype = torch.float32 if args.device == "cpu" else (args.dtype or torch.float16)

    bench = common.Bench("host", args)
    for cfg in configs(bench, sweeps, modes, masks, dtype):
        results = bench.run(cfg)
        if args.device == "cuda" and results:
            add_kernel_rows(bench, cfg, results)
    bench.headline_table(SWEEPS)
    return bench.finish()


if __name__ == "__main__":
    sys.exit(main())

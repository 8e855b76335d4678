"""Model benchmark: the seed's seq2seq Transformer on fasttrans.nn against the same model on torch.nn.

The fasttrans model is ``fasttrans.models.Seq2SeqTransformer``; its torch twin is a copy
whose ``transformer`` is a ``torch.nn.Transformer`` loaded with the fasttrans one's
state_dict (the embeddings, positional encoding and generator are plain torch modules in
both). Before timing, each fasttrans provider's logits are checked against the twin's, so
the two sides are the same function with the same weights.

Sweeps (select with --sweep):
    headline  one training step (forward, cross-entropy, backward, Adam) of the
              digits-average model: d_model 256, 4 heads, 3+3 layers, FFN 512, batch 64,
              source 91 tokens, decoder input 9 tokens. tokens/s = batch * (91 + 9) / step.
    decode    greedy decoding, 9 new tokens (the task's answer) for 64 sources and 64 new
              tokens for 8 and for 1: torch.nn (which has no KV cache: the whole prefix is
              re-decoded at every step), fasttrans without and with its KV cache.
              tokens/s = batch * new tokens / time.
    infer     the digits-average model's forward in eval mode without gradients (logits for
              a source and a decoder input), from one short sequence to the training batch:
              torch.nn takes its inference fast path here (the fused encoder layer),
              fasttrans its whole-layer op (one C++ call per encoder or decoder layer).
              tokens/s = batch * (source + decoder input) / time.
    train     (CUDA only) a base-size model: d_model 512, 8 heads, 6+6 layers, FFN 2048,
              batch 32, 128 + 128 tokens.
Every model runs in float32 (the optimizer's state and the weights in one precision; --dtype
does not apply). Every row also carries the peak memory of one call above what was live
before it.
"""

from __future__ import annotations

import copy
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

import fasttrans

if __package__ in (None, ""):  # run as a file: make the repository root importable for `benchmarks`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.common import Config, Entry  # noqa: E402

# The digits-average task (fasttrans.tasks.average): 13 tokens (10 digits, space, s, e);
# sources are 91 tokens, targets 10 (s, 8 digits, e), so training feeds 9 to the decoder.
DIGITS_VOCAB = 13
DIGITS_SRC_LEN = 91
DIGITS_TGT_INPUT_LEN = 9
DIGITS_BOS = 11  # "s"
# fasttrans.models.Seq2SeqTransformer's output agrees with the torch twin's to float32
# rounding (differences ~1e-5); a wrong weight mapping gives differences of order 1.
TWIN_TOLERANCE = 1e-3


def placeholders() -> list[str]:
    """The modules this benchmark needs that are still placeholders (None)."""
    needed = {
        "fasttrans.nn.Transformer": getattr(fasttrans.nn, "Transformer", None),
        "fasttrans.nn.MultiheadAttention": getattr(fasttrans.nn, "MultiheadAttention", None),
        "fasttrans.models.Seq2SeqTransformer": getattr(fasttrans.models, "Seq2SeqTransformer", None),
    }
    return [name for name, obj in needed.items() if obj is None]


# --------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------
def build_model(spec: types.SimpleNamespace, device: str, dtype: torch.dtype):
    from fasttrans.models.seq2seq import Seq2SeqConfig, Seq2SeqTransformer

    torch.manual_seed(0)
    config = Seq2SeqConfig(
        src_vocab_size=spec.vocab, d_model=spec.d_model, nhead=spec.nhead,
        num_encoder_layers=spec.layers, num_decoder_layers=spec.layers, dim_feedforward=spec.ffn,
    )
    return Seq2SeqTransformer(config).to(device=device, dtype=dtype)


def torch_twin(model):
    """A copy of ``model`` whose Transformer is torch.nn's, with the same weights."""
    twin = copy.deepcopy(model)
    c = model.config
    p = next(model.parameters())
    twin.transformer = torch.nn.Transformer(
        d_model=c.d_model, nhead=c.nhead, num_encoder_layers=c.num_encoder_layers,
        num_decoder_layers=c.num_decoder_layers, dim_feedforward=c.dim_feedforward, dropout=c.dropout,
        activation=c.activation, layer_norm_eps=c.layer_norm_eps, batch_first=True, norm_first=c.norm_first,
        bias=c.bias, device=p.device, dtype=p.dtype,
    )
    twin.transformer.load_state_dict(model.transformer.state_dict())  # strict: the drop-in promise
    return twin


def check_same_function(model, twin, inp, backend: str) -> None:
    """Raise unless ``model`` (on ``backend``) and ``twin`` give the same logits in eval mode."""
    model.eval()
    twin.eval()
    try:
        with torch.no_grad(), fasttrans.use_backend(backend):
            ours = model(inp.src[:2], inp.tgt_in[:2])
        with torch.no_grad():
            theirs = twin(inp.src[:2], inp.tgt_in[:2])
    finally:
        model.train()
        twin.train()
    diff = (ours.float() - theirs.float()).abs().max().item()
    if not diff <= TWIN_TOLERANCE * max(1.0, theirs.float().abs().max().item()):
        raise RuntimeError(f"fasttrans model on backend {backend!r} and its torch.nn twin disagree: "
                           f"max |logit difference| = {diff:.3g}; the comparison would not be like for like")


def model_inputs(spec, batch: int, src_len: int, tgt_len: int, device: str, dtype: torch.dtype):
    def build():
        model = build_model(spec, device, dtype)
        g = torch.Generator().manual_seed(0)
        src = torch.randint(0, spec.vocab, (batch, src_len), generator=g).to(device)
        tgt = torch.randint(0, spec.vocab, (batch, tgt_len + 1), generator=g).to(device)
        return types.SimpleNamespace(model=model, twin=torch_twin(model), src=src, tgt_in=tgt[:, :-1],
                                     tgt_out=tgt[:, 1:])

    return build


# --------------------------------------------------------------------------------------
# the timed functions
# --------------------------------------------------------------------------------------
def train_step(model, inp, backend: str | None, forward=None):
    """One optimisation step: forward, cross-entropy, backward, Adam."""
    forward = model if forward is None else forward  # a compiled module has no truth value
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model.train()

    def step():
        with common.backend_context(backend):
            logits = forward(inp.src, inp.tgt_in)  # (B, T, V)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), inp.tgt_out.reshape(-1))
            loss.backward()
            optimizer.step()
            # gradients are dropped here, not at the start of the next step: no memory outlives
            # a step except the weights and Adam's state, so the peak of one step is all its own
            optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def decode_run(model, inp, backend: str | None, new_tokens: int, use_cache: bool):
    """Greedy decoding of every source for exactly ``new_tokens`` tokens (no end token)."""
    def run():
        with common.backend_context(backend):
            return model.generate(inp.src, new_tokens, DIGITS_BOS, None, use_cache=use_cache)

    return run


def infer_run(model, inp, backend: str | None, forward=None):
    """The logits of every source and decoder input, in eval mode without gradients."""
    forward = model if forward is None else forward
    model.eval()

    def run():
        with torch.no_grad(), common.backend_context(backend):
            return forward(inp.src, inp.tgt_in)

    return run


def _entries(bench: common.Bench, timed) -> list[Entry]:
    """One entry per provider of ``timed(model, inp, backend, forward=None)``: each fasttrans
    backend on a copy of the model (checked against the twin first), torch on a copy of the
    twin, torch-compile on a compiled copy of the twin."""
    entries = []
    for p in bench.providers(None):
        if p.backend is not None:
            def make(inp, backend=p.backend):
                model = copy.deepcopy(inp.model)
                check_same_function(model, inp.twin, inp, backend)
                return timed(model, inp, backend)

            entries.append(Entry(p, make))
        elif p.name == "torch":
            entries.append(Entry(p, lambda inp: timed(copy.deepcopy(inp.twin), inp, None)))
        elif p.name == "torch-compile":
            def make_compiled(inp):
                twin = copy.deepcopy(inp.twin)
                return timed(twin, inp, None, forward=common.fresh_compile(twin))

            entries.append(Entry(p, make_compiled))
    return entries


def infer_entries(bench: common.Bench) -> list[Entry]:
    return _entries(bench, infer_run)


def train_entries(bench: common.Bench) -> list[Entry]:
    return _entries(bench, train_step)


def decode_entries(bench: common.Bench, new_tokens: int) -> list[Entry]:
    entries = []
    for p in bench.providers(None):
        if p.backend is not None:
            for use_cache in (False, True):
                def make(inp, backend=p.backend, use_cache=use_cache):
                    model = copy.deepcopy(inp.model)
                    check_same_function(model, inp.twin, inp, backend)
                    return decode_run(model, inp, backend, new_tokens, use_cache)

                entries.append(Entry(p, make, variant="kv-cache" if use_cache else "no-cache"))
        elif p.name == "torch":
            entries.append(Entry(p, lambda inp: decode_run(inp.twin, inp, None, new_tokens, False), variant="no-cache"))
        elif p.name == "torch-compile":
            entries.append(Entry(p, None, variant="no-cache",
                                 skip="the target grows by one token per step: torch.compile would recompile "
                                      "for every length"))
    return entries


# --------------------------------------------------------------------------------------
# what runs
# --------------------------------------------------------------------------------------
DIGITS_MODEL = types.SimpleNamespace(name="digits", vocab=DIGITS_VOCAB, d_model=256, nhead=4, layers=3, ffn=512)
BASE_MODEL = types.SimpleNamespace(name="base", vocab=1000, d_model=512, nhead=8, layers=6, ffn=2048)


def _params(spec, batch, src_len, tgt_len, **extra):
    return {"model": spec.name, "d_model": spec.d_model, "heads": spec.nhead, "layers": f"{spec.layers}+{spec.layers}",
            "ffn": spec.ffn, "batch": batch, "src": src_len, "tgt": tgt_len, **extra}


def configs(bench: common.Bench):
    fp32 = torch.float32
    batch = 2 if bench.quick else 64
    yield Config(
        sweep="headline", case="seq2seq training step (digits-average)", op="seq2seq", mode="train step",
        dtype=fp32, params=_params(DIGITS_MODEL, batch, DIGITS_SRC_LEN, DIGITS_TGT_INPUT_LEN),
        inputs=model_inputs(DIGITS_MODEL, batch, DIGITS_SRC_LEN, DIGITS_TGT_INPUT_LEN, bench.device, fp32),
        entries=train_entries(bench), work=float(batch * (DIGITS_SRC_LEN + DIGITS_TGT_INPUT_LEN)),
        work_unit="token", measure="time+memory",
    )
    # without a cache, T new tokens cost T * (T + 1) / 2 decoder positions: the long cases
    # use smaller batches so that the cacheless providers stay within the time budget; batch 1
    # is one sequence's latency, where each step's fixed costs weigh most
    for decode_batch, new_tokens in ((2, 9),) if bench.quick else ((64, 9), (8, 64), (1, 64)):
        yield Config(
            sweep="decode", case=f"greedy decode {new_tokens} tokens, batch {decode_batch}", op="seq2seq",
            mode="decode", dtype=fp32, params=_params(DIGITS_MODEL, decode_batch, DIGITS_SRC_LEN, new_tokens),
            inputs=model_inputs(DIGITS_MODEL, decode_batch, DIGITS_SRC_LEN, DIGITS_TGT_INPUT_LEN, bench.device, fp32),
            entries=decode_entries(bench, new_tokens), work=float(decode_batch * new_tokens), work_unit="token",
            measure="time+memory", baseline=("torch", "no-cache"),
        )
    shapes = ((1, 8, 4),) if bench.quick else ((1, 8, 4), (1, 32, 9), (1, 91, 9), (8, 91, 9), (64, 91, 9))
    for batch, src_len, tgt_len in shapes:
        yield Config(
            sweep="infer", case=f"inference forward, batch {batch}, source {src_len}", op="seq2seq", mode="infer",
            dtype=fp32, params=_params(DIGITS_MODEL, batch, src_len, tgt_len),
            inputs=model_inputs(DIGITS_MODEL, batch, src_len, tgt_len, bench.device, fp32),
            entries=infer_entries(bench), work=float(batch * (src_len + tgt_len)), work_unit="token",
            measure="time+memory",
        )
    if bench.device == "cuda" and not bench.quick:
        batch, length = 32, 128
        yield Config(
            sweep="train", case="seq2seq training step (base)", op="seq2seq", mode="train step",
            dtype=fp32, params=_params(BASE_MODEL, batch, length, length),
            inputs=model_inputs(BASE_MODEL, batch, length, length, bench.device, fp32),
            entries=train_entries(bench), work=float(batch * 2 * length), work_unit="token",
            measure="time+memory",
        )


PLOTTED_SWEEPS = {
    "headline": "training step throughput (source + decoder-input tokens per second)",
    "train": "training step throughput (source + decoder-input tokens per second)",
    "decode": "greedy decoding throughput (generated tokens per second)",
    "infer": "inference forward throughput (source + decoder-input tokens per second)",
}


def main(argv=None) -> int:
    parser = common.make_parser(__doc__)
    args = common.parse_args(parser, argv)
    missing = placeholders()
    if missing:
        print(f"bench_model: cannot run: {', '.join(missing)} "
              f"{'is' if len(missing) == 1 else 'are'} still a placeholder (None) in this checkout; "
              "nothing was measured or written", file=sys.stderr)
        return 2

    bench = common.Bench("model", args)
    for cfg in configs(bench):
        bench.run(cfg)

    # one figure per sweep, as the other benchmarks draw them: a run of some sweeps replaces
    # their figures and leaves the others' as the last full run drew them
    for sweep, what in PLOTTED_SWEEPS.items():
        results = [r for r in bench.results if r.config.sweep == sweep]
        bench.plot_bars(sweep, [
            (what, results, "throughput"),
            ("speedup vs torch.nn (median / median, interleaved in one run)", results, "speedup"),
            ("peak memory of one call above what was live before it", results, "memory"),
        ], title="seq2seq model: fasttrans.nn vs torch.nn, same weights")
    bench.headline_table()
    return bench.finish()


if __name__ == "__main__":
    sys.exit(main())

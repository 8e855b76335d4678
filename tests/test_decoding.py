"""Incremental (key/value-cached) greedy decoding equals full re-decoding."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fasttrans
import fasttrans.functional as FT
from fasttrans.models.decoding import build_cache, decode_step
from fasttrans.models.seq2seq import Seq2SeqConfig, Seq2SeqTransformer
from helpers import fuzz_settings, require_extension

PAD, BOS, EOS = 0, 1, 2
VOCAB = 23


def _model(norm_first: bool, activation: str = "relu", nhead: int = 3, layers: int = 2, **kw) -> Seq2SeqTransformer:
    torch.manual_seed(11)
    config = Seq2SeqConfig(
        src_vocab_size=19, tgt_vocab_size=VOCAB, d_model=24, nhead=nhead, num_encoder_layers=layers,
        num_decoder_layers=layers, dim_feedforward=40, dropout=0.1, activation=activation,
        norm_first=norm_first, src_pad_idx=PAD, tgt_pad_idx=PAD, max_len=64, **kw,
    )
    model = Seq2SeqTransformer(config)
    # sharper logits than at initialisation, so that argmax is never a near-tie
    with torch.no_grad():
        model.generator.weight.mul_(8.0)
    return model


def _src(batch: int = 3, length: int = 9) -> torch.Tensor:
    src = torch.randint(3, 19, (batch, length), generator=torch.Generator().manual_seed(5))
    src[1, 6:] = PAD  # right padding
    src[2, 2] = PAD  # a hole in the middle (masked, but not a key_lengths form)
    return src


@pytest.mark.parametrize(
    "norm_first, activation, nhead",
    [(False, "relu", 3), (True, "gelu", 3), (True, "relu", 1), (False, "gelu", 8)],
)
def test_cached_generation_equals_full_redecoding(norm_first, activation, nhead):
    model = _model(norm_first, activation, nhead)
    model.train()  # generate must switch dropout off by itself, and restore the mode
    src = _src()
    cached, cached_logits = model.generate(src, 12, BOS, None, return_logits=True)
    full, full_logits = model.generate(src, 12, BOS, None, use_cache=False, return_logits=True)
    assert model.training
    assert cached.shape == full.shape == (3, 13)
    assert torch.equal(cached, full)
    torch.testing.assert_close(cached_logits, full_logits, atol=2e-5, rtol=2e-5)
    # and both equal the teacher-forced logits of the sequence they produced
    model.eval()
    with torch.no_grad():
        forced = model(src, cached[:, :-1], tgt_key_padding_mask=torch.zeros_like(cached[:, :-1], dtype=torch.bool))
    torch.testing.assert_close(cached_logits, forced, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("hole", [True, False], ids=["padding-with-a-hole", "right-padding"])
def test_chunked_prefix_uses_bottom_right_causal_alignment(hole):
    """Several new positions at once on top of a cached prefix (Lq > 1, Lk > Lq), with the
    source padding as a dense mask (a hole) or as key lengths (right padding only)."""
    model = _model(False).eval()
    src = _src()
    if not hole:
        src[2, 2] = 5
    tgt = torch.randint(3, VOCAB, (3, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        memory = model.encode(src)
        reference = model.decode(tgt, memory, model.src_padding_mask(src))  # (3, 10, 24)
        cache = build_cache(model, memory, model.src_padding_mask(src), capacity=10)
        pieces = [decode_step(model, tgt[:, :1], cache), decode_step(model, tgt[:, 1:4], cache),
                  decode_step(model, tgt[:, 4:5], cache), decode_step(model, tgt[:, 5:], cache)]
    assert cache.length == 10
    if hole:
        assert cache.memory_lengths is None and cache.memory_mask.shape == (3, 1, 1, 9)
    else:
        assert cache.memory_mask is None and cache.memory_lengths.tolist() == [9, 6, 9]
    torch.testing.assert_close(torch.cat(pieces, dim=1), reference, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="capacity"):
        decode_step(model, tgt[:, :1], cache)


def test_cross_attention_keys_are_computed_once():
    model = _model(True).eval()
    src = _src()
    calls = []
    for layer in model.transformer.decoder.layers:
        layer.multihead_attn.register_forward_hook(lambda *a: calls.append(1))
    model.generate(src, 6, BOS, None)
    assert calls == []  # the cached path never runs the module: it reads its weights
    model.generate(src, 6, BOS, None, use_cache=False)
    assert len(calls) == 6 * 2


def test_eos_finishes_rows_and_fills_with_pad():
    model = _model(False).eval()
    src = _src()
    tokens = model.generate(src, 8, BOS, None)
    eos = int(tokens[0, 3])  # pretend the token row 0 emits third is the end token
    stopped = model.generate(src, 8, BOS, eos)
    full = model.generate(src, 8, BOS, eos, use_cache=False)
    assert torch.equal(stopped, full)
    row = stopped[0].tolist()
    first = row.index(eos, 1)
    assert all(t == PAD for t in row[first + 1 :])
    finished = (stopped[:, 1:] == eos).any(dim=1)
    if bool(finished.all()):
        assert stopped.shape[1] <= 9  # stops early once every row is finished


def test_generation_argument_errors():
    model = _model(False)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(_src(), 0, BOS, EOS)


def test_generate_restores_every_submodules_mode():
    """A model trained with a frozen part in eval mode keeps it so after generating."""
    model = _model(False)
    model.train()
    model.transformer.encoder.eval()
    before = {n: m.training for n, m in model.named_modules()}
    model.generate(_src(), 3, BOS, EOS)
    assert {n: m.training for n, m in model.named_modules()} == before


# --------------------------------------------------------------------------------------
# one fused call per layer and step (fasttrans::decoder_layer_step_fwd_extension)
# --------------------------------------------------------------------------------------
STEP_OP = "fasttrans::decoder_layer_step_fwd_extension"


@contextlib.contextmanager
def _python_steps():
    """decode_step never takes the fused call inside: the Python layer step runs."""
    with pytest.MonkeyPatch.context() as mp:
        real = FT.inference_op
        mp.setattr(FT, "inference_op", lambda kind, x: None if kind == "decoder_step" else real(kind, x))
        yield


def _steps(model, src, tgt, chunks, padding):
    """decode_step over tgt cut into chunks: (the outputs, the final cache, the ops that ran)."""
    with torch.no_grad():
        memory = model.encode(src, padding)
        cache = build_cache(model, memory, padding, capacity=tgt.shape[1])
        outs, start = [], 0
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for n in chunks:
                outs.append(decode_step(model, tgt[:, start:start + n], cache))
                start += n
    return outs, cache, {e.name for e in prof.events() if e.name.startswith("fasttrans::")}


def _assert_fused_steps_equal_python_steps(model, src, tgt, chunks, padding):
    """The fused steps ran, the Python steps did not, and both gave the same outputs and
    caches bit for bit; returns the fused run's cache."""
    fused, cache, ops = _steps(model, src, tgt, chunks, padding)
    assert STEP_OP in ops
    with _python_steps():
        plain, plain_cache, ops = _steps(model, src, tgt, chunks, padding)
    assert STEP_OP not in ops
    for a, b in zip(fused, plain):
        assert a.dtype == next(model.parameters()).dtype and torch.equal(a, b)
    for lc, plain_lc in zip(cache.layers, plain_cache.layers):
        assert torch.equal(lc.self_k, plain_lc.self_k) and torch.equal(lc.self_v, plain_lc.self_v)
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("padding", ["none", "right", "hole"])
@pytest.mark.parametrize("norm_first,activation", [(False, "relu"), (True, "gelu"), (True, "relu"), (False, "gelu")])
def test_fused_steps_equal_the_python_steps_bit_for_bit(norm_first, activation, padding, dtype):
    require_extension("cpu", "attention")
    model = _model(norm_first, activation).eval().to(dtype)
    src = _src()
    if padding != "hole":
        src[2, 2] = 5
    if padding == "none":
        src[1, 6:] = 5
    pad = model.src_padding_mask(src)
    tgt = torch.randint(3, VOCAB, (3, 9), generator=torch.Generator().manual_seed(2))
    chunks = (1, 3, 1, 4)  # single tokens and forced prefixes on top of a cached one
    cache = _assert_fused_steps_equal_python_steps(model, src, tgt, chunks, pad)
    if padding == "right":
        assert cache.memory_lengths is not None
    if padding == "hole":
        assert cache.memory_mask is not None


def test_fused_steps_only_where_nothing_needs_a_gradient_or_a_module():
    require_extension("cpu", "attention")
    model = _model(False).eval()
    src, tgt = _src(), torch.randint(3, VOCAB, (3, 2), generator=torch.Generator().manual_seed(2))

    def ops():
        memory = model.encode(src).detach()
        cache = build_cache(model, memory, model.src_padding_mask(src), capacity=2)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            decode_step(model, tgt[:, :1], cache)
        return {e.name for e in prof.events()}

    with torch.no_grad():
        assert STEP_OP in ops()
    assert STEP_OP not in ops()  # grad mode on and parameters that require one: autograd records the step
    with torch.no_grad():
        with fasttrans.use_backend("reference"):
            assert STEP_OP not in ops()
        model.transformer.decoder.layers[0].linear1.register_forward_hook(lambda *a: None)
        names = ops()
        assert STEP_OP in names and "aten::relu" in names  # the hooked layer steps in Python, the next one fused


def test_fused_step_in_generate_equals_python_steps():
    require_extension("cpu", "attention")
    model = _model(True, "gelu")
    src = _src()
    tokens, logits = model.generate(src, 10, BOS, None, return_logits=True)
    with _python_steps():
        tokens_p, logits_p = model.generate(src, 10, BOS, None, return_logits=True)
    assert torch.equal(tokens, tokens_p) and torch.equal(logits, logits_p)


def _step_op_args():
    model = _model(False).eval()
    layer = model.transformer.decoder.layers[0]
    H, E, S = 3, 24, 9
    g = torch.Generator().manual_seed(4)
    weights = [w.detach() for w in (layer.self_attn.in_proj_weight, layer.self_attn.out_proj.weight,
                                    layer.multihead_attn.in_proj_weight, layer.multihead_attn.out_proj.weight,
                                    layer.linear1.weight, layer.linear2.weight)]
    biases = [b.detach() for b in (layer.self_attn.in_proj_bias, layer.self_attn.out_proj.bias,
                                   layer.multihead_attn.in_proj_bias, layer.multihead_attn.out_proj.bias,
                                   layer.linear1.bias, layer.linear2.bias)]
    norms = (layer.norm1, layer.norm2, layer.norm3)
    return [torch.randn(2, 2, E, generator=g), torch.randn(2, H, 6, E // H, generator=g),
            torch.randn(2, H, 6, E // H, generator=g), 3, torch.randn(2, H, S, E // H, generator=g),
            torch.randn(2, H, S, E // H, generator=g), None, torch.tensor([9, 4], dtype=torch.int32), weights, biases,
            [n.weight.detach() for n in norms], [n.bias.detach() for n in norms], [1e-5] * 3, H, 0, False]


def test_step_opcheck():
    require_extension("cpu", "attention")
    fasttrans.backends.inference_ops()  # registers the fake implementation
    torch.library.opcheck(torch.ops.fasttrans.decoder_layer_step_fwd_extension, _step_op_args())


STEP_OP_ERRORS = {
    "start": (lambda a: a.__setitem__(3, -1), "start: expected a non-negative position"),
    "self_k": (lambda a: a.__setitem__(3, 5), "self_k: expected shape (2, 3, L, 8) with L >= 7"),
    "self_v": (lambda a: a.__setitem__(2, a[2].double()), "self_v: expected Float"),
    "cross_v": (lambda a: a.__setitem__(5, a[5][:, :, :4]), "cross_v: expected the 9 positions of cross_k"),
    "cross_k": (lambda a: a.__setitem__(4, a[4][:1]), "cross_k: expected shape (2, 3, L, 8)"),
    "weights": (lambda a: a.__setitem__(8, a[8][:4]), "weights, biases: expected 6"),
    "x": (lambda a: a.__setitem__(0, a[0][0]), "x: expected a 3-D"),
    "num_heads": (lambda a: a.__setitem__(13, 5), "num_heads: expected a positive divisor"),
    "cross_key_lengths": (lambda a: a.__setitem__(7, torch.tensor([1, 2, 3])), "key_lengths"),
}


@pytest.mark.parametrize("bad", list(STEP_OP_ERRORS))
def test_the_step_op_names_the_argument_at_fault(bad):
    require_extension("cpu", "attention")
    fasttrans.backends.inference_ops()
    args = _step_op_args()
    corrupt, message = STEP_OP_ERRORS[bad]
    corrupt(args)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        torch.ops.fasttrans.decoder_layer_step_fwd_extension(*args)


@st.composite
def _decoding_cases(draw):
    nhead = draw(st.sampled_from([1, 2, 4]))
    batch, source = draw(st.integers(1, 4)), draw(st.integers(1, 12))
    lengths = [draw(st.integers(1, source)) for _ in range(batch)]
    chunks = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    return dict(
        nhead=nhead, d_model=nhead * draw(st.sampled_from([2, 8, 16])), layers=draw(st.integers(1, 2)),
        norm_first=draw(st.booleans()), activation=draw(st.sampled_from(["relu", "gelu"])),
        bias=draw(st.booleans()), dtype=draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16])),
        source=source, lengths=lengths, hole=draw(st.booleans()) and source > 2, chunks=chunks,
        seed=draw(st.integers(0, 2**16)),
    )


@fuzz_settings(40)
@given(case=_decoding_cases())
def test_fused_steps_on_drawn_models_equal_the_python_steps(case):
    """Drawn model sizes, padding (right padding as key lengths, a hole as a dense mask),
    dtypes and chunkings of the target: the fused steps give the Python steps' bits."""
    require_extension("cpu", "attention")
    torch.manual_seed(case["seed"])
    config = Seq2SeqConfig(
        src_vocab_size=19, tgt_vocab_size=VOCAB, d_model=case["d_model"], nhead=case["nhead"],
        num_encoder_layers=case["layers"], num_decoder_layers=case["layers"], dim_feedforward=2 * case["d_model"],
        activation=case["activation"], norm_first=case["norm_first"], bias=case["bias"], src_pad_idx=PAD,
        tgt_pad_idx=PAD, max_len=64,
    )
    model = Seq2SeqTransformer(config).eval().to(case["dtype"])
    g = torch.Generator().manual_seed(case["seed"])
    src = torch.randint(3, 19, (len(case["lengths"]), case["source"]), generator=g)
    for row, length in enumerate(case["lengths"]):
        src[row, length:] = PAD
    if case["hole"]:
        src[0, 1] = PAD
    tgt = torch.randint(3, VOCAB, (src.shape[0], sum(case["chunks"])), generator=g)
    _assert_fused_steps_equal_python_steps(model, src, tgt, case["chunks"], model.src_padding_mask(src))

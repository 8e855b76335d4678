"""Incremental (key/value-cached) greedy decoding equals full re-decoding."""

from __future__ import annotations

import pytest
import torch

from fasttrans.models.decoding import build_cache, decode_step
from fasttrans.models.seq2seq import Seq2SeqConfig, Seq2SeqTransformer

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

"""Each seed's model, rebuilt from fasttrans.nn blocks: shapes, gradients, masking, formulas.

The seeds are the five model designs this project started from: 000 a from-scratch
Transformer (d_model 6, 9 layers, pad 0, exponent-doubled sinusoids), 001 the digits-average
model on torch.nn.Transformer, 002 a shared-embedding model with sqrt(d_model) scaling,
cos/sin-swapped sinusoids and a log-softmax generator, 003 an encoder with padding_idx=1,
004 the toy German -> English pair.
"""

from __future__ import annotations

import math

import pytest
import torch

import fasttrans
from fasttrans.models.seq2seq import Seq2SeqConfig, Seq2SeqTransformer
from fasttrans.nn import PositionalEncoding, TokenEmbedding
from fasttrans.nn.embedding import sinusoidal_table
from fasttrans.tasks import average, translate


# --------------------------------------------------------------------------------------
# the seeds' positional-encoding formulas, written out as the seeds write them
# --------------------------------------------------------------------------------------
def seed000_table(max_len: int, d: int) -> torch.Tensor:
    pe = torch.zeros(max_len, d, dtype=torch.float64)
    for pos in range(max_len):
        for i in range(0, d, 2):
            pe[pos, i] = math.sin(pos / (10000 ** ((2 * i) / d)))
            pe[pos, i + 1] = math.cos(pos / (10000 ** ((2 * i) / d)))
    return pe


def seed001_table(max_len: int, d: int) -> torch.Tensor:
    pe = torch.zeros(max_len, d, dtype=torch.float64)
    position = torch.arange(0, max_len, dtype=torch.float64).unsqueeze(1)
    scaling = torch.tensor([10000.0 ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    pe[:, 0::2] = torch.sin(position * scaling)
    pe[:, 1::2] = torch.cos(position * scaling)
    return pe


def seed002_table(max_len: int, d: int) -> torch.Tensor:
    pe = torch.zeros(max_len, d, dtype=torch.float64)
    position = torch.arange(0, max_len).unsqueeze(1).double()
    div_term = torch.exp(torch.arange(0, d, 2, dtype=torch.float64) * -(math.log(10000.0) / d))
    pe[:, 1::2] = torch.sin(position * div_term)
    pe[:, 0::2] = torch.cos(position * div_term)
    return pe


def seed003_table(max_len: int, d: int) -> torch.Tensor:
    pos = torch.arange(0, max_len, dtype=torch.float64).unsqueeze(1)
    _2i = torch.arange(0, d, 2, dtype=torch.float64)
    pe = torch.zeros(max_len, d, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos / (10000 ** (_2i / d)))
    pe[:, 1::2] = torch.cos(pos / (10000 ** (_2i / d)))
    return pe


@pytest.mark.parametrize(
    "variant, formula, d",
    [
        ("paper", seed001_table, 6),
        ("paper", seed003_table, 22),
        ("double_exponent", seed000_table, 6),
        ("double_exponent", seed000_table, 14),
        ("cos_sin", seed002_table, 10),
    ],
)
def test_sinusoids_match_the_seed_formulas(variant, formula, d):
    table = sinusoidal_table(37, d, variant)
    assert table.dtype == torch.float32 and table.shape == (37, d)
    torch.testing.assert_close(table.double(), formula(37, d), atol=1e-6, rtol=0)


def test_paper_variant_differs_from_the_seed_variants():
    paper = sinusoidal_table(20, 8)
    assert not torch.allclose(paper, sinusoidal_table(20, 8, "double_exponent"), atol=1e-3)
    assert not torch.allclose(paper, sinusoidal_table(20, 8, "cos_sin"), atol=1e-3)


def test_sinusoids_odd_width_and_bad_variant():
    table = sinusoidal_table(9, 7)
    pos = torch.arange(9, dtype=torch.float64)
    for col in range(7):
        angle = pos / 10000 ** ((col - col % 2) / 7)
        expected = torch.sin(angle) if col % 2 == 0 else torch.cos(angle)
        torch.testing.assert_close(table[:, col].double(), expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="variant"):
        sinusoidal_table(4, 4, "rope")


def test_positional_encoding_module():
    pe = PositionalEncoding(12, dropout=0.0, max_len=30)
    x = torch.randn(3, 7, 12)
    torch.testing.assert_close(pe(x), x + sinusoidal_table(30, 12)[:7])
    torch.testing.assert_close(pe(x, offset=5), x + sinusoidal_table(30, 12)[5:12])
    assert "pe" not in pe.state_dict()  # a function of the arguments, not a weight
    assert "pe" in dict(pe.named_buffers())
    with pytest.raises(ValueError, match="max_len"):
        pe(torch.randn(1, 31, 12))
    with pytest.raises(ValueError, match="x: expected shape"):
        pe(torch.randn(1, 4, 11))
    pe.train()
    dropped = PositionalEncoding(12, dropout=0.5, max_len=30)(x)
    assert (dropped == 0).any()  # dropout after the sum, as in the seeds


def test_token_embedding_scaling_padding_and_init():
    emb = TokenEmbedding(11, 16, padding_idx=1, scale=True, init_std=16**-0.5)
    tokens = torch.tensor([[1, 2, 3, 1], [4, 1, 10, 0]])
    out = emb(tokens)
    assert out.shape == (2, 4, 16)
    torch.testing.assert_close(out, emb.weight[tokens] * 4.0)
    assert torch.equal(out[tokens == 1], torch.zeros(3, 16))
    out.sum().backward()
    assert torch.equal(emb.weight.grad[1], torch.zeros(16))  # the pad row never learns
    assert emb.weight.grad[2].abs().sum() > 0
    # scaled N(0, 1/d) rows are unit-size again, like the sinusoids
    big = TokenEmbedding(1000, 64, scale=True, init_std=64**-0.5)
    assert abs(big(torch.arange(1000)).std().item() - 1.0) < 0.05
    plain = TokenEmbedding(1000, 64)
    assert abs(plain.weight.std().item() - 1.0) < 0.05  # nn.Embedding's N(0, 1)


# --------------------------------------------------------------------------------------
# the models
# --------------------------------------------------------------------------------------
def _check_forward_backward(model: Seq2SeqTransformer, src, tgt, vocab):
    model.train()
    out = model(src, tgt)
    assert out.shape == (*tgt.shape, vocab)
    assert torch.isfinite(out).all()
    out.logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    # every layer of both stacks is reached by the gradient
    assert model.transformer.encoder.layers[0].self_attn.in_proj_weight.grad.abs().sum() > 0
    assert model.transformer.decoder.layers[0].multihead_attn.in_proj_weight.grad.abs().sum() > 0
    return out


def _check_causal(model: Seq2SeqTransformer, src, tgt, vocab):
    """Changing target token t changes no output before t."""
    model.eval()
    with torch.no_grad():
        out = model(src, tgt)
        t = tgt.shape[1] - 2
        changed = tgt.clone()
        changed[:, t:] = (changed[:, t:] + 1) % vocab
        out2 = model(src, changed)
    torch.testing.assert_close(out2[:, :t], out[:, :t], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out2[:, t:], out[:, t:])


def _check_source_padding(model: Seq2SeqTransformer, src, tgt, pad: int, vocab: int):
    """Changing the tokens under the source padding mask, or adding more padding, changes nothing."""
    model.eval()
    mask = src == pad
    assert mask.any(), "the test data must contain padding"
    with torch.no_grad():
        out = model(src, tgt)
        changed = torch.where(mask, (pad + 1 + torch.arange(src.numel()).view_as(src)) % vocab, src)
        changed = torch.where(mask & (changed == pad), (pad + 1) % vocab, changed)
        out_changed = model(changed, tgt, src_key_padding_mask=mask)
        longer = torch.cat([src, torch.full((src.shape[0], 3), pad)], dim=1)
        out_longer = model(longer, tgt)
        out_unmasked = model(changed, tgt, src_key_padding_mask=torch.zeros_like(mask))
    torch.testing.assert_close(out_changed, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_longer, out, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out_unmasked, out, atol=1e-4)  # the mask is what protects the output


def test_seed000_model():
    # seed 000's final test: vocab 10/10, d 6, 2 heads, max_len 10, ffn 3, 9 layers, dropout 0.1,
    # pad 0 on both sides, post-norm, separate embeddings, no scaling, exponent-doubled sinusoids
    config = Seq2SeqConfig(
        src_vocab_size=10, tgt_vocab_size=10, d_model=6, nhead=2, num_encoder_layers=9, num_decoder_layers=9,
        dim_feedforward=3, dropout=0.1, src_pad_idx=0, tgt_pad_idx=0, scale_embedding=False,
        positional_variant="double_exponent", max_len=10,
    )
    torch.manual_seed(0)
    model = Seq2SeqTransformer(config)
    src = torch.tensor([[1, 1, 4, 0], [4, 3, 2, 9]])
    tgt = torch.tensor([[5, 2, 5, 0], [6, 7, 9, 8]])
    _check_forward_backward(model, src, tgt, 10)
    _check_causal(model, src, tgt, 10)
    _check_source_padding(model, src, tgt, 0, 10)
    # the padded target position is a masked key: its token does not reach the other positions
    model.eval()
    mask = tgt == 0
    with torch.no_grad():
        out = model(src, tgt)
        out_changed = model(src, torch.where(mask, torch.full_like(tgt, 3), tgt), tgt_key_padding_mask=mask)
    torch.testing.assert_close(out_changed[~mask], out[~mask], atol=1e-5, rtol=1e-5)


def test_seed001_model():
    # seed 001: one 13-token vocabulary shared by both sides, d 256, 4 heads, 3 + 3 layers,
    # ffn 128, torch.nn.Transformer's dropout 0.1, no padding, unscaled embeddings, max_len 100
    config = Seq2SeqConfig(
        src_vocab_size=len(average.VOCAB), d_model=256, nhead=4, num_encoder_layers=3, num_decoder_layers=3,
        dim_feedforward=128, share_embeddings=True, scale_embedding=False, max_len=100,
    )
    torch.manual_seed(0)
    model = Seq2SeqTransformer(config)
    assert model.src_embed is model.tgt_embed
    batch = average.sample(2, torch.Generator().manual_seed(1))
    tgt_in = batch.tgt[:, :-1]  # the seed's teacher forcing
    _check_forward_backward(model, batch.src, tgt_in, 13)
    _check_causal(model, batch.src, tgt_in, 13)
    # the seed's decoding loop: encode once, decode the growing prefix, generator on the last step
    model.eval()
    with torch.no_grad():
        memory = model.encode(batch.src)
        logits = model.generator(model.decode(tgt_in[:, :3], memory))
        full = model(batch.src, tgt_in)
    assert memory.shape == (2, average.SRC_LEN, 256)
    torch.testing.assert_close(logits, full[:, :3], atol=1e-5, rtol=1e-5)


def test_seed002_model():
    # seed 002: shared embedding scaled by sqrt(d_model), cos/sin-swapped sinusoids with dropout,
    # LayerNorm eps 1e-6, a log-softmax generator; the seed fixes no sizes
    config = Seq2SeqConfig(
        src_vocab_size=17, d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64,
        layer_norm_eps=1e-6, share_embeddings=True, scale_embedding=True, embedding_init_std=1.0,  # nn.Embedding's
        positional_variant="cos_sin", log_softmax=True, src_pad_idx=0, tgt_pad_idx=0,
    )
    torch.manual_seed(0)
    model = Seq2SeqTransformer(config)
    src = torch.tensor([[3, 4, 5, 6, 0, 0], [7, 8, 9, 10, 11, 12]])
    tgt = torch.tensor([[1, 2, 3, 4, 5], [1, 6, 7, 0, 0]])
    out = _check_forward_backward(model, src, tgt, 17)
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(2, 5), atol=1e-5, rtol=0)
    _check_causal(model, src, tgt, 17)
    _check_source_padding(model, src, tgt, 0, 17)
    emb = model.src_embed
    torch.testing.assert_close(emb(src), emb.embedding(src) * math.sqrt(32))


def test_seed003_encoder():
    # seed 003: TokenEmbedding with padding_idx=1, paper sinusoids, post-norm encoder layers
    # (its LayerNorm has eps 1e-10), built from the drop-in encoder
    d_model, vocab = 24, 15
    torch.manual_seed(0)
    embed = TokenEmbedding(vocab, d_model, padding_idx=1)
    pos = PositionalEncoding(d_model, dropout=0.1, max_len=64)
    layer = fasttrans.nn.TransformerEncoderLayer(d_model, 3, 40, dropout=0.1, batch_first=True, layer_norm_eps=1e-10)
    encoder = fasttrans.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    tokens = torch.tensor([[5, 6, 7, 8, 1, 1, 1], [9, 10, 11, 12, 13, 14, 2]])
    padding = tokens == 1

    def run(t, mask):
        return encoder(pos(embed(t)), src_key_padding_mask=mask)

    out = run(tokens, padding)
    assert out.shape == (2, 7, d_model)
    out.sum().backward()
    assert torch.equal(embed.weight.grad[1], torch.zeros(d_model))
    for m in (embed, pos, encoder):
        m.eval()
    with torch.no_grad():
        ref = run(tokens, padding)
        changed = run(torch.where(padding, torch.full_like(tokens, 4), tokens), padding)
    torch.testing.assert_close(changed[~padding], ref[~padding], atol=1e-5, rtol=1e-5)


def test_seed004_model():
    # seed 004: source vocabulary of 6 (P = 0), target of 9 (P = 0, S = 6, E = 7), source padded to 5
    config = Seq2SeqConfig(
        src_vocab_size=6, tgt_vocab_size=9, d_model=64, nhead=8, num_encoder_layers=2, num_decoder_layers=2,
        dim_feedforward=128, src_pad_idx=translate.PAD, tgt_pad_idx=translate.PAD,
    )
    torch.manual_seed(0)
    model = Seq2SeqTransformer(config)
    enc, dec_in, dec_out = translate.make_data()
    assert enc.tolist() == [[1, 2, 3, 4, 0], [1, 2, 3, 5, 0]]
    assert dec_in.tolist() == [[6, 1, 2, 3, 4, 8], [6, 1, 2, 3, 5, 8]]
    assert dec_out.tolist() == [[1, 2, 3, 4, 8, 7], [1, 2, 3, 5, 8, 7]]
    _check_forward_backward(model, enc, dec_in, 9)
    _check_causal(model, enc, dec_in, 9)
    _check_source_padding(model, enc, dec_in, 0, 6)


def test_config_validation():
    with pytest.raises(ValueError, match="d_model"):
        Seq2SeqConfig(src_vocab_size=5, d_model=10, nhead=4)
    with pytest.raises(ValueError, match="share_embeddings"):
        Seq2SeqConfig(src_vocab_size=5, tgt_vocab_size=6, share_embeddings=True)
    with pytest.raises(ValueError, match="tgt_pad_idx"):
        Seq2SeqConfig(src_vocab_size=5, tgt_pad_idx=5)
    c = Seq2SeqConfig(src_vocab_size=5, d_model=8, nhead=2)
    assert c.tgt_vocab_size == 5 and Seq2SeqConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="unknown fields"):
        Seq2SeqConfig.from_dict({**c.to_dict(), "depth": 3})


def test_model_uses_the_fasttrans_modules():
    model = Seq2SeqTransformer(Seq2SeqConfig(src_vocab_size=5, d_model=8, nhead=2, num_encoder_layers=1,
                                             num_decoder_layers=1, dim_feedforward=8))
    assert isinstance(model.transformer, fasttrans.nn.Transformer)
    assert isinstance(model.transformer.decoder.layers[0].self_attn, fasttrans.nn.MultiheadAttention)


# --------------------------------------------------------------------------------------
# seed 001's data
# --------------------------------------------------------------------------------------
def test_average_tokenization_matches_the_seed():
    g = torch.Generator().manual_seed(3)
    batch = average.sample(50, g)
    for row in range(50):
        x, y = batch.x[row].tolist(), batch.y[row].item()
        src_text = "s" + " ".join("{:.8f}".format(v)[2:] for v in x) + "e"
        tgt_text = "s" + "{:.8f}".format(y)[2:] + "e"
        assert average.detokenize(batch.src[row]) == src_text
        assert average.detokenize(batch.tgt[row]) == tgt_text
    assert batch.src.shape == (50, average.SRC_LEN) == (50, 91)
    assert batch.tgt.shape == (50, average.TGT_LEN) == (50, 10)
    torch.testing.assert_close(batch.y, batch.x.mean(1))


def test_average_digits_edge_cases_and_decoding():
    x = torch.tensor([0.0, 0.123456786, 0.999999994, 0.9999999999], dtype=torch.float64)
    assert average.digits_of(x).tolist() == [
        [0] * 8, [1, 2, 3, 4, 5, 6, 7, 9], [9] * 8, [9] * 8,  # no '1.00000000' wrap-around
    ]
    S, E, SP = average.START, average.END, average.SPACE
    tokens = torch.tensor([
        [S, 4, 9, 9, 0, 0, 0, 0, 1, E],
        [S, 5, E, E, E, E, E, E, E, E],  # stopped early: the digits read so far
        [S, 1, 2, SP, 3, 4, 5, 6, 7, E],  # a space inside: malformed, digits before it
    ])
    values, ok = average.decode_numbers(tokens)
    torch.testing.assert_close(values, torch.tensor([0.49900001, 0.5, 0.12], dtype=torch.float64))
    assert ok.tolist() == [True, False, False]


def test_average_training_batches_are_a_function_of_step():
    a, b = average.train_batch(5, 8, seed=1), average.train_batch(5, 8, seed=1)
    assert torch.equal(a.src, b.src)
    assert not torch.equal(a.src, average.train_batch(6, 8, seed=1).src)
    assert not torch.equal(a.src, average.train_batch(5, 8, seed=2).src)
    held = average.held_out(100)
    assert not any(torch.equal(held.x[0], r) for r in a.x)

"""Deployment routes: torch.export (and AOTInductor) hold fasttrans models; TorchScript is
refused with one clear error that names the supported routes (docs/semantics.md, "TorchScript
and torch.export").

An exported program calls fasttrans's registered ``torch.library`` ops (``torch.ops.fasttrans.*``,
the backend chosen at export time), so it runs wherever fasttrans is imported.
"""

from __future__ import annotations

import pytest
import torch

import fasttrans
from fasttrans.models.seq2seq import Seq2SeqConfig, Seq2SeqTransformer


def _padding(batch: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, length, generator=g) < 0.3
    mask[:, 0] = False  # every sequence keeps a token
    mask[0, length - 2:] = True  # right padding
    return mask


def _encoder_layer() -> torch.nn.Module:
    return fasttrans.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True).eval()


def _fasttrans_ops(program: torch.export.ExportedProgram) -> set[str]:
    return {str(n.target) for n in program.graph.nodes if n.op == "call_function" and "fasttrans" in str(n.target)}


def test_export_encoder_layer_with_key_padding():
    layer = _encoder_layer()
    x = torch.randn(3, 7, 16)
    program = torch.export.export(layer, (x,), {"src_key_padding_mask": _padding(3, 7, 0)})
    assert _fasttrans_ops(program), "the exported graph should call fasttrans's ops"
    exported = program.module()
    # other inputs and another padding pattern than the traced one: nothing was baked in
    for seed in (0, 1, 2):
        x = torch.randn(3, 7, 16)
        pad = _padding(3, 7, seed)
        torch.testing.assert_close(exported(x, src_key_padding_mask=pad), layer(x, src_key_padding_mask=pad))


def test_export_seq2seq_forward():
    cfg = Seq2SeqConfig(src_vocab_size=13, d_model=16, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                        dim_feedforward=32, dropout=0.0, src_pad_idx=0, tgt_pad_idx=0)
    model = Seq2SeqTransformer(cfg).eval()
    src, tgt = torch.randint(1, 13, (2, 6)), torch.randint(1, 13, (2, 5))
    program = torch.export.export(model, (src, tgt))
    assert _fasttrans_ops(program)
    src[1, 4:] = 0  # padded source: the mask the model derives from src_pad_idx is not a constant
    tgt[0, 3:] = 0
    torch.testing.assert_close(program.module()(src, tgt), model(src, tgt))


@pytest.mark.slow
def test_aoti_package_of_an_encoder_layer(tmp_path):
    """AOTInductor compiles the exported layer into a package (C++ compilation: slow) that
    loads and matches eager."""
    layer = _encoder_layer()
    x, pad = torch.randn(3, 7, 16), _padding(3, 7, 0)
    program = torch.export.export(layer, (x,), {"src_key_padding_mask": pad})
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "layer.pt2"))
    loaded = torch._inductor.aoti_load_package(path)
    x, pad = torch.randn(3, 7, 16), _padding(3, 7, 1)
    torch.testing.assert_close(loaded(x, src_key_padding_mask=pad), layer(x, src_key_padding_mask=pad))


class _UserModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.norm = fasttrans.nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.proj(x))


@pytest.mark.parametrize("make, name", [
    (lambda: fasttrans.nn.MultiheadAttention(16, 4, kdim=24, vdim=24).eval(), "MultiheadAttention"),
    (lambda: fasttrans.nn.TransformerEncoderLayer(8, 4, 32, batch_first=True), "TransformerEncoderLayer"),
    (lambda: fasttrans.nn.TransformerDecoderLayer(8, 4, 32), "TransformerDecoderLayer"),
    (lambda: fasttrans.nn.TransformerEncoder(fasttrans.nn.TransformerEncoderLayer(8, 4, 32), 2), "TransformerEncoder"),
    (lambda: fasttrans.nn.Transformer(8, 2, 1, 1, 16), "Transformer"),
    (lambda: fasttrans.nn.LayerNorm(8), "LayerNorm"),
    (lambda: fasttrans.nn.RMSNorm(8), "RMSNorm"),
    (lambda: fasttrans.nn.Dropout(0.1), "Dropout"),
    (lambda: fasttrans.nn.PositionalEncoding(8), "PositionalEncoding"),
    (_UserModel, "LayerNorm"),  # a user's model holding one fasttrans module
], ids=lambda v: v if isinstance(v, str) else "")
def test_torchscript_is_refused_with_the_supported_routes(make, name):
    with pytest.raises(RuntimeError, match=rf"fasttrans\.nn\.{name} cannot be compiled by torch\.jit\.script") as e:
        torch.jit.script(make())
    assert "torch.compile" in str(e.value) and "torch.export" in str(e.value)


def test_token_embedding_scripts():
    """TokenEmbedding runs no fasttrans op: it scripts as torch.nn.Embedding does."""
    emb = fasttrans.nn.TokenEmbedding(10, 8)
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(torch.jit.script(emb)(ids), emb(ids))

"""torch.compile(fullgraph=True) traces the fasttrans layers and model without graph breaks.

fullgraph=True turns any graph break into an error, so "it compiled" is the no-break check;
outputs and every gradient must then match eager mode, so dropout is 0 there (one test
checks that attention dropout compiles and draws a fresh mask per call). The layer tests use
the ``aot_eager`` backend (dynamo + AOTAutograd, the fake and autograd registrations of every
fasttrans op, no code generation); the command-line test runs the default inductor backend
end to end, in a fresh process.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fasttrans
from fasttrans import backends, train
from fasttrans.models.seq2seq import Seq2SeqConfig

from helpers import fasttrans_ops_run

D, H, FF = 24, 3, 40


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _padding(batch: int, length: int) -> torch.Tensor:
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[1, length - 3 :] = True  # right padding
    mask[2, 1] = True  # a hole
    return mask


def _compare(eager_module, inputs: dict, backend: str = "aot_eager"):
    compiled_module = copy.deepcopy(eager_module)
    compiled = torch.compile(compiled_module, fullgraph=True, backend=backend)
    leaves = {k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    eager_in = {k: (v.detach().clone().requires_grad_() if k in leaves else v) for k, v in inputs.items()}
    comp_in = {k: (v.detach().clone().requires_grad_() if k in leaves else v) for k, v in inputs.items()}
    out_e = eager_module(**eager_in)
    out_c = compiled(**comp_in)
    torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-5)
    weight = torch.randn_like(out_e)
    (out_e * weight).sum().backward()
    (out_c * weight).sum().backward()
    for k in leaves:
        torch.testing.assert_close(comp_in[k].grad, eager_in[k].grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"{k}: {m}")
    for (name, p_e), (_, p_c) in zip(eager_module.named_parameters(), compiled_module.named_parameters()):
        assert p_e.grad is not None, name
        torch.testing.assert_close(p_c.grad, p_e.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_with_padding_compiles_without_breaks(norm_first):
    layer = fasttrans.nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
    x = torch.randn(3, 7, D)
    _compare(layer, dict(src=x, src_key_padding_mask=_padding(3, 7)))


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_with_causal_and_padding_masks_compiles_without_breaks(norm_first):
    layer = fasttrans.nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first,
                                                 activation="gelu")
    tgt, memory = torch.randn(3, 5, D), torch.randn(3, 7, D)
    causal = torch.ones(5, 5, dtype=torch.bool).triu_(1)
    _compare(layer, dict(
        tgt=tgt, memory=memory, tgt_mask=causal, tgt_is_causal=True,
        tgt_key_padding_mask=_padding(3, 5), memory_key_padding_mask=_padding(3, 7),
    ))


def test_decoder_layer_causal_only_compiles_without_breaks():
    layer = fasttrans.nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, batch_first=True)
    causal = torch.ones(6, 6, dtype=torch.bool).triu_(1)
    _compare(layer, dict(tgt=torch.randn(2, 6, D), memory=torch.randn(2, 4, D), tgt_mask=causal, tgt_is_causal=True))


class _Loss(torch.nn.Module):
    """The training step's loss as a module, for torch.compile."""

    def __init__(self, model, config):
        super().__init__()
        self.model, self.config = model, config

    def forward(self, src, tgt):
        return train.compute_loss(self.model, src, tgt, self.config)


def test_seq2seq_training_loss_compiles_without_breaks():
    """The whole teacher-forced loss of a padded model (what --compile compiles)."""
    config = Seq2SeqConfig(src_vocab_size=11, tgt_vocab_size=13, d_model=D, nhead=H, num_encoder_layers=1,
                           num_decoder_layers=1, dim_feedforward=FF, dropout=0.0, src_pad_idx=0, tgt_pad_idx=0,
                           norm_first=True, max_len=32)
    model = train.build_model(config, seed=3)
    src = torch.randint(1, 11, (3, 7))
    src[1, 5:] = 0
    tgt = torch.randint(1, 13, (3, 6))
    tgt[2, 4:] = 0
    eager = _Loss(model, config)
    compiled_model = copy.deepcopy(model)
    compiled = torch.compile(_Loss(compiled_model, config), fullgraph=True, backend="aot_eager")
    loss_e, loss_c = eager(src, tgt), compiled(src, tgt)
    torch.testing.assert_close(loss_c, loss_e, atol=1e-5, rtol=1e-5)
    loss_e.backward()
    loss_c.backward()
    for (name, p_e), (_, p_c) in zip(model.named_parameters(), compiled_model.named_parameters()):
        torch.testing.assert_close(p_c.grad, p_e.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_attention_dropout_compiles_and_draws_fresh_masks():
    """Attention dropout traces too, and the seed is not baked into the graph as a constant."""
    torch.manual_seed(0)
    layer = fasttrans.nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, batch_first=True)
    layer.self_attn.dropout = 0.5  # dropout on the attention weights only
    x = torch.randn(2, 5, D)
    layer(x)  # eager first, so that the ops are registered outside the trace
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    a, b = compiled(x), compiled(x)
    assert not torch.allclose(a, b)
    layer.eval()
    torch.testing.assert_close(compiled(x), layer(x), atol=1e-5, rtol=1e-5)




def test_the_backend_is_chosen_once_when_the_function_is_traced(monkeypatch):
    """A compiled function keeps the backend chosen at trace time: FASTTRANS_BACKEND set later
    takes effect only once dynamo traces it again."""
    monkeypatch.delenv("FASTTRANS_BACKEND", raising=False)
    x = torch.randn(4, 8)
    traced = backends.select_backend("norm", "cpu", x.dtype).name
    assert traced != "reference"
    compiled = torch.compile(lambda x: fasttrans.layer_norm(x, (8,)), fullgraph=True, backend="eager")
    assert fasttrans_ops_run(lambda: compiled(x))[1] == {f"fasttrans::norm_fwd_{traced}"}
    monkeypatch.setenv("FASTTRANS_BACKEND", "reference")
    out, ops = fasttrans_ops_run(lambda: compiled(x))
    assert ops == {f"fasttrans::norm_fwd_{traced}"}
    torch.testing.assert_close(out, F.layer_norm(x, (8,)))
    torch._dynamo.reset()
    out, ops = fasttrans_ops_run(lambda: compiled(x))
    assert ops == {"fasttrans::norm_fwd_reference"}
    torch.testing.assert_close(out, F.layer_norm(x, (8,)))


def test_compile_flag_in_a_fresh_process(tmp_path):
    """python -m fasttrans train --compile: the first fasttrans op of the process runs compiled."""
    proc = subprocess.run(
        [sys.executable, "-m", "fasttrans", "train", "--task", "translate", "--steps", "2", "--compile",
         "--layers", "1", "--d-model", "16", "--nhead", "2", "--ffn", "16",  # small graphs: inductor is slow
         "--device", "cpu", "--threads", "1", "--out-dir", str(tmp_path), "--no-progress", "--no-plot", "--no-eval"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "(torch.compile)" in proc.stdout


_FRESH_LAYER = """
import torch, fasttrans
layer = fasttrans.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
x = torch.randn(2, 5, 16)
torch.testing.assert_close(compiled(x), layer(x), atol=1e-5, rtol=1e-5)
"""


def test_first_fasttrans_op_of_a_process_can_be_compiled():
    proc = subprocess.run([sys.executable, "-c", _FRESH_LAYER], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

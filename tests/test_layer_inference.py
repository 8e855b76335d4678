"""The whole-layer inference op (csrc/layer_cpu.cpp, fasttrans/nn/fused_inference.py).

In eval mode with nothing to differentiate, fasttrans.nn's encoder and decoder layers run
as one ``fasttrans::transformer_layer_fwd_extension`` call. These tests check that

- it is taken where it applies (every layer of the stacks), seen in the profiler's op list;
- it gives the module path's output bit for bit (the module path run with the fused call
  switched off), and torch.nn's within tolerance, for every mask kind, both layer kinds,
  pre- and post-norm, batch-first or not, unbatched inputs, each activation, with and
  without biases, in float32, float64 and bfloat16;
- everywhere it must not apply (training, gradients, hooks, other backends, replaced
  parts, autocast, large heads, empty inputs) the module path runs instead;
- argument errors are the module path's, and the op's own checks name the argument.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import fasttrans
import fasttrans.functional as FT
import fasttrans.nn as fnn
from helpers import assert_close_lowp, cast_floating, fasttrans_ops_run, require_extension, right_padded

OP = "fasttrans::transformer_layer_fwd_extension"
E, H, FF = 16, 4, 24
N, L, S = 3, 5, 7

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _extension():
    require_extension("cpu", "attention")


@pytest.fixture
def module_path(monkeypatch):
    """A context in which the layers and attention modules never take the fused calls (their module path)."""

    class Off:
        def __enter__(self):
            monkeypatch.setattr(FT, "inference_op", lambda kind, x: None)

        def __exit__(self, *exc):
            monkeypatch.undo()

    return Off()


def _layer(kind: str, lib=fnn, dtype=torch.float32, **kw):
    options = dict(dim_feedforward=FF, dropout=0.1, batch_first=True, dtype=dtype)
    options.update(kw)
    cls = lib.TransformerEncoderLayer if kind == "encoder" else lib.TransformerDecoderLayer
    return cls(E, H, **options).eval()


def _inputs(kind: str, batch_first: bool, batched: bool = True, dtype=torch.float32):
    def seq(length):
        if not batched:
            return torch.randn(length, E, dtype=dtype)
        return torch.randn((N, length, E) if batch_first else (length, N, E), dtype=dtype)

    return (seq(L),) if kind == "encoder" else (seq(L), seq(S))


def _run(layer, inputs, masks):
    if isinstance(layer, (fnn.TransformerEncoderLayer, torch.nn.TransformerEncoderLayer)):
        return layer(*inputs, src_mask=masks.get("mask"), src_key_padding_mask=masks.get("kpm"),
                     is_causal=masks.get("is_causal", False))
    return layer(*inputs, tgt_mask=masks.get("mask"), tgt_key_padding_mask=masks.get("kpm"),
                 memory_mask=masks.get("memory_mask"), memory_key_padding_mask=masks.get("memory_kpm"),
                 tgt_is_causal=masks.get("is_causal", False))


MHA_OP = "fasttrans::multihead_attention_fwd_extension"


def _fused_and_module(run, module_path, op=OP):
    """run()'s no-grad result with the fused call ``op`` (asserting it ran) and on the module
    path (asserting no fused call ran)."""
    with torch.no_grad():
        fused, ops = fasttrans_ops_run(run)
        assert op in ops, f"the fused call was not taken (ops: {sorted(ops)})"
        with module_path:
            plain, ops = fasttrans_ops_run(run)
        assert OP not in ops and MHA_OP not in ops
    return fused, plain


def _assert_like_torch(name, got, want, ref=None):
    """got (fasttrans) against torch.nn's regular path's want, in got's dtype; for bfloat16 by
    the project's low-precision rule against ref, torch in float32 (at most twice torch in
    bfloat16's error). Positions where torch gives NaN (a query with no allowed key, where
    fasttrans's fused kernel gives 0) are left out; returns which were kept."""
    keep = ~want.isnan() if ref is None else ~(want.isnan() | ref.isnan())
    if got.dtype == torch.bfloat16:
        assert_close_lowp(name, got[keep], ref[keep], want[keep])
    else:
        torch.testing.assert_close(got[keep], want[keep], **TOL[got.dtype])
    return keep


def _torch_fp32(module, run):
    """For bfloat16 modules, run(module) of a float32 copy (the low-precision rule's reference)."""
    return run(copy.deepcopy(module).float())


def _mask_case(name: str, kind: str, dtype):
    """torch.nn masks of one kind (batch first, batched) for self-attention (and memory)."""
    causal = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=dtype)
    if name == "none":
        return {}
    if name == "causal float, hint":
        return {"mask": causal, "is_causal": True}
    if name == "causal bool, detected":
        return {"mask": causal.isinf()}
    if name == "bool":
        m = torch.rand(L, L) < 0.3
        m[:, 0] = False  # every query sees a key
        return {"mask": m, "memory_mask": torch.rand(L, S) < 0.3}
    if name == "float per head":
        return {"mask": torch.randn(N * H, L, L, dtype=dtype), "memory_mask": torch.randn(L, S, dtype=dtype)}
    if name == "right-padded":
        return {"kpm": right_padded([5, 2, 4], L), "memory_kpm": right_padded([7, 1, 3], S)}
    if name == "left-padded":
        return {"kpm": right_padded([5, 2, 4], L).flip(-1), "memory_kpm": right_padded([7, 1, 3], S).flip(-1)}
    if name == "float padding":
        return {"kpm": torch.randn(N, L, dtype=dtype), "memory_kpm": torch.randn(N, S, dtype=dtype)}
    if name == "fully masked rows":
        m = torch.zeros(L, L, dtype=torch.bool)
        m[1] = True  # query 1 sees nothing: output 0 from attention, as torch's SDPA path
        return {"mask": m, "kpm": right_padded([5, 2, 4], L)}
    raise ValueError(name)


MASKS = ("none", "causal float, hint", "causal bool, detected", "bool", "float per head", "right-padded",
         "left-padded", "float padding", "fully masked rows")
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float64: dict(atol=1e-12, rtol=1e-12)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_masks_match_the_module_path_bit_for_bit_and_torch(kind, mask, dtype, module_path):
    layer = _layer(kind, dtype=dtype)
    ref = _layer(kind, torch.nn, dtype=dtype)
    ref.load_state_dict(layer.state_dict())
    inputs = _inputs(kind, batch_first=True, dtype=dtype)
    masks = _mask_case(mask, kind, dtype)
    fused, plain = _fused_and_module(lambda: _run(layer, inputs, masks), module_path)
    assert torch.equal(fused, plain)
    # torch with gradients on: its inference fast path returns NaN everywhere for a 3-D float
    # attn_mask (torch 2.13), so the reference is its regular path
    want = _run(ref, inputs, masks).detach()
    fp32 = None
    if dtype == torch.bfloat16:
        up = (cast_floating(inputs, torch.float32), cast_floating(masks, torch.float32))
        fp32 = _torch_fp32(ref, lambda m: _run(m, *up).detach())
    keep = _assert_like_torch("layer output", fused, want, fp32)
    assert keep.any() and (mask == "fully masked rows" or keep.all())


OPTIONS = list(itertools.product([False, True], [False, True], [False, True], [True, False]))


@pytest.mark.parametrize("activation", ["relu", "gelu", torch.nn.GELU("tanh"), torch.nn.ReLU()], ids=str)
@pytest.mark.parametrize("norm_first,batch_first,batched,bias", OPTIONS,
                         ids=[f"norm_first={a}-batch_first={b}-batched={c}-bias={d}" for a, b, c, d in OPTIONS])
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_layer_options_match_the_module_path_bit_for_bit(kind, norm_first, batch_first, batched, bias, activation,
                                                         module_path):
    layer = _layer(kind, norm_first=norm_first, batch_first=batch_first, bias=bias, activation=activation)
    ref = _layer(kind, torch.nn, norm_first=norm_first, batch_first=batch_first, bias=bias, activation=activation)
    ref.load_state_dict(layer.state_dict())
    inputs = _inputs(kind, batch_first, batched)
    masks = {"mask": torch.nn.Transformer.generate_square_subsequent_mask(L)}
    fused, plain = _fused_and_module(lambda: _run(layer, inputs, masks), module_path)
    assert fused.shape == inputs[0].shape
    assert torch.equal(fused, plain)
    torch.testing.assert_close(fused, _run(ref, inputs, masks).detach(), **TOL[torch.float32])


def test_layer_norms_without_affine_parameters(module_path):
    layer = _layer("decoder")
    for name in ("norm1", "norm2", "norm3"):
        setattr(layer, name, fnn.LayerNorm(E, elementwise_affine=False))
    inputs = _inputs("decoder", True)
    fused, plain = _fused_and_module(lambda: _run(layer, inputs, {}), module_path)
    assert torch.equal(fused, plain)


@pytest.mark.parametrize("kind", ["encoder", "decoder", "transformer"])
def test_every_layer_of_the_stacks_takes_the_fused_call(kind, module_path):
    model = fnn.Transformer(E, H, 3, 2, FF, batch_first=True).eval()
    src, tgt = torch.randn(N, S, E), torch.randn(N, L, E)
    causal = model.generate_square_subsequent_mask(L)
    kpm = right_padded([7, 3, 5], S)
    calls = {
        "encoder": lambda: model.encoder(src, src_key_padding_mask=kpm),
        "decoder": lambda: model.decoder(tgt, src, tgt_mask=causal, memory_key_padding_mask=kpm),
        "transformer": lambda: model(src, tgt, tgt_mask=causal, src_key_padding_mask=kpm,
                                     memory_key_padding_mask=kpm),
    }
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, torch.no_grad():
        fused = calls[kind]()
    count = sum(1 for e in prof.events() if e.name == OP)
    assert count == {"encoder": 3, "decoder": 2, "transformer": 5}[kind]
    with torch.no_grad(), module_path:
        assert torch.equal(fused, calls[kind]())


def test_inference_mode_and_a_forced_extension_backend_take_it():
    layer = _layer("encoder")
    (x,) = _inputs("encoder", True)
    with torch.inference_mode():
        _, ops = fasttrans_ops_run(lambda: layer(x))
    assert OP in ops
    with torch.no_grad(), fasttrans.use_backend("extension"):
        _, ops = fasttrans_ops_run(lambda: layer(x))
    assert OP in ops


# --------------------------------------------------------------------------------------
# where the fused call must not be taken
# --------------------------------------------------------------------------------------
def _hook(module, args, output):
    return output * 2  # a hook that changes the output: the module path must run it


def _setups():
    """name -> (prepare(layer) returning a context for the call, or None; no_grad)."""

    def replace(name, factory):
        def prepare(layer):
            setattr(layer, name, factory(layer))

        return prepare

    class Linear(torch.nn.Linear):
        pass

    return {
        "training": (lambda layer: layer.train(), True),
        "a dropout in training mode": (lambda layer: layer.dropout1.train(), True),
        "gradients recorded": (lambda layer: None, False),
        "a forward hook on linear1": (lambda layer: layer.linear1.register_forward_hook(_hook), True),
        "a global forward hook": (
            lambda layer: torch.nn.modules.module.register_module_forward_hook(_hook), True),
        "the reference backend forced": (lambda layer: fasttrans.use_backend("reference"), True),
        "self_attn pinned to the reference": (
            lambda layer: setattr(layer.self_attn, "_fasttrans_backend", "reference"), True),
        "a custom activation": (lambda layer: setattr(layer, "activation", lambda t: t.tanh()), True),
        "a Linear subclass": (replace("linear1", lambda layer: Linear(E, FF)), True),
        "torch's LayerNorm": (replace("norm1", lambda layer: torch.nn.LayerNorm(E)), True),
        "attention with bias_k": (
            replace("self_attn", lambda layer: fnn.MultiheadAttention(E, H, add_bias_kv=True, batch_first=True).eval()),
            True),
        "cpu autocast": (lambda layer: torch.autocast("cpu", dtype=torch.bfloat16), True),
    }


@pytest.mark.parametrize("setup", list(_setups()))
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_module_path_where_the_fused_call_does_not_apply(kind, setup):
    prepare, no_grad = _setups()[setup]
    layer = _layer(kind, dropout=0.0)
    inputs = _inputs(kind, True)
    handle = prepare(layer)
    context = handle if hasattr(handle, "__enter__") else torch.enable_grad()
    try:
        with torch.set_grad_enabled(not no_grad), context:
            out, ops = fasttrans_ops_run(lambda: layer(*inputs))
    finally:
        if hasattr(handle, "remove"):
            handle.remove()
    assert OP not in ops
    assert out.shape == inputs[0].shape and out.isfinite().all()


@pytest.mark.parametrize("kind", ["encoder", "decoder", "attention"])
def test_subclasses_run_their_own_code(kind):
    """A subclass may override a block the fused ops reproduce: only the exact classes take them."""

    class Encoder(fnn.TransformerEncoderLayer):
        def _ff_block(self, x):
            return -super()._ff_block(x)

    class Decoder(fnn.TransformerDecoderLayer):
        def _ff_block(self, x):
            return -super()._ff_block(x)

    class Attention(fnn.MultiheadAttention):
        def _in_projection(self, *args):
            q, k, v = super()._in_projection(*args)
            return q, k, -v

    if kind == "attention":
        module = Attention(E, H, dropout=0.0, batch_first=True).eval()
        (x,) = _inputs("encoder", True)
        inputs = (x, x, x)
        run = lambda m: m(*inputs, need_weights=False)[0]  # noqa: E731
        exact = fnn.MultiheadAttention(E, H, dropout=0.0, batch_first=True).eval()
    else:
        module = _layer(kind, dropout=0.0)
        exact = copy.deepcopy(module)
        module.__class__ = Encoder if kind == "encoder" else Decoder
        inputs = _inputs(kind, True)
        run = lambda m: m(*inputs)  # noqa: E731
    exact.load_state_dict(module.state_dict())
    with torch.no_grad():
        out, ops = fasttrans_ops_run(lambda: run(module))
        assert (MHA_OP if kind == "attention" else OP) not in ops
        want = run(module.train())  # training with no dropout: the module path, no fused call
        assert not torch.allclose(run(exact), want)  # the override changes the result
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


def test_the_modules_do_not_import_the_fused_path():
    """nn/transformer.py and nn/attention.py leave the fused path to fasttrans.nn.fused_inference.install."""
    import ast
    from pathlib import Path

    for name in ("transformer", "attention"):
        tree = ast.parse((Path(fnn.__file__).parent / f"{name}.py").read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                    for alias in node.names}
        assert not any("fused_inference" in n for n in imported), (name, imported)


@pytest.mark.parametrize("case", ["input needs a gradient", "float mask needs a gradient"])
def test_gradients_of_inputs_keep_the_module_path(case):
    layer = _layer("encoder").requires_grad_(False)
    (x,) = _inputs("encoder", True)
    mask = torch.zeros(L, L)
    if case == "input needs a gradient":
        x.requires_grad_()
    else:
        mask.requires_grad_()
    out, ops = fasttrans_ops_run(lambda: layer(x, src_mask=mask))
    assert OP not in ops
    out.sum().backward()
    assert (x.grad if x.requires_grad else mask.grad) is not None


def test_head_dims_past_the_kernels_and_empty_inputs_keep_the_module_path():
    big = fnn.TransformerEncoderLayer(272, 1, 8, batch_first=True).eval()  # head dim 272 > 256
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "runs on the reference implementation" (once per process)
        _, ops = fasttrans_ops_run(lambda: big(torch.randn(1, 3, 272)))
        assert OP not in ops
        layer = _layer("encoder")
        out, ops = fasttrans_ops_run(lambda: layer(torch.randn(0, L, E)))
        assert OP not in ops and out.shape == (0, L, E)


def test_an_activation_module_shadowed_by_relu_is_computed_as_relu(module_path):
    """torch's TransformerDecoderLayer.__setstate__ (run by deepcopy, as in the stacks) puts
    F.relu into the instance dict of a layer whose activation is a module; attribute lookup
    then finds relu, and the fused call must compute what the module path computes."""
    model = fnn.Transformer(E, H, 1, 1, FF, activation=torch.nn.GELU(), batch_first=True).eval()
    layer = model.decoder.layers[0]
    assert layer.activation is F.relu
    inputs = _inputs("decoder", True)
    fused, plain = _fused_and_module(lambda: _run(layer, inputs, {}), module_path)
    assert torch.equal(fused, plain)


# --------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------
BAD = {
    "attn_mask shape": {"mask": torch.zeros(L, L + 1, dtype=torch.bool)},
    "key_padding_mask shape": {"kpm": torch.zeros(N, L + 2, dtype=torch.bool)},
    "integer mask": {"mask": torch.zeros(L, L, dtype=torch.int64)},
    "is_causal without a mask": {"is_causal": True},
    "memory_mask shape": {"memory_mask": torch.zeros(L, S + 1)},
    "half-precision float mask": {"kpm": torch.zeros(N, L, dtype=torch.float16)},
}


@pytest.mark.parametrize("kind,bad", [(k, b) for k in ("encoder", "decoder") for b in BAD
                                      if k == "decoder" or not b.startswith("memory")])
def test_argument_errors_are_the_module_paths(kind, bad, module_path):
    layer = _layer(kind)
    inputs = _inputs(kind, True)

    def error():
        with pytest.raises(Exception) as info:
            with torch.no_grad():
                _run(layer, inputs, BAD[bad])
        return info.value

    fused = error()
    with module_path:
        plain = error()
    assert type(fused) is type(plain) and str(fused) == str(plain)


def _op_args(decoder: bool):
    layer = _layer("decoder" if decoder else "encoder", bias=True)
    attentions = [layer.self_attn] + ([layer.multihead_attn] if decoder else [])
    norms = [layer.norm1, layer.norm2] + ([layer.norm3] if decoder else [])
    weights = [w for a in attentions for w in (a.in_proj_weight, a.out_proj.weight)]
    biases = [b for a in attentions for b in (a.in_proj_bias, a.out_proj.bias)]
    weights += [layer.linear1.weight, layer.linear2.weight]
    biases += [layer.linear1.bias, layer.linear2.bias]
    x, *memory = _inputs("decoder" if decoder else "encoder", True)
    args = [x, memory[0] if decoder else None, [w.detach() for w in weights], [b.detach() for b in biases],
            [n.weight.detach() for n in norms], [n.bias.detach() for n in norms], [1e-5] * len(norms),
            None, torch.tensor([5, 2, 4], dtype=torch.int32), False,
            None, None, False, H, 0, False, False]
    return args


@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
def test_opcheck(decoder):
    fasttrans.backends.inference_ops()  # registers the fake implementation
    op = torch.ops.fasttrans.transformer_layer_fwd_extension
    torch.library.opcheck(op, _op_args(decoder))


OP_ERRORS = {
    "weights": (lambda a: a.__setitem__(2, a[2][:3]), "weights, biases: expected 4"),
    "in_proj shape": (lambda a: a[2].__setitem__(0, a[2][0][:10]), "weights[0] (self-attention in_proj)"),
    "linear1 bias": (lambda a: a[3].__setitem__(2, torch.zeros(FF + 1)), "linear1 bias: expected shape (24,)"),
    "weight dtype": (lambda a: a[2].__setitem__(3, a[2][3].double()), "linear2 weight: expected Float"),
    "norm eps": (lambda a: a.__setitem__(6, [1e-5, -1.0]), "norm_eps: expected finite non-negative"),
    "num_heads": (lambda a: a.__setitem__(13, 5), "num_heads: expected a positive divisor"),
    "activation": (lambda a: a.__setitem__(14, 3), "activation: expected 0 (relu)"),
    "x": (lambda a: a.__setitem__(0, a[0][0]), "x: expected a 3-D"),
    "memory": (lambda a: a.__setitem__(1, torch.randn(2, S, E)), "memory: expected the batch size"),
}


@pytest.mark.parametrize("bad", list(OP_ERRORS))
def test_the_op_names_the_argument_at_fault(bad):
    fasttrans.backends.inference_ops()
    args = _op_args(decoder=bad == "memory")
    corrupt, message = OP_ERRORS[bad]
    corrupt(args)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        torch.ops.fasttrans.transformer_layer_fwd_extension(*args)


# --------------------------------------------------------------------------------------
# MultiheadAttention on its own
# --------------------------------------------------------------------------------------
def _mha_run(mha, query, key, masks, need_weights, average=True):
    return mha(query, key, key, key_padding_mask=masks.get("kpm") if key is query else masks.get("memory_kpm"),
               attn_mask=masks.get("mask") if key is query else masks.get("memory_mask"),
               need_weights=need_weights, average_attn_weights=average,
               is_causal=masks.get("is_causal", False) if key is query else False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_multihead_attention_matches_the_module_path_and_torch(cross, need_weights, mask, dtype, module_path):
    mha = fnn.MultiheadAttention(E, H, dropout=0.1, batch_first=True, dtype=dtype).eval()
    ref = torch.nn.MultiheadAttention(E, H, dropout=0.1, batch_first=True, dtype=dtype).eval()
    ref.load_state_dict(mha.state_dict())
    query, memory = _inputs("decoder", True, dtype=dtype)
    key = memory if cross else query
    masks = _mask_case(mask, "decoder", dtype)
    if need_weights and masks.get("is_causal"):
        masks["is_causal"] = False  # torch applies the mask itself then; the hint alone is tested below
    (out, weights), (out_m, weights_m) = _fused_and_module(
        lambda: _mha_run(mha, query, key, masks, need_weights), module_path, MHA_OP)
    def torch_run(module, upcast=False):  # torch's regular path (gradients on)
        cast = (lambda x: cast_floating(x, torch.float32)) if upcast else (lambda x: x)
        q, m = cast(query), cast(masks)
        return tuple(t if t is None else t.detach() for t in _mha_run(module, q, q if key is query else cast(key), m,
                                                                      need_weights))

    out_t, weights_t = torch_run(ref)
    out_32, weights_32 = _torch_fp32(ref, lambda m: torch_run(m, upcast=True)) if dtype == torch.bfloat16 else \
        (None, None)
    if not need_weights:
        assert weights is None and weights_m is None
        assert torch.equal(out, out_m)  # the same kernels: bit for bit
    else:
        # a query with no allowed key: NaN weights and output, as torch
        assert torch.equal(weights.isnan(), weights_m.isnan()) and torch.equal(out.isnan(), out_m.isnan())
        assert torch.equal(weights.isnan(), weights_t.isnan())
        # weights from C++ against the module path's PyTorch ops: float32 and float64 within
        # TOL, bfloat16 within torch's default bfloat16 tolerance
        torch.testing.assert_close(weights, weights_m, equal_nan=True, **TOL.get(dtype, {}))
        torch.testing.assert_close(out, out_m, equal_nan=True, **TOL.get(dtype, {}))
        _assert_like_torch("weights", weights, weights_t, weights_32)
    keep = _assert_like_torch("output", out, out_t, out_32)
    assert keep.any() and (mask == "fully masked rows" or keep.all())


MHA_OPTIONS = list(itertools.product([False, True], [False, True], [False, True], [True, False]))


@pytest.mark.parametrize("batch_first,batched,average,bias", MHA_OPTIONS,
                         ids=[f"batch_first={a}-batched={b}-average={c}-bias={d}" for a, b, c, d in MHA_OPTIONS])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_multihead_attention_options(cross, batch_first, batched, average, bias, module_path):
    mha = fnn.MultiheadAttention(E, H, bias=bias, batch_first=batch_first).eval()
    ref = torch.nn.MultiheadAttention(E, H, bias=bias, batch_first=batch_first).eval()
    ref.load_state_dict(mha.state_dict())
    query, memory = _inputs("decoder", batch_first, batched)
    key = memory if cross else query
    masks = {"kpm": right_padded([5, 2, 4], L)[0] if not batched else right_padded([5, 2, 4], L),
             "memory_kpm": right_padded([7, 1, 3], S)[0] if not batched else right_padded([7, 1, 3], S)}
    for need_weights in (False, True):
        (out, weights), (out_m, weights_m) = _fused_and_module(
            lambda: _mha_run(mha, query, key, masks, need_weights, average), module_path, MHA_OP)
        out_t, weights_t = _mha_run(ref, query, key, masks, need_weights, average)
        assert out.shape == out_t.shape
        torch.testing.assert_close(out, out_t.detach(), **TOL[torch.float32])
        if need_weights:
            assert weights.shape == weights_t.shape
            torch.testing.assert_close(weights, weights_t.detach(), **TOL[torch.float32])
        else:
            assert torch.equal(out, out_m)


# With need_weights the op computes few scores in loops (N * H * L * S * D at most 2^17
# multiply-adds, csrc/layer_cpu.cpp) and more with ATen's batched matmuls and softmax; the
# grids above are all of the first kind.
WEIGHTS_SIZES = {"loops": (2, 6, 9), "matmuls": (2, 40, 50)}  # (N, L, S) with E = 64, H = 4
WEIGHTS_MASKS = ("none", "bool", "float", "right-padded", "causal", "fully masked rows")


def _weights_masks(name: str, n: int, length: int, source: int, cross: bool, dtype):
    keys = source if cross else length
    if name == "none":
        return {}
    if name == "bool":
        m = torch.rand(length, keys) < 0.3
        m[:, 0] = False
        return {"attn_mask": m}
    if name == "float":
        return {"attn_mask": torch.randn(n * 4, length, keys, dtype=dtype)}
    if name == "right-padded":
        return {"key_padding_mask": right_padded([keys, keys // 3] + [1] * (n - 2), keys)}
    if name == "causal":
        return {"attn_mask": torch.nn.Transformer.generate_square_subsequent_mask(length, dtype=dtype)}
    m = torch.zeros(length, keys, dtype=torch.bool)
    m[1] = True  # query 1 sees nothing: NaN weights and output, as torch
    return {"attn_mask": m}


@pytest.mark.parametrize("average", [True, False], ids=["average", "per-head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cross,mask",
                         [(c, m) for c in (False, True) for m in WEIGHTS_MASKS if not (c and m == "causal")],
                         ids=lambda v: {False: "self", True: "cross"}.get(v, v) if isinstance(v, bool) else v)
@pytest.mark.parametrize("path", list(WEIGHTS_SIZES))
def test_multihead_attention_weights_by_loops_and_by_matmuls(path, cross, mask, dtype, average, module_path):
    n, length, source = WEIGHTS_SIZES[path]
    mha = fnn.MultiheadAttention(64, 4, batch_first=True, dtype=dtype).eval()
    ref = torch.nn.MultiheadAttention(64, 4, batch_first=True, dtype=dtype).eval()
    ref.load_state_dict(mha.state_dict())
    query = torch.randn(n, length, 64, dtype=dtype)
    key = torch.randn(n, source, 64, dtype=dtype) if cross else query
    masks = _weights_masks(mask, n, length, source, cross, dtype)

    def run(module, upcast=False):
        cast = (lambda x: cast_floating(x, torch.float32)) if upcast else (lambda x: x)
        return module(cast(query), cast(key), cast(key), need_weights=True, average_attn_weights=average,
                      **cast(masks))

    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out, weights = run(mha)
    names = {e.name for e in prof.events()}
    assert MHA_OP in names
    assert ("aten::_softmax" in names) == (path == "matmuls"), sorted(names)
    with torch.no_grad(), module_path:
        out_m, weights_m = run(mha)
    keys = source if cross else length
    shape = (n, length, keys) if average else (n, 4, length, keys)
    assert weights.shape == weights_m.shape == shape, (weights.shape, weights_m.shape)
    assert torch.equal(weights.isnan(), weights_m.isnan()) and torch.equal(out.isnan(), out_m.isnan())
    assert (mask == "fully masked rows") == bool(out.isnan().any())
    out_t, weights_t = (t.detach() for t in run(ref))
    assert torch.equal(weights.isnan(), weights_t.isnan())
    if dtype == torch.bfloat16:
        # two bfloat16 computations in different orders: each against torch in float32, by
        # the project's low-precision rule (torch in bfloat16 sets the bound)
        out_32, weights_32 = (t.detach() for t in _torch_fp32(ref, lambda m: run(m, upcast=True)))
        for got_out, got_weights in ((out, weights), (out_m, weights_m)):
            _assert_like_torch("weights", got_weights, weights_t, weights_32)
            _assert_like_torch("output", got_out, out_t, out_32)
    else:
        torch.testing.assert_close(weights, weights_m, equal_nan=True, **TOL[dtype])
        torch.testing.assert_close(out, out_m, equal_nan=True, **TOL[dtype])
        _assert_like_torch("weights", weights, weights_t)
        _assert_like_torch("output", out, out_t)


@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
def test_multihead_attention_inf_value_with_a_subnormal_weight(need_weights, module_path):
    """Key 1's weight is exp(-95) = 5.5e-42 and its value projection overflows to inf: torch
    gives inf, 5.5e-42 * inf, where a weight flushed to 0 would give 0 * inf = NaN."""
    def build(cls):
        m = cls(2, 1, batch_first=True)
        with torch.no_grad():  # q = x, k = (x0, 1e-38 x1), v = (2 x1, 2 x1); out = sum of the head's two
            m.in_proj_weight.copy_(torch.tensor([[1.0, 0], [0, 1], [1, 0], [0, 1e-38], [0, 2], [0, 2]]))
            m.in_proj_bias.zero_()
            m.out_proj.weight.fill_(1.0)
            m.out_proj.bias.zero_()
        return m.eval()

    mha, ref = build(fnn.MultiheadAttention), build(torch.nn.MultiheadAttention)
    query = torch.tensor([[[1.0, 0.0], [0.5, 0.0]]])
    memory = torch.tensor([[[0.0, 1.0], [-95 * 2**0.5, 3e38]]])  # scores 0 and -95 for query 0
    run = lambda m: m(query, memory, memory, need_weights=need_weights)  # noqa: E731
    (out, weights), (out_m, weights_m) = _fused_and_module(lambda: run(mha), module_path, MHA_OP)
    with torch.no_grad():
        out_t, weights_t = run(ref)
    assert torch.equal(out_t, torch.full((1, 2, 2), math.inf))
    assert torch.equal(out, out_t) and torch.equal(out_m, out_t)
    if need_weights:
        assert 0 < weights_t[0, 0, 1] < torch.finfo(torch.float32).tiny
        torch.testing.assert_close(weights, weights_t, atol=0, rtol=1e-5)


def test_multihead_attention_causal_hint_without_weights(module_path):
    mha = fnn.MultiheadAttention(E, H, batch_first=True).eval()
    (x,) = _inputs("encoder", True)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(L)
    (out, _), (out_m, _) = _fused_and_module(
        lambda: mha(x, x, x, attn_mask=causal, is_causal=True, need_weights=False), module_path, MHA_OP)
    assert torch.equal(out, out_m)


def _mha_setups():
    return {
        "training": lambda: fnn.MultiheadAttention(E, H, dropout=0.0, batch_first=True),
        "separate projections (kdim)": lambda: fnn.MultiheadAttention(E, H, kdim=E + 2, vdim=E + 2,
                                                                      batch_first=True).eval(),
        "bias_k": lambda: fnn.MultiheadAttention(E, H, add_bias_kv=True, batch_first=True).eval(),
        "add_zero_attn": lambda: fnn.MultiheadAttention(E, H, add_zero_attn=True, batch_first=True).eval(),
        "gradients recorded": lambda: fnn.MultiheadAttention(E, H, batch_first=True).eval(),
        "key is not value": lambda: fnn.MultiheadAttention(E, H, batch_first=True).eval(),
    }


@pytest.mark.parametrize("setup", list(_mha_setups()))
def test_multihead_attention_module_path_where_the_fused_call_does_not_apply(setup):
    mha = _mha_setups()[setup]()
    query, memory = _inputs("decoder", True)
    key = value = memory
    if setup.startswith("separate"):
        key = value = torch.randn(N, S, E + 2)
    if setup == "key is not value":
        value = memory.clone()
    with torch.set_grad_enabled(setup == "gradients recorded"):
        (out, _), ops = fasttrans_ops_run(lambda: mha(query, key, value, need_weights=False))
    assert MHA_OP not in ops and out.shape == query.shape


@pytest.mark.parametrize("bad", ["attn_mask shape", "key_padding_mask shape", "integer mask",
                                 "is_causal without a mask", "half-precision float mask"])
def test_multihead_attention_errors_are_the_module_paths(bad, module_path):
    mha = fnn.MultiheadAttention(E, H, batch_first=True).eval()
    (x,) = _inputs("encoder", True)
    masks = BAD[bad]

    def error():
        with pytest.raises(Exception) as info, torch.no_grad():
            mha(x, x, x, key_padding_mask=masks.get("kpm"), attn_mask=masks.get("mask"),
                is_causal=masks.get("is_causal", False))
        return info.value

    fused = error()
    with module_path:
        plain = error()
    assert type(fused) is type(plain) and str(fused) == str(plain)


def _mha_op_args(cross: bool, need_weights: bool, average: bool):
    mha = fnn.MultiheadAttention(E, H, batch_first=True).eval()
    query, memory = _inputs("decoder", True)
    mask = torch.rand(L, S if cross else L) > 0.2
    mask[:, 0] = True  # every query sees a key: no NaN weights, which would never compare equal
    return [query, memory if cross else None, mha.in_proj_weight.detach(), mha.in_proj_bias.detach(),
            mha.out_proj.weight.detach(), mha.out_proj.bias.detach(), mask,
            torch.tensor([5, 2, 4], dtype=torch.int32), False, H, False, need_weights, average]


@pytest.mark.parametrize("cross,need_weights,average", [(False, False, True), (True, True, True),
                                                        (False, True, False)])
def test_multihead_attention_opcheck(cross, need_weights, average):
    fasttrans.backends.inference_ops()  # registers the fake implementation
    torch.library.opcheck(torch.ops.fasttrans.multihead_attention_fwd_extension,
                          _mha_op_args(cross, need_weights, average))


MHA_OP_ERRORS = {
    "in_weight": (lambda a: a.__setitem__(2, a[2][:20]), "in_weight: expected shape (48, 16)"),
    "out_bias": (lambda a: a.__setitem__(5, torch.zeros(3)), "out_bias: expected shape (16,)"),
    "num_heads": (lambda a: a.__setitem__(9, 3), "num_heads: expected a positive divisor"),
    "kv": (lambda a: a.__setitem__(1, torch.randn(2, S, E)), "kv: expected the batch size"),
    "attn_mask": (lambda a: a.__setitem__(6, torch.ones(2, 2, dtype=torch.bool)), "attn_mask: expected a shape"),
    "query": (lambda a: a.__setitem__(0, a[0].int()), "query: expected a floating-point dtype"),
    "key_lengths": (lambda a: a.__setitem__(7, torch.tensor([1, 2], dtype=torch.int32)),
                    "key_lengths: expected shape (3,)"),
}


@pytest.mark.parametrize("bad", list(MHA_OP_ERRORS))
@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
def test_the_multihead_attention_op_names_the_argument_at_fault(bad, need_weights):
    fasttrans.backends.inference_ops()
    args = _mha_op_args(cross=bad == "kv", need_weights=need_weights, average=True)
    corrupt, message = MHA_OP_ERRORS[bad]
    corrupt(args)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        torch.ops.fasttrans.multihead_attention_fwd_extension(*args)

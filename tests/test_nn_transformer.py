"""fasttrans.nn Transformer modules against torch.nn's (torch 2.13).

Seeded construction gives torch's weights; state_dicts load strictly both ways; outputs and
all parameter and input gradients match torch (fp64: 1e-10, fp32: 1e-5) across
batch_first x norm_first x relu/gelu x bias x {no mask, float causal, bool causal, key
padding, causal + key padding} in train mode (dropout 0), and in eval mode (dropout > 0,
inactive); Add & Norm goes through fasttrans.add_layer_norm; errors have torch's types.
"""

import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import fasttrans.nn as fnn
import fasttrans.nn.transformer as ft_transformer
from helpers import assert_close_lowp, right_padded

F64 = torch.float64
TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=1e-5, rtol=1e-5)}
E, H, FF, N, S, T = 16, 2, 24, 3, 7, 5  # d_model 16, 2 heads, source length 7, target length 5
MASK_KINDS = ["none", "float_causal", "bool_causal", "kpm", "both"]


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def _layer_kwargs(batch_first, norm_first, activation, bias, dtype=F64, dropout=0.0):
    return dict(dim_feedforward=FF, dropout=dropout, activation=activation, batch_first=batch_first,
                norm_first=norm_first, bias=bias, dtype=dtype)


def _build(kind, lib, **kw):
    """A module of ``kind`` from torch.nn (lib=torch.nn) or fasttrans.nn (lib=fnn)."""
    if kind == "encoder_layer":
        return lib.TransformerEncoderLayer(E, H, **kw)
    if kind == "decoder_layer":
        return lib.TransformerDecoderLayer(E, H, **kw)
    if kind == "encoder":
        norm = lib.LayerNorm(E, bias=kw["bias"], dtype=kw["dtype"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch: "enable_nested_tensor is True, but ..."
            return lib.TransformerEncoder(lib.TransformerEncoderLayer(E, H, **kw), 2, norm)
    if kind == "decoder":
        norm = lib.LayerNorm(E, bias=kw["bias"], dtype=kw["dtype"])
        return lib.TransformerDecoder(lib.TransformerDecoderLayer(E, H, **kw), 2, norm)
    if kind == "transformer":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return lib.Transformer(E, H, 1, 1, **kw)
    raise ValueError(kind)


def _pair(kind, seed=0, **kw):
    """(torch module, fasttrans module) built from the same seed: identical weights (asserted)."""
    torch.manual_seed(seed)
    t = _build(kind, torch.nn, **kw)
    torch.manual_seed(seed)
    f = _build(kind, fnn, **kw)
    sd_t, sd_f = t.state_dict(), f.state_dict()
    assert list(sd_f) == list(sd_t)
    for k in sd_t:
        assert torch.equal(sd_f[k], sd_t[k]), k
    # norms are initialised to 1/0; random values exercise their gradients properly
    with torch.no_grad():
        for name, p in t.named_parameters():
            if ".norm" in f".{name}":
                p.copy_(1 + 0.3 * torch.randn_like(p))
    f.load_state_dict(t.state_dict(), strict=True)
    return t, f


def _seq(length, batch_first, dtype=F64, batch=N):
    return torch.randn((batch, length, E) if batch_first else (length, batch, E), dtype=dtype)


def _causal(length, dtype, kind):
    mask = torch.ones(length, length, dtype=torch.bool).triu(1)
    return mask if kind == "bool_causal" else torch.zeros(length, length, dtype=dtype).masked_fill(mask, float("-inf"))


def _inputs(kind, mask_kind, batch_first, dtype=F64):
    """(positional tensors, keyword masks) for a module kind; masks never fully mask a row."""
    src, tgt = _seq(S, batch_first, dtype), _seq(T, batch_first, dtype)
    causal_kind = "bool_causal" if mask_kind in ("bool_causal", "both") else "float_causal"
    causal = mask_kind in ("float_causal", "bool_causal", "both")
    kpm = mask_kind in ("kpm", "both")
    src_kpm, tgt_kpm = right_padded([S, 4, 2], S), right_padded([T, 3, 1], T)
    memory_mask = torch.rand(T, S) < 0.3
    memory_mask[:, 0] = False
    kw = {}
    if kind == "encoder_layer":
        if causal:
            kw["src_mask"] = _causal(S, dtype, causal_kind)
        if kpm:
            kw["src_key_padding_mask"] = src_kpm
        return (src,), kw
    if kind == "encoder":
        if causal:
            kw["mask"] = _causal(S, dtype, causal_kind)
        if kpm:
            kw["src_key_padding_mask"] = src_kpm
        return (src,), kw
    if causal:
        kw["tgt_mask"] = _causal(T, dtype, causal_kind)
    if kpm:
        kw["tgt_key_padding_mask"] = tgt_kpm
        kw["memory_key_padding_mask"] = src_kpm
    if mask_kind == "both":
        kw["memory_mask"] = memory_mask
    if kind == "transformer":
        if causal:
            kw["src_mask"] = _causal(S, dtype, causal_kind)
        if kpm:
            kw["src_key_padding_mask"] = src_kpm
        return (src, tgt), kw
    return (tgt, src), kw  # decoder layer / decoder: (tgt, memory)


def _run(mod, tensors, kwargs, seed=1):
    leaves = [x.detach().clone().requires_grad_() for x in tensors]
    out = mod(*leaves, **kwargs)
    g = torch.Generator().manual_seed(seed)
    mod.zero_grad()
    (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum().backward()
    return out, [x.grad for x in leaves], [(n, p.grad) for n, p in mod.named_parameters()]


def _assert_match(t, f, tensors, kwargs, dtype=F64):
    out_t, gin_t, gp_t = _run(t, tensors, kwargs)
    out_f, gin_f, gp_f = _run(f, tensors, kwargs)
    torch.testing.assert_close(out_f, out_t, **TOL[dtype], msg="output")
    for i, (a, b) in enumerate(zip(gin_f, gin_t)):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=f"gradient of input {i}")
    assert [n for n, _ in gp_f] == [n for n, _ in gp_t]
    for (name, a), (_, b) in zip(gp_f, gp_t):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=f"gradient of {name}")
    return out_f, gin_f, gp_f


# --------------------------------------------------------------------------------------
# the grid: outputs and gradients equal to torch's
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
@pytest.mark.parametrize("kind", ["encoder_layer", "decoder_layer", "transformer"])
def test_matches_torch(kind, batch_first, norm_first, activation, bias, mask_kind):
    t, f = _pair(kind, **_layer_kwargs(batch_first, norm_first, activation, bias))
    tensors, kwargs = _inputs(kind, mask_kind, batch_first)
    _assert_match(t, f, tensors, kwargs)


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("kind", ["encoder_layer", "decoder_layer", "transformer"])
def test_eval_mode_matches_torch(kind, norm_first, mask_kind):
    """eval mode with dropout > 0 and grads on (torch stays off its inference fast path)."""
    t, f = _pair(kind, **_layer_kwargs(True, norm_first, "gelu", True, dropout=0.3))
    t.eval()
    f.eval()
    tensors, kwargs = _inputs(kind, mask_kind, True)
    _assert_match(t, f, tensors, kwargs)


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_stacks_match_torch(kind, batch_first, norm_first, mask_kind):
    """Two-layer stacks with a final norm (the layers themselves are swept in test_matches_torch)."""
    activation, bias = ("gelu", False) if norm_first else ("relu", True)
    t, f = _pair(kind, **_layer_kwargs(batch_first, norm_first, activation, bias))
    tensors, kwargs = _inputs(kind, mask_kind, batch_first)
    _assert_match(t, f, tensors, kwargs)


@pytest.mark.parametrize("kind", ["encoder_layer", "decoder_layer", "transformer"])
def test_fp32_matches_torch(kind):
    t, f = _pair(kind, **_layer_kwargs(True, False, "gelu", True, dtype=torch.float32))
    tensors, kwargs = _inputs(kind, "both", True, dtype=torch.float32)
    _assert_match(t, f, tensors, kwargs, dtype=torch.float32)


@pytest.mark.parametrize("kind", ["encoder_layer", "decoder_layer", "transformer"])
def test_unbatched_matches_torch(kind):
    t, f = _pair(kind, **_layer_kwargs(False, True, "relu", True))
    tensors, kwargs = _inputs(kind, "bool_causal", False)
    tensors = tuple(x[:, 0] for x in tensors)  # (L, E)
    _assert_match(t, f, tensors, kwargs)


@pytest.mark.parametrize("is_causal", [None, True, False])
@pytest.mark.parametrize("mask_kind", ["float_causal", "bool_causal", "bool"])
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_is_causal_detection_as_torch(kind, mask_kind, is_causal):
    """None compares the mask with the causal mask; True is trusted where torch trusts it."""
    t, f = _pair(kind, **_layer_kwargs(False, False, "relu", True))
    length = S if kind == "encoder" else T
    if mask_kind == "bool":
        mask = torch.rand(length, length) < 0.3
        mask.fill_diagonal_(False)
    else:
        mask = _causal(length, F64, mask_kind)
    if kind == "encoder":
        tensors, kwargs = (_seq(S, False),), dict(mask=mask, is_causal=is_causal)
    else:
        tensors, kwargs = (_seq(T, False), _seq(S, False)), dict(tgt_mask=mask, tgt_is_causal=is_causal)
    hints = {id(t): [], id(f): []}
    for mod in (t, f):
        for layer in mod.layers:  # the hint each layer receives, as torch hands it down
            layer.register_forward_pre_hook(
                lambda m, args, kw, store=hints[id(mod)]: store.append(kw.get("is_causal", kw.get("tgt_is_causal"))),
                with_kwargs=True,
            )
    _assert_match(t, f, tensors, kwargs)
    assert hints[id(f)] == hints[id(t)] and len(hints[id(t)]) == 2
    assert hints[id(t)][0] is (is_causal is True or (is_causal is None and mask_kind != "bool"))


def test_custom_activations():
    for activation in (F.silu, torch.nn.GELU(approximate="tanh"), torch.nn.ReLU()):
        for kind in ("encoder_layer", "decoder_layer"):
            t, f = _pair(kind, **_layer_kwargs(False, False, activation, True))
            if kind == "encoder_layer":
                assert f.activation_relu_or_gelu == t.activation_relu_or_gelu
            tensors, kwargs = _inputs(kind, "kpm", False)
            _assert_match(t, f, tensors, kwargs)


# --------------------------------------------------------------------------------------
# construction and state_dict
# --------------------------------------------------------------------------------------
CONSTRUCTORS = {
    "Transformer default": lambda lib: lib.Transformer(d_model=32, nhead=2, num_encoder_layers=2,
                                                       num_decoder_layers=1, dim_feedforward=40),
    "Transformer pre-norm no bias": lambda lib: lib.Transformer(16, 2, 1, 2, 24, 0.1, "gelu", layer_norm_eps=1e-6,
                                                                batch_first=True, norm_first=True, bias=False),
    "TransformerEncoder": lambda lib: lib.TransformerEncoder(lib.TransformerEncoderLayer(16, 2, 24), 3,
                                                             lib.LayerNorm(16), enable_nested_tensor=False),
    "TransformerDecoder": lambda lib: lib.TransformerDecoder(lib.TransformerDecoderLayer(16, 2, 24, bias=False), 2),
    "TransformerEncoderLayer": lambda lib: lib.TransformerEncoderLayer(16, 4),
    "TransformerDecoderLayer": lambda lib: lib.TransformerDecoderLayer(16, 4, 32, 0.2, "gelu", 1e-6, True, True),
}


@pytest.mark.parametrize("name", list(CONSTRUCTORS))
def test_seeded_construction_and_state_dict_match_torch(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(42)
        t = CONSTRUCTORS[name](torch.nn)
        torch.manual_seed(42)
        f = CONSTRUCTORS[name](fnn)
    sd_t, sd_f = t.state_dict(), f.state_dict()
    assert list(sd_f) == list(sd_t)
    for k in sd_t:
        assert sd_f[k].shape == sd_t[k].shape and torch.equal(sd_f[k], sd_t[k]), k
    for attr in ("d_model", "nhead", "batch_first", "num_layers", "norm_first", "enable_nested_tensor", "mask_check"):
        if hasattr(t, attr):
            assert getattr(f, attr) == getattr(t, attr), attr
    # strict loads both ways, after changing every value
    with torch.no_grad():
        for p in f.parameters():
            p.add_(torch.randn_like(p))
    t.load_state_dict(f.state_dict(), strict=True)
    f2 = CONSTRUCTORS[name](fnn)
    f2.load_state_dict(t.state_dict(), strict=True)
    for k, v in f.state_dict().items():
        assert torch.equal(t.state_dict()[k], v) and torch.equal(f2.state_dict()[k], v), k
    assert repr(f) == repr(t)  # printed models read the same after swapping the import


def test_stack_layers_are_independent_deep_copies():
    layer = fnn.TransformerEncoderLayer(E, H, FF)
    enc = fnn.TransformerEncoder(layer, 3)
    assert all(m is not layer for m in enc.layers)
    for m in enc.layers[1:]:
        for a, b in zip(m.parameters(), enc.layers[0].parameters()):
            assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    assert enc.use_nested_tensor is False and enc.enable_nested_tensor is True


def test_generate_square_subsequent_mask_matches_torch():
    for sz in (1, 5, 7):
        for dtype in (None, torch.float64):
            a = fnn.Transformer.generate_square_subsequent_mask(sz, dtype=dtype)
            b = torch.nn.Transformer.generate_square_subsequent_mask(sz, dtype=dtype)
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert fnn.Transformer.generate_square_subsequent_mask(3, device="meta").device.type == "meta"


# --------------------------------------------------------------------------------------
# fused Add & Norm
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("kind", ["encoder_layer", "decoder_layer"])
def test_add_and_norm_go_through_add_layer_norm(monkeypatch, kind, norm_first):
    calls = []
    real = ft_transformer.FT.add_layer_norm

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(ft_transformer.FT, "add_layer_norm", spy)
    t, f = _pair(kind, **_layer_kwargs(False, norm_first, "relu", True))
    tensors, kwargs = _inputs(kind, "both", False)
    _assert_match(t, f, tensors, kwargs)
    sublayers = 2 if kind == "encoder_layer" else 3
    # post-norm: one fused call per sublayer; pre-norm: one per sublayer but the last
    # (its residual add has no norm after it), the first norm being a plain LayerNorm
    assert len(calls) == (sublayers if not norm_first else sublayers - 1)


def test_hooked_or_replaced_norms_are_called_as_modules():
    t, f = _pair("encoder_layer", **_layer_kwargs(False, False, "relu", True))
    seen = []
    for mod in (t, f):
        mod.norm2.register_forward_hook(lambda m, i, o: seen.append(type(m).__module__))
    tensors, kwargs = _inputs("encoder_layer", "kpm", False)
    _assert_match(t, f, tensors, kwargs)
    assert seen.count("fasttrans.nn.normalization") == 1 and seen.count("torch.nn.modules.normalization") == 1
    # a norm replaced by RMSNorm (in both libraries) is used as is
    t, f = _pair("decoder_layer", **_layer_kwargs(True, True, "gelu", True))
    t.norm3, f.norm3 = torch.nn.RMSNorm(E, dtype=F64), fnn.RMSNorm(E, dtype=F64)
    tensors, kwargs = _inputs("decoder_layer", "kpm", True)
    _assert_match(t, f, tensors, kwargs)


# --------------------------------------------------------------------------------------
# fully masked rows, inference, compile
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_fully_masked_rows_stay_finite(norm_first):
    """A batch with every key padded, and causal + left padding (query 0 sees only a pad)."""
    for kpm in (right_padded([S, 3, 0], S), torch.tensor([[False] * S, [True, True] + [False] * (S - 2),
                                                            [True] * 3 + [False] * (S - 3)])):
        t, f = _pair("encoder_layer", **_layer_kwargs(True, norm_first, "relu", True))
        tensors = (_seq(S, True),)
        kwargs = dict(src_key_padding_mask=kpm, src_mask=_causal(S, F64, "bool_causal"))
        out, gin, gp = _assert_match(t, f, tensors, kwargs)  # torch's CPU SDPA path also gives 0 here
        assert torch.isfinite(out).all()
        assert all(torch.isfinite(g).all() for g in gin + [g for _, g in gp])


EMPTY_CASES = {  # kind: the dims that can be empty (the batch, the source, the target)
    "encoder_layer": ("batch", "source"),
    "decoder_layer": ("batch", "source", "target"),
    "transformer": ("batch", "source", "target"),
}


@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
@pytest.mark.parametrize("kind,empty", [(k, e) for k, dims in EMPTY_CASES.items() for e in dims],
                         ids=[f"{k}-{e}" for k, dims in EMPTY_CASES.items() for e in dims])
def test_empty_batches_and_sequences_match_torch(kind, empty, batch_first):
    """An empty batch or sequence: torch's output shape (empty where torch's is), outputs and
    gradients equal to torch's; every parameter gets a gradient, zero when the output is empty."""
    t, f = _pair(kind, **_layer_kwargs(batch_first, False, "relu", True))
    batch = 0 if empty == "batch" else N
    src = _seq(0 if empty == "source" else S, batch_first, batch=batch)
    tgt = _seq(0 if empty == "target" else T, batch_first, batch=batch)
    tensors = {"encoder_layer": (src,), "decoder_layer": (tgt, src), "transformer": (src, tgt)}[kind]
    out, gin, gp = _assert_match(t, f, tensors, {})
    assert out.shape == t(*tensors).shape == tensors[-1 if kind == "transformer" else 0].shape  # the (target) input's
    assert [g.shape for g in gin] == [x.shape for x in tensors]
    for name, g in gp:
        assert g is not None, name
        if out.numel() == 0:
            assert torch.equal(g, torch.zeros_like(g)), name


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_inference_matches_torch_fast_paths():
    """eval + no_grad: torch runs _transformer_encoder_layer_fwd and, in the encoder, nested
    tensors (which zero the padded positions); non-padded positions must agree."""
    t, f = _pair("encoder", **_layer_kwargs(True, False, "relu", True))
    t.eval()
    f.eval()
    t.use_nested_tensor = True  # what torch.nn sets for a batch_first, post-norm, even-head layer
    src = _seq(S, True)
    kpm = right_padded([S, 4, 2], S)
    with torch.no_grad():
        out_t = t(src, src_key_padding_mask=kpm)
        out_f = f(src, src_key_padding_mask=kpm)
        keep = ~kpm[..., None]
        torch.testing.assert_close(out_f * keep, out_t * keep, **TOL[F64])
        layer_t, layer_f = t.layers[0], f.layers[0]
        torch.testing.assert_close(layer_f(src, src_key_padding_mask=kpm) * keep,
                                   layer_t(src, src_key_padding_mask=kpm) * keep, **TOL[F64])


def _mismatch_warnings(mod, tensors, kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod(*tensors, **kwargs)
    return sorted(str(w.message) for w in caught if "mismatched" in str(w.message))


def test_mixed_mask_types_warn_like_torch():
    """A float mask with a bool padding mask: torch's deprecation warning, as often as torch gives it."""
    t, f = _pair("encoder", **_layer_kwargs(False, False, "relu", True))
    src = _seq(S, False)
    kwargs = dict(mask=_causal(S, F64, "float_causal"), src_key_padding_mask=right_padded([S, 4, 2], S))
    # one warning per forward, from the encoder (not again from each layer and attention)
    expected = _mismatch_warnings(t, (src,), kwargs)
    assert len(expected) == 1 and "src_key_padding_mask and mask" in expected[0]
    assert _mismatch_warnings(f, (src,), kwargs) == expected
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _assert_match(t, f, (src,), kwargs)
    for kind, mask_name in (("encoder_layer", "src_mask"), ("decoder_layer", "tgt_mask")):
        t, f = _pair(kind, **_layer_kwargs(False, False, "relu", True))
        tensors, kw = _inputs(kind, "kpm", False)
        kw[mask_name] = _causal(tensors[0].shape[0], F64, "float_causal")
        expected = _mismatch_warnings(t, tensors, kw)
        assert expected and _mismatch_warnings(f, tensors, kw) == expected, kind


def test_autocast_bf16_within_twice_torch_error():
    """Under CPU autocast (bf16 matmuls, fp32 residual stream): the 2x low-precision rule
    against the fp32 result, with torch's own autocast error as the baseline."""
    t, f = _pair("transformer", **_layer_kwargs(True, False, "relu", True, dtype=torch.float32))
    tensors, kwargs = _inputs("transformer", "both", True, dtype=torch.float32)
    with torch.no_grad():
        ref = t(*tensors, **kwargs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            baseline = t(*tensors, **kwargs)
            out = f(*tensors, **kwargs)
    assert out.dtype == baseline.dtype
    assert_close_lowp("autocast output", out, ref, baseline, dtype=torch.bfloat16)


def test_compiles_without_graph_breaks():
    f = fnn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True, norm_first=True)
    src = torch.randn(N, S, E)
    kwargs = dict(src_mask=_causal(S, torch.float32, "bool_causal"), src_key_padding_mask=right_padded([S, 4, 2], S))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(src, **kwargs), f(src, **kwargs), **TOL[torch.float32])


# --------------------------------------------------------------------------------------
# errors: same type as torch.nn, message naming the argument
# --------------------------------------------------------------------------------------
def _tf(lib):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return lib.Transformer(E, H, 1, 1, FF, dtype=F64)


def _enc_layer(lib):
    torch.manual_seed(0)
    return lib.TransformerEncoderLayer(E, H, FF, dtype=F64)


def _dec_layer(lib):
    torch.manual_seed(0)
    return lib.TransformerDecoderLayer(E, H, FF, dtype=F64)


ERROR_CASES = {
    "Transformer batch mismatch": lambda lib: _tf(lib)(_seq(S, False), _seq(T, False, batch=N + 1)),
    "Transformer d_model mismatch": lambda lib: _tf(lib)(torch.randn(S, N, E + 2, dtype=F64), _seq(T, False)),
    "Transformer tgt_mask shape": lambda lib: _tf(lib)(_seq(S, False), _seq(T, False),
                                                       tgt_mask=torch.zeros(T, T + 1, dtype=torch.bool)),
    "Transformer memory_mask uint8": lambda lib: _tf(lib)(_seq(S, False), _seq(T, False),
                                                          memory_mask=torch.zeros(T, S, dtype=torch.uint8)),
    "Transformer src_key_padding_mask long": lambda lib: _tf(lib)(
        _seq(S, False), _seq(T, False), src_key_padding_mask=torch.zeros(N, S, dtype=torch.long)),
    "Transformer memory_is_causal without memory_mask": lambda lib: _tf(lib)(_seq(S, False), _seq(T, False),
                                                                             memory_is_causal=True),
    "encoder layer src 4-D": lambda lib: _enc_layer(lib)(torch.randn(1, S, N, E, dtype=F64)),
    "encoder layer src dtype": lambda lib: _enc_layer(lib)(torch.randn(S, N, E)),
    "encoder layer src_mask uint8": lambda lib: _enc_layer(lib)(_seq(S, False),
                                                                src_mask=torch.zeros(S, S, dtype=torch.uint8)),
    "encoder layer src_key_padding_mask long": lambda lib: _enc_layer(lib)(
        _seq(S, False), src_key_padding_mask=torch.zeros(N, S, dtype=torch.long)),
    "encoder layer src_mask head count": lambda lib: _enc_layer(lib)(
        _seq(S, False), src_mask=torch.zeros(N * (H + 1), S, S, dtype=torch.bool)),
    "encoder layer src_key_padding_mask shape": lambda lib: _enc_layer(lib)(
        _seq(S, False), src_key_padding_mask=torch.zeros(N, S + 1, dtype=torch.bool)),
    "encoder layer is_causal without src_mask": lambda lib: _enc_layer(lib)(_seq(S, False), is_causal=True),
    "decoder layer memory batch": lambda lib: _dec_layer(lib)(_seq(T, False), _seq(S, False, batch=N + 1)),
    "decoder layer memory d_model": lambda lib: _dec_layer(lib)(_seq(T, False), torch.randn(S, N, E + 1, dtype=F64)),
    "decoder layer tgt_mask shape": lambda lib: _dec_layer(lib)(_seq(T, False), _seq(S, False),
                                                                tgt_mask=torch.zeros(T, S, dtype=torch.bool)),
    "decoder layer memory_key_padding_mask uint8": lambda lib: _dec_layer(lib)(
        _seq(T, False), _seq(S, False), memory_key_padding_mask=torch.zeros(N, S, dtype=torch.uint8)),
    "encoder layer unknown activation": lambda lib: lib.TransformerEncoderLayer(E, H, activation="tanh"),
    "decoder layer unknown activation": lambda lib: lib.TransformerDecoderLayer(E, H, activation="swish"),
    "encoder layer nhead does not divide d_model": lambda lib: lib.TransformerEncoderLayer(E, 3),
    "encoder stack src dtype": lambda lib: lib.TransformerEncoder(_enc_layer(lib), 1, enable_nested_tensor=False)(
        torch.randn(S, N, E)),
}
ARG_NAMES = ("src", "tgt", "memory", "mask", "query", "key", "value", "activation", "embed_dim", "d_model", "batch",
             "is_causal", "input")


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_have_torch_types(case):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception) as t_err:
            ERROR_CASES[case](torch.nn)
        with pytest.raises(Exception) as f_err:
            ERROR_CASES[case](fnn)
    assert isinstance(f_err.value, t_err.type), (
        f"torch raised {t_err.type.__name__}, fasttrans {type(f_err.value).__name__}: {f_err.value}"
    )
    assert re.search("|".join(ARG_NAMES), str(f_err.value)), str(f_err.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_training_step_with_device_masks_costs_no_host_sync():
    """Key padding and causal masks on the GPU are not read on the host per call: a padding
    mask stays a dense mask, and a causal mask is recognised once while it is unchanged."""
    torch.manual_seed(0)
    layer = fnn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True).cuda().half()
    x = torch.randn(3, 20, 64, device="cuda", dtype=torch.half, requires_grad=True)
    padding = torch.arange(20, device="cuda")[None, :] >= torch.tensor([20, 11, 3], device="cuda")[:, None]
    causal = torch.nn.Transformer.generate_square_subsequent_mask(20, device="cuda", dtype=torch.half)

    def step():
        out = layer(x, src_mask=causal, src_key_padding_mask=padding)
        out.float().sum().backward()

    step()  # compiles, tunes and recognises the causal mask: these may synchronise
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")

"""fasttrans.convert: existing torch.nn models, converted in one call, give the same numbers."""

import copy
import warnings

import pytest
import torch
from torch import nn

import fasttrans
from fasttrans import backends
from fasttrans import nn as ftnn

D, H = 16, 2


def _grads(model, inputs, forward):
    model.zero_grad(set_to_none=True)
    xs = [x.detach().clone().requires_grad_() if x.is_floating_point() else x for x in inputs]
    out = forward(model, *xs)
    g = torch.randn_like(out, generator=torch.Generator().manual_seed(1))
    out.backward(g)
    return out.detach(), [x.grad for x in xs if x.is_floating_point()], {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def _assert_same(a, b):
    out_a, in_a, par_a = a
    out_b, in_b, par_b = b
    torch.testing.assert_close(out_a, out_b, atol=1e-10, rtol=1e-10)
    for x, y in zip(in_a, in_b):
        torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-10)
    assert par_a.keys() == par_b.keys()
    for n in par_a:
        torch.testing.assert_close(par_a[n], par_b[n], atol=1e-10, rtol=1e-10, msg=n)


def test_transformer_converts_with_same_numbers_and_keys():
    torch.manual_seed(0)
    model = nn.Transformer(D, H, 2, 2, 32, dropout=0.0, batch_first=True, dtype=torch.float64)
    src, tgt = torch.randn(3, 7, D, dtype=torch.float64), torch.randn(3, 5, D, dtype=torch.float64)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    kpm = torch.zeros(3, 7, dtype=torch.bool)
    kpm[1, 5:] = True

    def fwd(m, s, t):
        return m(s, t, tgt_mask=tgt_mask, src_key_padding_mask=kpm, memory_key_padding_mask=kpm)

    expected = _grads(model, (src, tgt), fwd)
    converted, skipped = fasttrans.convert(model, inplace=False)
    assert skipped == []
    assert type(converted) is ftnn.Transformer and type(model) is nn.Transformer  # inplace=False: a copy
    assert type(converted.encoder.layers[1].self_attn) is ftnn.MultiheadAttention
    assert list(converted.state_dict().keys()) == list(model.state_dict().keys())
    _assert_same(_grads(converted, (src, tgt), fwd), expected)
    # an existing checkpoint loads (strict) into the converted model
    converted.load_state_dict(model.state_dict())


class Block(nn.Module):
    """A user's own block that nests torch.nn attention and norms."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, H, batch_first=True, dtype=torch.float64)
        self.norm = nn.LayerNorm(D, dtype=torch.float64)
        self.rms = nn.RMSNorm(D, dtype=torch.float64)
        self.proj = nn.Linear(D, D, dtype=torch.float64)

    def forward(self, x, kpm):
        a, _ = self.attn(x, x, x, key_padding_mask=kpm, need_weights=False)
        return self.rms(self.proj(self.norm(x + a)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, 3, dtype=torch.float64)

    def forward(self, x, kpm):
        for b in self.blocks:
            x = b(x, kpm)
        return self.head(x)


def test_custom_model_keeps_parameters_hooks_and_modes():
    torch.manual_seed(0)
    model = Model()
    x = torch.randn(2, 6, D, dtype=torch.float64)
    kpm = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    expected = _grads(model, (x, kpm), lambda m, x, k: m(x, k))
    params_before = {n: p for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    model.blocks[0].attn.register_forward_hook(lambda m, i, o: calls.append(type(m).__name__))
    model.blocks[1].norm.eval()

    converted, skipped = fasttrans.convert(model)
    assert converted is model and skipped == []
    assert type(model.blocks[0].attn) is ftnn.MultiheadAttention
    assert type(model.blocks[1].norm) is ftnn.LayerNorm and type(model.blocks[1].rms) is ftnn.RMSNorm
    for n, p in model.named_parameters():
        assert p is params_before[n], f"{n} is a new tensor: the optimizer would no longer train it"
    assert not model.blocks[1].norm.training and model.blocks[0].norm.training
    _assert_same(_grads(model, (x, kpm), lambda m, x, k: m(x, k)), expected)
    assert calls == ["MultiheadAttention"]
    optimizer.step()  # still steps the model's parameters

    # a second conversion finds nothing to do
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again, skipped = fasttrans.convert(model)
    assert again is model and skipped == []


class CustomLayer(nn.TransformerEncoderLayer):
    """A subclass with code of its own: cannot be represented by a fasttrans layer."""

    def forward(self, src, *args, **kwargs):
        return super().forward(src, *args, **kwargs) * 0.5


def test_unsupported_modules_are_left_alone_and_reported():
    torch.manual_seed(0)
    model = nn.Sequential(
        CustomLayer(D, H, 32, dropout=0.0, batch_first=True, dtype=torch.float64),
        nn.LayerNorm(D, dtype=torch.float64),
    )
    x = torch.randn(2, 5, D, dtype=torch.float64)
    expected = _grads(model, (x,), lambda m, x: m(x))
    with pytest.warns(UserWarning, match="CustomLayer"):
        _, skipped = fasttrans.convert(model)
    assert [name for name, _ in skipped] == ["0"]
    assert type(model[0]) is CustomLayer and type(model[1]) is ftnn.LayerNorm
    _assert_same(_grads(model, (x,), lambda m, x: m(x)), expected)


@pytest.fixture
def seen(monkeypatch):
    """The forced backend (or None) at each backend selection, in call order: the eager
    route's (backends.selected_route) and any other (backends.select_backend)."""
    calls = []
    select, route = backends.select_backend, backends.selected_route

    def spy_select(op, device, dtype=None):
        calls.append(backends.current_forced_backend())
        return select(op, device, dtype)

    def spy_route(kind, device, dtype):
        calls.append(backends.current_forced_backend())
        return route(kind, device, dtype)

    monkeypatch.setattr(backends, "select_backend", spy_select)
    monkeypatch.setattr(backends, "selected_route", spy_route)
    return calls


def test_backend_pin_applies_inside_converted_modules(seen):
    model = nn.Sequential(nn.MultiheadAttention(D, H, batch_first=True))
    _, _ = fasttrans.convert(model, backend="reference")
    x = torch.randn(1, 3, D)
    model[0](x, x, x, need_weights=False)
    assert seen == ["reference"]
    with pytest.raises(ValueError, match="unknown backend"):
        fasttrans.convert(model, backend="fastest")
    with pytest.raises(TypeError, match="model"):
        fasttrans.convert("not a module")


class ScaledLinear(nn.Linear):
    """A user's own Linear (same parameters, its own forward)."""

    def forward(self, x):
        return super().forward(x) * 2.0


class HalfNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x) * 0.5


def test_a_layers_own_children_and_settings_are_kept():
    """convert keeps every child of a layer it converts: replaced children (a Linear
    subclass, a custom norm, Identity for a dropout) stay the same objects, and per-sublayer
    settings (a norm's eps, a dropout's p) stay as they were."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, H, 32, dropout=0.0, batch_first=True, dtype=torch.float64)
    custom = {"linear1": ScaledLinear(D, 32, dtype=torch.float64), "norm2": HalfNorm(D, dtype=torch.float64),
              "dropout1": nn.Identity()}
    for name, child in custom.items():
        setattr(layer, name, child)
    layer.norm1.eps = 1.0
    layer.dropout2.p = 0.3
    model = nn.Sequential(layer).eval()
    x = torch.randn(2, 5, D, dtype=torch.float64)
    expected = _grads(model, (x,), lambda m, x: m(x))
    with pytest.warns(UserWarning, match="HalfNorm"):
        _, skipped = fasttrans.convert(model)
    assert [n for n, _ in skipped] == ["0.norm2"]
    assert type(model[0]) is ftnn.TransformerEncoderLayer
    for name, child in custom.items():
        assert getattr(model[0], name) is child, name
    assert type(model[0].norm1) is ftnn.LayerNorm and model[0].norm1.eps == 1.0
    assert type(model[0].dropout2) is ftnn.Dropout and model[0].dropout2.p == 0.3
    _assert_same(_grads(model, (x,), lambda m, x: m(x)), expected)


def test_parametrized_children_are_kept():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, H, 32, dropout=0.0, batch_first=True, dtype=torch.float64)
    torch.nn.utils.parametrizations.weight_norm(layer.linear1)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    expected = _grads(layer, (x,), lambda m, x: m(x))
    linear1 = layer.linear1
    converted, skipped = fasttrans.convert(layer)
    assert type(converted) is ftnn.TransformerEncoderLayer and converted.linear1 is linear1 and skipped == []
    assert list(converted.state_dict()) == list(layer.state_dict())
    _assert_same(_grads(converted, (x,), lambda m, x: m(x)), expected)


def test_a_module_held_twice_becomes_one_twin():
    ln = nn.LayerNorm(D)
    model = nn.Sequential(ln, nn.ReLU(), ln)
    model.extra = ln
    _, skipped = fasttrans.convert(model)
    assert skipped == [] and type(model[0]) is ftnn.LayerNorm
    assert model[0] is model[2] is model.extra


def _structure(m: nn.Module) -> list[tuple[str, type, int]]:
    return [(n, type(c), id(c)) for n, c in m.named_modules(remove_duplicate=False)]


def test_a_converted_root_leaves_the_original_as_it_was():
    """A supported module passed itself gets a twin; the original (and every module in it)
    is not modified, so code that still holds it computes what it did."""
    torch.manual_seed(0)
    model = nn.Transformer(D, H, 2, 2, 32, batch_first=True).eval()
    src, tgt = torch.randn(2, 7, D), torch.randn(2, 5, D)
    structure = _structure(model)
    with torch.no_grad():
        expected = model(src, tgt)
    converted, skipped = fasttrans.convert(model)
    assert skipped == [] and type(converted) is ftnn.Transformer
    assert _structure(model) == structure
    assert all(not type(m).__module__.startswith("fasttrans") for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(src, tgt), expected)
        torch.testing.assert_close(converted(src, tgt), expected)
    # the twin holds the same parameters; its layer lists are its own
    assert converted.encoder.layers[1].linear1.weight is model.encoder.layers[1].linear1.weight
    assert converted.encoder.layers is not model.encoder.layers
    assert type(converted.encoder.layers[1]) is ftnn.TransformerEncoderLayer


def test_modules_replaced_inside_a_model_are_not_modified():
    """In-place conversion changes the model; a replaced torch module, which the caller may
    still hold, keeps its own children."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoder(nn.TransformerEncoderLayer(D, H, 32, batch_first=True), 2,
                                                enable_nested_tensor=False), nn.Linear(D, 3))
    encoder = model[0]
    structure = _structure(encoder)
    fasttrans.convert(model)
    assert type(model[0]) is ftnn.TransformerEncoder and type(model[0].layers[0]) is ftnn.TransformerEncoderLayer
    assert _structure(encoder) == structure


def test_pinned_backend_goes_with_copies_clones_and_pickles(seen, tmp_path):
    layer = nn.TransformerEncoderLayer(D, H, 32, dropout=0.0, batch_first=True)
    layer, _ = fasttrans.convert(layer, backend="reference")
    x = torch.randn(2, 5, D)
    # a deep copy with other weights computes with its own weights, pinned too
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(-1.5)
    seen.clear()
    out = twin(x)
    assert set(seen) == {"reference"}
    unpinned = copy.deepcopy(twin)
    del unpinned._fasttrans_backend
    with fasttrans.use_backend("reference"):
        torch.testing.assert_close(out, unpinned(x))
    assert not torch.allclose(out, layer(x))
    # a stack clones the layer: every clone trains its own parameters
    stack = ftnn.TransformerEncoder(layer, 2)
    stack(x).sum().backward()
    assert all(p.grad is not None for p in stack.parameters())
    # and a saved model keeps the pin
    torch.save(layer, tmp_path / "layer.pt")
    loaded = torch.load(tmp_path / "layer.pt", weights_only=False)
    seen.clear()
    torch.testing.assert_close(loaded(x), layer(x))
    assert set(seen) == {"reference"}


def test_compiled_modules_are_reported_and_left_alone():
    inner = nn.LayerNorm(D)
    model = nn.Sequential(torch.compile(inner))
    with pytest.warns(UserWarning, match="torch.compile"):
        _, skipped = fasttrans.convert(model)
    assert skipped == [("0", "compiled with torch.compile: convert the model before compiling it")]
    assert model[0]._orig_mod is inner


def test_state_dict_hooks_do_not_run_during_conversion():
    model = nn.Sequential(nn.TransformerEncoderLayer(D, H, 32, batch_first=True))
    calls = []

    def add_key(module, state_dict, prefix, local_metadata):
        calls.append(prefix)
        state_dict[prefix + "calibration"] = torch.ones(1)

    model[0].norm1._register_state_dict_hook(add_key)
    _, skipped = fasttrans.convert(model)
    assert calls == [] and skipped == []
    assert "0.norm1.calibration" in model.state_dict()  # the hook moved to the twin with the module


def test_skipped_names_are_the_modules_paths():
    class MyLayer(nn.TransformerEncoderLayer):
        pass

    class MyEncoder(nn.TransformerEncoder):
        pass

    model = nn.Sequential(nn.ReLU(), nn.TransformerEncoder(MyLayer(D, H, 32), 2))
    with pytest.warns(UserWarning):
        _, skipped = fasttrans.convert(model)
    assert [n for n, _ in skipped] == ["1.layers.0", "1.layers.1"]
    t = nn.Transformer(D, H, 1, 1, 32, custom_encoder=MyEncoder(nn.TransformerEncoderLayer(D, H, 32), 1))
    with pytest.warns(UserWarning):
        _, skipped = fasttrans.convert(t)
    assert [n for n, _ in skipped] == ["encoder"]


def test_layers_that_lost_a_child_or_gained_a_tensor_are_reported():
    """A twin is made only when it can hold all of the layer's own tensors and fill every
    child it calls: otherwise the layer stays torch's, with the reason."""
    lost = nn.TransformerEncoderLayer(D, H, 32)
    del lost.dropout2
    gained = nn.TransformerEncoderLayer(D, H, 32)
    gained.register_buffer("calibration", torch.ones(1))
    model = nn.Sequential(lost, gained)
    with pytest.warns(UserWarning, match="dropout2"):
        _, skipped = fasttrans.convert(model)
    assert skipped == [("0", "it lacks the children dropout2 that torch's layout has"),
                       ("1", "its own parameters or buffers differ from torch's layout")]
    assert type(model[0]) is type(model[1]) is nn.TransformerEncoderLayer
    assert type(model[1].self_attn) is ftnn.MultiheadAttention  # their children are still converted


def test_dropout_flag_moves_every_plain_dropout():
    class MyDropout(nn.Dropout):
        pass

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(D, D), nn.Dropout(0.2), nn.Sequential(nn.Dropout(0.4, inplace=True)),
                             MyDropout(0.1), nn.TransformerEncoderLayer(D, H, 32, dropout=0.3, batch_first=True))

    kept = build()
    fasttrans.convert(kept)  # by default only the converted layer's own dropouts move
    assert type(kept[1]) is nn.Dropout and type(kept[2][0]) is nn.Dropout
    assert type(kept[4].dropout1) is ftnn.Dropout

    model = build()
    model[1].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    model[2].eval()
    seen = []
    _, skipped = fasttrans.convert(model, dropout=True)
    assert skipped == []
    assert type(model[1]) is ftnn.Dropout and model[1].p == 0.2 and not model[1].inplace
    assert type(model[2][0]) is ftnn.Dropout and model[2][0].p == 0.4 and model[2][0].inplace
    assert not model[2][0].training  # its own mode, kept
    assert type(model[3]) is MyDropout  # a subclass runs code of its own
    assert type(model[4].dropout1) is ftnn.Dropout and model[4].dropout1.p == 0.3
    x = torch.randn(2, 5, D)
    y = model[1](x)
    assert seen == [x.shape]  # the hook moved with it
    kept_fraction = (y != 0).float().mean().item()
    assert 0.7 < kept_fraction < 0.9
    torch.testing.assert_close(y[y != 0], x[y != 0] / 0.8)

"""fasttrans.nn.MultiheadAttention against torch.nn.MultiheadAttention (torch 2.13).

Same seeded initialisation and state_dict both ways; outputs, attention weights and every
parameter and input gradient equal to torch's across layouts, masks, need_weights, biases,
in train mode (dropout 0) and eval mode (dropout > 0, inactive) (fp64: 1e-10; fp32: 1e-5);
fully masked rows; dropout; errors of torch's type; and the mask translation into the
fasttrans.attention contract.
"""

import re
import warnings

import pytest
import torch

import fasttrans
import fasttrans.functional as FT
import fasttrans.nn as fnn
from fasttrans import reference
from fasttrans.nn import mask_translation
from helpers import right_padded

F64 = torch.float64
TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=1e-5, rtol=1e-5)}
E, H, N, L, S = 16, 2, 3, 5, 7  # awkward lengths: L=5 queries, S=7 keys


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def _pair(seed=0, perturb=True, **kwargs):
    """(torch module, fasttrans module) with the same weights; random biases when perturb."""
    torch.manual_seed(seed)
    t = torch.nn.MultiheadAttention(**kwargs)
    if perturb:
        with torch.no_grad():
            for p in t.parameters():
                p.copy_(0.5 * torch.randn_like(p))
    f = fnn.MultiheadAttention(**kwargs)
    f.load_state_dict(t.state_dict(), strict=True)
    return t, f


def _grads_of(mod, leaves):
    return [x.grad for x in leaves] + [p.grad for p in mod.parameters()]


def _run(mod, tensors, call, seed=1):
    """Forward with fresh leaves (identity between inputs preserved), backward of a random loss."""
    leaves, seen = [], {}
    for x in tensors:
        if id(x) not in seen:
            seen[id(x)] = x.detach().clone().requires_grad_()
            leaves.append(seen[id(x)])
    out, w = call(mod, *(seen[id(x)] for x in tensors))
    g = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()
    if w is not None:
        loss = loss + (w * torch.randn(w.shape, generator=g, dtype=w.dtype)).sum()
    mod.zero_grad()
    loss.backward()
    return out, w, _grads_of(mod, leaves)


def _assert_match(t_mod, f_mod, tensors, call, dtype=F64, equal_nan=False, grads=True):
    out_t, w_t, g_t = _run(t_mod, tensors, call)
    out_f, w_f, g_f = _run(f_mod, tensors, call)
    torch.testing.assert_close(out_f, out_t, **TOL[dtype], equal_nan=equal_nan, msg="output")
    assert (w_t is None) == (w_f is None)
    if w_t is not None:
        torch.testing.assert_close(w_f, w_t, **TOL[dtype], equal_nan=equal_nan, msg="attention weights")
    if grads:
        names = [f"input {i}" for i in range(len(g_t) - len(list(t_mod.parameters())))]
        names += [n for n, _ in t_mod.named_parameters()]
        for name, a, b in zip(names, g_f, g_t):
            assert (a is None) == (b is None), name
            if a is not None:
                torch.testing.assert_close(a, b, **TOL[dtype], msg=f"gradient of {name}")
    return out_f, w_f, g_f


def _seq(n_or_len, len_or_n, dim, batch_first, dtype=F64):
    """(N, L, E) if batch_first else (L, N, E)."""
    shape = (n_or_len, len_or_n, dim) if batch_first else (len_or_n, n_or_len, dim)
    return torch.randn(shape, dtype=dtype)


def _masks_for(kind, Lq, Sk, dtype=F64):
    """(attn_mask, key_padding_mask) of a kind, torch.nn conventions, no fully masked row."""
    causal_bool = torch.ones(Lq, Sk, dtype=torch.bool).triu(1)
    causal_float = torch.zeros(Lq, Sk, dtype=dtype).masked_fill(causal_bool, float("-inf"))
    if kind == "none":
        return None, None
    if kind == "float_causal":
        return causal_float, None
    if kind == "bool_causal":
        return causal_bool, None
    if kind == "bool":
        m = torch.rand(Lq, Sk) < 0.4
        m[:, 0] = False
        return m, None
    if kind == "float3d":
        m = torch.randn(N * H, Lq, Sk, dtype=dtype).masked_fill(torch.rand(N * H, Lq, Sk) < 0.2, float("-inf"))
        return m.index_fill(-1, torch.tensor([1]), 0.0), None  # key 1 always allowed
    if kind == "kpm":
        return None, right_padded([Sk, 3, 1], Sk)
    if kind == "kpm_scattered":
        kpm = torch.rand(N, Sk) < 0.4
        kpm[:, 2] = False
        return None, kpm
    if kind == "kpm_float":
        return None, torch.randn(N, Sk, dtype=dtype).masked_fill(right_padded([Sk, 4, 2], Sk), float("-inf"))
    if kind == "both":
        return causal_bool, right_padded([Sk, 3, 1], Sk)
    if kind == "mixed":  # the common seq2seq pair: float causal mask + bool padding mask (torch warns)
        return causal_float, right_padded([Sk, 4, 2], Sk)
    raise ValueError(kind)


MASK_KINDS = ["none", "float_causal", "bool_causal", "bool", "float3d", "kpm", "kpm_scattered", "kpm_float", "both",
              "mixed"]


# --------------------------------------------------------------------------------------
# parameters, initialisation, state_dict
# --------------------------------------------------------------------------------------
INIT_CONFIGS = [
    dict(),
    dict(bias=False),
    dict(add_bias_kv=True),
    dict(add_zero_attn=True, dropout=0.1),
    dict(kdim=12, vdim=20),
    dict(kdim=12, vdim=20, bias=False, add_bias_kv=True, batch_first=True),
]


@pytest.mark.parametrize("kwargs", INIT_CONFIGS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "default")
def test_seeded_init_and_state_dict_match_torch(kwargs):
    torch.manual_seed(123)
    t = torch.nn.MultiheadAttention(E, H, dtype=F64, **kwargs)
    torch.manual_seed(123)
    f = fnn.MultiheadAttention(E, H, dtype=F64, **kwargs)
    # same names, shapes, order and values (same RNG draws in the same order)
    assert [(n, p.shape) for n, p in f.named_parameters()] == [(n, p.shape) for n, p in t.named_parameters()]
    sd_t, sd_f = t.state_dict(), f.state_dict()
    assert list(sd_f) == list(sd_t)
    for k in sd_t:
        assert torch.equal(sd_f[k], sd_t[k]), k
    for attr in ("embed_dim", "kdim", "vdim", "num_heads", "head_dim", "dropout", "batch_first", "add_zero_attn",
                 "_qkv_same_embed_dim"):
        assert getattr(f, attr) == getattr(t, attr), attr
    # strict loads both ways
    _, f2 = _pair(seed=7, dtype=F64, embed_dim=E, num_heads=H, **kwargs)
    t2 = torch.nn.MultiheadAttention(E, H, dtype=F64, **kwargs)
    t2.load_state_dict(f2.state_dict(), strict=True)
    for k, v in f2.state_dict().items():
        assert torch.equal(t2.state_dict()[k], v), k


def test_merge_masks_is_torchs():
    t, f = _pair(embed_dim=E, num_heads=H, batch_first=True)
    query = torch.randn(N, L, E)
    kpm = right_padded([L, 3, 2], L)
    for masks in ((None, None), (torch.rand(L, L) > 0.5, None), (None, kpm), (torch.rand(L, L) > 0.5, kpm)):
        got, want = f.merge_masks(*masks, query), t.merge_masks(*masks, query)
        assert got[1] == want[1] and (got[0] is None) == (want[0] is None)
        if want[0] is not None:
            assert torch.equal(got[0], want[0])


def test_reset_parameters_repeats_construction():
    torch.manual_seed(5)
    fresh = fnn.MultiheadAttention(E, H, add_bias_kv=True)
    m = fnn.MultiheadAttention(E, H, add_bias_kv=True)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(3.0)
    torch.manual_seed(5)
    m.reset_parameters()
    for (k, a), b in zip(fresh.state_dict().items(), m.state_dict().values()):
        assert torch.equal(a, b), k


def test_factory_kwargs_and_repr():
    m = fnn.MultiheadAttention(E, H, kdim=8, vdim=8, device="meta", dtype=torch.float16)
    assert all(p.device.type == "meta" and p.dtype == torch.float16 for p in m.parameters())
    assert type(m.out_proj) is type(torch.nn.MultiheadAttention(E, H).out_proj)


@pytest.mark.parametrize("kwargs", [{}, {"kdim": 8, "vdim": 6, "bias": False}, {"add_bias_kv": True, "add_zero_attn": True,
                                                                             "batch_first": True, "dropout": 0.1}])
def test_repr_is_torchs(kwargs):
    """Printed models read the same after swapping the import."""
    assert repr(fnn.MultiheadAttention(E, H, **kwargs)) == repr(torch.nn.MultiheadAttention(E, H, **kwargs))


# --------------------------------------------------------------------------------------
# forward and gradients: the main grid
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("attn", ["self", "cross"])
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("need_weights", [False, True], ids=["fused", "weights"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
def test_matches_torch(batch_first, need_weights, mask_kind, attn, bias):
    t, f = _pair(embed_dim=E, num_heads=H, bias=bias, batch_first=batch_first, dtype=F64)
    x = _seq(N, L, E, batch_first)
    if attn == "self":
        tensors, Sk = (x, x, x), L
    else:
        mem = _seq(N, S, E, batch_first)
        tensors, Sk = (x, mem, mem), S
    attn_mask, kpm = _masks_for(mask_kind, L, Sk)

    def call(mod, q, k, v):
        return mod(q, k, v, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=need_weights)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "mixed" pair warns (tested separately)
        _assert_match(t, f, tensors, call)


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("need_weights", [False, True], ids=["fused", "weights"])
def test_eval_mode_matches_torch(need_weights, mask_kind):
    """eval mode with dropout > 0 and grads on: dropout is off and torch takes its regular path."""
    t, f = _pair(embed_dim=E, num_heads=H, dropout=0.3, batch_first=True, dtype=F64)
    t.eval()
    f.eval()
    x, mem = _seq(N, L, E, True), _seq(N, S, E, True)
    attn_mask, kpm = _masks_for(mask_kind, L, S)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _assert_match(t, f, (x, mem, mem), lambda m, q, k, v: m(
            q, k, v, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=need_weights))


@pytest.mark.parametrize(
    "kwargs",
    [dict(kdim=12, vdim=20), dict(add_bias_kv=True), dict(add_zero_attn=True),
     dict(add_bias_kv=True, add_zero_attn=True, kdim=12, vdim=20, bias=False)],
    ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()),
)
@pytest.mark.parametrize("mask_kind", ["none", "bool_causal", "float3d", "kpm", "both"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["fused", "weights"])
def test_options_match_torch(kwargs, mask_kind, need_weights):
    """kdim/vdim (separate projection weights), bias_k/bias_v and the zero key, with every mask kind."""
    t, f = _pair(embed_dim=E, num_heads=H, dtype=F64, **kwargs)
    x = _seq(N, L, E, False)
    k = torch.randn(S, N, kwargs.get("kdim", E), dtype=F64)
    v = torch.randn(S, N, kwargs.get("vdim", E), dtype=F64)
    attn_mask, kpm = _masks_for(mask_kind, L, S)
    for avg in (True, False):
        _assert_match(t, f, (x, k, v), lambda m, q, kk, vv: m(
            q, kk, vv, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=need_weights, average_attn_weights=avg))


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float3d", "kpm", "bool_causal"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["fused", "weights"])
def test_unbatched_matches_torch(mask_kind, need_weights):
    t, f = _pair(embed_dim=E, num_heads=H, dtype=F64, batch_first=True)  # batch_first is ignored when unbatched
    x, mem = torch.randn(L, E, dtype=F64), torch.randn(S, E, dtype=F64)
    attn_mask, kpm = _masks_for(mask_kind, L, S)
    if attn_mask is not None and attn_mask.dim() == 3:
        attn_mask = attn_mask[:H]  # (num_heads, L, S) for unbatched input
    if kpm is not None:
        kpm = kpm[1]  # (S,)
    for avg in (True, False):
        out, w, _ = _assert_match(t, f, (x, mem, mem), lambda m, q, k, v: m(
            q, k, v, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=need_weights, average_attn_weights=avg))
        assert out.shape == (L, E)
        if need_weights:
            assert w.shape == ((L, S) if avg else (H, L, S))


@pytest.mark.parametrize("with_kpm", [False, True], ids=["no_kpm", "kpm"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["fused", "weights"])
@pytest.mark.parametrize("truthful", [True, False], ids=["causal_mask", "other_mask"])
def test_is_causal_hint_as_torch(truthful, need_weights, with_kpm):
    """torch trusts is_causal (ignoring attn_mask) only without a padding mask and without weights."""
    t, f = _pair(embed_dim=E, num_heads=H, dtype=F64)
    x = _seq(N, L, E, False)
    attn_mask = _masks_for("bool_causal" if truthful else "bool", L, L)[0]
    kpm = right_padded([L, 3, 2], L) if with_kpm else None
    _assert_match(t, f, (x, x, x), lambda m, q, k, v: m(
        q, k, v, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=need_weights, is_causal=True))


def test_trusted_causal_hint_drops_a_mask_of_another_shape_as_torch():
    """Where torch trusts is_causal (no padding mask, no weights) it drops attn_mask before
    checking its shape: a (2, 2) mask on a length-1 sequence runs as causal attention."""
    t, f = _pair(embed_dim=E, num_heads=H, dtype=F64)
    x = _seq(N, 1, E, False)
    wrong = torch.zeros(2, 2, dtype=torch.bool)
    _assert_match(t, f, (x, x, x), lambda m, q, k, v: m(q, k, v, attn_mask=wrong, need_weights=False, is_causal=True))
    for kwargs in ({"need_weights": True}, {"need_weights": False, "key_padding_mask": torch.zeros(N, 1).bool()}):
        for mod in (t, f):  # the mask is used there, so both refuse its shape
            with pytest.raises(RuntimeError, match="attn_mask"):
                mod(x, x, x, attn_mask=wrong, is_causal=True, **kwargs)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["fused", "weights"])
def test_in_proj_bias_of_another_dtype_is_promoted_as_torch(need_weights, training):
    """torch's test_multihead_attn_fast_path_query_and_bias_have_different_dtypes: a float64
    module whose in_proj_bias became float16 returns float64, the bias added with promotion."""
    t, f = _pair(embed_dim=4, num_heads=4, batch_first=True, dtype=F64)
    for mod in (t, f):
        mod.in_proj_bias = torch.nn.Parameter(mod.in_proj_bias.detach().half())
        mod.train(training)
    x = torch.randn(4, 4, 4, dtype=F64)
    with torch.no_grad():
        out_t, _ = t(x, x, x, need_weights=need_weights)
        out_f, _ = f(x, x, x, need_weights=need_weights)
    assert out_f.dtype == out_t.dtype == F64
    torch.testing.assert_close(out_f, out_t, **TOL[F64])
    _assert_match(t, f, (x, x, x), lambda m, q, k, v: m(q, k, v, need_weights=need_weights))


@pytest.mark.parametrize("need_weights", [False, True], ids=["fused", "weights"])
def test_non_contiguous_inputs_and_masks(need_weights):
    """Transposed views as inputs and masks (strides are not assumed anywhere)."""
    t, f = _pair(embed_dim=E, num_heads=H, dtype=F64)
    x = torch.randn(N, L, E, dtype=F64).transpose(0, 1)  # (L, N, E), not contiguous
    mem = torch.randn(N, S, E, dtype=F64).transpose(0, 1)
    bool_mask = (torch.rand(S, L) < 0.3).index_fill(1, torch.tensor([0]), False)
    attn_mask = bool_mask.t()  # (L, S) transposed: key 0 always allowed
    float_mask = torch.randn(L, N * H, S, dtype=F64).transpose(0, 1)  # (N*H, L, S) view
    kpm = (torch.rand(S, N) < 0.3).index_fill(0, torch.tensor([0]), False).t()  # (N, S) view
    assert not (x.is_contiguous() or attn_mask.is_contiguous() or float_mask.is_contiguous() or kpm.is_contiguous())
    for am, pm in ((attn_mask, kpm), (float_mask, None), (None, kpm)):
        _assert_match(t, f, (x, mem, mem), lambda m, q, k, v: m(
            q, k, v, key_padding_mask=pm, attn_mask=am, need_weights=need_weights))


def test_fp32_matches_torch():
    t, f = _pair(embed_dim=E, num_heads=H, batch_first=True, dtype=torch.float32)
    x = _seq(N, L, E, True, torch.float32)
    attn_mask, kpm = _masks_for("both", L, L)
    for need_weights in (False, True):
        _assert_match(t, f, (x, x, x), lambda m, q, k, v: m(
            q, k, v, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=need_weights), dtype=torch.float32)


@pytest.mark.parametrize("mask_kind", ["none", "bool_causal", "kpm"])
def test_matches_torch_inference_fast_path(mask_kind):
    """eval + no_grad + batch_first self-attention: torch's native fast path, same results."""
    t, f = _pair(embed_dim=E, num_heads=H, batch_first=True, dtype=F64)
    t.eval()
    f.eval()
    x = _seq(N, L, E, True)
    attn_mask, kpm = _masks_for(mask_kind, L, L)
    with torch.no_grad():
        for need_weights in (False, True):
            out_t, w_t = t(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=need_weights)
            out_f, w_f = f(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=need_weights)
            torch.testing.assert_close(out_f, out_t, **TOL[F64])
            if need_weights:
                torch.testing.assert_close(w_f, w_t, **TOL[F64])


def test_mixed_mask_types_warn_like_torch():
    t, f = _pair(embed_dim=E, num_heads=H, dtype=F64)
    x = _seq(N, L, E, False)
    attn_mask, kpm = _masks_for("mixed", L, L)
    for mod in (t, f):
        with pytest.warns(UserWarning, match="mismatched key_padding_mask and attn_mask"):
            mod(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matching types: no warning
        f(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask.isinf(), need_weights=False)


MASK_DTYPES = [None, torch.bool, torch.float16, torch.float32, torch.float64]


@pytest.mark.parametrize("query_dtype", [torch.float32, F64], ids=["q32", "q64"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["fused", "weights"])
def test_mask_dtype_combinations_are_accepted_or_refused_as_in_torch(query_dtype, need_weights):
    """torch makes a bool mask a float mask of the query's dtype and adds the two masks, so a
    bool causal mask with a float32 padding mask works with a float64 query: every pair of
    mask dtypes (and the is_causal hint) either gives torch's output or fails as torch does."""
    t, f = _pair(embed_dim=E, num_heads=H, dtype=query_dtype)
    x = _seq(N, L, E, False, dtype=query_dtype)
    blocked = torch.ones(L, L, dtype=torch.bool).triu(1)
    pad = right_padded([L, 3, 1], L)

    def mask(pattern, dtype):
        if dtype is None or dtype == torch.bool:
            return None if dtype is None else pattern
        return torch.zeros(pattern.shape, dtype=dtype).masked_fill(pattern, float("-inf"))

    def outcome(mod, **kwargs):
        try:
            return mod(x, x, x, need_weights=need_weights, **kwargs)[0]
        except (RuntimeError, AssertionError) as e:
            return type(e)

    accepted = 0
    for kpm_dtype in MASK_DTYPES:
        for mask_dtype in MASK_DTYPES:
            for is_causal in ([False, True] if mask_dtype is not None else [False]):
                kwargs = dict(attn_mask=mask(blocked, mask_dtype), key_padding_mask=mask(pad, kpm_dtype),
                              is_causal=is_causal)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # mixed bool/float pairs warn, as in torch
                    want, got = outcome(t, **kwargs), outcome(f, **kwargs)
                case = f"key_padding_mask {kpm_dtype}, attn_mask {mask_dtype}, is_causal={is_causal}"
                if isinstance(want, torch.Tensor):
                    assert isinstance(got, torch.Tensor), f"{case}: torch computes, fasttrans raised {got}"
                    torch.testing.assert_close(got, want, **TOL[query_dtype], msg=case)
                    accepted += 1
                else:
                    assert got is want, f"{case}: torch raised {want}, fasttrans gave {got}"
    assert accepted > 10

@pytest.mark.parametrize("need_weights", [False, True], ids=["fused", "weights"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
@pytest.mark.parametrize("empty", ["batch", "queries", "keys"])
def test_empty_batches_and_sequences_match_torch(empty, batch_first, need_weights):
    """An empty batch, query or key sequence: torch's output and weight shapes, outputs and
    gradients equal to torch's; every parameter gets a gradient, zero when the output is empty."""
    t, f = _pair(embed_dim=E, num_heads=H, batch_first=batch_first, dtype=F64)
    n, Lq, Sk = (0 if empty == "batch" else N), (0 if empty == "queries" else L), (0 if empty == "keys" else S)
    x, mem = _seq(n, Lq, E, batch_first), _seq(n, Sk, E, batch_first)

    def call(mod, q, k, v):
        return mod(q, k, v, need_weights=need_weights)

    out, w, grads = _assert_match(t, f, (x, mem, mem), call)
    out_t, w_t = call(t, x, mem, mem)
    assert out.shape == out_t.shape == x.shape
    if need_weights:
        assert w.shape == w_t.shape == (n, Lq, Sk)
    params = grads[-len(list(f.parameters())):]
    assert all(g is not None for g in params)
    if out.numel() == 0:
        assert all(torch.equal(g, torch.zeros_like(g)) for g in params)


# --------------------------------------------------------------------------------------
# fully masked query rows
# --------------------------------------------------------------------------------------
def _fully_masked_case():
    """A bool attn_mask with query row 1 fully masked, and batch 2 with every key padded."""
    attn_mask = torch.rand(L, S) < 0.3
    attn_mask[:, 0] = False
    attn_mask[1] = True
    kpm = right_padded([S, 4, 0], S)
    return attn_mask, kpm


def test_fully_masked_rows_are_zero_with_finite_gradients():
    """need_weights=False: the contract's 0 (torch's CPU SDPA path agrees), gradients finite."""
    attn_mask, kpm = _fully_masked_case()
    t, f = _pair(embed_dim=E, num_heads=H, bias=False, dtype=F64)
    x, mem = _seq(N, L, E, False), _seq(N, S, E, False)
    float_mask = torch.zeros(L, S, dtype=F64).masked_fill(attn_mask, float("-inf"))
    for am, pm in ((attn_mask, None), (None, kpm), (attn_mask, kpm), (float_mask, None)):
        out, _, grads = _assert_match(t, f, (x, mem, mem), lambda m, q, k, v: m(
            q, k, v, key_padding_mask=pm, attn_mask=am, need_weights=False))
        assert torch.isfinite(out).all()
        assert all(torch.isfinite(g).all() for g in grads if g is not None)
        if am is not None:
            assert torch.equal(out[1], torch.zeros_like(out[1]))  # no bias: output row = attention row = 0
        if pm is not None:
            assert torch.equal(out[:, 2], torch.zeros_like(out[:, 2]))


def test_fully_masked_rows_with_weights_are_nan_like_torch():
    """need_weights=True: torch's softmax of an all -inf row is NaN (weights and output): matched."""
    attn_mask, kpm = _fully_masked_case()
    t, f = _pair(embed_dim=E, num_heads=H, dtype=F64)
    x, mem = _seq(N, L, E, False), _seq(N, S, E, False)
    for avg in (True, False):
        out_t, w_t = t(x, mem, mem, key_padding_mask=kpm, attn_mask=attn_mask, average_attn_weights=avg)
        out_f, w_f = f(x, mem, mem, key_padding_mask=kpm, attn_mask=attn_mask, average_attn_weights=avg)
        assert out_t.isnan().any() and w_t.isnan().any()
        torch.testing.assert_close(out_f, out_t, **TOL[F64], equal_nan=True)
        torch.testing.assert_close(w_f, w_t, **TOL[F64], equal_nan=True)


def test_fully_masked_rows_with_weights_keep_nan_out_of_the_q_and_k_gradients():
    """need_weights=True, backward: torch's NaN reaches the q, k and v projection gradients,
    fasttrans's only the v projection's (the NaN is written into the weights after the
    softmax, so no gradient flows through it to the scores); elsewhere the NaN patterns agree."""
    attn_mask, kpm = _fully_masked_case()
    t, f = _pair(embed_dim=E, num_heads=H, dtype=F64)
    x, mem = _seq(N, L, E, False), _seq(N, S, E, False)

    def call(mod, q, k, v):
        return mod(q, k, v, key_padding_mask=kpm, attn_mask=attn_mask)

    out_t, w_t, (dx_t, dmem_t, *_) = _run(t, (x, mem, mem), call)
    out_f, w_f, (dx_f, dmem_f, *_) = _run(f, (x, mem, mem), call)
    assert out_t.isnan().any() and w_t.isnan().any()
    assert torch.equal(out_f.isnan(), out_t.isnan()) and torch.equal(w_f.isnan(), w_t.isnan())
    for name in ("in_proj_weight", "in_proj_bias"):
        (q_t, k_t, v_t), (q_f, k_f, v_f) = (getattr(m, name).grad.chunk(3) for m in (t, f))
        assert q_t.isnan().any() and k_t.isnan().any() and v_t.isnan().any(), name
        assert torch.isfinite(q_f).all() and torch.isfinite(k_f).all(), name
        assert torch.equal(v_f.isnan(), v_t.isnan()), name
    for name in ("weight", "bias"):
        a, b = getattr(f.out_proj, name).grad, getattr(t.out_proj, name).grad
        assert torch.equal(a.isnan(), b.isnan()), f"out_proj.{name}"
    # the query reaches the loss through q alone, the memory through k and v
    assert dx_t.isnan().any() and torch.isfinite(dx_f).all()
    assert torch.equal(dmem_f.isnan(), dmem_t.isnan())


# --------------------------------------------------------------------------------------
# dropout
# --------------------------------------------------------------------------------------
def test_dropout_with_weights_matches_torch_under_the_same_seed():
    """need_weights=True drops the materialised weights with F.dropout, exactly as torch."""
    t, f = _pair(embed_dim=E, num_heads=H, dropout=0.3, dtype=F64)
    x, mem = _seq(N, L, E, False), _seq(N, S, E, False)
    kpm = right_padded([S, 4, 2], S)
    torch.manual_seed(11)
    out_t, w_t = t(x, mem, mem, key_padding_mask=kpm)
    torch.manual_seed(11)
    out_f, w_f = f(x, mem, mem, key_padding_mask=kpm)
    torch.testing.assert_close(out_f, out_t, **TOL[F64])
    torch.testing.assert_close(w_f, w_t, **TOL[F64])


def test_dropout_one_drops_every_weight_as_torch():
    """dropout=1 (torch accepts p <= 1): the attention output is 0, its gradients 0."""
    t, f = _pair(embed_dim=E, num_heads=H, dropout=1.0, dtype=F64)
    for need_weights in (False, True):
        _assert_match(t, f, (_seq(N, L, E, False),), lambda m, x: m(x, x, x, need_weights=need_weights))


@pytest.mark.parametrize("need_weights", [False, True])
def test_causal_float_mask_that_requires_grad_gets_its_gradient(need_weights):
    # a mask equal to the causal mask is run as is_causal, unless its gradient is asked for
    t, f = _pair(embed_dim=E, num_heads=H, dtype=F64)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=F64)
    _assert_match(t, f, (_seq(N, L, E, False), mask),
                  lambda m, x, am: m(x, x, x, attn_mask=am, need_weights=need_weights))


def test_fused_dropout_uses_the_op_keep_mask():
    """need_weights=False passes dropout_p to fasttrans.attention in training, 0 in eval."""
    p = 0.3
    _, f = _pair(embed_dim=E, num_heads=H, dropout=p, batch_first=True, dtype=F64)
    x = _seq(N, L, E, True)
    with torch.no_grad():
        qkv = torch.nn.functional.linear(x, f.in_proj_weight, f.in_proj_bias)
        q, k, v = (t.unflatten(-1, (H, E // H)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))  # (N, H, L, D)
        torch.manual_seed(3)
        keep = FT.attention_dropout_mask(q, k, p)
        attn = reference.attention(q, k, v, dropout_p=p, dropout_mask=keep)
        expected = f.out_proj(attn.transpose(1, 2).reshape(N, L, E))
        torch.manual_seed(3)
        out, _ = f(x, x, x, need_weights=False)
        torch.testing.assert_close(out, expected, **TOL[F64])
        assert not torch.allclose(out, f.eval()(x, x, x, need_weights=False)[0])  # dropout really was on


# --------------------------------------------------------------------------------------
# mask translation (the fasttrans.attention contract)
# --------------------------------------------------------------------------------------
def _translate(attn_mask=None, kpm=None, **kw):
    args = dict(is_causal=False, need_weights=False, batch=N, heads=H, tgt_len=L, src_len=S)
    args.update(kw)
    return mask_translation.translate(attn_mask, kpm, **args)


def test_translate_forms():
    causal = torch.ones(L, S, dtype=torch.bool).triu(1)
    m = _translate(causal)
    assert m.is_causal and m.attn_mask is None and m.key_lengths is None
    m = _translate(torch.zeros(L, S, dtype=F64).masked_fill(causal, float("-inf")))
    assert m.is_causal and m.attn_mask is None
    m = _translate(causal.expand(N * H, L, S).clone())
    assert m.is_causal
    m = _translate(None, right_padded([S, 3, 0], S))
    assert torch.equal(m.key_lengths, torch.tensor([S, 3, 0])) and m.attn_mask is None and not m.is_causal
    # a general bool mask is inverted (True = may attend) and keeps its size-1 broadcast dims
    bool_mask = torch.rand(L, S) < 0.5
    m = _translate(bool_mask)
    assert m.attn_mask.shape == (1, 1, L, S) and torch.equal(m.attn_mask[0, 0], ~bool_mask)
    float_mask = torch.randn(N * H, L, S)
    m = _translate(float_mask)
    assert m.attn_mask.shape == (N, H, L, S) and torch.equal(m.attn_mask.reshape(N * H, L, S), float_mask)
    scattered = torch.tensor([[False, True, False, False, False, False, True]] * N)
    m = _translate(None, scattered)
    assert m.key_lengths is None and m.attn_mask.shape == (N, 1, 1, S) and torch.equal(m.attn_mask[:, 0, 0], ~scattered)
    float_kpm = torch.randn(N, S)
    m = _translate(None, float_kpm)
    assert m.attn_mask.shape == (N, 1, 1, S) and m.attn_mask.dtype == float_kpm.dtype
    # causal + right padding: both fast forms at once
    m = _translate(causal, right_padded([S, 2, 5], S))
    assert m.is_causal and m.attn_mask is None and m.key_lengths.tolist() == [S, 2, 5]
    # bool + float: float additive (0/-inf for the bool one), broadcast to (N, 1, L, S) only
    m = _translate(bool_mask, float_kpm)
    expected = torch.zeros(L, S).masked_fill(bool_mask, float("-inf"))[None, None] + float_kpm[:, None, None, :]
    assert m.attn_mask.shape == (N, 1, L, S) and torch.equal(m.attn_mask, expected)
    # extra keys (bias_k, add_zero_attn): always allowed columns, no causal shortcut
    m = _translate(causal, None, extra_keys=2)
    assert not m.is_causal and m.attn_mask.shape == (1, 1, L, S + 2) and m.attn_mask[..., S:].all()
    # the trusted hint: causal over all keys, attn_mask dropped
    m = _translate(bool_mask, None, is_causal=True)
    assert m.is_causal and m.attn_mask is None
    m = _translate(bool_mask, None, is_causal=True, need_weights=True)
    assert not m.is_causal and m.attn_mask is not None


def test_translation_is_shared_while_the_mask_is_unchanged():
    """The layers of a stack given one mask get one op mask (and so one tile map in the
    Triton kernels); an in-place change, another mask or a mask that requires grad get their own."""
    bool_mask = torch.rand(L, S) < 0.5
    scattered = torch.tensor([[False, True, False, False, False, False, True]] * N)
    for attn_mask, kpm in ((bool_mask, None), (None, scattered), (torch.randn(N * H, L, S), None)):
        first = _translate(attn_mask, kpm).attn_mask
        assert _translate(attn_mask, kpm).attn_mask is first
        assert _translate(attn_mask, kpm, extra_keys=1).attn_mask is not first  # another translation
    assert _translate(bool_mask.clone()).attn_mask is not _translate(bool_mask).attn_mask
    before = _translate(bool_mask).attn_mask
    bool_mask[0, 0] = ~bool_mask[0, 0]
    after = _translate(bool_mask).attn_mask
    assert after is not before and torch.equal(after[0, 0], ~bool_mask)
    with_grad = torch.randn(L, S, requires_grad=True)
    assert _translate(with_grad).attn_mask is not _translate(with_grad).attn_mask


def _torch_ops_answer(monkeypatch, fn, *args):
    """fn(*args) answered by the PyTorch ops, as in a process without the extension."""
    with monkeypatch.context() as m:
        m.setattr(fasttrans.extension, "_mask_helpers", None)
        return fn(*args)


def _padding_masks():
    g = torch.Generator().manual_seed(0)
    for n, s in ((3, 7), (1, 1), (4, 0), (0, 5), (2, 300)):
        lengths = torch.randint(0, s + 1, (n,), generator=g).tolist()
        right = right_padded(lengths, s)
        yield right
        yield right.t().contiguous().t()  # the same values, column-major
        yield torch.cat([right, ~right], dim=1)[:, ::2]  # a strided view
        if n and s:
            for _ in range(3):  # one flipped entry: right-padded only by chance
                wrong = right.clone()
                wrong[torch.randint(0, n, (1,), generator=g), torch.randint(0, s, (1,), generator=g)] ^= True
                yield wrong
    yield torch.zeros(1, 4, dtype=torch.bool).expand(3, 4)  # stride 0 rows
    yield torch.tensor([[True, False, True, True]])  # padding before a key


def test_right_padding_check_of_the_extension_agrees_with_torch_ops(ext, monkeypatch):
    """The extension's one-pass answer (CPU masks) equals the PyTorch ops' answer, mask by mask."""
    assert fasttrans.extension.mask_helpers() is not None
    seen = set()
    for kpm in _padding_masks():
        fast = mask_translation.right_padded_lengths(kpm)
        slow = _torch_ops_answer(monkeypatch, mask_translation.right_padded_lengths, kpm)
        assert (fast is None) == (slow is None), kpm
        seen.add(fast is None)
        if fast is not None:
            assert fast.dtype == slow.dtype == torch.int32 and torch.equal(fast, slow)
    assert seen == {True, False}


def _causal_masks():
    for l_, s_ in ((5, 5), (5, 7), (7, 5), (1, 1), (0, 3)):
        upper = torch.ones(l_, s_, dtype=torch.bool).triu(1)
        yield upper, l_, s_
        yield upper.expand(N * H, l_, s_), l_, s_  # (N*H, L, S) with stride 0
        yield upper.t().contiguous().t(), l_, s_
        for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
            f = torch.zeros(l_, s_, dtype=dtype).masked_fill(upper, float("-inf"))
            yield f, l_, s_
            yield -f * 0.0 + f, l_, s_  # -0.0 on and below the diagonal: still causal for torch.equal
            if l_ > 1 and s_ > 1:
                for i, j, value in ((0, 1, -1e4), (1, 0, float("-inf")), (1, 1, float("nan")), (0, 0, 1.0)):
                    bad = f.clone()
                    bad[i, j] = value
                    yield bad, l_, s_
        if l_ > 1 and s_ > 1:
            lower = upper.clone()
            lower[-1, 0] = True  # one entry below the diagonal
            yield lower, l_, s_
            yield torch.stack([upper, lower]), l_, s_  # causal in one batch entry only
    yield torch.ones(3, 3, dtype=torch.bool).triu(1)[None, None], 3, 3  # 4-D
    # leading dims that do not merge into a view, (L, S) dims with swapped strides: the
    # inspection reads a copy, whose strides are its own
    lower = torch.ones(4, 4, dtype=torch.bool).tril(-1).expand(2, 3, 4, 4).contiguous()
    scrambled = lower.permute(1, 0, 3, 2)  # (3, 2, 4, 4), the causal pattern, strides (16, 48, 1, 4)
    assert not scrambled.is_contiguous() and scrambled.stride(-1) != 1
    yield scrambled, 4, 4
    off = scrambled.clone()
    off[2, 1, 3, 0] = True
    yield off, 4, 4
    yield torch.ones(3, 4, dtype=torch.bool).triu(1), 3, 3  # the wrong shape


def test_causal_check_of_the_extension_agrees_with_torch_ops(ext, monkeypatch):
    assert fasttrans.extension.mask_helpers() is not None
    seen = set()
    for mask, l_, s_ in _causal_masks():
        fast = mask_translation.is_causal_mask(mask, l_, s_)
        assert fast == _torch_ops_answer(monkeypatch, mask_translation.is_causal_mask, mask, l_, s_), (mask, l_, s_)
        seen.add(fast)
    assert seen == {True, False}


class _MaskSubclass(torch.Tensor):
    pass


def test_mask_helpers_are_left_to_torch_ops_where_they_cannot_answer(ext, monkeypatch):
    """Masks that need a gradient and tensor subclasses are inspected by the PyTorch ops; so
    are the masks of a process that has not loaded the extension."""
    calls = []
    spies = tuple((lambda op: (lambda *a: calls.append(op) or op(*a)))(op) for op in fasttrans.extension.mask_helpers())
    monkeypatch.setattr(fasttrans.extension, "_mask_helpers", spies)
    causal = torch.zeros(4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf"))
    kpm = right_padded([4, 2], 4)
    assert mask_translation.is_causal_mask(causal, 4, 4) and mask_translation.right_padded_lengths(kpm).tolist() == [4, 2]
    assert len(calls) == 2
    assert mask_translation.is_causal_mask(causal.clone().requires_grad_(), 4, 4)
    assert mask_translation.is_causal_mask(causal.as_subclass(_MaskSubclass), 4, 4)
    assert mask_translation.right_padded_lengths(kpm.as_subclass(_MaskSubclass)).tolist() == [4, 2]
    assert len(calls) == 2
    monkeypatch.setattr(fasttrans.extension, "_mask_helpers", None)
    assert mask_translation.right_padded_lengths(kpm).tolist() == [4, 2] and mask_translation.is_causal_mask(causal, 4, 4)
    assert len(calls) == 2


def test_translate_while_compiling_uses_dense_masks(monkeypatch):
    """No value inspection (causal detection, right-padding check) while compiling."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    causal = torch.ones(L, S, dtype=torch.bool).triu(1)
    kpm = right_padded([S, 3, 1], S)
    m = _translate(causal, kpm)
    assert not m.is_causal and m.key_lengths is None
    assert torch.equal(m.attn_mask, (~causal)[None, None] & (~kpm)[:, None, None, :])
    assert _translate(causal, None, is_causal=True).is_causal  # the hint needs no data


def test_module_hands_fast_forms_to_the_op(monkeypatch):
    """A causal mask and a right-padded key_padding_mask reach fasttrans.attention as is_causal / key_lengths."""
    calls = []
    real = fasttrans.nn.attention.FT.attention_prevalidated  # fasttrans.attention without its argument checks
    names = ("q", "k", "v", "attn_mask", "key_lengths", "is_causal", "causal_offset", "dropout_p", "scale")

    def spy(*args):
        calls.append(dict(zip(names, args)))
        return real(*args)

    monkeypatch.setattr(fasttrans.nn.attention.FT, "attention_prevalidated", spy)
    f = fnn.MultiheadAttention(E, H, dtype=F64)
    x = _seq(N, L, E, False)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=F64)
    with pytest.warns(UserWarning, match="mismatched"):  # the float causal + bool padding pair, as torch
        f(x, x, x, attn_mask=mask, key_padding_mask=right_padded([L, 3, 2], L), need_weights=False)
    (kw,) = calls
    assert kw["is_causal"] is True and kw["attn_mask"] is None and kw["key_lengths"].tolist() == [L, 3, 2]
    assert kw["dropout_p"] == 0.0


def test_compiles_without_graph_breaks():
    f = fnn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(N, L, E)
    kpm = right_padded([L, 3, 2], L)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(L)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float mask + bool padding mask: torch's deprecation warning
        for kwargs in (dict(key_padding_mask=kpm, attn_mask=mask, need_weights=False),
                       dict(attn_mask=mask, is_causal=True, need_weights=False)):
            torch.testing.assert_close(compiled(x, x, x, **kwargs)[0], f(x, x, x, **kwargs)[0], **TOL[torch.float32])


# --------------------------------------------------------------------------------------
# errors: same type as torch.nn, message naming the argument
# --------------------------------------------------------------------------------------
def _x(*shape, dtype=F64, **kw):
    return torch.randn(*shape, dtype=dtype, **kw)


ERROR_CASES = {
    # name: keyword overrides of (query, key, value, forward kwargs) for a (L, N, E) module call
    "query 4-D": dict(query=lambda: _x(1, L, N, E)),
    "query 1-D": dict(query=lambda: _x(E)),
    "key 2-D for batched query": dict(key=lambda: _x(S, E), value=lambda: _x(S, E)),
    "value 2-D for batched query": dict(value=lambda: _x(S, E)),
    "key 3-D for unbatched query": dict(query=lambda: _x(L, E)),
    "query embedding dim": dict(query=lambda: _x(L, N, E + 2)),
    "key embedding dim": dict(key=lambda: _x(S, N, E + 2), value=lambda: _x(S, N, E + 2)),
    "key and value lengths differ": dict(value=lambda: _x(S + 1, N, E)),
    "key batch differs from query": dict(key=lambda: _x(S, N + 1, E), value=lambda: _x(S, N + 1, E)),
    "query dtype": dict(query=lambda: _x(L, N, E, dtype=torch.float32)),
    "key dtype": dict(key=lambda: _x(S, N, E, dtype=torch.float32), value=lambda: _x(S, N, E, dtype=torch.float32)),
    "query integer": dict(query=lambda: torch.ones(L, N, E, dtype=torch.long)),
    "query device": dict(query=lambda: _x(L, N, E, device="meta")),
    "attn_mask uint8": dict(attn_mask=lambda: torch.zeros(L, S, dtype=torch.uint8)),
    "attn_mask long": dict(attn_mask=lambda: torch.zeros(L, S, dtype=torch.long)),
    "key_padding_mask uint8": dict(key_padding_mask=lambda: torch.zeros(N, S, dtype=torch.uint8)),
    "key_padding_mask long": dict(key_padding_mask=lambda: torch.zeros(N, S, dtype=torch.long)),
    "attn_mask 2-D shape": dict(attn_mask=lambda: torch.zeros(L, S + 1, dtype=torch.bool)),
    "attn_mask 3-D head count": dict(attn_mask=lambda: torch.zeros(N * (H + 1), L, S, dtype=torch.bool)),
    "attn_mask 3-D without batch": dict(attn_mask=lambda: torch.zeros(H, L, S, dtype=torch.bool)),
    "attn_mask 4-D": dict(attn_mask=lambda: torch.zeros(N, H, L, S, dtype=torch.bool)),
    "attn_mask 1-D": dict(attn_mask=lambda: torch.zeros(S, dtype=torch.bool)),
    "key_padding_mask length": dict(key_padding_mask=lambda: torch.zeros(N, S + 1, dtype=torch.bool)),
    "key_padding_mask batch": dict(key_padding_mask=lambda: torch.zeros(N + 1, S, dtype=torch.bool)),
    "key_padding_mask 1-D for batched query": dict(key_padding_mask=lambda: torch.zeros(S, dtype=torch.bool)),
    "is_causal without attn_mask": dict(is_causal=lambda: True),
    "float attn_mask of another dtype with weights": dict(attn_mask=lambda: torch.zeros(L, S)),
    # without weights torch takes float32 masks and masks of the query's dtype (float64 here)
    "float16 attn_mask": dict(attn_mask=lambda: torch.zeros(L, S, dtype=torch.float16), need_weights=lambda: False),
    "bfloat16 key_padding_mask": dict(key_padding_mask=lambda: torch.zeros(N, S, dtype=torch.bfloat16),
                                      need_weights=lambda: False),
    "unbatched attn_mask head count": dict(query=lambda: _x(L, E), key=lambda: _x(S, E), value=lambda: _x(S, E),
                                          attn_mask=lambda: torch.zeros(H + 1, L, S, dtype=torch.bool)),
    "unbatched key_padding_mask 2-D": dict(query=lambda: _x(L, E), key=lambda: _x(S, E), value=lambda: _x(S, E),
                                          key_padding_mask=lambda: torch.zeros(1, S, dtype=torch.bool)),
}
SEPARATE_ERROR_CASES = {  # kdim/vdim modules (separate projection weights)
    "kdim mismatch": dict(key=lambda: _x(S, N, 10)),
    "vdim mismatch": dict(value=lambda: _x(S, N, 10)),
    "key and value batch differ": dict(value=lambda: _x(S, N + 1, 20)),
}
ARG_NAMES = ("query", "key", "value", "attn_mask", "key_padding_mask", "is_causal", "embedding", "dtype")


def _call_case(cls, case, module_kwargs):
    torch.manual_seed(0)
    m = cls(E, H, dtype=F64, **module_kwargs)
    kdim, vdim = module_kwargs.get("kdim", E), module_kwargs.get("vdim", E)
    args = dict(query=_x(L, N, E), key=_x(S, N, kdim), value=None)
    args["value"] = args["key"] if vdim == kdim else _x(S, N, vdim)
    for name, make in case.items():
        args[name] = make()
    q, k, v = args.pop("query"), args.pop("key"), args.pop("value")
    return m(q, k, v, **args)


@pytest.mark.parametrize(
    "case,module_kwargs",
    [(c, {}) for c in ERROR_CASES] + [(c, dict(kdim=12, vdim=20)) for c in SEPARATE_ERROR_CASES],
    ids=list(ERROR_CASES) + list(SEPARATE_ERROR_CASES),
)
def test_errors_have_torch_types(case, module_kwargs):
    spec = ERROR_CASES.get(case) or SEPARATE_ERROR_CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception) as t_err:
            _call_case(torch.nn.MultiheadAttention, spec, module_kwargs)
        with pytest.raises(Exception) as f_err:
            _call_case(fnn.MultiheadAttention, spec, module_kwargs)
    assert isinstance(f_err.value, t_err.type), (
        f"torch raised {t_err.type.__name__}, fasttrans {type(f_err.value).__name__}: {f_err.value}"
    )
    assert re.search("|".join(ARG_NAMES), str(f_err.value)), str(f_err.value)


@pytest.mark.parametrize("args", [(16, 3), (0, 2), (16, 0)])
def test_constructor_errors_have_torch_types(args):
    with pytest.raises(Exception) as t_err:
        torch.nn.MultiheadAttention(*args)
    with pytest.raises(t_err.type, match="embed_dim"):
        fnn.MultiheadAttention(*args)


@pytest.mark.parametrize("need_weights", [False, True])
def test_a_dropout_probability_out_of_range_fails_in_training_as_in_torch(need_weights):
    """torch raises a RuntimeError (SDPA) or a ValueError (F.dropout, with weights); fasttrans's
    error is both, with the same message."""
    x = torch.randn(L, N, E)
    errors = []
    for cls in (torch.nn.MultiheadAttention, fnn.MultiheadAttention):
        m = cls(E, H, dropout=1.5)
        with pytest.raises((ValueError, RuntimeError), match="dropout probability has to be between 0 and 1, "
                                                              "but got 1.5") as err:
            m(x, x, x, need_weights=need_weights)
        errors.append(err.value)
        assert m.eval()(x, x, x, need_weights=need_weights)[0].shape == (L, N, E)  # unused in eval mode
    assert isinstance(errors[1], type(errors[0]))


def test_tensor_memo_keeps_values_per_live_unchanged_tensor():
    """The memo behind the GPU causal check (and the transformers integration's key lengths):
    keyed by identity (a WeakKeyDictionary compares multi-element tensors with == and fails),
    forgotten on an in-place change, another extra argument, or the tensor's death."""
    memo = mask_translation.TensorMemo()
    a, twin = torch.ones(2, 3, dtype=torch.bool), torch.ones(2, 3, dtype=torch.bool)
    memo.put(a, (2, 3), "a")
    assert memo.get(a, (2, 3)) == "a"
    assert memo.get(twin, (2, 3)) is None  # equal values, another tensor
    assert memo.get(a, (3, 3)) is None
    a[0, 0] = False
    assert memo.get(a, (2, 3)) is None
    memo.put(a, (2, 3), "changed")
    assert memo.get(a, (2, 3)) == "changed"
    del a
    assert memo._entries == {}
    with torch.inference_mode():
        frozen = torch.ones(2, 3)
        memo.put(frozen, None, "x")
        assert memo.get(frozen) is None

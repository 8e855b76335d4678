"""Hugging Face transformers models on fasttrans: attn_implementation="fasttrans" and apply().

Small random-weight models of each family tested (no downloads) against the same weights on
transformers' "eager" attention, in float32: logits at the positions that see a key, every
parameter's gradient (on every backend, Triton's through its interpreter), and greedy
generate() with a key/value cache.
Positions that may attend to no key (the pads of left padding) are left out: eager gives
them the mean of the values, fasttrans 0 (docs/integrations.md); nothing else reads them.
"""

import copy
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'fasttrans[transformers]'; make test installs it)")

import fasttrans  # noqa: E402
import fasttrans.integrations.transformers as ftt  # noqa: E402

from conftest import backend_params  # noqa: E402
from helpers import assert_close_lowp  # noqa: E402

ftt.register()

V = 99  # vocabulary
B, L = 3, 9  # batch, sequence length
LENGTHS = [9, 5, 7]  # tokens per sequence (the rest is padding)
# float32: the kernels and eager attention round differently. 1e-5 relative, and 1e-5 of the
# largest value of the kind compared (logits; any parameter's gradient: rounding in the
# backward scales with the gradients flowing through it, and some gradients are exactly 0
# in exact arithmetic, such as a key projection's bias under softmax's shift invariance)
RTOL = ATOL = 1e-5
BACKENDS = [p for p in backend_params("attention") if p.values[0] in ("reference", "extension")]
# with the Triton kernels, which run here through Triton's interpreter (seconds per model)
ALL_BACKENDS = backend_params("attention")


def _config(family: str):
    common = dict(vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.3)
    if family == "bert":
        return transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                                       max_position_embeddings=64, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0, **common)
    if family == "bart":
        return transformers.BartConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                       decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37,
                                       max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                       decoder_start_token_id=2, init_std=0.3, **common)
    if family == "marian":  # BART's attention with sinusoidal positions and a scaled embedding
        return transformers.MarianConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                         decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37,
                                         max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                         decoder_start_token_id=0, forced_eos_token_id=2, init_std=0.3,
                                         decoder_vocab_size=V, **common)
    if family == "t5":
        return transformers.T5Config(d_model=32, d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=2, num_heads=4,
                                     relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0,
                                     **common)
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0, **common)
    if family == "llama":
        return transformers.LlamaConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        **common)
    raise AssertionError(family)


_CLASSES = {"bert": "BertForMaskedLM", "bart": "BartForConditionalGeneration", "marian": "MarianMTModel",
            "t5": "T5ForConditionalGeneration", "gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
FAMILIES = list(_CLASSES)
ENC_DEC = {"bart", "marian", "t5"}
DECODER_ONLY = {"gpt2", "llama"}


# seed 0's tiny Marian generates the same tokens for every prompt, which would hide the encoder
_SEEDS = {"marian": 3}


def _pair(family: str):
    """(eager model, its fasttrans twin after apply): the same weights, eval mode."""
    torch.manual_seed(_SEEDS.get(family, 0))
    model = getattr(transformers, _CLASSES[family])(_config(family))
    model.set_attn_implementation("eager")
    model.eval()
    twin, skipped = ftt.apply(copy.deepcopy(model))
    assert skipped == []
    assert twin.config._attn_implementation == "fasttrans"
    return model, twin


def _inputs(family: str, left: bool):
    """Model inputs with padding (left for the decoder-only models when ``left``), and the
    bool (B, L) mask of the positions whose logits are compared."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (B, L), generator=g)
    pad = torch.zeros(B, L, dtype=torch.long)
    for b, n in enumerate(LENGTHS):
        if left:
            pad[b, L - n:] = 1
        else:
            pad[b, :n] = 1
    ids = ids.masked_fill(pad == 0, 0)
    if family in ENC_DEC:
        dec = torch.randint(3, V, (B, 6), generator=g)
        return dict(input_ids=ids, attention_mask=pad, decoder_input_ids=dec), torch.ones(B, 6, dtype=torch.bool)
    kw = dict(input_ids=ids, attention_mask=pad)
    if family in DECODER_ONLY:
        kw["position_ids"] = (pad.cumsum(-1) - 1).clamp(min=0)
    return kw, pad.bool() if family in DECODER_ONLY else torch.ones(B, L, dtype=torch.bool)


def _close(got, want, what, scale=None):
    scale = want.abs().max().item() if scale is None else scale
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL * max(scale, 1e-30), msg=lambda m: f"{what}: {m}")


def _close_grads(got: dict, want: dict):
    """Every parameter's gradient, each to the tolerance of the largest of them."""
    assert got.keys() == want.keys()
    scale = max(g.abs().max().item() for g in want.values())
    for name, g in want.items():
        _close(got[name], g, f"grad of {name}", scale)


def _forward_backward(model, kw, seen):
    model.zero_grad(set_to_none=True)
    logits = model(**kw).logits
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
    (logits * weights * seen[..., None]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach()[seen], grads


CASES = [pytest.param(f, left, id=f"{f}-{'left' if left else 'right'}")
         for f in FAMILIES for left in ((False, True) if f in DECODER_ONLY else (False,))]
CASES.append(pytest.param("llama", None, id="llama-unpadded"))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("family, left", CASES)
def test_logits_and_gradients_match_eager(family, left, backend, one_thread):
    model, twin = _pair(family)
    kw, seen = _inputs(family, bool(left))
    if left is None:  # no mask at all: the causal mask goes as is_causal alone
        kw = {"input_ids": kw["input_ids"]}
        seen = torch.ones_like(seen)
    want, want_grads = _forward_backward(model, kw, seen)
    with fasttrans.use_backend(backend):
        got, got_grads = _forward_backward(twin, kw, seen)
    _close(got, want, "logits")
    _close_grads(got_grads, want_grads)


# More families whose attention goes through transformers' attention interface, built from
# their default configs shrunk to a few dozen dimensions: the function must honour each one's
# masks, scaling and head layout (partial rotary, QK norms, local layers, GQA), and apply()
# must leave only norms that compute something else.
_MOE_DECODERS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "granitemoe", "glm4_moe", "minimax",
                 "ernie4_5_moe", "hunyuan_v1_moe", "gpt_oss", "deepseek_v2", "deepseek_v3", "glm4_moe_lite",
                 "inkling2_text"]
# multi-head latent attention: queries and keys of 16 dims (8 of them rotary, as head_dim), values of 12
_MLA = dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=12, n_group=1, topk_group=1)
_MORE_DECODERS = ["qwen2", "qwen3", "mistral", "phi", "phi3", "gemma", "gemma2", "vaultgemma", "gemma3_text", "cohere",
                  "olmo", "olmo2",
                  "granite", "stablelm", "starcoder2", "gpt_neox", "gptj", "falcon", "opt", "gpt_bigcode",
                  "smollm3", "glm4", "exaone4", "ernie4_5", "codegen", "biogpt", "persimmon", "helium", "minicpm3",
                  *_MOE_DECODERS]
_MORE_ENCODERS = ["roberta", "distilbert", "albert", "electra", "modernbert", "esm", "ernie", "eurobert"]
# the norms apply() reports and leaves, by class (none: Inkling 2's norm that holds no size is replaced too)
_NORMS_KEPT: dict[str, set[str]] = {}
_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=37, vocab_size=V, head_dim=8, max_position_embeddings=64, n_embd=32, n_layer=2,
              n_head=4, n_positions=64, embedding_size=32, rotary_dim=4, ffn_dim=37, word_embed_proj_dim=32,
              global_attn_every_n_layers=2, local_attention=4, initializer_range=0.3)
# Mixture-of-experts layers route every token to all of their 4 experts: a top-k choice would
# make the output jump where two experts' router scores tie, and rounding alone could cross one.
_MOE_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_MOE_TOP_K = ("num_experts_per_tok", "moe_k", "moe_topk")
# per family: gpt-oss's sliding-window layers with a window shorter than the inputs; the
# latent attention's dims; a logit cap that these small models' scores reach
_OWN = {"gpt_oss": dict(sliding_window=4),
        **dict.fromkeys(("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3"), _MLA),
        **dict.fromkeys(("gemma2", "vaultgemma"), dict(attn_logit_softcapping=0.5)),
        "cohere": dict(use_qk_norm=True)}  # layer norms of queries and keys with a weight per head
# (intermediate_size: torch._grouped_mm, which runs some families' experts, needs rows of a multiple of 16 bytes)
_MOE = dict(dict.fromkeys(_MOE_EXPERTS + _MOE_TOP_K, 4), moe_intermediate_size=16, intermediate_size=40,
            shared_expert_intermediate_size=16)


def _small_model(family: str, causal: bool):
    config = transformers.AutoConfig.for_model(family)
    for name, value in {**_SMALL, **(_MOE if family in _MOE_DECODERS else {}), **_OWN.get(family, {})}.items():
        if hasattr(config, name) and not isinstance(getattr(type(config), name, None), property):
            setattr(config, name, value)
    if family in _MOE_DECODERS:  # every expert chosen: the model is a continuous function
        experts, top_k = ({n: getattr(config, n) for n in names if hasattr(config, n)}
                          for names in (_MOE_EXPERTS, _MOE_TOP_K))
        assert experts and top_k and set(experts.values()) == set(top_k.values()) == {4}, (experts, top_k)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:config.num_hidden_layers]
    config.pad_token_id = 0
    torch.manual_seed(0)
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModelForMaskedLM
    return auto.from_config(config, attn_implementation="eager").eval()


@pytest.mark.parametrize("family, causal", [pytest.param(f, True, id=f) for f in _MORE_DECODERS]
                         + [pytest.param(f, False, id=f) for f in _MORE_ENCODERS])
def test_more_families_match_eager(family, causal, one_thread):
    """Logits at the real tokens and every gradient, left padding for the causal models and
    right padding for the encoders, on the extension."""
    model = _small_model(family, causal)
    twin, skipped = ftt.apply(copy.deepcopy(model))
    kept = _NORMS_KEPT.get(family, set())
    assert {why.split(":")[0] for _, why in skipped} == kept, skipped
    norms_left = {type(m).__name__ for m in twin.modules() if type(m).__name__.endswith(("RMSNorm", "LayerNorm"))
                  and not type(m).__module__.startswith("fasttrans")}
    assert norms_left == kept
    assert twin.config._attn_implementation == "fasttrans"
    kw, _ = _inputs(family, left=causal)
    seen = kw["attention_mask"].bool()
    want, want_grads = _forward_backward(model, kw, seen)
    with fasttrans.use_backend("extension"):
        got, got_grads = _forward_backward(twin, kw, seen)
    _close(got, want, "logits")
    _close_grads(got_grads, want_grads)


@pytest.mark.parametrize("family", ["gemma2", "vaultgemma"])
def test_the_soft_capped_families_reach_their_cap(family):
    """Gemma 2 and VaultGemma cap their attention logits (fasttrans.attention's softcap): in
    the configs above the cap changes the logits, so matching eager checks it."""
    model = _small_model(family, causal=True)
    ids = torch.randint(3, V, (B, L))
    with torch.no_grad():
        capped = model(input_ids=ids).logits
        for module in model.modules():
            if getattr(module, "attn_logit_softcapping", None) is not None:
                module.attn_logit_softcapping = None
        uncapped = model(input_ids=ids).logits
    assert (capped - uncapped).abs().max() > 0.05


def _farther(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Whichever of a and b is farther from ref (max abs difference)."""
    return a if (a.double() - ref.double()).abs().max() >= (b.double() - ref.double()).abs().max() else b


# Triton through its interpreter takes seconds per model: BERT (key padding) and Llama
# (causal, grouped-query heads, left padding) cover its mask forms
HALF_CASES = [pytest.param(f, *b.values, id=f"{f}-{b.id}", marks=b.marks) for f in FAMILIES
              for b in (ALL_BACKENDS if f in ("bert", "llama") else BACKENDS)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family,backend", HALF_CASES)
def test_half_precision_logits_and_gradients_by_the_2x_rule(family, backend, dtype, one_thread):
    # flash-attention's rule against the fp32 eager model: fasttrans in half precision is at
    # most twice as far from it as torch's attention in the same precision, plus a floor.
    # torch's attention is both of its implementations, eager and sdpa: a whole model's
    # gradient error in half precision is one draw of rounding that the backward amplifies,
    # and on some of these models sdpa's alone is several times eager's. The gradient is
    # that draw as one vector (every parameter's, in order): which parameter holds its largest
    # error is the draw's, and varies with the machine's matmuls (correctness per parameter is
    # test_logits_and_gradients_match_eager's, in fp32).
    model, twin = _pair(family)
    kw, seen = _inputs(family, family in DECODER_ONLY)
    want, want_grads = _forward_backward(model, kw, seen)
    torch_runs = []
    for implementation in ("eager", "sdpa"):
        low = copy.deepcopy(model).to(dtype)
        low.set_attn_implementation(implementation)
        torch_runs.append(_forward_backward(low, kw, seen))
    with fasttrans.use_backend(backend):
        got, got_grads = _forward_backward(twin.to(dtype), kw, seen)
    (eager, eager_grads), (sdpa, sdpa_grads) = torch_runs
    assert_close_lowp("logits", got, want, _farther(eager, sdpa, want))
    assert got_grads.keys() == want_grads.keys()

    def flat(grads):
        return torch.cat([grads[name].double().flatten() for name in want_grads])

    want_flat = flat(want_grads)
    assert_close_lowp("gradient", flat(got_grads), want_flat, _farther(flat(eager_grads), flat(sdpa_grads), want_flat),
                      dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["bart", "marian", "t5", "gpt2", "llama"])
def test_generate_gives_eager_tokens(family, backend, one_thread):
    model, twin = _pair(family)
    kw, _ = _inputs(family, left=True)
    kw.pop("decoder_input_ids", None)
    kw.pop("position_ids", None)
    if family in ENC_DEC:  # the encoder's padding on the right, as tokenizers pad it
        kw, _ = _inputs(family, left=False)
        kw.pop("decoder_input_ids")
    _same_tokens(model, twin, kw, backend, 4)


def _same_tokens(model, twin, kw: dict, backend: str, tokens: int) -> None:
    """Greedy generate() with the key/value cache: the twin on ``backend`` gives the model's
    tokens, and the prompts do not all give the same ones."""
    # pad and bos suppressed, eos held off: every step picks among the other tokens (a random model may prefer those)
    gen = dict(max_new_tokens=tokens, do_sample=False, use_cache=True, pad_token_id=0, suppress_tokens=[0, 1],
               min_new_tokens=tokens)
    want = model.generate(**kw, **gen)
    with fasttrans.use_backend(backend):
        got = twin.generate(**kw, **gen)
    assert torch.equal(got, want), (got, want)
    new = want[:, -tokens:]
    assert len({tuple(row) for row in new.tolist()}) > 1, f"the prompts gave the same tokens: {new}"


def test_unpadded_causal_and_padded_masks_take_the_cheap_forms(monkeypatch):
    """No padding: no mask at all (is_causal / nothing); padding: transformers' bool mask,
    with key lengths beside it."""
    calls = []
    real = fasttrans.functional.attention

    def spy(q, k, v, **kw):
        calls.append(kw)
        return real(q, k, v, **kw)

    monkeypatch.setattr(ftt.FT, "attention", spy)
    for family in ("llama", "bert"):
        _, twin = _pair(family)
        kw, _ = _inputs(family, left=False)
        calls.clear()
        with torch.no_grad():
            twin(input_ids=kw["input_ids"], attention_mask=torch.ones_like(kw["attention_mask"]))
        assert calls and all(c["attn_mask"] is None and c["key_lengths"] is None for c in calls)
        assert all(c["is_causal"] == (family == "llama") for c in calls)
        calls.clear()
        with torch.no_grad():
            twin(input_ids=kw["input_ids"], attention_mask=kw["attention_mask"])
        assert all(c["attn_mask"].dtype == torch.bool and c["key_lengths"].tolist() == LENGTHS for c in calls)


@pytest.mark.parametrize("kv_length", [6, 8])  # 8: past the 2-D mask, which transformers pads with False
def test_bidirectional_padding_mask_is_a_view_with_sdpa_mask_values(kv_length):
    """An encoder's padding mask comes back as the 2-D mask's view broadcast over the queries
    (one row of tiles for the kernels), with the values transformers' sdpa_mask builds."""
    mu = transformers.masking_utils
    padding = torch.tensor([[True] * 6, [False, True, True, True, False, False]])
    kw = dict(batch_size=2, q_length=5, kv_length=kv_length, mask_function=mu.bidirectional_mask_function,
              attention_mask=padding, allow_is_causal_skip=False, allow_is_bidirectional_skip=True)
    got = ftt.attention_mask(**kw)
    want = mu.sdpa_mask(**{**kw, "allow_is_bidirectional_skip": False})
    assert got.shape == want.shape == (2, 1, 5, kv_length) and got.stride(2) == 0
    assert torch.equal(got, want)
    if kv_length == 6:
        assert got.data_ptr() == padding.data_ptr()  # not copied
    # another mask function (here vmap-built) keeps transformers' own mask
    built = ftt.attention_mask(**{**kw, "use_vmap": True})
    assert built.stride(2) != 0 and torch.equal(built, want)


def test_cached_decoding_uses_a_bottom_right_causal_offset(monkeypatch):
    calls = []
    real = fasttrans.functional.attention
    monkeypatch.setattr(ftt.FT, "attention", lambda q, k, v, **kw: calls.append((q.shape[2], k.shape[2], kw))
                        or real(q, k, v, **kw))
    model, twin = _pair("llama")
    ids = torch.randint(3, V, (2, 5))
    with torch.no_grad():
        out = twin(input_ids=ids, use_cache=True)
        calls.clear()
        nxt = torch.randint(3, V, (2, 3))
        got = twin(input_ids=nxt, cache=out.cache, use_cache=True).logits
        want = model(input_ids=torch.cat([ids, nxt], 1)).logits[:, 5:]
    assert all(kw["is_causal"] and kw["causal_offset"] == lk - lq == 5 and kw["attn_mask"] is None
               for lq, lk, kw in calls)
    _close(got, want, "logits of 3 queries after 5 cached keys")


def test_key_lengths_are_computed_once_per_mask():
    """Every layer gets the same mask tensor: its key lengths are taken once and kept while
    the mask is unchanged; an in-place change of the mask is seen."""
    mask = torch.ones(2, 1, 3, 6, dtype=torch.bool)
    mask[0, ..., 4:] = False
    first = ftt._key_lengths(mask, 2, 6)
    assert first.tolist() == [4, 6]
    assert ftt._key_lengths(mask, 2, 6) is first
    mask[1, ..., 5:] = False
    assert ftt._key_lengths(mask, 2, 6).tolist() == [4, 5]
    with torch.inference_mode():
        frozen = torch.ones(1, 1, 2, 6, dtype=torch.bool)
        assert ftt._key_lengths(frozen, 3, 6).tolist() == [6, 6, 6]
    # an encoder's padding mask, broadcast over the queries (left padding and holes too)
    padding = torch.tensor([[True] * 4 + [False] * 2, [False, True, True, False, True, False]])
    assert ftt._key_lengths(padding[:, None, None, :].expand(2, 1, 3, 6), 2, 6).tolist() == [4, 5]


def test_t5_position_bias_gets_its_gradient():
    model, twin = _pair("t5")
    kw, seen = _inputs("t5", left=False)
    _, want = _forward_backward(model, kw, seen)
    _, got = _forward_backward(twin, kw, seen)
    name = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert got[name].abs().max() > 0
    _close(got[name], want[name], name)


def test_gqa_keys_and_values_keep_their_heads(monkeypatch):
    shapes = []
    real = fasttrans.functional.attention
    monkeypatch.setattr(ftt.FT, "attention", lambda q, k, v, **kw: shapes.append((q.shape[1], k.shape[1]))
                        or real(q, k, v, **kw))
    _, twin = _pair("llama")
    with torch.no_grad():
        twin(input_ids=torch.randint(3, V, (1, 4)))
    assert shapes and all(s == (4, 2) for s in shapes)


@pytest.mark.parametrize("family", ["llama", "gpt_oss", "gemma2", "gemma3_text"])
def test_compiled_forward_has_no_graph_break(family):
    """Llama; gpt-oss's sinks and sliding windows; Gemma 2's logit cap; Gemma 3's OffsetRMSNorm."""
    twin = _pair(family)[1] if family in _CLASSES else ftt.apply(_small_model(family, causal=True))[0]
    ids = torch.randint(3, V, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    torch._dynamo.reset()
    compiled = torch.compile(twin, fullgraph=True, backend="eager")
    with torch.no_grad():
        for am in (None, mask):
            torch.testing.assert_close(compiled(input_ids=ids, attention_mask=am).logits,
                                       twin(input_ids=ids, attention_mask=am).logits, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------
# norms, apply and convert
# ---------------------------------------------------------------------------------------
def test_apply_keeps_parameters_state_dict_and_checkpoints(tmp_path):
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(_config("t5")).eval()
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    model, skipped = ftt.apply(model)
    assert skipped == []
    assert all(type(m).__name__ != "T5LayerNorm" for m in model.modules())
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    kw, seen = _inputs("t5", left=False)
    with torch.no_grad():
        want = model(**kw).logits
    model.save_pretrained(tmp_path)
    loaded = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="fasttrans").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**kw).logits, want, rtol=RTOL, atol=ATOL)  # the same weights, T5's norms
    loaded, _ = ftt.apply(loaded)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**kw).logits, want, rtol=0, atol=0)


def test_apply_moves_dropout_modules_unless_asked_not_to():
    from fasttrans import nn as ftnn

    config = _config("bert")
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.25
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config)
    kept, _ = ftt.apply(copy.deepcopy(model), dropout=False)
    assert {type(m) for m in kept.modules() if isinstance(m, torch.nn.Dropout)} == {torch.nn.Dropout}
    model, skipped = ftt.apply(model)
    assert skipped == []
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert len(dropouts) == 7 and all(type(m) is ftnn.Dropout and m.p == 0.25 for m in dropouts)
    kw, _ = _inputs("bert", left=False)
    model.train()
    torch.manual_seed(1)
    first = model(**kw).logits
    first.sum().backward()  # trains with the fused dropout
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    torch.manual_seed(1)
    torch.testing.assert_close(model(**kw).logits, first, rtol=0, atol=0)  # masks follow torch's seed
    model.eval()
    with torch.no_grad():  # off in eval mode: the model computes what it did with torch's dropout
        torch.testing.assert_close(model(**kw).logits, kept.eval()(**kw).logits, rtol=RTOL, atol=ATOL)


def test_rms_norm_matches_llama_and_t5_norms_in_half_precision():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    for cls in (LlamaRMSNorm, T5LayerNorm):
        for dtype, wdtype in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                              (torch.float32, torch.float32)):
            hf = cls(64, eps=1e-5).to(wdtype)
            with torch.no_grad():
                hf.weight.normal_()
            x = torch.randn(5, 64, dtype=dtype)
            holder = torch.nn.Sequential(hf)
            ftt.apply(holder, attention=False)
            assert isinstance(holder[0], ftt.RMSNorm) and holder[0].variance_epsilon == 1e-5
            want, got = hf(x), holder[0](x)
            assert got.dtype == want.dtype
            # one rounding to the input's dtype apart (the module rounds before the weight product)
            tol = 2 * torch.finfo(dtype).eps
            torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_layer_norm_without_bias_matches_cohere_norm_in_every_precision():
    """Cohere's layer norm (a weight, no bias) becomes fasttrans's LayerNorm: its numbers, the
    input's dtype out (also with fp32 weights), the same Parameter."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    for dtype, wdtype in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                          (torch.float16, torch.float32), (torch.float32, torch.float32)):
        hf = CohereLayerNorm(64, eps=1e-5).to(wdtype)
        with torch.no_grad():
            hf.weight.normal_()
        x = (torch.randn(5, 64) + 2).to(dtype)
        holder = torch.nn.Sequential(hf)
        _, skipped = ftt.apply(holder, attention=False)
        assert skipped == [] and isinstance(holder[0], ftt.LayerNorm) and holder[0].weight is hf.weight
        assert holder[0].variance_epsilon == 1e-5 and holder[0].bias is None
        want, got = hf(x), holder[0](x)
        assert got.dtype == want.dtype == dtype
        tol = 2 * torch.finfo(dtype).eps  # both compute in fp32 and round once to dtype
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_offset_rms_norm_matches_gemma_norm_in_every_precision():
    """Gemma's (1 + weight) RMS norm becomes fasttrans's OffsetRMSNorm: its numbers and
    gradients, the input's dtype out (also with fp32 weights), the same Parameter."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    for dtype, wdtype in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                          (torch.float16, torch.float32), (torch.float32, torch.float32),
                          (torch.float32, torch.bfloat16), (torch.float64, torch.float64)):
        hf = GemmaRMSNorm(64, eps=1e-6).to(wdtype)
        with torch.no_grad():
            hf.weight.normal_()
        holder = torch.nn.Sequential(hf)
        _, skipped = ftt.apply(holder, attention=False)
        assert skipped == [] and isinstance(holder[0], ftt.OffsetRMSNorm) and holder[0].weight is hf.weight
        assert holder[0].variance_epsilon == 1e-6 and holder[0].offset == 1.0
        x = (torch.randn(5, 64) + 2).to(dtype).requires_grad_()
        dy = torch.randn(5, 64).to(dtype)
        want = hf(x)
        want_dx, want_dw = torch.autograd.grad(want, (x, hf.weight), dy)
        got = holder[0](x)
        got_dx, got_dw = torch.autograd.grad(got, (x, hf.weight), dy)
        assert got.dtype == want.dtype == dtype and got_dw.dtype == wdtype
        # both compute in fp32 (whatever the input) and round once to dtype
        tol = 2 * max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)
        for g, w, what in ((got, want, "out"), (got_dx, want_dx, "dx"), (got_dw, want_dw, "dweight")):
            wtol = max(tol, 2 * torch.finfo(w.dtype).eps)
            torch.testing.assert_close(g, w, rtol=wtol, atol=wtol * w.abs().max().item(),
                                       msg=lambda m, what=what, dtype=dtype: f"{what} ({dtype}): {m}")


def test_layer_norm_without_parameters_matches_olmo_norm_in_every_precision():
    """OLMo's layer norm (no weight, no bias, eps 1e-5 written in its forward) becomes
    fasttrans's LayerNorm without parameters: its numbers and input gradient, the input's dtype."""
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        holder = torch.nn.Sequential(OlmoLayerNorm(64))
        _, skipped = ftt.apply(holder, attention=False)
        assert skipped == [] and isinstance(holder[0], ftt.LayerNorm)
        assert holder[0].weight is None and holder[0].eps == 1e-5 and list(holder.state_dict()) == []
        _assert_norm_matches(holder[0], OlmoLayerNorm(64), (5, 64), dtype, shift=2)


def _assert_norm_matches(got_norm, want_norm, shape, dtype, shift=1):
    """got_norm's output and input gradient are want_norm's within 2 ulp of dtype, in dtype:
    both compute in fp32 and round once to dtype."""
    x = (torch.randn(shape) * 3 + shift).to(dtype).requires_grad_()
    dy = torch.randn(shape).to(dtype)
    want = want_norm(x)
    (want_dx,) = torch.autograd.grad(want, x, dy)
    got = got_norm(x)
    (got_dx,) = torch.autograd.grad(got, x, dy)
    assert got.dtype == want.dtype == dtype
    tol = 2 * torch.finfo(dtype).eps
    for g, w in ((got, want), (got_dx, want_dx)):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol * w.abs().max().item(),
                                   msg=lambda m: f"{tuple(shape)}, {dtype}: {m}")


def _gemma3n_unscaled_norm():
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm

    return Gemma3nRMSNorm(48, eps=1e-6, with_scale=False)


def _inkling2_unweighted_norm():
    from transformers.models.inkling2.modeling_inkling2 import Inkling2UnweightedRMSNorm

    return Inkling2UnweightedRMSNorm(eps=1e-5)


class _UnsizedLayerNorm(torch.nn.Module):
    """A parameter-free layer norm over whatever last dimension it is given."""

    def __init__(self):
        super().__init__()
        self.eps = 1e-5

    def forward(self, x):
        return torch.nn.functional.layer_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


_UnsizedLayerNorm.__module__ = "transformers.models.unsized.modeling_unsized"


@pytest.mark.parametrize("make, kind", [(_inkling2_unweighted_norm, ftt.UnsizedRMSNorm),
                                        (_gemma3n_unscaled_norm, ftt.UnsizedRMSNorm),
                                        (_UnsizedLayerNorm, ftt.UnsizedLayerNorm)],
                         ids=["inkling2", "gemma3n", "layer_norm"])
def test_norms_that_hold_no_size_become_unsized_norms(make, kind):
    """A norm without parameters that holds no size normalises whatever last dimension it
    gets: its replacement does too, with its eps, numbers and input gradient, in the input's dtype."""
    holder = torch.nn.Sequential(make())
    _, skipped = ftt.apply(holder, attention=False)
    assert skipped == [] and type(holder[0]) is kind and list(holder.state_dict()) == []
    original = make()
    eps = getattr(original, "variance_epsilon", getattr(original, "eps", None))
    assert holder[0].variance_epsilon == holder[0].eps == eps
    for n in (7, 48, 300):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            _assert_norm_matches(holder[0], original, (3, 5, n), dtype)


def test_head_layer_norm_matches_cohere_query_key_norms_in_every_precision():
    """Cohere's query/key norm (a layer norm over head_dim with a (heads, head_dim) weight)
    becomes HeadLayerNorm with the same Parameter: its numbers and the gradients of the input
    and of the weight, in the input's dtype (both normalise and scale in fp32 and round once)."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        original = CohereLayerNorm((4, 16), eps=1e-5)
        with torch.no_grad():
            original.weight.copy_(torch.randn(4, 16))
        holder = torch.nn.Sequential(copy.deepcopy(original))
        _, skipped = ftt.apply(holder, attention=False)
        assert skipped == [] and isinstance(holder[0], ftt.HeadLayerNorm)
        assert holder[0].eps == holder[0].variance_epsilon == 1e-5 and list(holder.state_dict()) == ["0.weight"]
        x = (torch.randn(2, 5, 4, 16) * 3 + 1).to(dtype).requires_grad_()
        dy = torch.randn(2, 5, 4, 16).to(dtype)
        want = original(x)
        want_dx, want_dw = torch.autograd.grad(want, (x, original.weight), dy)
        got = holder[0](x)
        got_dx, got_dw = torch.autograd.grad(got, (x, holder[0].weight), dy)
        assert got.dtype == want.dtype == dtype and got_dw.dtype == torch.float32
        tol = 2 * torch.finfo(dtype).eps
        for g, w in ((got, want), (got_dx, want_dx), (got_dw, want_dw)):
            torch.testing.assert_close(g, w, rtol=tol, atol=tol * w.abs().max().item(),
                                       msg=lambda m, dtype=dtype: f"{dtype}: {m}")


class _WeightlessLayerNorm(torch.nn.Module):
    """A layer norm without parameters whose eps (1e-3) is not an attribute."""

    def __init__(self, hidden: int):
        super().__init__()
        self.normalized_shape = (hidden,)

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, self.normalized_shape, eps=1e-3)


_WeightlessLayerNorm.__module__ = "transformers.models.weightless.modeling_weightless"


def test_a_norm_without_parameters_is_replaced_only_if_the_probe_confirms_its_eps():
    """Without an eps attribute, the probe tries torch's default 1e-5: a norm with another eps
    is reported, not replaced with the wrong one."""
    holder = torch.nn.Sequential(_WeightlessLayerNorm(16))
    with pytest.warns(UserWarning, match="_WeightlessLayerNorm"):
        _, skipped = ftt.apply(holder, attention=False)
    assert type(holder[0]) is _WeightlessLayerNorm and len(skipped) == 1 and "weight * (x - mean)" in skipped[0][1]


class _HalfRMSNorm(torch.nn.Module):
    """A norm formula none of fasttrans's computes: weight * x / (2 rms(x))."""

    def __init__(self, hidden: int):
        super().__init__()
        self.eps = 1e-6
        self.weight = torch.nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) / 2


_HalfRMSNorm.__module__ = "transformers.models.half.modeling_half"  # what apply() takes for transformers'


def test_apply_skips_a_norm_of_another_formula_and_says_why():
    holder = torch.nn.Sequential(_HalfRMSNorm(16))
    with pytest.warns(UserWarning, match="_HalfRMSNorm"):
        _, skipped = ftt.apply(holder, attention=False)
    assert len(skipped) == 1 and type(holder[0]) is _HalfRMSNorm
    name, why = skipped[0]
    assert name == "0" and "none of fasttrans's norms" in why
    assert "weight * x /" in why and "(1 + weight) * x /" in why and "weight * (x - mean) /" in why


@pytest.mark.parametrize("family", ["llama", "t5", "gemma"])
def test_norms_are_replaced_while_loading(family, tmp_path):
    """replacing_norms(): models built inside get fasttrans's RMSNorm (Gemma's: OffsetRMSNorm)
    from the start, with the same state_dict and numbers as transformers' norms; nothing
    stays patched after."""
    auto = transformers.AutoModelForSeq2SeqLM if family in ENC_DEC else transformers.AutoModelForCausalLM
    config = _small_model(family, causal=True).config if family == "gemma" else _config(family)
    kind = ftt.OffsetRMSNorm if family == "gemma" else ftt.RMSNorm
    torch.manual_seed(0)
    plain = auto.from_config(config).eval()
    with torch.no_grad():  # weights other than a fresh norm's, so that the state_dict must carry them
        for n, p in plain.named_parameters():
            if "norm" in n:
                p.normal_()
    with ftt.replacing_norms() as names:
        assert {"LlamaRMSNorm", "T5LayerNorm", "GemmaRMSNorm", "Gemma3RMSNorm"} <= set(names)
        built = auto.from_config(config).eval()
    assert transformers.monkey_patching.get_patch_mapping() == {}
    norms = [m for m in built.modules() if "Norm" in type(m).__name__]
    assert norms and all(type(m) is kind for m in norms)
    assert list(built.state_dict()) == list(plain.state_dict())
    built.load_state_dict(plain.state_dict())
    kw, _ = _inputs(family, left=False)
    with torch.no_grad():
        want = plain(**kw).logits
        _close(built(**kw).logits, want, "logits", scale=want.abs().max().item())
    built.save_pretrained(tmp_path)
    with ftt.replacing_norms():
        loaded = auto.from_pretrained(tmp_path, attn_implementation=built.config._attn_implementation).eval()
    assert all(type(m) is kind for m in loaded.modules() if "Norm" in type(m).__name__)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**kw).logits, built(**kw).logits, rtol=0, atol=0)


def test_replacing_norms_refuses_a_mapping_the_user_made():
    mp = transformers.monkey_patching
    mp.register_patch_mapping({"LlamaRMSNorm": torch.nn.Identity})
    try:
        with pytest.raises(RuntimeError, match="LlamaRMSNorm"):
            with ftt.replacing_norms():
                pass
        assert mp.get_patch_mapping() == {"LlamaRMSNorm": torch.nn.Identity}
    finally:
        mp.unregister_patch_mapping(["LlamaRMSNorm"])


def test_convert_reports_transformers_parts():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config("llama"))
    model.set_attn_implementation("sdpa")
    with pytest.warns(UserWarning, match="attn_implementation='fasttrans'"):
        _, skipped = fasttrans.convert(model)
    names = dict(skipped)
    assert "model.layers.0.self_attn" in names and "register()" in names["model.layers.0.self_attn"]
    assert "model.norm" in names and "apply(model)" in names["model.norm"]
    model.set_attn_implementation("fasttrans")
    with pytest.warns(UserWarning, match="model.norm"):
        _, skipped = fasttrans.convert(model)
    assert not any("self_attn" in n for n, _ in skipped)


class _SinkModule(torch.nn.Module):
    """What gpt-oss's eager attention reads of its module."""

    def __init__(self, heads: int, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.sinks = torch.nn.Parameter(torch.randn(heads, generator=torch.Generator().manual_seed(3)) * 2)
        self.is_causal = True


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("mask", ["causal", "none", "bool", "float"])
def test_attention_sinks_match_gpt_oss_eager(mask, backend):
    """s_aux: one sink logit per query head joins every softmax; outputs and the gradients of
    queries, keys, values and the sinks as gpt-oss's eager attention (grouped-query heads;
    causal as a flag, with a cache offset; no mask; a bool mask with a query that sees no key;
    a float mask)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 5, 9, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, n, D, generator=g).requires_grad_() for h, n in ((H, Lq), (Hkv, Lk), (Hkv, Lk)))
    module = _SinkModule(H, H // Hkv)
    if mask == "causal":  # queries at the cache's end: query i sees keys up to i + Lk - Lq
        attn_mask, additive = None, torch.zeros(Lq, Lk).masked_fill(
            ~torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq), float("-inf"))
    elif mask == "none":
        module.is_causal, attn_mask, additive = False, None, None
    elif mask == "bool":
        attn_mask = torch.rand(B, 1, Lq, Lk, generator=g) < 0.6
        attn_mask[1, 0, 2] = False  # a query that sees no key: zeros, as eager's sink takes all its weight
        additive = torch.zeros(attn_mask.shape).masked_fill(~attn_mask, float("-inf"))
    else:
        attn_mask = additive = torch.randn(B, 1, Lq, Lk, generator=g)
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=D ** -0.5)
    dout = torch.randn(want.shape, generator=g)
    wanted = torch.autograd.grad(want, (q, k, v, module.sinks), dout)
    with fasttrans.use_backend(backend):
        got, weights = ftt.attention_forward(module, q, k, v, attn_mask, scaling=D ** -0.5, s_aux=module.sinks)
        grads = torch.autograd.grad(got, (q, k, v, module.sinks), dout)
    assert weights is None
    _close(got, want, "out")
    for name, a, b in zip(("q", "k", "v", "sinks"), grads, wanted):
        _close(a, b, f"grad of {name}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_newer_families_generate_eager_tokens(family, backend, one_thread):
    """gpt-oss (sinks, sliding-window layers whose cache keeps the last 4 keys, GQA, experts)
    and DeepSeek-V3 (latent attention: values of another head dim than the keys, experts)
    with left-padded prompts and a key/value cache: eager's tokens."""
    model = _small_model(family, causal=True)
    twin, skipped = ftt.apply(copy.deepcopy(model))
    assert skipped == []
    _same_tokens(model, twin, _inputs(family, left=True)[0], backend, 6)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("per_row", [False, True], ids=["s_aux", "sinks-per-row"])
def test_packed_sequences_with_sinks_match_each_sequence_alone(per_row, backend):
    """Sinks with packed sequences (s_aux per head; sinks per query row, laid out with the
    queries): each sequence as attention_forward gives it alone, its gradients (the sinks'
    included) too."""
    g = torch.Generator().manual_seed(0)
    cu = _cumulative(PACKED)
    q = torch.randn(1, 4, int(cu[-1]), 8, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, int(cu[-1]), 8, generator=g, requires_grad=True) for _ in range(2))
    module = _SinkModule(4, 2)
    sinks = torch.randn(1, 4, int(cu[-1]), 1, generator=g, requires_grad=True) if per_row else module.sinks
    name = "sinks" if per_row else "s_aux"

    def own(a, b):  # a sequence's sinks
        return {name: sinks[:, :, a:b] if per_row else sinks}

    with fasttrans.use_backend(backend):
        got, _ = ftt.attention_forward(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                       max_length_q=max(PACKED), max_length_k=max(PACKED), **{name: sinks})
        want = torch.cat([ftt.attention_forward(module, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], None,
                                                **own(a, b))[0] for a, b in zip(cu[:-1], cu[1:])], dim=1)
    _close(got, want, "packed attention with sinks")
    grad = torch.randn(got.shape, generator=g)
    inputs = (q, k, v, sinks)
    for name, a, b in zip(("q", "k", "v", "sinks"), torch.autograd.grad(got, inputs, grad),
                          torch.autograd.grad(want, inputs, grad)):
        _close(a, b, f"grad of {name}")


# ---------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------
class _Module(torch.nn.Module):
    is_causal = False


@pytest.mark.parametrize("kwargs, name", [
    ({"head_mask": torch.ones(4)}, "head_mask"), ({"sinks": torch.zeros(4)}, "sinks"),
    ({"sinks": torch.zeros(1, 4, 8, 1), "s_aux": torch.zeros(4)}, "s_aux, sinks"),
    ({"s_aux": torch.zeros(3)}, "s_aux"), ({"s_aux": torch.zeros(4, dtype=torch.long)}, "s_aux"),
    ({"s_aux": [0.0] * 4}, "s_aux"),
    ({"output_attentions": True}, "output_attentions"), ({"sliding_window": 4}, "sliding_window"),
])
def test_unsupported_arguments_raise_naming_them(kwargs, name):
    q = torch.randn(1, 4, 8, 8)
    with pytest.raises(ValueError, match=name):
        ftt.attention_forward(_Module(), q, q, q, None, **kwargs)


def test_a_sliding_window_within_the_keys_or_in_the_mask_is_honoured():
    q, k = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8, 8)
    out, weights = ftt.attention_forward(_Module(), q, k, k, None, sliding_window=8)
    assert weights is None and out.shape == (1, 8, 4, 8)
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril().triu(-3)
    out, _ = ftt.attention_forward(_Module(), q, k, k, mask, sliding_window=4)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)
    _close(out, want.transpose(1, 2), "sliding-window attention")


def test_version_outside_the_supported_range_raises(monkeypatch):
    module = sys.modules["transformers"]  # loading a model class can put a new module object there
    monkeypatch.setattr(module, "__version__", "4.57.1")
    with pytest.raises(RuntimeError, match=r"transformers 4\.57\.1 is not supported.*>= 5\.0 and < 6\.0"):
        ftt.register()
    monkeypatch.setattr(module, "__version__", "6.0.0")
    with pytest.raises(RuntimeError, match="6.0.0"):
        ftt.apply(torch.nn.Linear(2, 2))


def test_importing_fasttrans_does_not_import_transformers():
    code = ("import sys, fasttrans, fasttrans.integrations, fasttrans.nn\n"
            "m = [n for n in sys.modules if n == 'transformers' or n.startswith('transformers.')]\n"
            "assert not m, m\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


# ---------------------------------------------------------------------------------------
# packed sequences (transformers' padding-free batches) and unpadded encoders
# ---------------------------------------------------------------------------------------
PACKED = [4, 7, 1, 3]  # tokens per packed sequence


def _cumulative(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _per_sequence_sdpa(q, k, v, cu_q, cu_k, causal):
    outs = []
    for (a, b), (c, d) in zip(zip(cu_q[:-1].tolist(), cu_q[1:].tolist()), zip(cu_k[:-1].tolist(), cu_k[1:].tolist())):
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, c:d], v[:, :, c:d], is_causal=causal, enable_gqa=True))
    return torch.cat(outs, dim=2).transpose(1, 2)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("causal, keys", [(False, None), (True, None), (False, [2, 5, 3, 6])],
                         ids=["bidirectional", "causal", "cross"])
def test_packed_sequences_attend_within_each_sequence(causal, keys, backend):
    """cu_seq_lens_q / _k (and max_length_q / _k): each packed sequence attends to its own
    keys only, grouped-query heads included; outputs and gradients as torch on each
    sequence alone."""
    g = torch.Generator().manual_seed(0)
    cu_q = _cumulative(PACKED)
    cu_k = cu_q if keys is None else _cumulative(keys)
    Nq, Nk = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(1, 4, Nq, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, Nk, 8, generator=g, requires_grad=True) for _ in range(2))
    longest_k = max(keys or PACKED)
    with fasttrans.use_backend(backend):
        got, weights = ftt.attention_forward(_Module(), q, k, v, None, is_causal=causal, cu_seq_lens_q=cu_q,
                                             cu_seq_lens_k=cu_k, max_length_q=max(PACKED), max_length_k=longest_k)
    want = _per_sequence_sdpa(q, k, v, cu_q, cu_k, causal)
    assert weights is None and got.shape == (1, Nq, 4, 8)
    _close(got, want, "packed attention")
    grad = torch.randn(got.shape, generator=g)
    for name, a, b in zip("qkv", torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        _close(a, b, f"grad of {name}")
    # without max_length_* the longest sequence is read from the lengths
    again, _ = ftt.attention_forward(_Module(), q, k, v, None, is_causal=causal, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k)
    _close(again, want, "packed attention, lengths read")


def _flattened(family: str, sequences):
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    batch = collator([{"input_ids": s.tolist()} for s in sequences])
    return {k: v for k, v in batch.items() if k != "labels"}


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_padding_free_batches_match_each_sequence_alone(family, backend, one_thread):
    """A batch from transformers' DataCollatorWithFlattening (one row of packed sequences,
    position_ids and the padding-free arguments): logits and every gradient as the eager
    model run on each sequence alone."""
    model, twin = _pair(family)
    g = torch.Generator().manual_seed(3)
    sequences = [torch.randint(3, V, (n,), generator=g) for n in PACKED]
    weights = torch.randn(sum(PACKED), V, generator=g)

    def run(m, calls):
        m.zero_grad(set_to_none=True)
        logits = torch.cat([m(**kw).logits[0] for kw in calls])
        (logits * weights).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    want, want_grads = run(model, [{"input_ids": s[None]} for s in sequences])
    with fasttrans.use_backend(backend):
        got, got_grads = run(twin, [_flattened(family, sequences)])
    _close(got, want, "logits")
    assert got_grads.keys() == want_grads.keys()
    scale = max(gr.abs().max().item() for gr in want_grads.values())
    for name, gr in want_grads.items():
        _close(got_grads[name], gr, f"grad of {name}", scale)


_Q = torch.zeros(1, 4, 8, 8)
_CU = torch.tensor([0, 3, 8], dtype=torch.int32)


@pytest.mark.parametrize("q, kwargs, name", [
    (_Q, {"cu_seq_lens_q": _CU}, "cu_seq_lens_k"),
    (_Q, {"cu_seq_lens_k": _CU}, "cu_seq_lens_q"),
    (_Q, {"cu_seq_lens_q": _CU.float(), "cu_seq_lens_k": _CU}, "cu_seq_lens_q: expected a 1-D int32 or int64"),
    (_Q, {"cu_seq_lens_q": _CU, "cu_seq_lens_k": torch.tensor([0, 8], dtype=torch.int32)}, "as many sequences"),
    (_Q, {"cu_seq_lens_q": torch.tensor([0, 3, 7]), "cu_seq_lens_k": _CU}, "from 0 to the 8 packed tokens"),
    (_Q, {"cu_seq_lens_q": _CU, "cu_seq_lens_k": _CU, "max_length_q": 4}, r"longer than max_length \(4\)"),
    (_Q, {"cu_seq_lens_q": _CU, "cu_seq_lens_k": _CU, "max_length_k": -1}, "max_length_k: expected a non-negative"),
    (_Q, {"cu_seq_lens_q": _CU, "cu_seq_lens_k": _CU, "position_bias": torch.zeros(1, 4, 8, 8)}, "position_bias"),
    (_Q.expand(2, -1, -1, -1), {"cu_seq_lens_q": _CU, "cu_seq_lens_k": _CU}, "batch of one"),
])
def test_bad_packed_arguments_raise_naming_them(q, kwargs, name):
    with pytest.raises(ValueError, match=name):
        ftt.attention_forward(_Module(), q, q, q, None, **kwargs)


def test_causal_packed_sequences_need_the_same_lengths_for_queries_and_keys():
    q = torch.zeros(1, 4, 8, 8)
    with pytest.raises(ValueError, match="cu_seq_lens_k: causal packed sequences"):
        ftt.attention_forward(_Module(), q, q, q, None, is_causal=True, cu_seq_lens_q=_CU,
                              cu_seq_lens_k=torch.tensor([0, 4, 8], dtype=torch.int32))
    out, _ = ftt.attention_forward(_Module(), q, q, q, None, is_causal=True, cu_seq_lens_q=_CU,
                                   cu_seq_lens_k=_CU.clone())  # equal values in another tensor
    assert out.shape == (1, 8, 4, 8)


def _masked_lm(family: str):
    """A small eager ``{family}ForMaskedLM`` of the RoBERTa-like families (pad token 1)."""
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1,
        initializer_range=0.3, **({"embedding_size": 32} if family == "Electra" else {}))
    model = getattr(transformers, f"{family}ForMaskedLM")(config)
    model.set_attn_implementation("eager")
    return model.eval()


def _unpadded_pair(family: str):
    model = _pair("bert")[0] if family == "bert" else _masked_lm("Roberta")
    twin, skipped = ftt.apply(copy.deepcopy(model), unpad=True)
    assert skipped == []
    return model, twin


def _assert_unpadded_like_eager(model, twin, kw, real, backend):
    """The unpadded twin on ``backend``: logits at the real tokens and every gradient of a
    loss over them are the eager model's, and the base model's last hidden state is 0 at the
    pads (the packed path ran)."""
    want, want_grads = _forward_backward(model, kw, real)
    with fasttrans.use_backend(backend):
        got, got_grads = _forward_backward(twin, kw, real)
        with torch.no_grad():
            hidden = twin.base_model(**kw).last_hidden_state
    _close(got, want, "logits")
    _close_grads(got_grads, want_grads)
    assert hidden[real].abs().min() > 0 and torch.equal(hidden[~real], torch.zeros_like(hidden[~real]))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_unpadded_encoders_match_eager_at_real_tokens(family, left, backend, one_thread):
    """apply(unpad=True): the layers run on the real tokens only. Logits at real tokens and
    every gradient of a loss over them are eager's; the last hidden state is 0 at the pads."""
    model, twin = _unpadded_pair(family)
    kw, _ = _inputs("bert", left)
    if family == "roberta":
        kw["input_ids"] = kw["input_ids"].masked_fill(kw["attention_mask"] == 0, 1)
    _assert_unpadded_like_eager(model, twin, kw, kw["attention_mask"].bool(), backend)


@pytest.mark.parametrize("family", ["XLMRoberta", "Camembert", "Electra"])
def test_every_listed_encoder_runs_unpadded(family, one_thread):
    """The other encoders apply(unpad=True) lists: logits at real tokens are eager's and the
    last hidden state is 0 at the pads (so the packed path ran)."""
    model = _masked_lm(family)
    twin, skipped = ftt.apply(copy.deepcopy(model), unpad=True)
    assert skipped == []
    kw, _ = _inputs("bert", left=False)
    kw["input_ids"] = kw["input_ids"].masked_fill(kw["attention_mask"] == 0, 1)
    real = kw["attention_mask"].bool()
    with torch.no_grad():
        _close(twin(**kw).logits[real], model(**kw).logits[real], "logits")
        hidden = twin.base_model(**kw).last_hidden_state
    assert torch.equal(hidden[~real], torch.zeros_like(hidden[~real]))


def test_unpadded_encoder_runs_padded_where_packing_would_change_the_result():
    """Collected hidden states, a 4-D mask that is not padding alone, a batch without
    padding and another attention implementation take the encoder's own forward."""
    _, plain = _pair("bert")
    _, twin = _unpadded_pair("bert")
    kw, _ = _inputs("bert", left=False)
    with torch.no_grad():
        got = twin.bert(**kw, output_hidden_states=True)
        want = plain.bert(**kw, output_hidden_states=True)
        assert len(got.hidden_states) == 3
        for a, b in zip(got.hidden_states, want.hidden_states):
            assert torch.equal(a, b)
        hidden = torch.randn(B, L, 32)
        mask = torch.ones(B, 1, L, L, dtype=torch.bool).tril()  # not padding: rows differ
        encoder = twin.bert.encoder
        assert torch.equal(encoder(hidden, mask).last_hidden_state,
                           type(encoder).forward(encoder, hidden, mask).last_hidden_state)
        full = torch.ones(B, 1, L, L, dtype=torch.bool)
        assert torch.equal(encoder(hidden, full).last_hidden_state,
                           type(encoder).forward(encoder, hidden, full).last_hidden_state)
    # another attention implementation would attend across packed sequences: padded again
    twin.set_attn_implementation("sdpa")
    plain.set_attn_implementation("sdpa")
    with torch.no_grad():
        _close(twin(**kw).logits, plain(**kw).logits, "logits on sdpa")


def _decoder(family: str):
    """A small eager decoder-only LM of the families apply(unpad=True) packs, in training mode."""
    if family in ("llama", "gpt2"):
        model = _pair(family)[0]
    else:
        torch.manual_seed(0)
        config = transformers.Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          pad_token_id=0, initializer_range=0.3)
        model = transformers.Qwen2ForCausalLM(config)
        model.set_attn_implementation("eager")
    twin, skipped = ftt.apply(copy.deepcopy(model), unpad=True)
    assert skipped == []
    return model.train(), twin.train()


@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
@pytest.mark.parametrize("family,backend", [  # Triton (interpreted, seconds per model) on Llama
    pytest.param(f, *b.values, id=f"{f}-{b.id}", marks=b.marks)
    for f in ("llama", "qwen2", "gpt2") for b in (ALL_BACKENDS if f == "llama" else BACKENDS)])
def test_unpadded_decoders_match_eager_at_real_tokens(family, left, backend, one_thread):
    """apply(unpad=True) on a decoder-only LM in training: the layers run on the real tokens,
    each at its padded position (rotary embedding; GPT-2's learned one). Logits at real tokens
    and every gradient of a loss over them are eager's; the last hidden state is 0 at the pads."""
    model, twin = _decoder(family)
    kw, real = _inputs("llama", left)
    kw.pop("position_ids")  # each token at its column, as the padded model places it
    _assert_unpadded_like_eager(model, twin, kw, real, backend)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_unpadded_causal_lm_heads_and_losses_skip_the_pads(family, one_thread):
    """With labels (-100 at the pads) the LM head and the loss run on the real tokens only:
    the loss and every gradient are eager's. Where a pad's shifted label counts (before the
    first token of a left-padded sequence) the head runs on every position."""
    model, twin = _decoder(family)
    rows = []
    twin.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[:-1]))
    for left in (False, True):
        kw, real = _inputs("llama", left)
        kw.pop("position_ids")
        kw["labels"] = kw["input_ids"].masked_fill(~real, -100)
        grads = []
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
            out = m(**kw)
            out.loss.backward()
            grads.append(({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}, out))
        (want_grads, want), (got_grads, got) = grads
        _close(got.logits[real], want.logits[real], "logits")
        if left:  # the head ran padded: the last pad's logits (zeros) predict the first token
            assert rows[-1] == real.shape
            continue
        assert rows[-1] == (1, int(real.sum()))
        _close(got.loss, want.loss, "loss")
        assert torch.equal(got.logits[~real], torch.zeros_like(got.logits[~real]))
        _close_grads(got_grads, want_grads)


def test_unpadded_decoder_keeps_given_positions_and_runs_padded_where_it_must():
    """Position ids given with the batch go with their tokens; in eval mode without
    use_cache=False (a cache to fill), with collected hidden states, without padding and on
    another attention implementation, the model's own forward runs (pads not zeroed)."""
    model, twin = _decoder("llama")
    kw, real = _inputs("llama", left=True)  # position_ids: counted from each first real token
    kw["input_ids"] = kw["input_ids"].masked_fill(~real, 5)  # pads whose states are not 0 unpacked
    with torch.no_grad():
        _close(twin(**kw).logits[real], model(**kw).logits[real], "logits with position_ids")
        model.eval()
        twin.eval()
        packed = twin.model(**kw, use_cache=False).last_hidden_state
        assert torch.equal(packed[~real], torch.zeros_like(packed[~real]))
        cached = twin.model(**kw)
        assert cached.cache is not None and cached.last_hidden_state[~real].abs().max() > 0
        hidden = twin.model(**kw, use_cache=False, output_hidden_states=True)
        assert len(hidden.hidden_states) == 3 and hidden.last_hidden_state[~real].abs().max() > 0
        full = dict(kw, attention_mask=torch.ones_like(kw["attention_mask"]), position_ids=None)
        _close(twin(**full, use_cache=False).logits, model(**full, use_cache=False).logits, "logits, no padding")
    twin.set_attn_implementation("sdpa")
    with torch.no_grad():
        assert twin.model(**kw, use_cache=False).last_hidden_state[~real].abs().max() > 0


def test_unpad_skips_decoders_with_sliding_window_layers():
    config = transformers.Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                      sliding_window=4, max_window_layers=0, pad_token_id=0)
    model = transformers.Qwen2ForCausalLM(config)
    assert model.model.has_sliding_layers
    with pytest.warns(UserWarning, match="unpad"):
        _, skipped = ftt.apply(model, unpad=True)
    assert [n for n, why in skipped if "unpad=True" in why] == ["Qwen2ForCausalLM"]


def test_compiled_packed_forward_has_no_graph_break():
    _, twin = _pair("llama")
    g = torch.Generator().manual_seed(3)
    batch = _flattened("llama", [torch.randint(3, V, (n,), generator=g) for n in PACKED])
    torch._dynamo.reset()
    compiled = torch.compile(twin, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(**batch).logits, twin(**batch).logits, rtol=0, atol=0)


def test_unpad_needs_the_attention_and_an_encoder_it_knows():
    model, _ = _pair("bert")
    with pytest.raises(ValueError, match="unpad"):
        ftt.apply(copy.deepcopy(model), attention=False, unpad=True)
    t5, _ = _pair("t5")
    with pytest.warns(UserWarning, match="unpad"):
        _, skipped = ftt.apply(copy.deepcopy(t5), unpad=True)
    assert [n for n, why in skipped if "unpad=True" in why] == ["T5ForConditionalGeneration"]
    # the state_dict is the model's, and a copy runs unpadded on its own weights
    _, twin = _unpadded_pair("bert")
    assert twin.state_dict().keys() == model.state_dict().keys()
    clone = copy.deepcopy(twin)
    assert clone.bert.encoder.forward.encoder is clone.bert.encoder


def test_unpadded_gpt2_runs_padded_with_token_types():
    """GPT-2 adds an embedding of token_type_ids, which packing would have to pack too: given
    them, the model's own forward runs (the pads' states are not 0) and matches eager."""
    model, twin = _decoder("gpt2")
    kw, real = _inputs("gpt2", left=False)
    kw.pop("position_ids")
    kw["token_type_ids"] = torch.ones_like(kw["input_ids"])
    with torch.no_grad():
        packed = twin.transformer(**{k: v for k, v in kw.items() if k != "token_type_ids"}).last_hidden_state
        assert torch.equal(packed[~real], torch.zeros_like(packed[~real]))
        typed = twin.transformer(**kw).last_hidden_state
        assert typed[~real].abs().max() > 0
        _close(twin(**kw).logits[real], model(**kw).logits[real], "logits with token types")

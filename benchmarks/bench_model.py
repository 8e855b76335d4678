"""Model benchmark: the seed's seq2seq Transformer on fasttrans.nn against the same model on torch.nn.

The fasttrans model is ``fasttrans.models.Seq2SeqTransformer``; its torch twin is a copy
whose ``transformer`` is a ``torch.nn.Transformer`` loaded with the fasttrans one's
state_dict (the embeddings, positional encoding and generator are plain torch modules in
both). Before timing, each fasttrans provider's logits are checked against the twin's, so
the two sides are the same function with the same weights.

Sweeps (select with --sweep):
    headline  one training step (forward, cross-entropy, backward, Adam) of the
              digits-average model: d_model 256, 4 heads, 3+3 layers, FFN 512, batch 64,
              source 91 tokens, decoder input 9 tokens. tokens/s = batch * (91 + 9) / step.
    decode    greedy decoding, 9 new tokens (the task's answer) for 64 sources and 64 new
              tokens for 8 and for 1: torch.nn (which has no KV cache: the whole prefix is
              re-decoded at every step), fasttrans without and with its KV cache.
              tokens/s = batch * new tokens / time.
    infer     the digits-average model's forward in eval mode without gradients (logits for
              a source and a decoder input), from one short sequence to the training batch:
              torch.nn takes its inference fast path here (the fused encoder layer),
              fasttrans its whole-layer op (one C++ call per encoder or decoder layer).
              tokens/s = batch * (source + decoder input) / time.
    train     (CUDA only) a base-size model: d_model 512, 8 heads, 6+6 layers, FFN 2048,
              batch 32, 128 + 128 tokens.
    hf        Hugging Face transformers models with random weights (no downloads): a
              BERT-base-shaped BertForMaskedLM (hidden 768, 12 heads, FFN 3072, vocabulary
              30522, dropout 0.1; 4 layers, and BERT-base's 12) training step, batch 8, 128 tokens
              with 25% right padding, the MLM loss on 15% of the real tokens (the head runs
              on those positions only, as BERT pretraining code does); a Llama-shaped
              LlamaForCausalLM (hidden 512, 8 heads, 4 key/value heads, FFN 1376, vocabulary
              32000, 4 layers) training step, batch 8, 128 tokens, causal, without padding
              and with 25% right padding (the pads out of the loss); and its greedy
              generate() with the KV cache, batch 4, prompt 32, 32 new tokens.
              AdamW in both training steps. Providers: the model with
              attn_implementation="sdpa" (torch [sdpa], the baseline) and "eager" (torch
              [eager]), and fasttrans.integrations.transformers.apply() on a copy
              (fasttrans's attention and norms; for the padded batches also
              apply(unpad=True), variant [unpad]: the layers on the real tokens only), all
              from the same weights.
              tokens/s = batch * 128 / step (padding included) and batch * new tokens / time.
    hf-families  a training step of each family the integration is tested on (BERT, BART,
              Marian, T5, GPT-2, Llama with 2 key/value heads; gpt-oss with 2 key/value heads,
              attention sinks, a sliding window of 128 keys on every other layer and 4
              experts, 2 per token; Gemma 2 with 2 key/value heads and its attention logits
              capped at 50) at one small shape: hidden 256, 4 heads, FFN 1024
              (per expert), vocabulary 8000, 2 layers (2 + 2 for the encoder-decoders),
              batch 8, 128 input tokens with 25% right padding (the pads out of the loss;
              64 target tokens for the encoder-decoders); apply() (and for BERT, GPT-2 and
              Llama apply(unpad=True), variant [unpad]) against "sdpa" (gpt-oss and Gemma 2,
              which transformers runs on "eager" alone: against "eager"); and gpt-oss's greedy
              generate() with the KV cache, batch 4, prompt 512, 32 new tokens.
The seq2seq models run in float32 (--dtype does not apply to them). The hf models run in
--dtype (the default: float32 on CPU, float16 on CUDA), weights, optimizer state and
activations in that one precision, as half-precision fine-tuning without autocast does.
Every row also carries the peak memory of one call above what was live before it.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

import fasttrans

if __package__ in (None, ""):  # run as a file: make the repository root importable for `benchmarks`
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: see tests/conftest.py

from benchmarks import common  # noqa: E402
from benchmarks.common import Config, Entry  # noqa: E402

# The digits-average task (fasttrans.tasks.average): 13 tokens (10 digits, space, s, e);
# sources are 91 tokens, targets 10 (s, 8 digits, e), so training feeds 9 to the decoder.
DIGITS_VOCAB = 13
DIGITS_SRC_LEN = 91
DIGITS_TGT_INPUT_LEN = 9
DIGITS_BOS = 11  # "s"
# fasttrans.models.Seq2SeqTransformer's output agrees with the torch twin's to float32
# rounding (differences ~1e-5); a wrong weight mapping gives differences of order 1.
TWIN_TOLERANCE = 1e-3
# In bf16/fp16 two attention implementations' logits differ by the half-precision rounding of
# every layer's activations (an ulp of bf16 is 2^-8 relative), so that check is looser there.
HALF_TWIN_TOLERANCE = 5e-2


def placeholders() -> list[str]:
    """The modules this benchmark needs that are still placeholders (None)."""
    needed = {
        "fasttrans.nn.Transformer": getattr(fasttrans.nn, "Transformer", None),
        "fasttrans.nn.MultiheadAttention": getattr(fasttrans.nn, "MultiheadAttention", None),
        "fasttrans.models.Seq2SeqTransformer": getattr(fasttrans.models, "Seq2SeqTransformer", None),
    }
    return [name for name, obj in needed.items() if obj is None]


# --------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------
def build_model(spec: types.SimpleNamespace, device: str, dtype: torch.dtype):
    from fasttrans.models.seq2seq import Seq2SeqConfig, Seq2SeqTransformer

    torch.manual_seed(0)
    config = Seq2SeqConfig(
        src_vocab_size=spec.vocab, d_model=spec.d_model, nhead=spec.nhead,
        num_encoder_layers=spec.layers, num_decoder_layers=spec.layers, dim_feedforward=spec.ffn,
    )
    return Seq2SeqTransformer(config).to(device=device, dtype=dtype)


def torch_twin(model):
    """A copy of ``model`` whose Transformer is torch.nn's, with the same weights."""
    twin = copy.deepcopy(model)
    c = model.config
    p = next(model.parameters())
    twin.transformer = torch.nn.Transformer(
        d_model=c.d_model, nhead=c.nhead, num_encoder_layers=c.num_encoder_layers,
        num_decoder_layers=c.num_decoder_layers, dim_feedforward=c.dim_feedforward, dropout=c.dropout,
        activation=c.activation, layer_norm_eps=c.layer_norm_eps, batch_first=True, norm_first=c.norm_first,
        bias=c.bias, device=p.device, dtype=p.dtype,
    )
    twin.transformer.load_state_dict(model.transformer.state_dict())  # strict: the drop-in promise
    return twin


def check_same_function(model, twin, inp, backend: str) -> None:
    """Raise unless ``model`` (on ``backend``) and ``twin`` give the same logits in eval mode."""
    model.eval()
    twin.eval()
    try:
        with torch.no_grad(), fasttrans.use_backend(backend):
            ours = model(inp.src[:2], inp.tgt_in[:2])
        with torch.no_grad():
            theirs = twin(inp.src[:2], inp.tgt_in[:2])
    finally:
        model.train()
        twin.train()
    diff = (ours.float() - theirs.float()).abs().max().item()
    if not diff <= TWIN_TOLERANCE * max(1.0, theirs.float().abs().max().item()):
        raise RuntimeError(f"fasttrans model on backend {backend!r} and its torch.nn twin disagree: "
                           f"max |logit difference| = {diff:.3g}; the comparison would not be like for like")


def model_inputs(spec, batch: int, src_len: int, tgt_len: int, device: str, dtype: torch.dtype):
    def build():
        model = build_model(spec, device, dtype)
        g = torch.Generator().manual_seed(0)
        src = torch.randint(0, spec.vocab, (batch, src_len), generator=g).to(device)
        tgt = torch.randint(0, spec.vocab, (batch, tgt_len + 1), generator=g).to(device)
        return types.SimpleNamespace(model=model, twin=torch_twin(model), src=src, tgt_in=tgt[:, :-1],
                                     tgt_out=tgt[:, 1:])

    return build


# --------------------------------------------------------------------------------------
# the timed functions
# --------------------------------------------------------------------------------------
def train_step(model, inp, backend: str | None, forward=None):
    """One optimisation step: forward, cross-entropy, backward, Adam."""
    forward = model if forward is None else forward  # a compiled module has no truth value
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model.train()

    def step():
        with common.backend_context(backend):
            logits = forward(inp.src, inp.tgt_in)  # (B, T, V)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), inp.tgt_out.reshape(-1))
            loss.backward()
            optimizer.step()
            # gradients are dropped here, not at the start of the next step: no memory outlives
            # a step except the weights and Adam's state, so the peak of one step is all its own
            optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def decode_run(model, inp, backend: str | None, new_tokens: int, use_cache: bool):
    """Greedy decoding of every source for exactly ``new_tokens`` tokens (no end token)."""
    def run():
        with common.backend_context(backend):
            return model.generate(inp.src, new_tokens, DIGITS_BOS, None, use_cache=use_cache)

    return run


def infer_run(model, inp, backend: str | None, forward=None):
    """The logits of every source and decoder input, in eval mode without gradients."""
    forward = model if forward is None else forward
    model.eval()

    def run():
        with torch.no_grad(), common.backend_context(backend):
            return forward(inp.src, inp.tgt_in)

    return run


def _entries(bench: common.Bench, timed) -> list[Entry]:
    """One entry per provider of ``timed(model, inp, backend, forward=None)``: each fasttrans
    backend on a copy of the model (checked against the twin first), torch on a copy of the
    twin, torch-compile on a compiled copy of the twin."""
    entries = []
    for p in bench.providers(None):
        if p.backend is not None:
            def make(inp, backend=p.backend):
                model = copy.deepcopy(inp.model)
                check_same_function(model, inp.twin, inp, backend)
                return timed(model, inp, backend)

            entries.append(Entry(p, make))
        elif p.name == "torch":
            entries.append(Entry(p, lambda inp: timed(copy.deepcopy(inp.twin), inp, None)))
        elif p.name == "torch-compile":
            def make_compiled(inp):
                twin = copy.deepcopy(inp.twin)
                return timed(twin, inp, None, forward=common.fresh_compile(twin))

            entries.append(Entry(p, make_compiled))
    return entries


def infer_entries(bench: common.Bench) -> list[Entry]:
    return _entries(bench, infer_run)


def train_entries(bench: common.Bench) -> list[Entry]:
    return _entries(bench, train_step)


def decode_entries(bench: common.Bench, new_tokens: int) -> list[Entry]:
    entries = []
    for p in bench.providers(None):
        if p.backend is not None:
            for use_cache in (False, True):
                def make(inp, backend=p.backend, use_cache=use_cache):
                    model = copy.deepcopy(inp.model)
                    check_same_function(model, inp.twin, inp, backend)
                    return decode_run(model, inp, backend, new_tokens, use_cache)

                entries.append(Entry(p, make, variant="kv-cache" if use_cache else "no-cache"))
        elif p.name == "torch":
            entries.append(Entry(p, lambda inp: decode_run(inp.twin, inp, None, new_tokens, False), variant="no-cache"))
        elif p.name == "torch-compile":
            entries.append(Entry(p, None, variant="no-cache",
                                 skip="the target grows by one token per step: torch.compile would recompile "
                                      "for every length"))
    return entries


# --------------------------------------------------------------------------------------
# Hugging Face transformers models (the hf sweep)
# --------------------------------------------------------------------------------------
HF_BERT = types.SimpleNamespace(name="bert", vocab=30522, hidden=768, heads=12, kv_heads=12, ffn=3072, layers=4)
# BERT-base's own depth: with 4 layers, work the same on both sides (the vocabulary-sized
# gradients and their AdamW update) weighs more in the step than it does in BERT-base
HF_BERT_BASE = types.SimpleNamespace(**{**vars(HF_BERT), "layers": 12})
HF_LLAMA = types.SimpleNamespace(name="llama", vocab=32000, hidden=512, heads=8, kv_heads=4, ffn=1376, layers=4)
HF_BERT_QUICK = types.SimpleNamespace(name="bert", vocab=256, hidden=64, heads=4, kv_heads=4, ffn=128, layers=1)
HF_BERT_BASE_QUICK = types.SimpleNamespace(**{**vars(HF_BERT_QUICK), "layers": 2})
HF_LLAMA_QUICK = types.SimpleNamespace(name="llama", vocab=256, hidden=64, heads=4, kv_heads=2, ffn=172, layers=1)
# the hf-families sweep: one small shape for every family the integration is tested on
HF_FAMILIES = ("bert", "bart", "marian", "t5", "gpt2", "llama", "gpt_oss", "gemma2")
# families transformers runs on "eager" alone (gpt-oss's sinks, Gemma 2's logit cap): their baseline
HF_EAGER_ONLY = ("gpt_oss", "gemma2")
HF_EXPERTS = dict(num_local_experts=4, num_experts_per_tok=2)  # gpt-oss's mixture of experts, shrunk
HF_UNPADDABLE = ("bert", "gpt2", "llama")  # the families apply(unpad=True) runs on real tokens only
HF_FAMILY = dict(vocab=8000, hidden=256, heads=4, kv_heads=2, ffn=1024, layers=2)
HF_FAMILY_QUICK = dict(vocab=256, hidden=64, heads=4, kv_heads=2, ffn=128, layers=1)
HF_PADDING = 0.25  # mean fraction of right padding in the padded batches
HF_MLM_FRACTION = 0.15  # fraction of the real tokens masked and predicted, as in BERT's pretraining
HF_FIRST_TOKEN = 3  # random token ids start past pad (0), bos (1) and eos (2)
HF_MASK_TOKEN = 2  # the [MASK] stand-in of the random-weight BERT


def hf_unavailable() -> str | None:
    """Why the hf sweep cannot run here (transformers missing, or a version the integration
    does not support), or None; registers attn_implementation="fasttrans" when it can."""
    import fasttrans.integrations.transformers as ftt

    try:
        ftt.register()
    except (ImportError, RuntimeError) as e:
        return str(e)
    return None


def build_hf_model(spec: types.SimpleNamespace, device: str, dtype: torch.dtype):
    """A random-weight model of ``spec``'s family, seeded, on attn_implementation="sdpa" (on
    "eager" for the families of HF_EAGER_ONLY)."""
    import transformers as T

    common_ids = dict(vocab_size=spec.vocab, pad_token_id=0)
    seq2seq = dict(d_model=spec.hidden, encoder_layers=spec.layers, decoder_layers=spec.layers,
                   encoder_attention_heads=spec.heads, decoder_attention_heads=spec.heads,
                   encoder_ffn_dim=spec.ffn, decoder_ffn_dim=spec.ffn, decoder_start_token_id=HF_FIRST_TOKEN,
                   **common_ids)
    if spec.name == "bert":
        config, cls = T.BertConfig(hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                                   num_attention_heads=spec.heads, intermediate_size=spec.ffn,
                                   **common_ids), T.BertForMaskedLM
    elif spec.name == "bart":
        config, cls = T.BartConfig(**seq2seq), T.BartForConditionalGeneration
    elif spec.name == "marian":
        config, cls = T.MarianConfig(**seq2seq), T.MarianMTModel
    elif spec.name == "t5":
        config, cls = T.T5Config(d_model=spec.hidden, d_kv=spec.hidden // spec.heads, d_ff=spec.ffn,
                                 num_layers=spec.layers, num_heads=spec.heads, decoder_start_token_id=HF_FIRST_TOKEN,
                                 **common_ids), T.T5ForConditionalGeneration
    elif spec.name == "gpt2":
        config, cls = T.GPT2Config(n_embd=spec.hidden, n_layer=spec.layers, n_head=spec.heads, n_inner=spec.ffn,
                                   bos_token_id=1, eos_token_id=2, **common_ids), T.GPT2LMHeadModel
    elif spec.name == "gpt_oss":  # sinks, sliding-window layers (of 128 keys) and experts
        config, cls = T.GptOssConfig(hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                                     num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                                     head_dim=spec.hidden // spec.heads, intermediate_size=spec.ffn,
                                     eos_token_id=None, **HF_EXPERTS, **common_ids), T.GptOssForCausalLM
    elif spec.name == "gemma2":  # logits capped at 50 in attention (and at 30 at the output)
        config, cls = T.Gemma2Config(hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                                     num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                                     head_dim=spec.hidden // spec.heads, intermediate_size=spec.ffn,
                                     bos_token_id=1, eos_token_id=None, **common_ids), T.Gemma2ForCausalLM
    else:
        # no end token: every generate() call produces exactly the tokens asked for
        config, cls = T.LlamaConfig(hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                                    num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                                    intermediate_size=spec.ffn, bos_token_id=1, eos_token_id=None,
                                    **common_ids), T.LlamaForCausalLM
    torch.manual_seed(0)
    model = cls(config)
    model.set_attn_implementation("eager" if spec.name in HF_EAGER_ONLY else "sdpa")
    return model.to(device=device, dtype=dtype)


def hf_inputs(spec, batch: int, seq_len: int, device: str, dtype: torch.dtype, padding: float = 0.0,
              prompt_batch: int = 0, prompt_len: int = 0):
    """The shared model and its inputs: token ids, the padding mask (right padding, sequence
    lengths spread evenly so that ``padding`` of the positions are pads) and, for BERT, the
    masked positions and their labels; for the encoder-decoders, target tokens half as long
    as the inputs; for generation, prompts without padding."""
    def build():
        model = build_hf_model(spec, device, dtype)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(HF_FIRST_TOKEN, spec.vocab, (batch, seq_len), generator=g)
        shortest = max(1, round(seq_len * (1 - 2 * padding)))
        lengths = torch.linspace(shortest, seq_len, batch).round().long() if batch > 1 else torch.tensor([seq_len])
        mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
        ids = ids.masked_fill(mask == 0, 0)
        masked = (torch.rand(batch, seq_len, generator=g) < HF_MLM_FRACTION) & (mask == 1)
        masked[:, 0] |= ~masked.any(dim=1)  # every sequence predicts at least one token
        labels = ids[masked]
        prompts = torch.randint(HF_FIRST_TOKEN, spec.vocab, (max(prompt_batch, 1), max(prompt_len, 1)), generator=g)
        targets = torch.randint(HF_FIRST_TOKEN, spec.vocab, (batch, max(1, seq_len // 2)), generator=g)
        return types.SimpleNamespace(
            model=model, ids=ids.to(device), mask=mask.to(device), masked=masked.to(device),
            lm_labels=ids.masked_fill(mask == 0, -100).to(device),  # the pads left out of the loss
            mlm_ids=ids.masked_fill(masked, HF_MASK_TOKEN).to(device), labels=labels.to(device),
            prompts=prompts.to(device), prompt_mask=torch.ones_like(prompts).to(device),
            targets=targets.to(device),  # the encoder-decoders' labels: half as long, no padding
        )

    return build


HF_SEQ2SEQ = ("bart", "marian", "t5")  # model_type of the encoder-decoder families


def hf_loss(model, inp) -> torch.Tensor:
    """BERT: the MLM loss, the head applied to the masked positions only. Encoder-decoders:
    the loss on the target tokens. Causal LMs: the next-token loss, computed by the model
    from labels = its inputs (-100 at the pads)."""
    kind = model.config.model_type
    if kind == "bert":
        hidden = model.bert(input_ids=inp.mlm_ids, attention_mask=inp.mask).last_hidden_state
        logits = model.cls(hidden[inp.masked])  # (masked tokens, vocabulary)
        return F.cross_entropy(logits.float(), inp.labels)
    if kind in HF_SEQ2SEQ:
        return model(input_ids=inp.ids, attention_mask=inp.mask, labels=inp.targets).loss
    return model(input_ids=inp.ids, attention_mask=inp.mask, labels=inp.lm_labels).loss


def hf_train_step(model, inp, backend: str | None):
    """One optimisation step: forward, loss, backward, AdamW; gradients dropped at its end
    (as in ``train_step``) so that the peak of one step is all its own."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()

    def step():
        with common.backend_context(backend):
            loss = hf_loss(model, inp)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def hf_generate(model, inp, backend: str | None, new_tokens: int):
    """Greedy generate() with the KV cache, exactly ``new_tokens`` tokens per prompt."""
    model.eval()

    def run():
        with common.backend_context(backend):
            return model.generate(input_ids=inp.prompts, attention_mask=inp.prompt_mask, do_sample=False,
                                  use_cache=True, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  pad_token_id=0)

    return run


def hf_fasttrans_copy(model, inp, backend: str, unpad: bool = False):
    """A copy of ``model`` moved onto fasttrans with ``apply()`` (attention and norms; with
    ``unpad``, the layers on the real tokens only), after checking that it computes what
    ``model`` does in eval mode on ``backend``, at the real tokens."""
    import fasttrans.integrations.transformers as ftt

    ours, skipped = ftt.apply(copy.deepcopy(model), unpad=unpad)
    if skipped:
        raise RuntimeError("fasttrans.integrations.transformers.apply left modules as they were: "
                           + "; ".join(f"{name} ({why})" for name, why in skipped))
    kw = dict(input_ids=inp.ids[:2], attention_mask=inp.mask[:2])
    real = inp.mask[:2].bool()  # compared at the real tokens: unpad=True gives the pads hidden states of 0
    if model.config.model_type == "llama":
        kw["use_cache"] = False  # what unpad=True packs outside training
    elif model.config.model_type in HF_SEQ2SEQ:  # the decoder's logits, which have no padding
        kw["decoder_input_ids"] = inp.targets[:2]
        real = torch.ones_like(inp.targets[:2], dtype=torch.bool)
    training = model.training
    ours.eval()
    model.eval()
    try:
        with torch.no_grad(), fasttrans.use_backend(backend):
            got = ours(**kw).logits
        with torch.no_grad():
            want = model(**kw).logits
    finally:
        ours.train(training)
        model.train(training)
    got, want = got[real], want[real]
    diff = (got.float() - want.float()).abs().max().item()
    tolerance = TWIN_TOLERANCE if want.dtype == torch.float32 else HALF_TWIN_TOLERANCE
    if not diff <= tolerance * max(1.0, want.float().abs().max().item()):
        raise RuntimeError(f"{type(model).__name__} with attn_implementation='fasttrans' on backend {backend!r} and "
                           f"with {model.config._attn_implementation!r} disagree: max |logit difference| = {diff:.3g}; the comparison would not "
                           "be like for like")
    return ours


HF_TORCH_VARIANTS = ("sdpa", "eager")  # transformers' own attention implementations; sdpa is the baseline


def hf_entries(bench: common.Bench, timed, unavailable: str | None, unpad: bool = False,
               torch_variants: tuple = HF_TORCH_VARIANTS) -> list[Entry]:
    """One entry per provider of ``timed(model, inp, backend)``, each on its own copy of the
    shared model: fasttrans per backend through apply() (and, with ``unpad``, through
    apply(unpad=True) as variant "unpad"), torch once per attn_implementation of
    ``torch_variants``."""
    entries = []
    for p in bench.providers(None):
        if unavailable and not p.unavailable:
            p = dataclasses.replace(p, unavailable=unavailable)
        if p.backend is not None:
            # the reference backend is the unfused correctness oracle: --quick checks that it runs
            skip = None if bench.quick or p.backend != "reference" else (
                "the hf sweep times the fused backends; the reference (the unfused oracle) runs with --quick")
            for variant in ("", "unpad") if unpad else ("",):
                def make(inp, backend=p.backend, variant=variant):
                    return timed(hf_fasttrans_copy(inp.model, inp, backend, unpad=variant == "unpad"), inp, backend)

                entries.append(Entry(p, make, variant=variant, skip=skip))
        elif p.name == "torch":
            for impl in torch_variants:
                def make_torch(inp, impl=impl):
                    model = copy.deepcopy(inp.model)
                    model.set_attn_implementation(impl)
                    return timed(model, inp, None)

                entries.append(Entry(p, make_torch, variant=impl))
        elif p.name == "torch-compile":
            entries.append(Entry(p, None, variant="sdpa",
                                 skip="the hf sweep compares attention implementations of models run eagerly"))
    return entries


def hf_params(spec, batch: int, **extra) -> dict:
    return {"model": spec.name, "hidden": spec.hidden, "heads": spec.heads, "kv_heads": spec.kv_heads,
            "layers": spec.layers, "ffn": spec.ffn, "vocab": spec.vocab, "batch": batch, **extra}


def hf_configs(bench: common.Bench):
    dtype = bench.args.dtype
    wanted = not bench.args.sweep or bool({"hf", "hf-families"} & set(bench.args.sweep))
    unavailable = hf_unavailable() if wanted else None  # transformers is imported only when the sweep runs
    if unavailable:
        print(f"hf sweep: UNAVAILABLE: {unavailable}")
    (bert, bert_base), llama = ((HF_BERT_QUICK, HF_BERT_BASE_QUICK), HF_LLAMA_QUICK) if bench.quick else (
        (HF_BERT, HF_BERT_BASE), HF_LLAMA)
    batch, seq_len = (2, 16) if bench.quick else (8, 128)
    gen_batch, prompt_len, new_tokens = (2, 8, 4) if bench.quick else (4, 32, 32)
    base = ("torch", "sdpa")

    def bert_step(spec):
        return Config(
            sweep="hf", case=f"BERT-base-shaped MLM training step, {spec.layers} layers", op="BertForMaskedLM",
            mode="train step", dtype=dtype,
            params=hf_params(spec, batch, seq=seq_len, padding=f"{HF_PADDING:.0%}", mlm=f"{HF_MLM_FRACTION:.0%}"),
            inputs=hf_inputs(spec, batch, seq_len, bench.device, dtype, padding=HF_PADDING),
            entries=hf_entries(bench, hf_train_step, unavailable, unpad=True), work=float(batch * seq_len),
            work_unit="token", measure="time+memory", baseline=base,
        )

    yield bert_step(bert)
    yield Config(
        sweep="hf", case=f"Llama-shaped causal LM training step, {llama.layers} layers", op="LlamaForCausalLM",
        mode="train step", dtype=dtype, params=hf_params(llama, batch, seq=seq_len, padding="0%"),
        inputs=hf_inputs(llama, batch, seq_len, bench.device, dtype),
        entries=hf_entries(bench, hf_train_step, unavailable), work=float(batch * seq_len), work_unit="token",
        measure="time+memory", baseline=base,
    )
    yield Config(
        sweep="hf", case=f"Llama-shaped causal LM training step, {llama.layers} layers, padded",
        op="LlamaForCausalLM", mode="train step", dtype=dtype,
        params=hf_params(llama, batch, seq=seq_len, padding=f"{HF_PADDING:.0%}"),
        inputs=hf_inputs(llama, batch, seq_len, bench.device, dtype, padding=HF_PADDING),
        entries=hf_entries(bench, hf_train_step, unavailable, unpad=True), work=float(batch * seq_len),
        work_unit="token", measure="time+memory", baseline=base,
    )
    yield Config(
        sweep="hf", case=f"Llama-shaped greedy generate {new_tokens} tokens, batch {gen_batch}",
        op="LlamaForCausalLM", mode="decode", dtype=dtype,
        params=hf_params(llama, gen_batch, prompt=prompt_len, new=new_tokens),
        inputs=hf_inputs(llama, 2, prompt_len, bench.device, dtype, prompt_batch=gen_batch, prompt_len=prompt_len),
        entries=hf_entries(bench, lambda model, inp, backend: hf_generate(model, inp, backend, new_tokens),
                           unavailable),
        work=float(gen_batch * new_tokens), work_unit="token", measure="time+memory", baseline=base,
    )
    shape = HF_FAMILY_QUICK if bench.quick else HF_FAMILY
    for family in HF_FAMILIES:
        spec = types.SimpleNamespace(name=family, **shape)
        yield Config(
            sweep="hf-families", case=f"{family} training step, {spec.layers} layers", op=family,
            mode="train step", dtype=dtype, params=hf_params(spec, batch, seq=seq_len, padding=f"{HF_PADDING:.0%}"),
            inputs=hf_inputs(spec, batch, seq_len, bench.device, dtype, padding=HF_PADDING),
            entries=hf_entries(bench, hf_train_step, unavailable, unpad=family in HF_UNPADDABLE,
                               torch_variants=("eager",) if family in HF_EAGER_ONLY else ("sdpa",)),
            work=float(batch * seq_len), work_unit="token", measure="time",
            baseline=("torch", "eager") if family in HF_EAGER_ONLY else base,
        )
    # gpt-oss is most often run for inference: its generate() too, with a long prompt
    gpt_oss, prompt = types.SimpleNamespace(name="gpt_oss", **shape), 8 if bench.quick else 512
    yield Config(
        sweep="hf-families", case=f"gpt_oss greedy generate {new_tokens} tokens, prompt {prompt}, batch {gen_batch}",
        op="gpt_oss", mode="decode", dtype=dtype, params=hf_params(gpt_oss, gen_batch, prompt=prompt, new=new_tokens),
        inputs=hf_inputs(gpt_oss, 2, prompt, bench.device, dtype, prompt_batch=gen_batch, prompt_len=prompt),
        entries=hf_entries(bench, lambda model, inp, backend: hf_generate(model, inp, backend, new_tokens),
                           unavailable, torch_variants=("eager",)),
        work=float(gen_batch * new_tokens), work_unit="token", measure="time", baseline=("torch", "eager"),
    )
    # last: the costliest case, so that a run cut short by a time limit (make gpu-check) has the others' rows
    yield bert_step(bert_base)


# --------------------------------------------------------------------------------------
# what runs
# --------------------------------------------------------------------------------------
DIGITS_MODEL = types.SimpleNamespace(name="digits", vocab=DIGITS_VOCAB, d_model=256, nhead=4, layers=3, ffn=512)
BASE_MODEL = types.SimpleNamespace(name="base", vocab=1000, d_model=512, nhead=8, layers=6, ffn=2048)


def _params(spec, batch, src_len, tgt_len, **extra):
    return {"model": spec.name, "d_model": spec.d_model, "heads": spec.nhead, "layers": f"{spec.layers}+{spec.layers}",
            "ffn": spec.ffn, "batch": batch, "src": src_len, "tgt": tgt_len, **extra}


def configs(bench: common.Bench):
    fp32 = torch.float32
    batch = 2 if bench.quick else 64
    yield Config(
        sweep="headline", case="seq2seq training step (digits-average)", op="seq2seq", mode="train step",
        dtype=fp32, params=_params(DIGITS_MODEL, batch, DIGITS_SRC_LEN, DIGITS_TGT_INPUT_LEN),
        inputs=model_inputs(DIGITS_MODEL, batch, DIGITS_SRC_LEN, DIGITS_TGT_INPUT_LEN, bench.device, fp32),
        entries=train_entries(bench), work=float(batch * (DIGITS_SRC_LEN + DIGITS_TGT_INPUT_LEN)),
        work_unit="token", measure="time+memory",
    )
    # without a cache, T new tokens cost T * (T + 1) / 2 decoder positions: the long cases
    # use smaller batches so that the cacheless providers stay within the time budget; batch 1
    # is one sequence's latency, where each step's fixed costs weigh most
    for decode_batch, new_tokens in ((2, 9),) if bench.quick else ((64, 9), (8, 64), (1, 64)):
        yield Config(
            sweep="decode", case=f"greedy decode {new_tokens} tokens, batch {decode_batch}", op="seq2seq",
            mode="decode", dtype=fp32, params=_params(DIGITS_MODEL, decode_batch, DIGITS_SRC_LEN, new_tokens),
            inputs=model_inputs(DIGITS_MODEL, decode_batch, DIGITS_SRC_LEN, DIGITS_TGT_INPUT_LEN, bench.device, fp32),
            entries=decode_entries(bench, new_tokens), work=float(decode_batch * new_tokens), work_unit="token",
            measure="time+memory", baseline=("torch", "no-cache"),
        )
    shapes = ((1, 8, 4),) if bench.quick else ((1, 8, 4), (1, 32, 9), (1, 91, 9), (8, 91, 9), (64, 91, 9))
    for batch, src_len, tgt_len in shapes:
        yield Config(
            sweep="infer", case=f"inference forward, batch {batch}, source {src_len}", op="seq2seq", mode="infer",
            dtype=fp32, params=_params(DIGITS_MODEL, batch, src_len, tgt_len),
            inputs=model_inputs(DIGITS_MODEL, batch, src_len, tgt_len, bench.device, fp32),
            entries=infer_entries(bench), work=float(batch * (src_len + tgt_len)), work_unit="token",
            measure="time+memory",
        )
    if bench.device == "cuda" and not bench.quick:
        batch, length = 32, 128
        yield Config(
            sweep="train", case="seq2seq training step (base)", op="seq2seq", mode="train step",
            dtype=fp32, params=_params(BASE_MODEL, batch, length, length),
            inputs=model_inputs(BASE_MODEL, batch, length, length, bench.device, fp32),
            entries=train_entries(bench), work=float(batch * 2 * length), work_unit="token",
            measure="time+memory",
        )
    yield from hf_configs(bench)


PLOTTED_SWEEPS = {
    "headline": "training step throughput (source + decoder-input tokens per second)",
    "train": "training step throughput (source + decoder-input tokens per second)",
    "decode": "greedy decoding throughput (generated tokens per second)",
    "infer": "inference forward throughput (source + decoder-input tokens per second)",
    "hf": "training step throughput (tokens per second, padding included); generate() (new tokens per second)",
    "hf-families": "training step throughput (input tokens per second, padding included)",
}
# (figure title, what the speed-up is against) per sweep
SEQ2SEQ_TITLE = ("seq2seq model: fasttrans.nn vs torch.nn, same weights", "torch.nn")
PLOT_TITLES = {"hf": ("Hugging Face models: fasttrans apply() vs attn_implementation sdpa and eager, same weights",
                      "attn_implementation='sdpa'"),
               "hf-families": ("Hugging Face model families, one small shape: fasttrans apply() vs "
                               "attn_implementation sdpa, same weights", "attn_implementation='sdpa'")}


def print_kernel_profiles(cfg: Config, results, top: int) -> None:
    """Where the GPU time of a step goes, per provider that ran (common.kernel_profile)."""
    inputs = cfg.inputs()
    for r in results:
        if r.status != "ok":
            continue
        entry = next(e for e in cfg.entries if e.key == (r.provider, r.variant))
        # a total far below the step's wall time: the step is bound by the host, not its kernels
        print(f"  kernels of one step, {r.label} ({r.timing.median * 1e3:.3f} ms a step, wall):")
        try:
            for line in common.kernel_profile(entry.make(inputs), top):
                print(f"    {line}")
        except Exception as e:
            print(f"    profile failed: {type(e).__name__}: {e}")
    sys.stdout.flush()


def main(argv=None) -> int:
    parser = common.make_parser(__doc__)
    parser.add_argument("--kernel-profile", type=int, default=0, metavar="N",
                        help="CUDA: after each training step of the hf sweep, print each provider's N longest "
                             "GPU kernels per step (torch.profiler)")
    args = common.parse_args(parser, argv)
    missing = placeholders()
    if missing:
        print(f"bench_model: cannot run: {', '.join(missing)} "
              f"{'is' if len(missing) == 1 else 'are'} still a placeholder (None) in this checkout; "
              "nothing was measured or written", file=sys.stderr)
        return 2

    bench = common.Bench("model", args)
    for cfg in configs(bench):
        results = bench.run(cfg)
        if args.kernel_profile and bench.device == "cuda" and cfg.sweep == "hf" and cfg.mode == "train step":
            print_kernel_profiles(cfg, results, args.kernel_profile)

    # one figure per sweep, as the other benchmarks draw them: a run of some sweeps replaces
    # their figures and leaves the others' as the last full run drew them
    for sweep, what in PLOTTED_SWEEPS.items():
        results = [r for r in bench.results if r.config.sweep == sweep]
        title, baseline = PLOT_TITLES.get(sweep, SEQ2SEQ_TITLE)
        bench.plot_bars(sweep, [
            (what, results, "throughput"),
            (f"speedup vs {baseline} (median / median, interleaved in one run)", results, "speedup"),
            ("peak memory of one call above what was live before it", results, "memory"),
        ], title=title)
    bench.headline_table(("headline", "memory", "hf", "hf-families"))
    return bench.finish()


if __name__ == "__main__":
    sys.exit(main())

"""The toy German -> English task of seed 004: two sentences, word-level vocabularies.

Token ids are the seed's: ``P`` (0) pads, ``S`` starts and ``E`` ends the target. The
source is padded to 5 tokens; the decoder reads ``S i want a beer .`` and must produce
``i want a beer . E``.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = [
    "SENTENCES",
    "SRC_VOCAB",
    "TGT_VOCAB",
    "SRC_LEN",
    "TGT_LEN",
    "PAD",
    "BOS",
    "EOS",
    "make_data",
    "encode_source",
    "decode_target",
    "train_batch",
    "translate",
    "evaluate",
    "TranslateReport",
]

# (encoder input, decoder input, decoder output), exactly as in the seed
SENTENCES = [
    ("ich mochte ein bier P", "S i want a beer .", "i want a beer . E"),
    ("ich mochte ein cola P", "S i want a coke .", "i want a coke . E"),
]
SRC_VOCAB = {"P": 0, "ich": 1, "mochte": 2, "ein": 3, "bier": 4, "cola": 5}
TGT_VOCAB = {"P": 0, "i": 1, "want": 2, "a": 3, "beer": 4, "coke": 5, "S": 6, "E": 7, ".": 8}
IDX_TO_TGT = {i: w for w, i in TGT_VOCAB.items()}
SRC_LEN = 5
TGT_LEN = 6
PAD = 0  # the pad id of both vocabularies
BOS = TGT_VOCAB["S"]
EOS = TGT_VOCAB["E"]


def make_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(enc_inputs (2, 5), dec_inputs (2, 6), dec_outputs (2, 6)) int64, as the seed's make_data."""
    enc = [[SRC_VOCAB[w] for w in s.split()] for s, _, _ in SENTENCES]
    dec_in = [[TGT_VOCAB[w] for w in t.split()] for _, t, _ in SENTENCES]
    dec_out = [[TGT_VOCAB[w] for w in t.split()] for _, _, t in SENTENCES]
    return torch.tensor(enc), torch.tensor(dec_in), torch.tensor(dec_out)


def encode_source(sentence: str) -> torch.Tensor:
    """A German sentence -> (1, SRC_LEN) ids, right-padded with P; unknown words are an error."""
    words = sentence.split()
    unknown = [w for w in words if w not in SRC_VOCAB or w == "P"]
    if unknown:
        known = ", ".join(w for w in SRC_VOCAB if w != "P")
        raise ValueError(f"sentence: unknown words {unknown}; the vocabulary is {known}")
    if len(words) > SRC_LEN:
        raise ValueError(f"sentence: at most {SRC_LEN} words, got {len(words)}")
    ids = [SRC_VOCAB[w] for w in words] + [PAD] * (SRC_LEN - len(words))
    return torch.tensor([ids])


def decode_target(ids: torch.Tensor) -> str:
    """Generated target ids (after S) -> text, stopping at E."""
    words = []
    for i in ids.tolist():
        if i == EOS:
            break
        if i in (BOS, PAD):
            continue
        words.append(IDX_TO_TGT[i])
    return " ".join(words)


def train_batch(step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(src (N, 5), tgt (N, 7)): the two sentences repeated to ``batch_size`` rows.

    tgt is ``S ... E``: the seed's decoder input is tgt[:, :-1] and its output tgt[:, 1:].
    The toy set is the same at every step, so ``step`` and ``seed`` do not change it.
    """
    enc, dec_in, dec_out = make_data()
    tgt = torch.cat([dec_in, dec_out[:, -1:]], dim=1)  # S i want a beer . E
    rows = torch.arange(batch_size) % enc.shape[0]
    return enc[rows], tgt[rows]


def translate(model, sentence: str, device: torch.device | str = "cpu", max_new_tokens: int = TGT_LEN + 2) -> str:
    """Greedy translation of one German sentence with a trained Seq2SeqTransformer."""
    src = encode_source(sentence).to(device)
    tokens = model.generate(src, max_new_tokens, BOS, EOS)
    return decode_target(tokens[0, 1:].cpu())


@dataclasses.dataclass
class TranslateReport:
    translations: list[tuple[str, str, str]]  # (source, expected, greedy output)

    @property
    def accuracy(self) -> float:
        return sum(out == ref for _, ref, out in self.translations) / len(self.translations)

    def to_dict(self) -> dict:
        return {"translations": self.translations, "accuracy": self.accuracy}

    def format(self) -> str:
        lines = [f"greedy translations ({100 * self.accuracy:.0f}% exact):"]
        lines += [f"  {src!r} -> {out!r}   (expected {ref!r})" for src, ref, out in self.translations]
        return "\n".join(lines)


@torch.no_grad()
def evaluate(model, device: torch.device | str = "cpu") -> TranslateReport:
    pairs = []
    for src, _, ref in SENTENCES:
        source = " ".join(w for w in src.split() if w != "P")
        pairs.append((source, ref.replace(" E", ""), translate(model, source, device)))
    return TranslateReport(pairs)

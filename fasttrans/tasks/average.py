"""The digits-average task of seed 001: ten numbers in [0, 1) in, their mean out, digit by digit.

Vocabulary and tokenization are the seed's: the ten digits, a space, ``s`` (start) and
``e`` (end). Every number is written with 8 decimals and its ``0.`` prefix dropped, so
0.31415926 becomes ``31415926``. A source is ``s`` + the ten numbers joined by spaces + ``e``
(1 + 10 * 8 + 9 + 1 = 91 tokens); a target is ``s`` + the mean's 8 digits + ``e`` (10 tokens).
Every sequence has the same length, so there is no padding.

The seed draws one fixed set of 5000 samples (4000 train / 1000 test). Here the data is
synthetic and free, so training draws fresh samples every step from its own generator
and the held-out set comes from a different, fixed seed: no held-out sample is ever
trained on.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = [
    "VOCAB",
    "MAX_DIGITS",
    "NUM_INPUTS",
    "SRC_LEN",
    "TGT_LEN",
    "START",
    "END",
    "SPACE",
    "AverageBatch",
    "digits_of",
    "tokenize_inputs",
    "tokenize_targets",
    "sample",
    "decode_numbers",
    "detokenize",
    "train_batch",
    "held_out",
    "evaluate",
    "AverageReport",
]

VOCAB = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9", " ", "s", "e"]
SPACE, START, END = VOCAB.index(" "), VOCAB.index("s"), VOCAB.index("e")
MAX_DIGITS = 8
NUM_INPUTS = 10
SRC_LEN = 1 + NUM_INPUTS * MAX_DIGITS + (NUM_INPUTS - 1) + 1  # s, digits, spaces, e = 91
TGT_LEN = 1 + MAX_DIGITS + 1  # s, digits, e = 10

_SCALE = 10**MAX_DIGITS


def digits_of(x: torch.Tensor) -> torch.Tensor:
    """(..., MAX_DIGITS) int64 decimal digits of x in [0, 1), as ``'{:.8f}'.format(x)[2:]``.

    The seed's string formatting rounds, so a value above 0.999999995 would print as
    ``1.00000000`` and lose its leading 1; those values are clamped to 0.99999999 instead.
    """
    n = torch.round(x.double() * _SCALE).long().clamp_(0, _SCALE - 1)  # (...,)
    powers = 10 ** torch.arange(MAX_DIGITS - 1, -1, -1, device=x.device)  # (MAX_DIGITS,)
    return (n.unsqueeze(-1) // powers) % 10


def tokenize_inputs(x: torch.Tensor) -> torch.Tensor:
    """(N, NUM_INPUTS) floats -> (N, SRC_LEN) token ids: ``s d..d ␣ d..d ... d..d e``."""
    if x.dim() != 2 or x.shape[1] != NUM_INPUTS:
        raise ValueError(f"x: expected shape (N, {NUM_INPUTS}), got {tuple(x.shape)}")
    n = x.shape[0]
    digits = digits_of(x)  # (N, 10, 8)
    space = torch.full((n, NUM_INPUTS, 1), SPACE, dtype=torch.long, device=x.device)
    body = torch.cat([digits, space], dim=2).reshape(n, -1)[:, :-1]  # (N, 89): no space after the last
    start = torch.full((n, 1), START, dtype=torch.long, device=x.device)
    end = torch.full((n, 1), END, dtype=torch.long, device=x.device)
    return torch.cat([start, body, end], dim=1)  # (N, 91)


def tokenize_targets(y: torch.Tensor) -> torch.Tensor:
    """(N,) floats -> (N, TGT_LEN) token ids: ``s d d d d d d d d e``."""
    if y.dim() != 1:
        raise ValueError(f"y: expected shape (N,), got {tuple(y.shape)}")
    n = y.shape[0]
    start = torch.full((n, 1), START, dtype=torch.long, device=y.device)
    end = torch.full((n, 1), END, dtype=torch.long, device=y.device)
    return torch.cat([start, digits_of(y), end], dim=1)  # (N, 10)


@dataclasses.dataclass
class AverageBatch:
    """One batch: raw values and their tokens."""

    x: torch.Tensor  # (N, NUM_INPUTS) float64 inputs
    y: torch.Tensor  # (N,) float64 means
    src: torch.Tensor  # (N, SRC_LEN) token ids
    tgt: torch.Tensor  # (N, TGT_LEN) token ids


def sample(n: int, generator: torch.Generator | None = None) -> AverageBatch:
    """n fresh samples: x uniform in [0, 1), y = mean(x), both tokenized."""
    if n <= 0:
        raise ValueError(f"n: expected a positive number of samples, got {n}")
    x = torch.rand(n, NUM_INPUTS, dtype=torch.float64, generator=generator)
    y = x.mean(dim=1)
    return AverageBatch(x=x, y=y, src=tokenize_inputs(x), tgt=tokenize_targets(y))


def decode_numbers(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Generated target tokens (N, T) -> (values (N,) float64, well_formed (N,) bool).

    ``tokens`` may start with ``s``; the next MAX_DIGITS tokens are read as the digits after
    ``0.``. A non-digit token there makes the sample malformed; its value keeps the digits
    before it (the rest count as 0), which is how the seed's ``float('0.' + text)`` would
    read a truncated number, without its fallback to 0.0 for any bad character.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens: expected shape (N, T), got {tuple(tokens.shape)}")
    if tokens.shape[1] > 0 and bool((tokens[:, 0] == START).all()):
        tokens = tokens[:, 1:]
    digits = tokens[:, :MAX_DIGITS].cpu()
    if digits.shape[1] < MAX_DIGITS:
        pad = torch.full((digits.shape[0], MAX_DIGITS - digits.shape[1]), END, dtype=digits.dtype)
        digits = torch.cat([digits, pad], dim=1)
    is_digit = digits <= 9
    prefix = torch.cumprod(is_digit.long(), dim=1).bool()  # digits before the first non-digit
    weights = 10.0 ** -torch.arange(1, MAX_DIGITS + 1, dtype=torch.float64)
    values = (digits.double() * weights * prefix).sum(dim=1)
    return values, is_digit.all(dim=1)


def detokenize(tokens: torch.Tensor) -> str:
    """A 1-D sequence of token ids as text, for printing examples."""
    return "".join(VOCAB[int(t)] if 0 <= int(t) < len(VOCAB) else "?" for t in tokens)


# --------------------------------------------------------------------------------------
# Training data and held-out evaluation
# --------------------------------------------------------------------------------------
EVAL_SEED = 123  # the seed's np.random.seed(123); a torch generator here, so other numbers


def train_batch(step: int, batch_size: int, seed: int) -> AverageBatch:
    """The global training batch of ``step``: fresh samples, a pure function of (seed, step).

    Drawing from a generator seeded per step makes a resumed run see exactly the batches
    an uninterrupted run would, and lets every distributed rank cut its shard from the same
    global batch.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
    return sample(batch_size, generator)


def held_out(n: int = 1000) -> AverageBatch:
    """The fixed held-out set: drawn from its own seed, never seen in training."""
    return sample(n, torch.Generator().manual_seed(EVAL_SEED))


@dataclasses.dataclass
class AverageReport:
    """Held-out figures of a model and of the constant predictor (the training mean)."""

    n: int
    mae: float
    digit_accuracy: list[float]  # per digit position, 1..MAX_DIGITS
    well_formed: float  # fraction of outputs made of MAX_DIGITS digits
    baseline_value: float
    baseline_mae: float
    baseline_digit_accuracy: list[float]
    examples: list[tuple[str, str, str]]  # (inputs, target digits, predicted digits)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def format(self) -> str:
        def row(name: str, mae: float, acc: list[float]) -> str:
            cells = " ".join(f"{a:5.3f}" for a in acc)
            return f"  {name:<22} MAE {mae:.4f}   digit accuracy {cells}"

        lines = [
            f"held-out set: {self.n} samples (10 numbers in [0, 1) -> their mean, {MAX_DIGITS} digits)",
            row("model (greedy)", self.mae, self.digit_accuracy),
            row(f"baseline ({self.baseline_value:.4f})", self.baseline_mae, self.baseline_digit_accuracy),
            f"  MAE ratio model/baseline: {self.mae / self.baseline_mae:.3f}"
            f"   well-formed outputs: {100 * self.well_formed:.1f}%",
            "  examples (inputs -> target | prediction):",
        ]
        lines += [f"    {x} -> 0.{y} | 0.{p}" for x, y, p in self.examples]
        return "\n".join(lines)


@torch.no_grad()
def evaluate(
    model,
    device: torch.device | str = "cpu",
    n: int = 1000,
    batch_size: int = 500,
    train_mean: float = 0.5,
    num_examples: int = 5,
) -> AverageReport:
    """Greedy-decode the held-out set with ``model`` (a Seq2SeqTransformer) and score it.

    ``train_mean`` is the constant prediction of the baseline: the mean target of the
    training data.
    """
    data = held_out(n)
    generated = []
    for start in range(0, n, batch_size):
        src = data.src[start : start + batch_size].to(device)
        generated.append(model.generate(src, MAX_DIGITS + 1, START, END).cpu())
    width = max(g.shape[1] for g in generated)
    tokens = torch.cat(
        [torch.cat([g, g.new_full((g.shape[0], width - g.shape[1]), END)], dim=1) for g in generated]
    )  # (n, 1 + steps), rows that ended early padded with the end token
    values, well_formed = decode_numbers(tokens)
    target_digits = digits_of(data.y)  # (n, 8)
    predicted = tokens[:, 1 : 1 + MAX_DIGITS]
    if predicted.shape[1] < MAX_DIGITS:
        predicted = torch.cat([predicted, predicted.new_full((n, MAX_DIGITS - predicted.shape[1]), END)], dim=1)
    baseline_digits = digits_of(torch.tensor([train_mean], dtype=torch.float64))  # (1, 8)
    examples = [
        (
            " ".join(f"{v:.8f}"[1:] for v in data.x[i, :3].tolist()) + " ...",
            detokenize(target_digits[i]),
            detokenize(predicted[i]),
        )
        for i in range(min(num_examples, n))
    ]
    return AverageReport(
        n=n,
        mae=(values - data.y).abs().mean().item(),
        digit_accuracy=(predicted == target_digits).double().mean(0).tolist(),
        well_formed=well_formed.double().mean().item(),
        baseline_value=train_mean,
        baseline_mae=(train_mean - data.y).abs().mean().item(),
        baseline_digit_accuracy=(baseline_digits == target_digits).double().mean(0).tolist(),
        examples=examples,
    )

"""The seed tasks, as the training loop sees them: data, a default model, a default recipe, a report.

``TASKS["average"]`` is seed 001's digits-average task, ``TASKS["translate"]`` seed 004's
toy German -> English pair. Each batch function returns the *global* batch of a step as
``(src, tgt, values)``: tgt runs from the start to the end token (the decoder reads
tgt[:, :-1] and predicts tgt[:, 1:]); ``values`` are the numbers behind the targets when
there are any (the training mean is the average task's baseline), else None.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ..models.seq2seq import Seq2SeqConfig
from . import average, translate

__all__ = ["Task", "TASKS", "get_task", "average", "translate"]


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    description: str
    model_config: Callable[[], Seq2SeqConfig]
    train_defaults: dict[str, Any]  # TrainConfig fields this task sets by default
    samples_per_epoch: int  # what one "epoch" means for --epochs
    bos_idx: int
    eos_idx: int
    batch: Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
    evaluate: Callable[..., Any]  # (model, device, train_mean) -> report with .format() and .to_dict()


def _average_model() -> Seq2SeqConfig:
    # Why these choices (see the README's recipe section):
    # * small (d_model 64, 2 + 2 layers): the task needs a few attention patterns, not
    #   capacity, and the time budget is CPU minutes; one step costs ~4x less than the
    #   seed's 256-wide 3 + 3 model;
    # * 8 heads of width 8: more attention patterns to find the leading digits of the ten
    #   numbers with (the loss plateaus at the baseline until they are found; 8 heads left
    #   the plateau sooner than 4 in our runs);
    # * pre-norm: trains at a high learning rate from the first steps, where post-norm
    #   needs a long warmup;
    # * sqrt(d_model)-scaled embeddings initialised at std d_model^-0.5: token vectors of
    #   unit size, the same scale as the sinusoids, so the position signal that tells the
    #   model which digit of which number a token is stays visible;
    # * no dropout: every batch is fresh data, so there is nothing to overfit.
    return Seq2SeqConfig(
        src_vocab_size=len(average.VOCAB),
        d_model=64,
        nhead=8,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dim_feedforward=256,
        dropout=0.0,
        norm_first=True,
        share_embeddings=True,  # one vocabulary for inputs and outputs, as in the seed
        scale_embedding=True,
        max_len=128,
    )


def _average_batch(step: int, batch_size: int, seed: int):
    b = average.train_batch(step, batch_size, seed)
    return b.src, b.tgt, b.y


def _average_evaluate(model, device, train_mean: float | None, **kwargs):
    return average.evaluate(model, device, train_mean=0.5 if train_mean is None else train_mean, **kwargs)


def _translate_model() -> Seq2SeqConfig:
    # seed 004's vocabularies and padding; a small model so that the toy pair trains in seconds
    return Seq2SeqConfig(
        src_vocab_size=len(translate.SRC_VOCAB),
        tgt_vocab_size=len(translate.TGT_VOCAB),
        d_model=32,
        nhead=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dim_feedforward=64,
        dropout=0.0,
        src_pad_idx=translate.PAD,
        tgt_pad_idx=translate.PAD,
        max_len=16,
    )


def _translate_batch(step: int, batch_size: int, seed: int):
    src, tgt = translate.train_batch(step, batch_size, seed)
    return src, tgt, None


def _translate_evaluate(model, device, train_mean: float | None, **kwargs):
    return translate.evaluate(model, device)


TASKS: dict[str, Task] = {
    "average": Task(
        name="average",
        description="seed 001: the mean of ten numbers in [0, 1), digit by digit",
        model_config=_average_model,
        train_defaults=dict(steps=2000, batch_size=64, lr=3e-3, warmup_steps=150, schedule="cosine"),
        samples_per_epoch=4000,  # the seed's training set size
        bos_idx=average.START,
        eos_idx=average.END,
        batch=_average_batch,
        evaluate=_average_evaluate,
    ),
    "translate": Task(
        name="translate",
        description="seed 004: ich mochte ein bier/cola -> i want a beer/coke .",
        model_config=_translate_model,
        train_defaults=dict(steps=40, batch_size=2, lr=3e-3, warmup_steps=5, schedule="constant"),
        samples_per_epoch=len(translate.SENTENCES),
        bos_idx=translate.BOS,
        eos_idx=translate.EOS,
        batch=_translate_batch,
        evaluate=_translate_evaluate,
    ),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"task: expected one of {', '.join(TASKS)}, got {name!r}")
    return TASKS[name]

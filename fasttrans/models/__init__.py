"""Complete models built from fasttrans.nn."""

from .seq2seq import Seq2SeqTransformer

__all__ = ["Seq2SeqTransformer"]

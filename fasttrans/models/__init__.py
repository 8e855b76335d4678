"""Complete models built from fasttrans.nn."""

from .decoding import greedy_decode
from .seq2seq import Seq2SeqConfig, Seq2SeqTransformer

__all__ = ["Seq2SeqConfig", "Seq2SeqTransformer", "greedy_decode"]

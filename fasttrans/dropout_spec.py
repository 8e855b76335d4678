"""The definition of dropout's keep decisions that every backend shares (csrc/philox.h).

A neutral module below the kernels and the reference, which both evaluate it: the Triton
kernels, the C++/CUDA extension and ``fasttrans.reference`` drop the same elements for a
seed. docs/semantics.md ("Dropout") states the whole rule.
"""

FLAT_DOMAIN = 0x44524F50  # last counter word of elementwise dropout ("DROP")


def dropout_threshold(p: float) -> int:
    """round(p * 2^24), as csrc/philox.h's dropout_threshold: a word is kept when
    (word >> 8) >= threshold, P(keep) = 1 - p."""
    t = float(p) * 16777216.0 + 0.5  # the same double operations as the C++ code
    return 16777216 if t >= 16777216.0 else int(t)


def attention_dropout_threshold(p: float) -> int:
    """min(round(p * 2^16), 2^16 - 1), as csrc/philox.h's attention_dropout_threshold: a
    score is kept when its 16-bit draw is >= threshold, P(keep) = 1 - threshold / 2^16 (at
    least 2^-16 for p < 1; p = 1 never reaches the kernels)."""
    t = float(p) * 65536.0 + 0.5  # the same double operations as the C++ code
    return 65535 if t >= 65535.0 else int(t)

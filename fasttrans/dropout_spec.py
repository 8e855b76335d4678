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

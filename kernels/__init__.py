"""The Triton kernels, one module per op: attention, layernorm, dropout."""

# Every launch names its FMA contraction explicitly. The kernels are compiled and checked
# (compile-check) with contraction on; left unnamed, Triton 3.9 warns at the first compile
# that its default changes in 3.10, which would change the kernels' numerics with it.
LAUNCH_OPTIONS = {"enable_fp_fusion": True}


# Host-side integer helpers for the launchers. triton.cdiv and triton.next_power_of_2 are
# constexpr functions: called from host code they go through Triton's wrapper, about 1.4 us
# a call against 0.02 us for the arithmetic (Triton 3.9, the 2-core CPU of the README), and a
# norm forward + backward made eight such calls.
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative a and positive b, as triton.cdiv."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for n >= 1, as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length() if n > 0 else 0

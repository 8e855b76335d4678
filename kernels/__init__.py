"""The Triton kernels, one module per op: attention, layernorm, dropout."""

# Every launch names its FMA contraction explicitly. The kernels are compiled and checked
# (compile-check) with contraction on; left unnamed, Triton 3.9 warns at the first compile
# that its default changes in 3.10, which would change the kernels' numerics with it.
LAUNCH_OPTIONS = {"enable_fp_fusion": True}

"""The attention kernels' launch configurations (kernels/attention.py launches them).

Tables of ``triton.Config`` per architecture, head-dim class and weight, with the fp32
classes that run IEEE dots, the fixed configurations of the helper kernels and the one
small configuration the interpreter runs; and the launch keys the launchers and the
compile targets (kernels/_attention_targets.py) share: the mask kinds and the dK/dV
kernel's output groups. Why each entry is what it is: the comments below and ``python -m
fasttrans compile-check``, which compiles every entry.
"""

from __future__ import annotations

import triton

__all__ = ["FWD_CONFIGS", "FWD_CONFIGS_FP32", "BWD_DKDV_CONFIGS", "BWD_DKDV_CONFIGS_FP32", "BWD_DQ_CONFIGS",
           "BWD_DQ_CONFIGS_FP32", "FP32_IEEE_CLASSES", "BY_POINTERS", "CAPPED", "DROPOUT_MASK_CONFIG",
           "TILE_MAP_CONFIG",
           "INTERPRETER_CONFIGS", "BEFORE_TRITON_3_9", "TRITON_3_7", "TRITON_3_8", "TRITON_VERSION", "MASK_NONE",
           "MASK_BOOL", "MASK_FLOAT", "dkdv_outputs"]

# Mask kinds (the kernels' MASK_KIND constexpr)
MASK_NONE = 0
MASK_BOOL = 1  # True (stored as uint8 1) = may attend
MASK_FLOAT = 2  # added to the scaled scores


def _cfg(block_m: int, block_n: int | None, num_warps: int, num_stages: int) -> triton.Config:
    meta = {"BLOCK_M": block_m} if block_n is None else {"BLOCK_M": block_m, "BLOCK_N": block_n}
    return triton.Config(meta, num_warps=num_warps, num_stages=num_stages)


# GPU configurations, autotuned per (architecture, head-dim class, weight). The architecture is
# "sm_90" for compute capability >= 9 (wgmma) and "sm_80" below (mma.sync, which holds both
# matmul operands in registers and so needs smaller tiles). The head-dim class is the padded
# head dim BLOCK_D rounded up to 64, 128 or 256. "heavy" launches read a dense mask tile or
# generate dropout bits per element (more registers live per tile); "light" ones have at most
# key lengths and causal masking. BLOCK_M is the query tile, BLOCK_N the key tile in every
# kernel. `python -m fasttrans compile-check` (part of the test suite) compiles every entry for
# its architecture in its worst specialisation (light: causal + key lengths; heavy: float
# mask and its gradient + causal + key lengths + dropout): each must spill nothing and lower
# every matmul to mma.sync (sm_80) / wgmma (sm_90). wgmma needs a matmul M dimension >= 64:
# the query tile in the forward and dQ kernels, the key tile in the dK/dV kernel (which
# computes transposed for that reason).
# Two more weights, "bool" (a dense bool mask, with or without dropout: its partial tiles read
# the mask's bits, its full tiles no mask at all) and "dropout" (dropout without a dense mask), have
# entries where compile-check found tiles larger than the heavy ones or fewer SASS
# instructions per score, without spills; elsewhere they take the heavy entry
# (attention._table_class).
FWD_CONFIGS = {
    # sm_90 16-bit light entries load their loop's tiles through TMA where the layout allows
    # (attention._tma_layout) and by cp.async elsewhere: compile-check builds both
    "sm_90": {  # light 16-bit entries: the ones with the fewest SASS instructions per score in the loop
        (64, "light"): [_cfg(128, 128, 8, 3), _cfg(128, 64, 4, 2)],
        (64, "heavy"): [_cfg(64, 64, 4, 2)],
        (64, "dropout"): [_cfg(128, 128, 8, 2), _cfg(128, 64, 8, 2)],
        # key tiles of 64 take more SASS per score than 128 (compile-check)
        (128, "light"): [_cfg(128, 128, 8, 2)],
        (128, "heavy"): [_cfg(128, 32, 8, 2), _cfg(64, 32, 4, 2)],
        (128, "dropout"): [_cfg(128, 64, 8, 2)],
        (256, "light"): [_cfg(128, 32, 8, 1), _cfg(128, 64, 8, 2)],
        (256, "heavy"): [_cfg(64, 16, 4, 1)],
    },
    "sm_80": {
        (64, "light"): [_cfg(128, 64, 4, 3), _cfg(128, 128, 8, 3)],
        (64, "heavy"): [_cfg(64, 32, 4, 2), _cfg(128, 32, 8, 2)],
        (128, "light"): [_cfg(128, 32, 8, 2), _cfg(64, 64, 4, 2)],
        (128, "heavy"): [_cfg(64, 32, 4, 2)],  # 128 x 32 spills beside the loops over listed tiles
        (256, "light"): [_cfg(64, 16, 4, 1)],
        (256, "heavy"): [_cfg(32, 32, 4, 1)],
    },
}
# dK/dV: one program per key tile (BLOCK_N), inner loop over query tiles (BLOCK_M). Head dims
# above 128 run it twice (dV, then dK), one fp32 accumulator at a time.
BWD_DKDV_CONFIGS = {
    "sm_90": {  # query tiles of 64 where they fit: the transposed S^T = K Q^T then has wgmma N = 64
        (64, "light"): [_cfg(64, 128, 8, 2), _cfg(64, 64, 4, 2)],
        (64, "heavy"): [_cfg(32, 64, 4, 2)],
        (64, "dropout"): [_cfg(64, 128, 8, 1), _cfg(32, 128, 8, 2)],
        (128, "light"): [_cfg(64, 128, 8, 2), _cfg(64, 64, 4, 2)],
        (128, "heavy"): [_cfg(16, 128, 8, 1)],
        (128, "bool"): [_cfg(16, 128, 8, 1)],
        (128, "dropout"): [_cfg(32, 128, 8, 2)],
        (256, "light"): [_cfg(16, 64, 8, 2)],
        (256, "heavy"): [_cfg(16, 16, 4, 1), _cfg(16, 32, 8, 1)],  # mma.sync: every 64-key tile spills dK
    },
    "sm_80": {
        (64, "light"): [_cfg(32, 128, 8, 2), _cfg(32, 64, 4, 2)],
        (64, "heavy"): [_cfg(16, 64, 4, 1)],
        (128, "light"): [_cfg(16, 128, 8, 2), _cfg(32, 64, 4, 2)],
        (128, "heavy"): [_cfg(16, 32, 4, 2)],
        (256, "light"): [_cfg(16, 64, 8, 1)],
        (256, "heavy"): [_cfg(16, 16, 4, 1)],
    },
}


def dkdv_outputs(block_d: int) -> tuple[str, ...]:
    """The dK/dV kernel's launches for a padded head dim, by their OUTPUT constexpr."""
    # two fp32 (BLOCK_N, 256) accumulators do not fit in registers next to the rest
    return ("dkdv",) if block_d <= 128 else ("dv", "dk")


# dQ: one program per query tile (BLOCK_M), inner loop over key tiles (BLOCK_N).
BWD_DQ_CONFIGS = {
    "sm_90": {  # d64 light: the one entry within the backward's loop goal (kernels/_attention_targets.py)
        (64, "light"): [_cfg(128, 128, 8, 2)],
        (64, "heavy"): [_cfg(64, 16, 4, 1)],  # key tiles of 32 spill beside the loops over listed tiles
        (64, "bool"): [_cfg(128, 64, 8, 2)],
        (64, "dropout"): [_cfg(128, 64, 8, 2)],
        (128, "light"): [_cfg(64, 128, 4, 1), _cfg(128, 128, 8, 1)],  # within the loop goal too
        (128, "heavy"): [_cfg(64, 16, 4, 2), _cfg(128, 16, 8, 2)],
        (128, "bool"): [_cfg(64, 32, 4, 2), _cfg(128, 32, 8, 2)],
        (128, "dropout"): [_cfg(64, 32, 4, 2), _cfg(128, 32, 8, 2)],
        (256, "light"): [_cfg(128, 32, 8, 2)],
        (256, "heavy"): [_cfg(16, 16, 4, 2)],  # mma.sync: every 64-row tile spills
    },
    "sm_80": {
        (64, "light"): [_cfg(128, 32, 4, 1), _cfg(64, 32, 4, 2)],
        (64, "heavy"): [_cfg(64, 16, 4, 2)],
        (128, "light"): [_cfg(128, 32, 8, 2), _cfg(64, 64, 4, 2)],
        (128, "heavy"): [_cfg(64, 16, 8, 2)],
        (256, "light"): [_cfg(64, 32, 8, 1), _cfg(32, 32, 4, 1)],
        (256, "heavy"): [_cfg(16, 16, 4, 1)],
    },
}
# fp32: 3xTF32 splits every operand into two TF32 halves held in registers at once, about
# twice a 16-bit tile's registers, so fp32 has tables of its own, each entry the largest tiles
# that compile-check builds without spills (smaller than the 16-bit ones; below 64 rows,
# sm_90 runs mma.sync instead of wgmma). Where no 3xTF32 tile of any size compiled without
# spills (head dim 256, and the masked/dropout dQ and sm_80 dK/dV at 128), the class runs
# IEEE fp32 on FMA units in small tiles instead: FP32_IEEE_CLASSES.
FWD_CONFIGS_FP32 = {
    "sm_90": {
        (64, "light"): [_cfg(128, 64, 8, 1), _cfg(128, 32, 8, 2)],
        (64, "heavy"): [_cfg(64, 32, 4, 1)],
        (128, "light"): [_cfg(16, 32, 4, 1)],
        (128, "heavy"): [_cfg(16, 32, 4, 1), _cfg(16, 16, 8, 1)],
        (256, "light"): [_cfg(16, 16, 8, 1)],
        (256, "heavy"): [_cfg(16, 16, 8, 1)],
    },
    "sm_80": {
        (64, "light"): [_cfg(128, 32, 8, 2), _cfg(128, 16, 8, 2)],
        (64, "heavy"): [_cfg(32, 32, 4, 1)],
        (128, "light"): [_cfg(32, 32, 4, 1)],
        (128, "heavy"): [_cfg(16, 16, 4, 1)],
        (256, "light"): [_cfg(16, 16, 4, 1)],
        (256, "heavy"): [_cfg(16, 16, 8, 1)],
    },
}
BWD_DKDV_CONFIGS_FP32 = {
    "sm_90": {
        (64, "light"): [_cfg(32, 128, 8, 1), _cfg(16, 128, 8, 2)],
        (64, "heavy"): [_cfg(16, 32, 4, 2), _cfg(16, 16, 4, 1)],
        (128, "light"): [_cfg(16, 16, 4, 1)],
        (128, "heavy"): [_cfg(16, 16, 8, 2)],
        (256, "light"): [_cfg(16, 32, 4, 1)],
        (256, "heavy"): [_cfg(16, 32, 8, 1)],
    },
    "sm_80": {
        (64, "light"): [_cfg(16, 32, 4, 1)],
        (64, "heavy"): [_cfg(16, 32, 8, 1), _cfg(16, 16, 4, 1)],
        (128, "light"): [_cfg(16, 16, 4, 1), _cfg(32, 16, 8, 1)],
        (128, "heavy"): [_cfg(16, 32, 4, 1)],
        (256, "light"): [_cfg(16, 32, 4, 1)],
        (256, "heavy"): [_cfg(16, 32, 8, 1)],
    },
}
BWD_DQ_CONFIGS_FP32 = {
    "sm_90": {
        (64, "light"): [_cfg(128, 64, 8, 1), _cfg(128, 32, 8, 2)],
        (64, "heavy"): [_cfg(16, 16, 4, 1), _cfg(16, 32, 8, 1)],
        (128, "light"): [_cfg(16, 32, 4, 1)],
        (128, "heavy"): [_cfg(16, 16, 8, 1)],
        (256, "light"): [_cfg(16, 16, 4, 2)],
        (256, "heavy"): [_cfg(16, 16, 8, 2)],
    },
    "sm_80": {
        (64, "light"): [_cfg(32, 32, 4, 1), _cfg(32, 16, 4, 1)],
        (64, "heavy"): [_cfg(16, 32, 4, 1), _cfg(32, 32, 8, 1)],
        (128, "light"): [_cfg(32, 16, 8, 1), _cfg(16, 32, 4, 1)],
        (128, "heavy"): [_cfg(16, 16, 8, 2)],
        (256, "light"): [_cfg(16, 16, 8, 2)],
        (256, "heavy"): [_cfg(16, 16, 8, 2)],
    },
}
# Triton 3.6 (the Triton of torch 2.11) and 3.9 build the same tiles with different ptxas
# runs, and each spills in entries the other builds clean: below Triton 3.9 these classes
# take the entries compile-check builds without spills under 3.6, the tables above holding
# 3.9's. (table name, architecture, class) -> the entries.
BEFORE_TRITON_3_9 = {
    ("FWD_CONFIGS", "sm_90", (256, "light")): [_cfg(128, 32, 8, 1)],
    ("FWD_CONFIGS", "sm_90", (256, "heavy")): [_cfg(64, 16, 8, 1)],
    ("FWD_CONFIGS", "sm_80", (128, "heavy")): [_cfg(32, 32, 4, 2)],
    ("FWD_CONFIGS", "sm_80", (256, "heavy")): [_cfg(16, 32, 4, 1)],
    ("FWD_CONFIGS_FP32", "sm_90", (64, "light")): [_cfg(128, 64, 8, 2), _cfg(128, 32, 8, 2)],
    ("FWD_CONFIGS_FP32", "sm_90", (64, "heavy")): [_cfg(128, 16, 8, 1)],
    ("FWD_CONFIGS_FP32", "sm_90", (128, "heavy")): [_cfg(16, 32, 8, 1), _cfg(16, 16, 8, 1)],
    ("FWD_CONFIGS_FP32", "sm_90", (256, "heavy")): [_cfg(16, 16, 4, 1)],
    ("FWD_CONFIGS_FP32", "sm_80", (128, "light")): [_cfg(16, 32, 4, 1)],
    ("FWD_CONFIGS_FP32", "sm_80", (256, "light")): [_cfg(16, 16, 8, 1)],
    ("BWD_DKDV_CONFIGS", "sm_90", (64, "heavy")): [_cfg(32, 64, 4, 1)],
    ("BWD_DKDV_CONFIGS", "sm_90", (64, "dropout")): [_cfg(64, 128, 8, 2)],
    ("BWD_DKDV_CONFIGS", "sm_90", (128, "light")): [_cfg(32, 128, 8, 2), _cfg(16, 64, 4, 1)],
    ("BWD_DKDV_CONFIGS", "sm_90", (128, "heavy")): [_cfg(16, 64, 8, 2)],
    ("BWD_DKDV_CONFIGS", "sm_90", (128, "bool")): [_cfg(16, 128, 8, 2)],
    ("BWD_DKDV_CONFIGS", "sm_90", (256, "heavy")): [_cfg(16, 64, 8, 2)],
    ("BWD_DKDV_CONFIGS_FP32", "sm_90", (64, "heavy")): [_cfg(16, 16, 4, 1), _cfg(16, 32, 8, 1)],
    ("BWD_DKDV_CONFIGS_FP32", "sm_90", (128, "heavy")): [_cfg(16, 16, 8, 1)],
    ("BWD_DKDV_CONFIGS", "sm_80", (64, "heavy")): [_cfg(16, 32, 4, 1)],
    ("BWD_DQ_CONFIGS", "sm_90", (256, "light")): [_cfg(64, 32, 8, 2)],
    ("BWD_DQ_CONFIGS", "sm_90", (128, "light")): [_cfg(128, 64, 8, 2), _cfg(64, 64, 4, 1)],
    ("BWD_DQ_CONFIGS", "sm_90", (128, "heavy")): [_cfg(64, 16, 4, 1)],
    ("BWD_DQ_CONFIGS", "sm_90", (256, "heavy")): [_cfg(32, 16, 8, 2)],
    ("BWD_DQ_CONFIGS", "sm_80", (128, "light")): [_cfg(128, 32, 8, 2), _cfg(64, 32, 4, 1)],
    ("BWD_DQ_CONFIGS_FP32", "sm_90", (64, "light")): [_cfg(128, 32, 8, 1), _cfg(128, 32, 8, 2)],
    ("BWD_DQ_CONFIGS_FP32", "sm_90", (64, "heavy")): [_cfg(16, 32, 4, 1)],
    ("BWD_DQ_CONFIGS_FP32", "sm_80", (128, "light")): [_cfg(16, 32, 4, 1)],
}
# sm_90's light 16-bit entries are chosen for their TMA builds. Where a layout rules TMA out
# (attention._tma_layout), the same tiles load by pointers, which takes more registers: these
# classes' TMA tiles spill there, so that route takes these entries. stage -> class -> entries.
BY_POINTERS = {
    "fwd": {(256, "light"): [_cfg(128, 32, 8, 1)]},
    "dkdv": {(128, "light"): [_cfg(32, 128, 8, 2), _cfg(32, 64, 4, 2)]},
    "dq": {(128, "light"): [_cfg(128, 64, 8, 2), _cfg(64, 64, 4, 2)]},
}
# Triton 3.7 and 3.8 (3.8 is the Triton of torch 2.14) take BEFORE_TRITON_3_9 with the classes
# of their own table replaced, where compile-check found spills under them in 3.6's entries
# (and in 3.9's). Under 3.7 the sm_90 d128 light forward also loads by pointers in key tiles of
# 64 (128 spills there).
TRITON_3_7 = {
    ("BWD_DQ_CONFIGS_FP32", "sm_90", (128, "light")): [_cfg(16, 32, 8, 1)],
}
TRITON_3_8 = {
    ("FWD_CONFIGS_FP32", "sm_80", (64, "light")): [_cfg(128, 16, 8, 2)],
    ("BWD_DKDV_CONFIGS", "sm_90", (128, "dropout")): [_cfg(16, 128, 8, 2)],
    ("BWD_DKDV_CONFIGS", "sm_90", (256, "light")): [_cfg(16, 128, 8, 1)],
    ("BWD_DKDV_CONFIGS", "sm_90", (256, "heavy")): [_cfg(16, 16, 4, 1), _cfg(16, 32, 8, 1)],  # 3.9's
    ("BWD_DKDV_CONFIGS_FP32", "sm_90", (64, "light")): [_cfg(32, 128, 8, 2), _cfg(16, 128, 8, 2)],
    ("BWD_DKDV_CONFIGS_FP32", "sm_90", (128, "light")): [_cfg(16, 16, 4, 2)],
    ("BWD_DKDV_CONFIGS_FP32", "sm_80", (128, "heavy")): [_cfg(16, 32, 8, 1)],
    ("BWD_DQ_CONFIGS", "sm_90", (128, "bool")): [_cfg(128, 32, 8, 2), _cfg(128, 32, 8, 1)],
    ("BWD_DQ_CONFIGS", "sm_80", (128, "light")): [_cfg(128, 32, 8, 1), _cfg(64, 32, 4, 1)],
    ("BWD_DQ_CONFIGS_FP32", "sm_90", (128, "light")): [_cfg(16, 32, 8, 1)],
}
TRITON_VERSION = tuple(int(x) for x in triton.__version__.split(".")[:2])
if TRITON_VERSION < (3, 9):
    _older = {**BEFORE_TRITON_3_9, **{(3, 7): TRITON_3_7, (3, 8): TRITON_3_8}.get(TRITON_VERSION, {})}
    for (_table, _arch, _class), _entries in _older.items():
        globals()[_table][_arch][_class] = list(_entries)
    del _older, _table, _arch, _class, _entries
    # the entries above serve both routes, but for that one class under 3.7
    BY_POINTERS = {"fwd": {(128, "light"): [_cfg(128, 64, 8, 3)]}} if TRITON_VERSION == (3, 7) else {}

_BOTH = {(256, "light"), (256, "heavy")}
# Capped scores (SOFTCAP) take the entry of their weight class counted as dropout
# (kernels/attention.py, _class_weight), but where those tiles spill with the cap's registers
# these: {(stage, precision class, arch, (head-dim class, weight)): configs} (compile-check).
CAPPED = {("dkdv", "fp32", arch, (256, "heavy")): [_cfg(16, 16, 8, 1)] for arch in ("sm_80", "sm_90")}
if TRITON_VERSION < (3, 9):  # the older tables' capped entries that spill (compile-check under Triton 3.6)
    CAPPED.update({
        ("dkdv", "16-bit", "sm_90", (64, "dropout")): [_cfg(32, 128, 8, 2)],
        ("dkdv", "16-bit", "sm_90", (128, "dropout")): [_cfg(16, 128, 8, 1)],
        ("dq", "16-bit", "sm_90", (128, "heavy")): [_cfg(128, 16, 8, 2)],
        ("dkdv", "fp32", "sm_80", (256, "heavy")): [_cfg(16, 16, 8, 2)],
    })

FP32_IEEE_CLASSES = {  # stage -> arch -> the fp32 (head-dim class, weight)s run as IEEE fp32
    "fwd": {"sm_90": _BOTH, "sm_80": _BOTH},
    "dq": {"sm_90": _BOTH | {(128, "heavy")}, "sm_80": _BOTH | {(128, "heavy")}},
    "dkdv": {"sm_90": _BOTH, "sm_80": _BOTH | {(128, "heavy")}},
}
del _BOTH
DROPOUT_MASK_CONFIG = _cfg(32, 32, 4, 1)  # debug entry point: not tuned
# one pass over a mask: not tuned; 4 warps spill 104-264 bytes under Triton 3.7
TILE_MAP_CONFIG = triton.Config({}, num_warps=8, num_stages=1)

# The interpreter (TRITON_INTERPRET=1, CPU) runs one fixed small configuration: tiles small
# enough that awkward sizes exercise partial tiles, multi-tile loops and BLOCK_M != BLOCK_N.
INTERPRETER_CONFIGS = {
    "fwd": _cfg(32, 16, 4, 1),
    "dkdv": _cfg(16, 32, 4, 1),
    "dq": _cfg(32, 16, 4, 1),
    "dropout_mask": _cfg(64, 128, 4, 1),  # large: the interpreter's cost is per tile operation
}

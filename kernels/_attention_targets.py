"""The attention kernels' compile-check targets (``python -m fasttrans compile-check``).

Every kernel of kernels/attention.py in every launch configuration of
kernels/_attention_configs.py, each specialised for the worst case of its class.
kernels/attention.py's ``compile_targets()`` passes its kernels in: this module does not
import it, which would make the two import each other.
"""

from __future__ import annotations

import inspect

import torch
import triton

from ._attention_configs import (
    FWD_CONFIGS, FWD_CONFIGS_FP32, BWD_DKDV_CONFIGS,
    BWD_DKDV_CONFIGS_FP32, BWD_DQ_CONFIGS, BWD_DQ_CONFIGS_FP32,
    FP32_IEEE_CLASSES, BY_POINTERS, CAPPED,
    DROPOUT_MASK_CONFIG, TILE_MAP_CONFIG, MASK_BOOL, MASK_FLOAT, MASK_NONE, TRITON_VERSION, dkdv_outputs,
)

__all__ = ["compile_targets", "LOOP_GOALS"]

# pointer arguments holding q/k/v-dtype tensors; the rest have fixed types
_IO_POINTERS = {"Q", "K", "V", "Out", "DO", "DQ", "DK", "DV"}
_FIXED_TYPES = {"Lse": "*fp32", "Hi": "*fp32", "Delta": "*fp32", "R": "*fp32", "DMask": "*fp32", "Exact": "*i8",
                "KeyLengths": "*i32", "TileMap": "*i8", "Lists": "*i32",
                "Keep": "*u8", "scale": "fp32", "dropout_p": "fp32"}
# kernels whose main loop computes a (BLOCK_M, BLOCK_N) tile of scores: compile-check counts its
# SASS per score element
_LOOP_KERNELS = {"attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq"}
# the most SASS instructions per score element the main loop may take on sm_90 in 16-bit, per
# (kernel, head-dim class, weight): compile-check fails a target above its goal
# (the backward's goal, 19 per score for its two loops together, split between dK/dV and dQ)
# (on their TMA builds: the route sm_90's light launches take where the layout allows)
LOOP_GOALS = {("attention_fwd", 64, "light"): 8.5, ("attention_fwd", 128, "light"): 8.5,
              ("attention_bwd_dkdv", 64, "light"): 11.4, ("attention_bwd_dq", 64, "light"): 6.95,
              ("attention_bwd_dkdv", 128, "light"): 11.4, ("attention_bwd_dq", 128, "light"): 7.5}
_TRITON_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _compile_target(kernel, name: str, cfg: triton.Config, dclass: int | None, weight: str | None,
                    dtype: torch.dtype = torch.float16, matmul: bool = True, archs=None,
                    precision: str | None = None, list_tile: int | None = None, lists_max_head_dim: int = 0,
                    tma: bool = False, **extra) -> dict:
    """One compile-check target: ``kernel`` in ``cfg``, specialised for the worst case of its class.

    light: causal + key lengths; heavy: a float mask of the input dtype (contiguous last dim,
    which Triton's launcher specialises as the constant 1), its gradient, causal, key lengths
    and dropout; bool: a dense bool mask (contiguous last dim), causal, key lengths and
    dropout; dropout: dropout, causal and key lengths. Head dim = the class's largest (no padded lanes). fp32 builds use ``precision`` as tl.dot's
    input precision (default: 3xTF32, what fp32 launches use).
    ``tma``: the loop's tiles through tensor descriptors (kernels/attention.py, "Loads").
    """
    label = extra.pop("label", None)  # a name part of the config, not a constexpr
    if precision is None:
        precision = "tf32x3" if dtype == torch.float32 else "ieee"
    io = "*" + _TRITON_DTYPE[dtype]
    params = _runtime_params(kernel)
    constexprs = dict(cfg.kwargs, **extra)
    if dclass is not None:
        constexprs.update(HEAD_DIM=dclass, BLOCK_D=dclass)
    if weight is not None:
        heavy = weight == "heavy"
        mask_kind = {"heavy": MASK_FLOAT, "bool": MASK_BOOL}.get(weight, MASK_NONE)
        constexprs.update(DOT_FP32=False, INPUT_PRECISION=precision, MASK_KIND=mask_kind,
                          HAS_KEY_LENGTHS=True, IS_CAUSAL=True, HAS_DROPOUT=weight in ("heavy", "bool", "dropout"))
        if mask_kind != MASK_NONE:
            constexprs["stride_mask_n"] = 1
        if "MASK_GRAD" in kernel.arg_names:
            constexprs["MASK_GRAD"] = heavy
        if "LIST_TILE" in kernel.arg_names:
            constexprs["LIST_TILE"] = list_tile
        if "FOLD_SCALE" in kernel.arg_names:  # a positive scale
            constexprs["FOLD_SCALE"] = True
        if "TMA" in kernel.arg_names:
            constexprs["TMA"] = tma
        if "SOFTCAP" in kernel.arg_names:  # no cap unless the target asks for one
            constexprs.setdefault("SOFTCAP", 0.0)
        constexprs = {k: v for k, v in constexprs.items() if k in kernel.arg_names}
    signature = {
        p: io if p in _IO_POINTERS or p == "Mask" else _FIXED_TYPES.get(p, "i32")
        for p in params if p not in constexprs
    }
    if weight == "bool" and "Mask" in signature:  # read as uint8
        signature["Mask"] = "*u8"
    parts = [f"d{dclass}" if dclass else None, weight, label,
             "m{BLOCK_M}".format(**cfg.kwargs) if "BLOCK_M" in cfg.kwargs else None,
             "n{BLOCK_N}".format(**cfg.kwargs) if "BLOCK_N" in cfg.kwargs else None,
             f"w{cfg.num_warps}s{cfg.num_stages}", extra.get("OUTPUT") if extra.get("OUTPUT", "dkdv") != "dkdv"
             else None, _TRITON_DTYPE[dtype] if dtype != torch.float16 else None,
             precision if dtype == torch.float32 and precision != "tf32x3" else None]
    target = dict(
        kernel=name, fn=kernel, config="-".join(x for x in parts if x), signature=signature, constexprs=constexprs,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, matmul=matmul,
        divisible_by_16=[p for p in signature if p.startswith("stride_")],
    )
    if archs is not None:
        target["archs"] = list(archs)
    if name in _LOOP_KERNELS:
        target["loop_scores"] = cfg.kwargs["BLOCK_M"] * cfg.kwargs["BLOCK_N"]
        # with a dense mask, the forward's and dQ's loop over the listed tiles whose mask they read
        target["partial_loop"] = (name != "attention_bwd_dkdv" and constexprs.get("MASK_KIND", MASK_NONE) != MASK_NONE
                                  and dclass is not None and dclass <= lists_max_head_dim)
        goal = LOOP_GOALS.get((name, dclass, weight))
        # the goals are counts of Triton 3.9's SASS; older compilers' loops are reported, not held
        if (goal is not None and dtype != torch.float32 and archs is not None and "sm_90" in archs
                and TRITON_VERSION >= (3, 9) and (tma or "TMA" not in kernel.arg_names)):
            target["loop_goal"] = goal
    if matmul and _wgmma_rows(name, cfg) < 64:
        target["wgmma"] = False  # below wgmma's 64 rows: mma.sync on sm_90 too
    return target


def _feature_alone(target: dict, feature: str) -> dict:
    """A heavy forward target specialised for one feature alone ("bool" mask or "dropout"),
    or for none ("plain", the count the other two are compared with), so that compile-check
    counts that feature's own cost in the loop; built, not shipped apart."""
    c = dict(target["constexprs"], IS_CAUSAL=False, HAS_KEY_LENGTHS=False, HAS_DROPOUT=feature == "dropout",
             MASK_KIND=MASK_BOOL if feature == "bool" else MASK_NONE)
    signature = dict(target["signature"])
    if feature == "bool":
        signature["Mask"] = "*u8"
    else:  # no mask: its last stride is an ordinary integer
        c.pop("stride_mask_n")
        signature["stride_mask_n"] = "i32"
    return dict(target, config=f"{target['config']}-{feature}", constexprs=c, signature=signature,
                divisible_by_16=[p for p in signature if p.startswith("stride_")], partial_loop=feature == "bool")


def _with_bool_mask(target: dict) -> dict:
    """A heavy target's worst case with a dense bool mask in place of the float one: the path
    whose loops over listed partial tiles read the mask's bits; shipped in the same entries."""
    c = dict(target["constexprs"], MASK_KIND=MASK_BOOL)
    if "MASK_GRAD" in c:  # a bool mask has no gradient
        c["MASK_GRAD"] = False
    return dict(target, config=f"{target['config']}-boolmask", constexprs=c,
                signature=dict(target["signature"], Mask="*u8"))


def _with_softcap(target: dict) -> dict:
    """A target with its scores capped (SOFTCAP, Gemma 2's cap of 50): capped launches take the
    entries of the dropout weight and heavier (kernels/attention.py, _class_weight), whose
    worst case this is; their SASS is reported, not held to the loop goals."""
    return dict({k: v for k, v in target.items() if k != "loop_goal"}, config=f"{target['config']}-softcap",
                constexprs=dict(target["constexprs"], SOFTCAP=50.0, **(
                    {"FOLD_SCALE": False} if "FOLD_SCALE" in target["constexprs"] else {})))


def _runtime_params(kernel) -> list[str]:
    """The kernel's non-constexpr arguments (read from the source under the interpreter, whose
    functions carry no parsed parameters)."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return [p.name for p in params if not p.is_constexpr]
    signature = inspect.signature(kernel.fn)
    return [n for n, p in signature.parameters.items() if "constexpr" not in str(p.annotation)]


def _wgmma_rows(name: str, cfg: triton.Config) -> int:
    """The M dimension of a matmul kernel's dots: the key tile in the transposed dK/dV kernel,
    the query tile elsewhere. wgmma (sm_90) needs >= 64; smaller tiles run mma.sync."""
    return cfg.kwargs["BLOCK_N"] if name == "attention_bwd_dkdv" else cfg.kwargs["BLOCK_M"]


def compile_targets(*, fwd, dkdv, dq, dropout_mask, tile_map, tile_lists, list_tile: int,
                    lists_max_head_dim: int, dkdv_tma_max_head_dim: int) -> list[dict]:
    """Every kernel in every shipped GPU configuration, given the @triton.jit kernels of
    kernels/attention.py: the forward, dK/dV, dQ, dropout-mask, tile-map and tile-list ones;
    the tile lists' level on a GPU, the head dims up to which the kernels use them, and those
    up to which dK/dV loads through TMA."""
    targets = []
    for arch in ("sm_80", "sm_90"):
        for stage, kernel, name, table, table_fp32 in (
            ("fwd", fwd, "attention_fwd", FWD_CONFIGS, FWD_CONFIGS_FP32),
            ("dkdv", dkdv, "attention_bwd_dkdv", BWD_DKDV_CONFIGS, BWD_DKDV_CONFIGS_FP32),
            ("dq", dq, "attention_bwd_dq", BWD_DQ_CONFIGS, BWD_DQ_CONFIGS_FP32),
        ):
            def tma_route(dclass, weight, dtype):  # as attention._tma_layout, where the layout allows
                return (arch == "sm_90" and weight == "light" and dtype != torch.float32
                        and (stage != "dkdv" or dclass <= dkdv_tma_max_head_dim))

            def builds(cfgs, dclass, weight, dtype=torch.float16, precision=None, outputs=None, tma=None):
                outputs = outputs or (dkdv_outputs(dclass) if stage == "dkdv" else (None,))
                if tma is None:
                    tma = tma_route(dclass, weight, dtype)
                label = {"label": "cpasync"} if tma_route(dclass, weight, dtype) and not tma else {}
                return [_compile_target(kernel, name, c, dclass, weight, dtype, matmul=precision != "ieee",
                                        archs=[arch], precision=precision, list_tile=list_tile,
                                        lists_max_head_dim=lists_max_head_dim, tma=tma,
                                        **({"OUTPUT": out} if out else {}), **label)
                        for c in cfgs for out in outputs]

            for (dclass, weight), cfgs in table[arch].items():  # fp16: every entry, capped or not
                entry = builds(cfgs, dclass, weight)
                if tma_route(dclass, weight, torch.float16):  # and by pointer loads, where the layout rules TMA out
                    entry += builds(BY_POINTERS.get(stage, {}).get((dclass, weight), cfgs), dclass, weight, tma=False)
                targets += entry
                if weight != "light":
                    capped = CAPPED.get((stage, "16-bit", arch, (dclass, weight)))
                    targets += [_with_softcap(t) for t in (entry if capped is None else builds(capped, dclass, weight))]
            # bf16 lowers through the same tensor-core paths; one build per kernel proves it, and
            # every entry with a loop goal is held to it in bf16 too
            goals = [(d, w) for d, w in table[arch] if (name, d, w) in LOOP_GOALS and arch == "sm_90"]
            if (128, "light") not in goals:
                targets += builds(table[arch][(128, "light")][:1], 128, "light", torch.bfloat16)
            for dclass, weight in goals:
                targets += builds(table[arch][(dclass, weight)], dclass, weight, torch.bfloat16)
            if stage != "dkdv":  # a bool mask reads its bits where a float mask reads its values
                for (dclass, weight), cfgs in table[arch].items():
                    if weight == "heavy" and dclass <= lists_max_head_dim:
                        targets += [_with_bool_mask(t) for t in builds(cfgs, dclass, weight)]
            if stage == "fwd" and arch == "sm_90":  # the loop alone, with a dense mask alone, with dropout alone
                for dclass in (64, 128):
                    heavy = builds(table[arch][(dclass, "heavy")][:1], dclass, "heavy")[0]
                    targets += [_feature_alone(heavy, feature) for feature in ("plain", "bool", "dropout")]
            # fp32: every entry of its own tables, in the precision its class runs
            ieee = FP32_IEEE_CLASSES[stage][arch]
            for (dclass, weight), cfgs in table_fp32[arch].items():
                precision = "ieee" if (dclass, weight) in ieee else "tf32x3"
                targets += builds(cfgs, dclass, weight, torch.float32, precision)
                if weight != "light":
                    capped = CAPPED.get((stage, "fp32", arch, (dclass, weight)), cfgs)
                    targets += [_with_softcap(t) for t in builds(capped, dclass, weight, torch.float32, precision)]
            # single TF32 (allow_tf32) holds half the operand registers of 3xTF32 in the same
            # tiles; one build in the largest 3xTF32 class proves it lowers to tensor cores
            dclass, weight = max((k for k in table_fp32[arch] if k not in ieee), key=lambda k: (k[0], k[1] == "heavy"))
            first_output = (dkdv_outputs(dclass)[0],) if stage == "dkdv" else None
            targets += builds(table_fp32[arch][(dclass, weight)][:1], dclass, weight, torch.float32, "tf32",
                              first_output)
    targets.append(_compile_target(dropout_mask, "attention_dropout_mask", DROPOUT_MASK_CONFIG,
                                   None, None, matmul=False))
    for kind, dtype in ((MASK_BOOL, torch.float16), (MASK_FLOAT, torch.float32)):  # a float mask of fp32
        target = _compile_target(tile_map, "attention_tile_map", TILE_MAP_CONFIG, None, None, dtype, matmul=False,
                                 MASK_KIND=kind, label="bool" if kind == MASK_BOOL else "float")
        if kind == MASK_BOOL:  # read as uint8
            target["signature"]["Mask"] = "*u8"
        targets.append(target)
    for pack_bits in (False, True):  # a float mask's lists (the codes in Mask's place); a bool mask's, with its bits
        target = _compile_target(tile_lists, "attention_tile_lists", TILE_MAP_CONFIG, None, None, matmul=False,
                                 LIST_TILE=list_tile, PACK_BITS=pack_bits, stride_mask_n=1,
                                 label="bool" if pack_bits else "float")
        target["signature"]["Mask"] = "*u8" if pack_bits else "*i8"
        targets.append(target)
    return targets

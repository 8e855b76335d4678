"""Shared test utilities: the low-precision error rule, mask factories, the extension's device
check, one call of each norm op, the dropout oracle, and the differential tests' hypothesis
settings."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

from fasttrans import backends, reference

def skip_module_without_triton(op: str) -> None:
    """Skip the calling test module when Triton cannot be imported for ``op``'s backend."""
    why = backends.BACKENDS["triton"].unavailable_reason("cuda" if torch.cuda.is_available() else "cpu", op)
    if why is not None and "not importable" in why:
        pytest.skip(f"triton backend: {why}", allow_module_level=True)


# The devices a Triton kernel test runs on: the CPU through the interpreter (tests/conftest.py
# switches it on where there is no CUDA), CUDA where there is a device.
TRITON_DEVICES = [
    pytest.param("cpu", id="cpu", marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="Triton runs on CPU only through the interpreter (enabled when there is no CUDA)")),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device")]),
]


# Per-dtype floor added to the 2x rule: absolute error a correct kernel may always have.
FLOOR = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_close_lowp(name: str, out: torch.Tensor, ref: torch.Tensor, baseline: torch.Tensor | None, dtype=None):
    """flash-attention's rule: max|out - ref| <= 2 * max|baseline - ref| + floor.

    ``ref`` is computed in fp32 (fp64) from the same inputs; ``baseline`` is PyTorch in the
    same low precision as ``out`` (None for fp32/fp64, where the floor alone applies).
    """
    dtype = dtype or out.dtype
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    err = (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0
    base = (baseline.double() - ref.double()).abs().max().item() if baseline is not None and out.numel() else 0.0
    bound = 2 * base + FLOOR[dtype] * max(1.0, ref.abs().max().item() if ref.numel() else 1.0)
    assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e} (baseline error {base:.3e})"


MASK_KINDS = ("none", "bool", "float", "key_lengths", "causal", "all")


def mask_case(kind: str, B: int, Lq: int, Lk: int, dtype: torch.dtype = torch.float32):
    """(fasttrans.attention keywords, the bool allowed mask, the float bias or None) of one mask
    kind, for B = 2 sequences: "causal" (queries at the end of a cache), "bool" (the second
    sequence's third query sees no key), "float", "key_lengths" (the first sequence sees no
    key), or "none"."""
    g = torch.Generator().manual_seed(5)
    everything = torch.ones(Lq, Lk, dtype=torch.bool)
    if kind == "causal":
        return dict(is_causal=True, causal_offset=Lk - Lq), everything.tril(Lk - Lq), None
    if kind == "bool":
        allowed = torch.rand(B, 1, Lq, Lk, generator=g) < 0.6
        allowed[1, 0, 2] = False
        return dict(attn_mask=allowed), allowed, None
    if kind == "float":
        bias = torch.randn(B, 1, Lq, Lk, generator=g, dtype=dtype)
        return dict(attn_mask=bias), everything, bias
    if kind == "key_lengths":
        lengths = torch.tensor([0, 6])
        return dict(key_lengths=lengths), torch.arange(Lk).view(1, 1, 1, Lk) < lengths.view(B, 1, 1, 1), None
    return {}, everything, None


def make_key_lengths(B: int, Lk: int, device, *, zero: bool = False) -> torch.Tensor:
    """(B,) int lengths in [0, Lk], including Lk itself and (optionally) 0."""
    kl = torch.randint(0, Lk + 1, (B,), device=device)
    kl[0] = Lk
    if zero and B > 1:
        kl[1] = 0
    return kl


def cast_floating(x, dtype: torch.dtype):
    """x (a tensor, or a tuple or dict of them, other values passed through) with its
    floating-point tensors cast to dtype: inputs for a reference in higher precision."""
    if isinstance(x, dict):
        return {k: cast_floating(v, dtype) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(cast_floating(v, dtype) for v in x)
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def right_padded(lengths, total: int) -> torch.Tensor:
    """(N, total) bool key padding mask in torch.nn's convention (True = pad) of sequences of
    the given lengths, padded on the right."""
    return torch.arange(total)[None, :] >= torch.tensor(lengths)[:, None]


def make_bool_mask(shape, device, p_keep: float = 0.7) -> torch.Tensor:
    return torch.rand(shape, device=device) < p_keep


def make_float_mask(shape, device, dtype=torch.float32, neg_inf_frac: float = 0.1) -> torch.Tensor:
    m = torch.randn(shape, device=device, dtype=dtype)
    return m.masked_fill(torch.rand(shape, device=device) < neg_inf_frac, float("-inf"))


def huge_score_rows(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, fill):
    """(q, k, mask) for rows whose log-sum-exp is huge, where the backward's float32 lse loses
    log l: a finite ``fill`` (-1e9, finfo.min, -1e4) on every key of every third row, and on
    half the keys of the next rows (lse of order one there); or, for fill "logits", scores
    of a few hundred from q . k itself (|lse| > 256 on most rows), and for "logits_inexact"
    the same from unrounded inputs. mask is filled in place.

    For "logits", q holds integers below 2^11 and k multiples of 1/16 below 4, so every
    partial sum of q . k (D <= 64) is exact in float32 and TF32: the scores have the same
    bits in any tile shape, summation order or BLAS kernel, and the test checks the kernels'
    statistics, not how the machine's matmul rounds."""
    if fill == "logits_inexact":
        return q * 400, k, mask
    if fill == "logits":
        assert q.shape[-1] <= 64, "exact float32 scores need D <= 64"
        q = (q * 400).round().clamp(-2047, 2047)
        k = (k * 16).round().clamp(-63, 63) / 16
        return q, k, mask
    mask[:, :, ::3] = fill
    mask[:, :, 1::3, : mask.shape[-1] // 2] = fill
    return q, k, mask


def subnormal_weight_with_inf_value(Lq: int, Lk: int, dtype: torch.dtype, device="cpu"):
    """(q, k, v, the reference's output) of shape (1, 2, L, 8), for scale 1, where every
    query's weight on the last key is exp(-95) = 5.5e-42 in head 0 (below float32's smallest
    normal, 1.2e-38) and exp(-1e4) = 0 in head 1, and that key's value is inf in column 3.
    The reference gives inf there in head 0 (5.5e-42 * inf) and NaN in head 1 (0 * inf); the
    other columns are finite (asserted here)."""
    g = torch.Generator().manual_seed(Lq + Lk)
    q = torch.zeros(1, 2, Lq, 8)
    q[..., 0] = 1.0  # the score of key j is k[j, 0]
    k = torch.randn(1, 2, Lk, 8, generator=g)
    k[..., 0] = torch.rand(1, 2, Lk, generator=g)  # scores in [0, 1)
    k[:, 0, -1, 0] = -95.0
    k[:, 1, -1, 0] = -1e4
    v = torch.randn(1, 2, Lk, 8, generator=g)
    v[:, :, -1, 3] = math.inf
    q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    ref = reference.attention(q, k, v, scale=1.0)
    assert (ref[:, 0, :, 3] == math.inf).all() and ref[:, 1, :, 3].isnan().all()
    assert ref.isfinite()[..., [0, 1, 2, 4, 5, 6, 7]].all()
    return q, k, v, ref


def assert_compile_targets_well_formed(targets: list[dict], num_stages: int) -> None:
    """The compile-check protocol of a kernel module's compile_targets() (elementwise kernels:
    no matmul): every key, a type for each argument in order, unique configuration names."""
    for t in targets:
        assert set(t) >= {"kernel", "fn", "config", "signature", "constexprs", "num_warps", "num_stages", "matmul"}
        assert list(t["signature"]) == list(t["fn"].arg_names), t["config"]
        assert all(t["signature"][k] == "constexpr" for k in t["constexprs"]), t["config"]
        assert t["matmul"] is False and t["num_stages"] == num_stages
    assert len({(t["kernel"], t["config"]) for t in targets}) == len(targets), "duplicate configuration names"


def require_extension(device: str, op: str) -> None:
    """Skip when the device is CUDA and none is present; fail when the extension cannot run
    ``op`` on ``device`` (a broken build must not pass as a skip)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    why = backends.BACKENDS["extension"].unavailable_reason(device, op)
    if why is not None:
        pytest.fail(f"extension unavailable on {device}: {why}")


def norm_call(op: str, module, x, r, w, b, eps: float) -> tuple:
    """The outputs of one norm op as ``module`` computes it: ``fasttrans`` (whatever backend
    is in force) or ``fasttrans.reference``, which share the functional signatures."""
    N = x.shape[-1]
    if op == "layer_norm":
        return (module.layer_norm(x, (N,), w, b, eps),)
    if op == "add_layer_norm":
        return module.add_layer_norm(x, r, w, b, eps)
    return (module.rms_norm(x, (N,), w, eps),)


# --------------------------------------------------------------------------------------
# dropout: the op contract and the extension's generator (csrc/philox.h) in numpy
# --------------------------------------------------------------------------------------
FLAT_DOMAIN = 0x44524F50  # kFlatDomain in csrc/philox.h


def dropout_scale(p: float, dtype: torch.dtype) -> float:
    """1 / (1 - p) rounded to the accumulation dtype (fp64 for fp64, else fp32)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return torch.tensor(1.0 / (1.0 - p), dtype=acc).item()


def dropout_expected(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """The contract: x * keep * scale in the accumulation dtype, rounded once to x's dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(acc) * (keep.to(acc) * dropout_scale(p, x.dtype))).to(x.dtype)


def philox4x32_10(counter, seed: int) -> np.ndarray:
    """Philox4x32-10 (csrc/philox.h) in numpy: counter is four uint32 words or arrays of them
    (broadcast together), the key is (seed mod 2^32, seed div 2^32). Returns (..., 4) words."""
    m32 = np.uint64(0xFFFFFFFF)
    c0, c1, c2, c3 = np.broadcast_arrays(*(np.asarray(c, dtype=np.uint64) for c in counter))
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    for _ in range(10):
        p0, p1 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2  # exact: 32 x 32 bits
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & m32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & m32
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & m32, (k1 + np.uint64(0xBB67AE85)) & m32
    return np.stack([c0, c1, c2, c3], axis=-1)


def philox_words(seed: int, g: np.ndarray) -> np.ndarray:
    """(len(g), 4) uint32 words of flat_dropout_words(seed, g) (csrc/philox.h), in numpy."""
    g = np.asarray(g, dtype=np.uint64)
    return philox4x32_10((g & np.uint64(0xFFFFFFFF), g >> np.uint64(32), 0, FLAT_DOMAIN), seed)


def attention_keep(seed: int, p: float, B: int, H: int, Lq: int, Lk: int) -> torch.Tensor:
    """The attention dropout mask (csrc/philox.h), one score at a time: the counter (8 (i //
    16) + i % 8, h, b, 4 (j // 16) + j % 8 // 2), word 2 (i // 8 % 2) + j // 8 % 2, its 16-bit
    half j % 2, kept when >= min(round(p * 2**16), 2**16 - 1). (B, H, Lq, Lk) bool."""
    threshold = min(int(p * 2**16 + 0.5), 2**16 - 1)
    b, h, i, j = np.meshgrid(*(np.arange(n, dtype=np.uint64) for n in (B, H, Lq, Lk)), indexing="ij")
    u = np.uint64
    words = philox4x32_10((u(8) * (i // u(16)) + i % u(8), h, b, u(4) * (j // u(16)) + j % u(8) // u(2)), seed)
    index = (u(2) * (i // u(8) % u(2)) + j // u(8) % u(2)).astype(np.int64)
    word = np.take_along_axis(words, index[..., None], axis=-1)[..., 0]
    return torch.from_numpy(((word >> (u(16) * (j % u(2)))) & u(0xFFFF)) >= threshold)


def philox_keep(seed: int, p: float, numel: int, start: int = 0) -> torch.Tensor:
    """keep[i] for the flat indices start .. start + numel - 1: (word >> 8) >= round(p * 2**24)."""
    threshold = min(int(p * 2**24 + 0.5), 2**24)
    i = np.arange(start, start + numel, dtype=np.uint64)
    words = philox_words(seed, i >> np.uint64(2))[np.arange(numel), (i & np.uint64(3)).astype(np.int64)]
    return torch.from_numpy((words >> np.uint64(8)) >= threshold)


def fasttrans_ops_run(call) -> tuple:
    """call()'s result and the names of the fasttrans:: ops it ran (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = call()
    return result, {e.name for e in prof.events() if e.name.startswith("fasttrans::")}


def fuzz_settings(examples: int) -> settings:
    """Settings of the differential tests (test_nn_fuzz.py, test_convert_fuzz.py): CI's fixed,
    derandomized ``examples``, or FASTTRANS_FUZZ_EXAMPLES fresh ones for long runs."""
    common = dict(deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    long_run = os.environ.get("FASTTRANS_FUZZ_EXAMPLES")
    if long_run:
        return settings(max_examples=int(long_run), derandomize=False, **common)
    return settings(max_examples=examples, derandomize=True, **common)


def fresh_leaves(tensors, grads: bool) -> list:
    """The inputs, those that require grad as fresh leaves (identity between inputs and
    strides kept), the others detached."""
    seen = {}
    for x in tensors:
        if x is not None and id(x) not in seen:
            seen[id(x)] = x.detach().clone().requires_grad_() if grads and x.requires_grad else x.detach()
    return [None if x is None else seen[id(x)] for x in tensors]


def run_with_grads(mod, tensors, call, seed: int, grads: bool):
    """(outputs, gradients by name: inputs, then every parameter) of ``call(mod, *inputs)``
    and the backward of a random loss (its weights drawn in float64 from ``seed``, the same
    numbers for an output of any float dtype); no gradients when not ``grads``. Warnings are
    ignored (torch's mask-type and fast-path warnings; the grids test them)."""
    leaves = fresh_leaves(tensors, grads)
    with torch.set_grad_enabled(grads), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = call(mod, *leaves)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    if not grads:
        return outs, {}
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)).sum()
               for o in outs if o is not None)
    mod.zero_grad(set_to_none=True)
    loss.backward()
    named = {f"input {i}": x.grad for i, x in enumerate(leaves) if x is not None and x.requires_grad}
    named.update((n, p.grad) for n, p in mod.named_parameters())
    return outs, named


def perturb_parameters(mod, g: torch.Generator) -> None:
    """Every parameter of ``mod`` drawn from ``g``: LayerNorm/RMSNorm weights near 1, other
    matrices ~ 1/sqrt(fan_in), vectors ~ 0.5 N(0, 1)."""
    norms = (torch.nn.LayerNorm, torch.nn.RMSNorm)
    with torch.no_grad():
        for name, p in mod.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            if name.endswith("weight") and isinstance(mod.get_submodule(name.rpartition(".")[0]), norms):
                p.copy_(1 + 0.3 * noise)
            elif p.dim() == 2:
                p.copy_(noise / p.shape[1] ** 0.5)
            else:
                p.copy_(0.5 * noise)


TRANSFORMER_KINDS = ("encoder_layer", "decoder_layer", "encoder", "decoder", "transformer")


def transformer_module(lib, case: dict, final_norm, transformer_layers: int | None = None):
    """lib's (torch.nn or fasttrans.nn) module of kind case["kind"], one of TRANSFORMER_KINDS,
    in float64, from a drawn case's options (E, H, ff, dropout, activation, eps, batch_first,
    norm_first, bias, layers, enable_nested_tensor; final_norm for the stacks).
    ``transformer_layers``: encoder and decoder layers of a Transformer (case["layers"] if None)."""
    E, H, kind, n = case["E"], case["H"], case["kind"], case["layers"]
    layer = dict(dim_feedforward=case["ff"], dropout=case["dropout"], activation=case["activation"],
                 layer_norm_eps=case["eps"], batch_first=case["batch_first"], norm_first=case["norm_first"],
                 bias=case["bias"], dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "enable_nested_tensor is True, but ..."
        if kind == "encoder_layer":
            return lib.TransformerEncoderLayer(E, H, **layer)
        if kind == "decoder_layer":
            return lib.TransformerDecoderLayer(E, H, **layer)
        if kind == "encoder":
            return lib.TransformerEncoder(lib.TransformerEncoderLayer(E, H, **layer), n, final_norm,
                                          enable_nested_tensor=case["enable_nested_tensor"])
        if kind == "decoder":
            return lib.TransformerDecoder(lib.TransformerDecoderLayer(E, H, **layer), n, final_norm)
        if kind == "transformer":
            t = n if transformer_layers is None else transformer_layers
            return lib.Transformer(E, H, t, t, **layer)
    raise ValueError(f"kind: expected one of {TRANSFORMER_KINDS}, got {kind!r}")


def run_python(args: list[str], timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    """``python *args`` in a child process at the repository root, with this process's
    environment less fasttrans's settings (the extension cache kept, so that the child reuses
    its builds) plus ``env``; its output captured."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("FASTTRANS_") or k == "FASTTRANS_CACHE"}
    child_env.update(env)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=child_env, timeout=timeout,
                          cwd=Path(__file__).resolve().parents[1])


# The stand-in CUDA driver (benchmarks/standin_cuda.py): Triton's real launcher without a GPU,
# in a child process without the interpreter.
needs_c_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                      reason="the stand-in CUDA driver is built with a C compiler")


def run_through_standin_driver(code: str, timeout: int = 900) -> str:
    """Run ``code`` in a child process with the stand-in driver active and launch plans on;
    returns its output, failing the test with the child's output when it fails."""
    repo = Path(__file__).resolve().parents[1]
    preamble = "import sys\nsys.path[:] = [p for p in sys.path if p]\nsys.path.append(sys.argv[1])\nfrom benchmarks import standin_cuda\nstandin_cuda.activate()\n"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTTRANS_TRITON_PLANS")}
    proc = subprocess.run([sys.executable, "-c", preamble + code, str(repo)], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


# Inputs every stand-in child tests with: attention with grouped heads (fp32), each mask
# kind, and norm rows; ``grad_of(fn, *inputs)`` makes a call into a forward+backward.
STANDIN_INPUTS = """
def grad_of(fn, *inputs):
    return lambda: torch.autograd.grad(fn().float().sum(), inputs)


torch.manual_seed(0)
B, H, Hkv, L, D = 2, 4, 2, 37, 64
q = torch.randn(B, H, L, D, requires_grad=True)
k = torch.randn(B, Hkv, L + 3, D, requires_grad=True)
v = torch.randn(B, Hkv, L + 3, D, requires_grad=True)
bool_mask = torch.rand(B, 1, L, L + 3) < 0.7
float_mask = torch.randn(1, H, L, L + 3, requires_grad=True)
lengths = torch.tensor([L + 3, 5], dtype=torch.int32)
x = torch.randn(6, 1000, requires_grad=True)
r = torch.randn(6, 1000, requires_grad=True)
w = torch.randn(1000, requires_grad=True)
b = torch.randn(1000, requires_grad=True)
"""

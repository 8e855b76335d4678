"""Loops of fasttrans calls in a plain process do not page-fault their outputs back in.

glibc's malloc returns the top of its heap to the system when enough of it is free and maps
big blocks afresh, so an op whose large outputs are freed together can fault every page of
them again on the next call (docs/backends.md, "CPU output memory"). Each check runs in a
fresh child process with glibc's and torch's defaults, counts minor page faults
(``getrusage``) per call after warm-up at sizes of 16 MiB per tensor, and holds fasttrans's
count to torch's for the same work in the same process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fasttrans.extension as extension

REPO = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts glibc's page faults"),
    pytest.mark.skipif(extension.build_info().get("error") is not None, reason="the C++ extension does not build here"),
]

# Minor page faults per call of fn after warm-up; every child counts with this.
_FAULTS_PER_CALL = r"""
def faults_per_call(fn, warm=3, calls=6):
    for _ in range(warm):
        out = fn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        out = fn()  # the previous call's outputs are freed here, as in a user's loop
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls
"""

_CHILD = r"""
import json, resource, sys
import torch, torch.nn.functional as F
import fasttrans

torch.manual_seed(0)
torch.set_num_threads(1)

N, C = 4096, 1024                                           # 16 MiB per fp32 tensor
x, r = torch.randn(N, C), torch.randn(N, C)
w, b = torch.randn(C), torch.randn(C)
xg = x.clone().requires_grad_()
q, k, v = (torch.randn(8, 32, 128, 128) for _ in range(3))  # 16 MiB each
qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
lengths = torch.tensor([128, 96] * 4)

# the output gradients, allocated once: a fresh 16 MiB ones_like per call would be torch's
# allocation in both loops, and glibc's trimming of it would count against whichever loop
# happens to run when the heap shrinks
grad_outputs = {t.shape: t for t in (torch.ones(N, C), torch.ones(8, 32, 128, 128))}

def backward(out):
    out.backward(grad_outputs[out.shape])

def training_step(nn):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
    src = torch.randn(256, 256, 64)                         # 16 MiB activations
    pad = torch.zeros(256, 256, dtype=torch.bool)
    pad[:, 192:] = True
    def step():
        opt.zero_grad(set_to_none=True)
        layer(src, src_key_padding_mask=pad).square().mean().backward()
        opt.step()
    return step

CASES = {
    "add_layer_norm": (lambda: fasttrans.add_layer_norm(x, r, w, b),
                       lambda: (F.layer_norm(x + r, (C,), w, b), x + r)),
    "layer_norm": (lambda: fasttrans.layer_norm(x, (C,), w, b), lambda: F.layer_norm(x, (C,), w, b)),
    "layer_norm fwd+bwd": (lambda: backward(fasttrans.layer_norm(xg, (C,), w, b)),
                           lambda: backward(F.layer_norm(xg, (C,), w, b))),
    "attention": (lambda: fasttrans.attention(q, k, v, key_lengths=lengths),
                  lambda: F.scaled_dot_product_attention(q, k, v)),
    "attention fwd+bwd": (lambda: backward(fasttrans.attention(qg, kg, vg, key_lengths=lengths)),
                          lambda: backward(F.scaled_dot_product_attention(qg, kg, vg))),
    "training step": (training_step(fasttrans.nn), training_step(torch.nn)),
}

""" + _FAULTS_PER_CALL + r"""
with fasttrans.use_backend("extension"):
    result = {name: {"fasttrans": faults_per_call(ours), "torch": faults_per_call(theirs)}
              for name, (ours, theirs) in CASES.items()}
print(json.dumps(result))
"""

# Outputs the op computes without autograd fault nothing after warm-up; with autograd and in
# a training step torch's own allocations (gradients, linear layers) fault as they do in
# torch.nn, so those are held to twice torch's count. The allowance covers Python's and
# torch's small allocations (a few pages).
_NO_GRAD = ("add_layer_norm", "layer_norm", "attention")
_ALLOWANCE = 64


def _run_child(code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTTRANS_", "MALLOC_", "GLIBC_TUNABLES"))}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=600)


@pytest.mark.slow
def test_loops_fault_no_more_than_torch():
    proc = _run_child(_CHILD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) == {*_NO_GRAD, "layer_norm fwd+bwd", "attention fwd+bwd", "training step"}
    for name, counts in result.items():
        ours, theirs = counts["fasttrans"], counts["torch"]
        if name in _NO_GRAD:
            assert ours <= _ALLOWANCE, f"{name}: {ours:.0f} minor faults per call after warm-up (torch: {theirs:.0f})"
        assert ours <= 2 * theirs + _ALLOWANCE, f"{name}: {ours:.0f} minor faults per call, torch {theirs:.0f}"


# With a fixed mmap threshold (M_MMAP_THRESHOLD, here through GLIBC_TUNABLES) glibc maps and
# unmaps every block over it on each call, so any per-call working memory that does not come
# from the cache faults all its pages every call: here the attention forward's per-thread
# K^T copy of a head at long key lengths (1 MiB).
_LONG_KEYS_CHILD = r"""
import json, resource
import torch, torch.nn.functional as F
import fasttrans

torch.set_num_threads(1)
q = torch.randn(1, 4, 1024, 64)                          # a 1 MiB output, cached
k, v = (torch.randn(1, 4, 4096, 64) for _ in range(2))
""" + _FAULTS_PER_CALL + r"""
with fasttrans.use_backend("extension"):
    ours = faults_per_call(lambda: fasttrans.attention(q, k, v))
theirs = faults_per_call(lambda: F.scaled_dot_product_attention(q, k, v))
print(json.dumps({"fasttrans": ours, "torch": theirs}))
"""


def test_long_key_working_memory_is_not_faulted_in_per_call():
    proc = _run_child(_LONG_KEYS_CHILD, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["fasttrans"] <= _ALLOWANCE, f"{counts['fasttrans']:.0f} minor faults per call (torch: {counts['torch']:.0f})"


_CACHE_CHILD = r"""
import json, torch
import fasttrans, fasttrans.extension as ext

x, r = torch.randn(4096, 1024), torch.randn(4096, 1024)
small = torch.randn(8, 1024)
info = []
with fasttrans.use_backend("extension"):
    y = fasttrans.layer_norm(x, (1024,)); info.append(ext.cpu_cache_info())
    expected = torch.nn.functional.layer_norm(x, (1024,))
    del y; info.append(ext.cpu_cache_info())
    y = fasttrans.layer_norm(x, (1024,)); info.append(ext.cpu_cache_info())
    reused_ok = bool(torch.allclose(y, expected, atol=1e-5, rtol=1e-5))
    del y
    h = fasttrans.add_layer_norm(x, r); del h; info.append(ext.cpu_cache_info())
    fasttrans.layer_norm(small, (1024,)); info.append(ext.cpu_cache_info())
    ext.cpu_cache_clear(); info.append(ext.cpu_cache_info())
print(json.dumps({"info": info, "reused_ok": reused_ok}))
"""


def _cache_run(limit_mb: str) -> dict:
    proc = _run_child(_CACHE_CHILD, {"FASTTRANS_CPU_CACHE_MB": limit_mb})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


MiB16 = 16 << 20


def test_freed_outputs_are_reused_within_the_limit():
    out = _cache_run("40")
    first, freed, again, pair, small, cleared = out["info"]
    assert first["limit_bytes"] == 40 << 20
    assert (first["misses"], first["hits"], first["in_use_bytes"], first["cached_bytes"]) == (1, 0, MiB16, 0)
    assert (freed["cached_blocks"], freed["cached_bytes"], freed["in_use_bytes"]) == (1, MiB16, 0)
    assert (again["hits"], again["misses"], again["cached_blocks"]) == (1, 1, 0)
    assert out["reused_ok"]
    # add_layer_norm: one output reuses the cached block, the other is new; both come back
    # and fit the 40 MiB limit
    assert (pair["hits"], pair["misses"], pair["cached_blocks"]) == (2, 2, 2)
    assert small == pair, "an output under 1 MiB must not touch the cache"
    assert (cleared["cached_blocks"], cleared["cached_bytes"], cleared["in_use_bytes"]) == (0, 0, 0)


def test_the_oldest_block_leaves_first_at_the_limit():
    pair = _cache_run("20")["info"][3]
    assert (pair["cached_blocks"], pair["cached_bytes"]) == (1, MiB16)


def test_a_zero_limit_turns_the_cache_off():
    for info in _cache_run("0")["info"]:
        assert (info["hits"], info["misses"], info["cached_bytes"], info["in_use_bytes"]) == (0, 0, 0, 0)


def test_a_bad_limit_is_refused_by_name():
    proc = _run_child(_CACHE_CHILD, {"FASTTRANS_CPU_CACHE_MB": "lots"})
    assert proc.returncode != 0
    assert "FASTTRANS_CPU_CACHE_MB" in proc.stderr and "'lots'" in proc.stderr, proc.stderr[-2000:]


# A reused block holds whatever its last tensor held: every output element must be written.
# Each case runs twice in this process; the first run's outputs are filled with NaN and freed
# (so the cache holds NaN blocks of exactly the sizes the second run asks for), and the second
# run must reproduce the first run's values.
def _attention_case():
    import fasttrans

    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 8, 128, 128, generator=g)  # 2 MiB per tensor
    k, v = (torch.randn(4, 4, 128, 128, generator=g) for _ in range(2))  # grouped-query heads
    bias = torch.randn(4, 8, 128, 128, generator=g)
    lengths = torch.tensor([128, 0, 77, 128])  # a sequence with no key at all
    dout = torch.randn(4, 8, 128, 128, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out = fasttrans.attention(*leaves[:3], attn_mask=leaves[3], key_lengths=lengths, is_causal=True)
    return (out, *torch.autograd.grad(out, leaves, dout))


def _norm_case(op):
    import fasttrans

    g = torch.Generator().manual_seed(1)
    x, r, dy, dh = (torch.randn(1024, 512, generator=g) for _ in range(4))  # 2 MiB per tensor
    w, b = torch.randn(512, generator=g), torch.randn(512, generator=g)
    xg, rg = x.clone().requires_grad_(), r.clone().requires_grad_()
    if op == "add_layer_norm":
        y, h = fasttrans.add_layer_norm(xg, rg, w, b)
        return (y, h, *torch.autograd.grad((y, h), (xg, rg), (dy, dh)))
    y = fasttrans.rms_norm(xg, (512,), w) if op == "rms_norm" else fasttrans.layer_norm(xg, (512,), w, b)
    return (y, *torch.autograd.grad(y, (xg,), dy))


def _dropout_case():
    import fasttrans

    x = torch.randn(1024, 512, generator=torch.Generator().manual_seed(2), requires_grad=True)
    torch.manual_seed(3)
    y = fasttrans.functional.dropout(x, 0.3)
    return (y, *torch.autograd.grad(y, (x,), torch.ones_like(y)))


@pytest.mark.parametrize("case", ["attention", "layer_norm", "add_layer_norm", "rms_norm", "dropout"])
def test_reused_blocks_are_overwritten_everywhere(case):
    import fasttrans

    run = {"attention": _attention_case, "dropout": _dropout_case}.get(case, lambda: _norm_case(case))
    with fasttrans.use_backend("extension"):
        first = run()
        want = [t.detach().clone() for t in first]
        for t in first:
            t.detach().fill_(float("nan"))
        hits = extension.cpu_cache_info()["hits"]
        del first
        again = run()
        assert extension.cpu_cache_info()["hits"] > hits, "the second run did not reuse the poisoned blocks"
    for i, (got, expected) in enumerate(zip(again, want)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True, msg=f"{case}: output {i}")
        assert not got.isnan().any(), f"{case}: output {i} kept NaN from a reused block"

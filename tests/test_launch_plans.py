"""Launch plans (kernels/_launch.py) pass the kernels what Triton's own launch passes them.

A plan replays a compiled kernel's C launcher with the argument list it built once; a plan
that put one argument in the wrong place, or kept a stale constexpr, would launch the right
binary on the wrong data. No GPU runs here, so each check launches through the stand-in CUDA
driver (benchmarks/standin_cuda.py) in a child process without the interpreter, records what
reaches Triton's C launcher, and holds the planned launches of a call to those of the same
call through the public ``kernel[grid](...)`` route: the same kernels, grids, metadata and
arguments, for every op and mask kind.
"""

import os
import re

import pytest

from helpers import STANDIN_INPUTS, needs_c_compiler, run_through_standin_driver

pytestmark = needs_c_compiler

_CHILD = r"""
import torch
import triton
from triton.backends.nvidia import driver as nvidia
import fasttrans
from fasttrans.kernels import _launch as launch
from fasttrans.kernels import attention as kernels_attention

assert launch.plans_enabled()
launches = []
# What reaches Triton's C launch function, recorded by wrapping it in every launcher Triton
# makes: plans call it directly (kernels/_launch.py), the public route through
# CudaLauncher.__call__. The launch metadata and hooks are left out: the public route always
# passes Triton's (empty) hook chains, plans pass None while no hook is installed.
minor = ".".join(triton.__version__.split(".")[:2])
unhooked = (10, 11, 12) if minor == "3.6" else (8, 9, 10)  # launch metadata and the two hooks
real_init = nvidia.CudaLauncher.__init__


def describe(a):
    if isinstance(a, torch.Tensor):  # fresh outputs differ in address from call to call
        return ("tensor", a.dtype, tuple(a.shape), a.stride(), a.data_ptr() % 16 == 0)
    if isinstance(a, tuple):
        return tuple(describe(x) for x in a)
    return a


def recording_init(self, *args, **kwargs):
    real_init(self, *args, **kwargs)
    c_launch = self.launch

    def launch(*args):
        launches.append((id(self), tuple(describe(a) for i, a in enumerate(args) if i not in unhooked)))
        return c_launch(*args)

    self.launch = launch


nvidia.CudaLauncher.__init__ = recording_init


def record(call):
    launches.clear()
    call()
    return list(launches)


""" + STANDIN_INPUTS + r"""qh, kh, vh = (t.detach().half().requires_grad_() for t in (q, k, v))
wide = torch.randn(3, 20000, requires_grad=True)
# fp16 parameters: their gradients always take the stage-2 launch (kernels/layernorm.py)
wide_h, wide_w, wide_b = (torch.randn(*shape).half().requires_grad_() for shape in ((3, 20000), (20000,), (20000,)))
# x's shape and strides at an address 4 bytes past alignment: bound launches are keyed by it
q_shifted = torch.randn(q.numel() + 1)[1:].view(q.shape).requires_grad_()
cache = torch.randn(B, Hkv, 64, D)
shifted = torch.randn(6 * 1000 + 1)[1:].view(6, 1000).requires_grad_()

cases = {
    "attention": grad_of(lambda: fasttrans.attention(q, k, v), q, k, v),
    "attention fp16 causal": grad_of(lambda: fasttrans.attention(qh, kh, vh, is_causal=True), qh, kh, vh),
    "attention bool mask": grad_of(lambda: fasttrans.attention(q, k, v, attn_mask=bool_mask), q, k, v),
    "attention float mask": grad_of(lambda: fasttrans.attention(q, k, v, attn_mask=float_mask), q, float_mask),
    "attention key lengths": grad_of(lambda: fasttrans.attention(q, k, v, key_lengths=lengths), q, k, v),
    "attention dropout": grad_of(lambda: fasttrans.attention(q, k, v, dropout_p=0.25), q, k, v),
    "attention strided q": grad_of(lambda: fasttrans.attention(q.transpose(1, 2).contiguous().transpose(1, 2),
                                                               k, v), q, k, v),
    "attention unaligned q": grad_of(lambda: fasttrans.attention(q_shifted, k, v), q_shifted, k, v),
    # the seed is an integer argument Triton specialises (divisible by 16, equal to 1)
    "attention seed classes": lambda: [kernels_attention.attention_fwd(q, k, v, None, None, False, 0, 0.25, 0.125, s)
                                       for s in (16, 17, 1, 48)],
    # decoding over a growing key/value cache: one site for every length, each launch with
    # its own length and offset (their integer classes and the tuning bucket keyed)
    "attention growing cache": lambda: [
        kernels_attention.attention_fwd(q[:, :, :1], cache[:, :, :n], cache[:, :, :n], None, None, True, n - 1, 0.0,
                                        0.125, 0)
        for n in (1, 2, 15, 16, 17, 31, 32, 33, 48)],
    "layer_norm": grad_of(lambda: fasttrans.layer_norm(x, 1000, w, b), x, w, b),
    "add_layer_norm": grad_of(lambda: fasttrans.add_layer_norm(x, r, w, b)[1], x, r, w),
    "rms_norm": grad_of(lambda: fasttrans.rms_norm(x, 1000, w), x, w),
    "layer_norm split rows": grad_of(lambda: fasttrans.layer_norm(wide, 20000), wide),
    "layer_norm split rows fp16": grad_of(lambda: fasttrans.layer_norm(wide_h, 20000, wide_w, wide_b),
                                          wide_h, wide_w, wide_b),
    "layer_norm unaligned rows": grad_of(lambda: fasttrans.layer_norm(x[:, 1:], 999, w[1:], b[1:]), x, w),
    "layer_norm unaligned base": grad_of(lambda: fasttrans.layer_norm(shifted, 1000, w, b), shifted, w, b),
    "dropout": grad_of(lambda: fasttrans.functional.dropout(x, 0.3), x),
}
with fasttrans.use_backend("triton"):
    for name, call in cases.items():
        call()  # compiles, tunes (the stand-in times every configuration alike) and plans
        torch.manual_seed(1)
        planned = record(call)
        launch._PLANS = False  # the public route, kernel[grid](...), for the same call
        try:
            torch.manual_seed(1)
            public = record(call)
        finally:
            launch._PLANS = True
        assert public, name
        assert len(planned) == len(public), (name, len(public), len(planned))
        for i, (a, p) in enumerate(zip(public, planned)):
            assert a == p, f"{name}: launch {i} differs:\n public  {a}\n planned {p}"
        # the global scratch argument: the fp16 forward, dQ and dK/dV (sm_90 here, rows of 128
        # bytes) make tensor descriptors, whose scratch the plan allocates as Triton's launcher does
        scratch = [p[1][7 if minor == "3.6" else 8] for p in planned]
        with_scratch = 3 if name == "attention fp16 causal" else 0
        assert all(s is not None and s[0] == "tensor" for s in scratch[:with_scratch]), (name, scratch)
        assert all(s is None for s in scratch[with_scratch:]), (name, scratch)
        print(f"{name}: {len(public)} launches agree")
"""


@pytest.mark.slow(minutes=2)
def test_planned_launches_match_tritons_own():
    stdout = run_through_standin_driver(_CHILD)
    assert stdout.count("launches agree") == 18, stdout
    # each norm's forward and backward, with parameter gradients, in at most three launches
    launches = {name: int(n) for name, n in re.findall(r"^(.+): (\d+) launches agree$", stdout, re.M)}
    for name in ("layer_norm", "add_layer_norm", "rms_norm", "layer_norm split rows fp16"):
        assert launches[name] <= 3, (name, launches[name])


def test_plans_are_off_under_the_interpreter():
    from fasttrans.kernels import _launch as launch

    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert not launch.plans_enabled()

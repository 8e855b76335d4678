"""The Triton path reads no tensor value on the host, so on a GPU it never synchronises.

On a GPU a host read of a device value (``.item()``, ``.tolist()``, ``bool(t)``, ...) waits for
every queued kernel. The GPU suite checks whole calls under
``torch.cuda.set_sync_debug_mode("error")`` (tests/test_attention_triton.py,
tests/test_nn_transformer.py). Without a GPU the same code runs through the stand-in CUDA
driver (benchmarks/standin_cuda.py) on CPU tensors; this test makes every way of reading a
tensor's value raise there, and every copy of host data to a device by torch.tensor, and
runs each op's forward and backward on the Triton path, first
calls (compile, tune, bind) and bound calls alike. Key lengths are passed to the kernels
directly: the public op checks lengths that live on the host, which costs no synchronisation
(docs/semantics.md); dropout seeds are drawn from torch's CPU generator, a host value too.
"""

from helpers import STANDIN_INPUTS, needs_c_compiler, run_through_standin_driver

pytestmark = needs_c_compiler

_CHILD = r"""
import torch
import fasttrans
from fasttrans.kernels import attention as kernels_attention


class HostRead(RuntimeError):
    pass


def refuse(name):
    def read(self, *args, **kwargs):
        raise HostRead(f"Tensor.{name} read a tensor's value on the host")
    return read


READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__array__")
saved = {name: getattr(torch.Tensor, name) for name in READS}


""" + STANDIN_INPUTS + r"""qd, kd, vd = q.detach(), k.detach(), v.detach()


def kernel_key_lengths():
    out, lse = kernels_attention.attention_fwd(qd, kd, vd, None, lengths, True, 3, 0.0, 0.125, 0)
    kernels_attention.attention_bwd(torch.ones_like(out), qd, kd, vd, out, lse, None, lengths, True, 3, 0.0, 0.125,
                                    0, False)


cases = {
    "attention": grad_of(lambda: fasttrans.attention(q, k, v), q, k, v),
    "attention causal": grad_of(lambda: fasttrans.attention(q, k, v, is_causal=True), q, k, v),
    "attention bool mask": grad_of(lambda: fasttrans.attention(q, k, v, attn_mask=bool_mask), q, k, v),
    "attention float mask": grad_of(lambda: fasttrans.attention(q, k, v, attn_mask=float_mask), q, float_mask),
    "attention dropout": grad_of(lambda: fasttrans.attention(q, k, v, dropout_p=0.25), q, k, v),
    "attention kernels, key lengths": kernel_key_lengths,
    "layer_norm": grad_of(lambda: fasttrans.layer_norm(x, 1000, w, b), x, w, b),
    "add_layer_norm": grad_of(lambda: fasttrans.add_layer_norm(x, r, w, b)[1], x, r, w),
    "rms_norm": grad_of(lambda: fasttrans.rms_norm(x, 1000, w), x, w),
    "layer_norm without grad": lambda: fasttrans.layer_norm(x.detach(), 1000, w.detach(), b.detach()),
    "dropout": grad_of(lambda: fasttrans.functional.dropout(x, 0.3), x),
}
# torch.tensor(data, device=...) copies host data to the device, which waits for it on a GPU
saved_tensor = torch.tensor


def tensor_on_device(data, *args, **kwargs):
    if kwargs.get("device") is not None:
        raise HostRead("torch.tensor copied host data to a device")
    return saved_tensor(data, *args, **kwargs)


def refusing():
    for name in READS:
        setattr(torch.Tensor, name, refuse(name))
    torch.tensor = tensor_on_device


def allowing():
    for name, method in saved.items():
        setattr(torch.Tensor, name, method)
    torch.tensor = saved_tensor


# A dropout seed is drawn from torch's CPU generator, a value that lives on the host whatever
# the device: its read is allowed.
draw_seed = fasttrans.functional._draw_seed


def draw_seed_on_host(p):
    allowing()
    try:
        return draw_seed(p)
    finally:
        refusing()


fasttrans.functional._draw_seed = draw_seed_on_host
# the check is live: a read raises
refusing()
try:
    torch.ones(1).item()
    raise AssertionError("Tensor.item did not raise")
except HostRead:
    pass
try:
    torch.tensor([1], device="cpu")
    raise AssertionError("torch.tensor(device=...) did not raise")
except HostRead:
    pass
with fasttrans.use_backend("triton"):
    for name, call in cases.items():
        call()  # the site's first call: compile, tune, bind
        call()  # a bound call
        print(f"{name}: no host read")
allowing()
"""


def test_triton_path_reads_no_tensor_value():
    stdout = run_through_standin_driver(_CHILD)
    assert stdout.count("no host read") == 11, stdout

"""The CUDA kernels of csrc/*.cu, run on the host: every CUDA thread an std::thread.

Without a GPU the CUDA fallback would otherwise only be compiled (test_csrc_nvcc.py). Here
the kernel code of each .cu file (everything before its launchers, which need nvcc's
``<<<>>>``) is compiled with the host compiler and AddressSanitizer against
``tests/cuda_emulation/shim.h``, which provides threadIdx/blockIdx, __syncthreads, the warp
shuffles and shared memory, and run by a harness that launches the kernels as the
launchers do and checks every output against a double-precision reference. This tests the
kernels' logic (indexing, strides, masking, reductions across warps, barriers, NaN
handling, Philox masks, fp16/bf16 loads and stores) and their memory accesses; not their
speed, and not the GPU's memory model. The harnesses run fp32, bf16 and fp16.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fasttrans.extension import source_dir

HERE = Path(__file__).parent / "cuda_emulation"
# Kernel text ends where the launchers begin; the launchers' first function:
LAUNCHERS = re.compile(r"^const char\* last_error\(\) \{$", re.MULTILINE)
# Shared-memory declarations -> the emulated block's buffer (count: how often each must occur)
SHARED = {
    "attention_cuda.cu": [("  extern __shared__ float smem[];", "  float* smem = t_smem;", 3)],
    "layernorm_cuda.cu": [("  __shared__ float red[kWarps];", "  float* red = t_smem;", 2)],
    "dropout_cuda.cu": [],
}


def kernel_text(name: str) -> str:
    """The kernels of csrc/<name>, with shared memory pointed at the emulated block's buffer."""
    text = (source_dir() / name).read_text()
    m = LAUNCHERS.search(text)
    assert m, f"{name}: no launcher section (a line 'const char* last_error() {{') to cut at"
    text = text[: m.start()]
    for old, new, count in SHARED[name]:
        assert text.count(old) == count, f"{name}: expected {count} x {old.strip()!r}, found {text.count(old)}"
        text = text.replace(old, new)
    # the cut leaves fasttrans::cuda_kernels and its anonymous namespace open
    return text + "}  // namespace\n}  // namespace fasttrans::cuda_kernels\n"


def _compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """build(harness) -> path of the compiled harness (tests/cuda_emulation/<harness>.cpp)."""
    cxx = _compiler()
    if cxx is None:
        pytest.skip("no C++ compiler (g++ or c++) on PATH")
    out = tmp_path_factory.mktemp("cuda_emulation")
    for name in SHARED:  # attention_cuda.cu -> attention_kernels.h, which the harnesses include
        (out / name.replace("_cuda.cu", "_kernels.h")).write_text(kernel_text(name))

    def compile_harness(harness: str) -> Path:
        exe = out / harness
        cmd = [cxx, "-std=c++20", "-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer", "-pthread",
               "-I", str(out), "-I", str(HERE), "-I", str(source_dir()), str(HERE / f"{harness}.cpp"), "-o", str(exe)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}{r.stderr}"
        return exe

    return compile_harness


def _run(exe: Path, timeout: float) -> str:
    # ASan aborts on any out-of-bounds access of the host arrays the kernels are given
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=timeout,
                       env={"ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0"})
    assert r.returncode == 0, f"{exe.name} failed (exit {r.returncode}):\n{r.stdout}{r.stderr}"
    return r.stdout


def test_kernel_text_is_cut_before_the_launchers():
    for name in SHARED:
        text = kernel_text(name)
        assert "<<<" not in text and "last_error" not in text, name
        assert "__global__" in text, name


def test_layernorm_kernels(build):
    out = _run(build("layernorm"), timeout=300)
    assert out.rstrip().endswith("0 bad"), out


def test_attention_kernels(build):
    out = _run(build("attention"), timeout=600)
    assert out.rstrip().endswith("0 bad configs"), out


def test_dropout_kernels(build):
    out = _run(build("dropout"), timeout=120)
    assert out.rstrip().endswith("\n0 bad"), out


def test_attention_dropout_mask_kernel(build):
    out = _run(build("attention_dropout_mask"), timeout=120)
    assert out.rstrip() == "mismatches 0", out

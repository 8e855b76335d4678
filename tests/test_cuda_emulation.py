"""The CUDA kernels of csrc/*.cu, run on the host: every CUDA thread a fiber.

Without a GPU the CUDA fallback would otherwise only be compiled (test_csrc_nvcc.py). Here
each .cu file, kernels and launchers, is compiled with the host compiler and
AddressSanitizer against ``tests/cuda_emulation/shim.h``, which provides threadIdx/blockIdx,
__syncthreads, the warp shuffles, shared memory and the few CUDA runtime calls the
launchers make. The threads of a block are fibers that one OS thread switches round-robin
at their barriers, so the run does not depend on how the OS schedules a hundred threads on a
busy machine; a barrier that can never complete aborts with a message instead of hanging. nvcc's ``kernel<<<grid, block, smem, stream>>>(args)`` is rewritten
into a call of the shim's ``launch``. A harness per file calls the launchers of
csrc/cuda_launchers.h (the dropout harness also the kernels directly, on grids small enough
for their grid-stride loops) and checks every output against a double-precision
reference. This tests the launchers' grids and shared-memory sizes and the kernels' logic (indexing, strides, masking, reductions across warps, barriers, NaN
handling, Philox masks, soft-capped scores, fp16/bf16 loads and stores) and their memory accesses; not their
speed, and not the GPU's memory model. The harnesses run fp32, bf16 and fp16.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fasttrans.extension import source_dir

HERE = Path(__file__).parent / "cuda_emulation"
SOURCES = ("attention_cuda.cu", "layernorm_cuda.cu", "dropout_cuda.cu")
# Dynamic shared memory -> the emulated block's buffer (static __shared__ arrays are the
# shim's `static`): how often each file declares it
DYNAMIC_SMEM = ("  extern __shared__ float smem[];", "  float* smem = t_smem;")
DYNAMIC_SMEM_COUNT = {"attention_cuda.cu": 3, "layernorm_cuda.cu": 0, "dropout_cuda.cu": 0}
LAUNCH = re.compile(r"\b([A-Za-z_]\w*(?:<[^<>;]*>)?)<<<")


def _close(text: str, i: int) -> int:
    """Index of the parenthesis closing the one at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        depth += {"(": 1, ")": -1}.get(text[j], 0)
        if depth == 0:
            return j
    raise AssertionError(f"unbalanced parenthesis at {text[i:i + 60]!r}")


def _split_top_level(config: str) -> list[str]:
    """The comma-separated parts of a launch configuration, commas inside parentheses kept."""
    parts, depth, start = [], 0, 0
    for j, ch in enumerate(config):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(config[start:j].strip())
            start = j + 1
    return parts + [config[start:].strip()]


def rewrite_launches(text: str) -> tuple[str, int]:
    """kernel<<<grid, block, smem, stream>>>(args) -> launch(dim3(grid), block, smem, [&] { kernel(args); }),
    and the number of launches rewritten."""
    out, pos, n = [], 0, 0
    for m in LAUNCH.finditer(text):
        config_end = text.index(">>>", m.end())
        grid, block, smem, _stream = _split_top_level(text[m.end():config_end])
        args_open = config_end + 3
        assert text[args_open] == "(", f"expected the kernel's arguments after >>> at {text[m.start():args_open]!r}"
        args_close = _close(text, args_open)
        out += [text[pos:m.start()],
                f"launch(dim3({grid}), {block}, {smem}, [&] {{ {m.group(1)}{text[args_open:args_close + 1]}; }})"]
        pos, n = args_close + 1, n + 1
    return "".join(out) + text[pos:], n


def host_source(name: str) -> str:
    """csrc/<name>, kernels and launchers, as C++ for the host emulation of shim.h."""
    text = (source_dir() / name).read_text()
    old, new = DYNAMIC_SMEM
    count = DYNAMIC_SMEM_COUNT[name]
    assert text.count(old) == count, f"{name}: expected {count} x {old.strip()!r}, found {text.count(old)}"
    text, launches = rewrite_launches(text.replace(old, new))
    assert launches > 0 and "<<<" not in text, f"{name}: kernel launches left unrewritten"
    return text


def _compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """build(harness) -> path of the compiled harness (tests/cuda_emulation/<harness>.cpp)."""
    cxx = _compiler()
    if cxx is None:
        pytest.skip("no C++ compiler (g++ or c++) on PATH")
    out = tmp_path_factory.mktemp("cuda_emulation")
    for name in SOURCES:  # attention_cuda.cu -> attention_cuda.h, which the harnesses include
        (out / name.replace(".cu", ".h")).write_text(host_source(name))

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


def test_launches_are_rewritten_for_the_host():
    text, n = rewrite_launches("  k<T, true><<<dim3(a, f(b, c)), kThreads, smem, stream>>>(x, g(y, z));\n")
    assert n == 1
    assert text == "  launch(dim3(dim3(a, f(b, c))), kThreads, smem, [&] { k<T, true>(x, g(y, z)); });\n"
    for name in SOURCES:
        assert "launch(dim3(" in host_source(name), name


@pytest.mark.slow
def test_layernorm_kernels(build):
    out = _run(build("layernorm"), timeout=300)
    assert out.rstrip().endswith("0 bad"), out


@pytest.mark.slow(minutes=0.5)
def test_attention_kernels(build):
    out = _run(build("attention"), timeout=600)
    assert out.rstrip().endswith("0 bad configs"), out


def test_dropout_kernels(build):
    out = _run(build("dropout"), timeout=120)
    assert out.rstrip().endswith("\n0 bad"), out


def test_attention_dropout_mask_kernel(build):
    out = _run(build("attention_dropout_mask"), timeout=120)
    assert out.rstrip() == "mismatches 0", out

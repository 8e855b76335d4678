"""Every CUDA kernel source compiles with plain nvcc for sm_80 and sm_90 and spills nothing.

The .cu files include only CUDA headers (no torch), so this runs on any machine with nvcc,
GPU or not. ``-Xptxas -v`` reports, per kernel and architecture, its stack frame and its
spill stores/loads; every kernel must report zero spills. The files compile in parallel
(the attention file has ~40 kernel instantiations per architecture).
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fasttrans.extension import source_dir

ARCHS = (80, 90)
SOURCES = sorted(p.name for p in source_dir().glob("*.cu"))
ENTRY = re.compile(r"Compiling entry function '(\S+)' for 'sm_(\d+)'")
USAGE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _nvcc() -> str | None:
    candidates = [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    if os.environ.get("CUDA_HOME"):
        candidates.insert(0, os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    return next((c for c in candidates if c and os.path.exists(c)), None)


def parse_ptxas(text: str) -> dict[tuple[str, int], tuple[int, int, int]]:
    """{(kernel, arch): (stack frame, spill stores, spill loads)} from ``-Xptxas -v`` output."""
    usage = {}
    entry = None
    for line in text.splitlines():
        m = ENTRY.search(line)
        if m:
            entry = (m.group(1), int(m.group(2)))
            continue
        m = USAGE.search(line)
        if m and entry is not None:
            usage[entry] = tuple(int(g) for g in m.groups())
            entry = None
    return usage


@pytest.fixture(scope="module")
def ptxas_reports(tmp_path_factory):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (not on PATH, not in $CUDA_HOME/bin or /usr/local/cuda/bin)")
    out_dir = tmp_path_factory.mktemp("nvcc")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    procs = {
        name: subprocess.Popen(
            [nvcc, "-std=c++17", "-O3", *gencode, "-Xptxas", "-v", "-I", str(source_dir()), "-c",
             str(source_dir() / name), "-o", str(out_dir / (name + ".o"))],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for name in SOURCES
    }
    return {name: (p.wait(timeout=900), p.stdout.read()) for name, p in procs.items()}


def test_there_are_cuda_sources():
    assert set(SOURCES) == {"attention_cuda.cu", "dropout_cuda.cu", "layernorm_cuda.cu"}


def test_parser_reads_spills():
    text = (
        "ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90'\n"
        "ptxas info    : Function properties for _Z3fooPf\n"
        "    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
    )
    assert parse_ptxas(text) == {("_Z3fooPf", 90): (16, 8, 4)}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES)
def test_compiles_without_spills(ptxas_reports, source, arch):
    returncode, output = ptxas_reports[source]
    assert returncode == 0, f"nvcc failed on {source}:\n{output[-4000:]}"
    usage = {k: v for (k, a), v in parse_ptxas(output).items() if a == arch}
    assert usage, f"no kernels reported for sm_{arch} in {source}:\n{output[-2000:]}"
    spilling = {k: v for k, v in usage.items() if v[1] or v[2]}
    assert not spilling, f"{source} sm_{arch}: kernels with spills (stack, stores, loads): {spilling}"


def test_launcher_header_needs_no_cuda_or_torch(tmp_path):
    """cuda_launchers.h is the boundary: plain C++ must be able to include it."""
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    src = tmp_path / "probe.cpp"
    src.write_text('#include "cuda_launchers.h"\nint main() { return 0; }\n')
    proc = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-I", str(source_dir()), str(src)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for name in SOURCES:
        includes = re.findall(r'#include [<"]([^>"]+)[>"]', (Path(source_dir()) / name).read_text())
        assert not [i for i in includes if i.startswith(("torch", "ATen", "c10"))], (name, includes)


def test_cuda_binding_compiles_against_this_torch(tmp_path):
    """cuda_binding.cpp, the torch side of the CUDA kernels, is built only where torch has CUDA.

    A syntax-only compile against this torch's headers and the CUDA toolkit's keeps it honest
    on CPU machines too. CPU builds of torch ship c10/cuda without the header that CMake
    generates for it (c10/cuda/impl/cuda_cmake_macros.h, export macros only); an empty one
    stands in for it when it is missing.
    """
    from torch.utils.cpp_extension import include_paths

    cxx = shutil.which(os.environ.get("CXX", "c++"))
    nvcc = _nvcc()
    if cxx is None or nvcc is None:
        pytest.skip("needs a C++ compiler and nvcc (for the CUDA toolkit's headers)")
    # nvcc names its own include directories (it may be a wrapper script around the real one)
    dry = subprocess.run([nvcc, "--dryrun", "-c", "probe.cu"], capture_output=True, text=True, cwd=tmp_path)
    cuda_includes = re.findall(r'-I"?([^"\s]+)', "".join(re.findall(r"INCLUDES=(.*)", dry.stderr + dry.stdout)))
    assert cuda_includes, f"nvcc --dryrun named no include directory:\n{dry.stderr[-2000:]}"
    includes = [*include_paths(), *cuda_includes, str(source_dir())]
    if not any((Path(p) / "c10/cuda/impl/cuda_cmake_macros.h").exists() for p in include_paths()):
        stub = tmp_path / "c10/cuda/impl/cuda_cmake_macros.h"
        stub.parent.mkdir(parents=True)
        stub.write_text("#pragma once\n")
        includes.append(str(tmp_path))
    proc = subprocess.run([cxx, "-std=c++20", "-fsyntax-only", *(f"-I{p}" for p in includes),
                           "-DTORCH_EXTENSION_NAME=fasttrans_probe", str(source_dir() / "cuda_binding.cpp")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]

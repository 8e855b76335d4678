"""The CPU kernels built for another instruction set than this machine's best.

The extension compiles for the machine it runs on (-march=native), so the suite exercises
one of the kernels' vector paths: AVX-512 on the machines this project tests on. Most x86
CPUs without AVX-512 (AMD Zen 2/3, many Intel parts) run the AVX2 path, which nothing else
here runs. This file builds that path (FASTTRANS_CPU_ARCH=x86-64-v3), or on an AVX2-only
machine the scalar one (x86-64), and runs the kernels' comparisons with the reference
again under it, with CPU attention tiles that split every shape unevenly (24 rows by 40
keys), in a child process.
"""

import os
import platform
from pathlib import Path

import pytest

from fasttrans import extension

from helpers import run_python

REPO = Path(__file__).resolve().parents[1]
# the kernels' comparisons with the reference and their bit-exact checks, not the build,
# packaging or process tests of those files
_SELECTION = (
    "not cuda and not triton and not split_over_threads and not setting_is_validated "
    "and not other_instruction_set and ("
    "test_attention_extension or matches_reference or large_outputs or rows_ or very_wide or zero_eps "
    "or default_eps or deterministic or gradcheck or strided or without_weight or fp32_parameters "
    "or extension_mask or every_backend or forward_and_backward or flags_follow)"
)


def _other_isa() -> tuple[str, str] | None:
    """(-march target, CPU_CAPABILITY it gives) of the other vector path, or None off x86-64."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    native = extension.build_info()["cflags"]
    if "-DCPU_CAPABILITY=AVX512" in native:
        return "x86-64-v3", "AVX2"
    return "x86-64", ""


def test_build_flags_follow_the_setting(ext):
    flags = extension.build_info()["cflags"]
    forced = os.environ.get("FASTTRANS_CPU_ARCH")
    arch = [f for f in flags if f.startswith(("-march=", "-mcpu="))]
    # unset: the machine's own target, where the compiler takes one (else its default)
    assert arch == [f"-march={forced}"] if forced else arch in ([], ["-march=native"], ["-mcpu=native"])
    capability = os.environ.get("EXPECT_CPU_CAPABILITY")  # set by the test below for its child
    if capability is not None:
        assert [f for f in flags if f.startswith("-DCPU_CAPABILITY=")] == (
            [f"-DCPU_CAPABILITY={capability}"] if capability else [])


@pytest.mark.slow(minutes=1.5)
def test_other_instruction_set_matches_reference(ext):
    other = _other_isa()
    if other is None:
        pytest.skip(f"builds an x86-64 instruction set; this machine is {platform.machine()}")
    arch, capability = other
    files = [str(REPO / "tests" / f) for f in
             ("test_attention_extension.py", "test_layernorm_extension.py", "test_dropout.py", "test_properties.py",
              "test_cpu_isa.py")]
    proc = run_python(["-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-k", _SELECTION],
                      timeout=1200, FASTTRANS_CPU_ARCH=arch, EXPECT_CPU_CAPABILITY=capability,
                      FASTTRANS_CPU_ATTENTION_TILES="24x40,24x40")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-2000:]


def test_a_target_the_compiler_rejects_is_named(ext, tmp_path):
    code = ("from fasttrans import extension\n"
            "try:\n    extension.load()\nexcept extension.ExtensionBuildError as e:\n    print(e)\n")
    proc = run_python(["-c", code], timeout=300, FASTTRANS_CPU_ARCH="no-such-cpu", FASTTRANS_CACHE=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "FASTTRANS_CPU_ARCH" in proc.stdout and "-march=no-such-cpu" in proc.stdout, proc.stdout
    assert not any(tmp_path.iterdir())  # refused before anything is built

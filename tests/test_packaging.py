"""The wheel is self-contained: built, installed into a fresh venv, used outside the tree."""

import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    import fasttrans
    from fasttrans import reference
    from importlib import resources

    here = os.path.dirname(fasttrans.__file__)
    assert here.startswith(sys.prefix), f"fasttrans imported from {here}, not the fresh venv {sys.prefix}"
    import fasttrans.kernels
    assert os.path.dirname(fasttrans.kernels.__file__).startswith(here)
    sources = sorted(p.name for p in resources.files("fasttrans.csrc").iterdir() if p.suffix in (".cpp", ".cu", ".h"))
    print("csrc:", " ".join(sources))
    with fasttrans.use_backend("reference"):
        q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
        out = fasttrans.attention(q, k, v, key_lengths=torch.tensor([7, 3]), is_causal=True, causal_offset=2)
        ref = reference.attention(q, k, v, key_lengths=torch.tensor([7, 3]), is_causal=True, causal_offset=2)
        torch.testing.assert_close(out, ref)
        x = torch.randn(3, 8)
        y, h = fasttrans.add_layer_norm(x, x, torch.ones(8), torch.zeros(8))
        torch.testing.assert_close(y, torch.nn.functional.layer_norm(2 * x, (8,)))
    print("ok")
    """
)


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_source_tree(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(ROOT)],
        check=True, cwd=tmp_path,
    )
    wheels = list(dist.glob("fasttrans-*.whl"))
    assert len(wheels) == 1, wheels

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # torch and the other dependencies come from this environment (a .pth adds its site-packages
    # as a plain path: its own .pth files, including any editable install of fasttrans, are not run)
    Path(purelib, "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", purelib, str(wheels[0])],
        check=True,
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FASTTRANS_BACKEND")}
    run = subprocess.run([str(python), "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().endswith("ok")
    csrc = [ln for ln in run.stdout.splitlines() if ln.startswith("csrc:")][0].split()[1:]
    on_disk = sorted(p.name for p in (ROOT / "csrc").iterdir() if p.suffix in (".cpp", ".cu", ".h"))
    assert csrc == on_disk, f"wheel ships {csrc}, the tree has {on_disk}"


@pytest.mark.slow(minutes=1)
def test_build_ext_compiles_the_extension_at_install_time(tmp_path):
    """FASTTRANS_BUILD_EXT=1 builds the extension while the package is built, into the
    cache that first use then finds (so it loads without compiling)."""
    cache = tmp_path / "cache"
    env = {**os.environ, "FASTTRANS_CACHE": str(cache)}
    env.pop("FASTTRANS_BUILD_EXT", None)
    probe = "from fasttrans import extension; print(extension.build_info()['built'])"

    def built() -> str:
        run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()

    assert built() == "False"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
         str(ROOT)],
        check=True, cwd=tmp_path, env={**env, "FASTTRANS_BUILD_EXT": "1"},
    )
    assert built() == "True"

"""Backend/device fixtures and the Triton interpreter switch.

Without a GPU, Triton kernels run through Triton's interpreter, which must be switched on
before triton is first imported: hence the environment variable is set here, at collection.
Tests marked ``gpu`` run only with ``pytest -m gpu`` (the default run deselects them).
"""

import os
import sys

# `python -m pytest` puts the working directory, the repository root, first on sys.path,
# where the source directory kernels/ (installed as fasttrans.kernels) would shadow the
# `kernels` package that transformers (>= 5.25) imports. Tests that need the root's
# `benchmarks` scripts append it at the end (tests/helpers.py, REPO_PATH).
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _REPO]

# OpenMP threads that spin while they wait make the suite many times slower on a machine
# shared with another busy process (tests/README.md); libgomp reads this when torch loads
# it, and the tests' subprocesses inherit it.
if "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ:
    import warnings

    warnings.warn("torch was imported before tests/conftest.py: set OMP_WAIT_POLICY=PASSIVE in the environment "
                  "for the suite to run at speed on a shared machine (tests/README.md)", stacklevel=1)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fasttrans import backends  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _expected_minutes(item: pytest.Item) -> float:
    mark = item.get_closest_marker("slow")
    return 0.0 if mark is None else float(mark.kwargs.get("minutes", 0.5))


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test``: --dist loadfile --no-loadscope-reorder), the files of
    the longest tests start first, as a file is queued where its first test is collected: one
    started near the end would run on alone while the other worker idles. Every worker sorts
    alike, so their collections agree; a serial run keeps the files' order."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: -_expected_minutes(item))


@pytest.fixture
def device() -> str:
    return DEVICE


def backend_params(op: str, device: str = DEVICE):
    """pytest params for every backend that can run ``op`` on ``device``.

    A backend that cannot run is reported as a skip *with its reason* (never silently
    dropped), so a broken build shows up in the summary.
    """
    params = []
    for name, backend in backends.BACKENDS.items():
        why = backend.unavailable_reason(device, op)
        marks = [pytest.mark.skip(reason=f"{name}: {why}")] if why else []
        params.append(pytest.param(name, id=name, marks=marks))
    return params


@pytest.fixture(scope="module")
def one_thread():
    """For files of tiny shapes: a second intra-op thread only adds synchronisation, and on a
    loaded machine its spin-waiting made such files several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def ext():
    """The extension's ops (attention_fwd, attention_bwd, norm_fwd, norm_bwd), built once
    into the cache; a failed build fails the tests."""
    import shutil

    from torch.utils.cpp_extension import get_cxx_compiler

    if shutil.which(get_cxx_compiler()) is None:
        pytest.skip(f"no C++ compiler ('{get_cxx_compiler()}') on PATH: the extension cannot be built")
    backends.BACKENDS["extension"].impl()
    return backends.ops_for("extension")

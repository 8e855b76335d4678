# Set-up and entry points. Each target creates .venv when missing and installs what it needs.
#
# torch: a machine that already has torch keeps it (the venv sees the packages of $(PY), also
# when $(PY) is itself a virtual environment, through a .pth file naming its site-packages);
# otherwise torch==2.13.0 is installed explicitly, which on CPU machines resolves to the
# local CPU build. The package itself is installed with --no-build-isolation so pip never
# builds in an isolated environment (where a torch requirement would pull a CUDA build).

PY ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.fasttrans-installed
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (0: all tests in one process). --dist loadfile runs each test
# file on one worker: module-scoped fixtures (minutes of compiling) are set up once, and the two
# packaging tests do not build in the source tree at the same time. Files start longest first
# (the slow marks' minutes, tests/conftest.py).
TEST_WORKERS ?= 2
BENCH_ARGS ?=
GPU_CHECK_ARGS ?=

.PHONY: demo test test-gpu gpu-check bench bench-quick compile-check info clean

$(STAMP): setup.py
	@if [ ! -x $(PYTHON) ]; then \
		if $(PY) -c "import torch" >/dev/null 2>&1; then \
			echo "using the torch already installed for $(PY)"; \
			$(PY) -m venv --system-site-packages $(VENV); \
			$(PY) -c "import site; print(*site.getsitepackages(), sep='\n')" \
				> "$$($(PYTHON) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/_fasttrans_host.pth"; \
		else \
			$(PY) -m venv $(VENV); \
		fi; \
	fi
	$(PYTHON) -m pip install --quiet "setuptools>=70" wheel
	$(PYTHON) -c "import torch" >/dev/null 2>&1 || $(PYTHON) -m pip install --quiet "$(TORCH_SPEC)"
	$(PYTHON) -m pip install --quiet --no-build-isolation -e ".[test,demo]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PYTHON) -m fasttrans demo

test: $(STAMP)
	$(PYTHON) -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(PYTHON) -m pytest tests -m gpu $(PYTEST_ARGS)

# the GPU questions in one budgeted run (benchmarks/README.md, "GPU check"); --dry-run works anywhere
gpu-check: $(STAMP)
	$(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

bench: $(STAMP)
	$(PYTHON) benchmarks/bench_attention.py $(BENCH_ARGS)
	$(PYTHON) benchmarks/bench_layernorm.py $(BENCH_ARGS)
	$(PYTHON) benchmarks/bench_dropout.py $(BENCH_ARGS)
	$(PYTHON) benchmarks/bench_model.py $(BENCH_ARGS)

bench-quick: $(STAMP)
	$(PYTHON) benchmarks/bench_attention.py --quick $(BENCH_ARGS)
	$(PYTHON) benchmarks/bench_layernorm.py --quick $(BENCH_ARGS)
	$(PYTHON) benchmarks/bench_dropout.py --quick $(BENCH_ARGS)
	$(PYTHON) benchmarks/bench_model.py --quick $(BENCH_ARGS)

compile-check: $(STAMP)
	$(PYTHON) -m fasttrans compile-check

info: $(STAMP)
	$(PYTHON) -m fasttrans info

clean:
	rm -rf build dist *.egg-info .pytest_cache

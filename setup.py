"""Packaging for fasttrans.

Deliberately does not import torch: pip builds in an isolated environment, where a torch
requirement would download the newest (CUDA) build of torch even when torch is installed.
The C++/CUDA extension is JIT-built at first use (fasttrans.extension); to build it ahead
of time, install with ``FASTTRANS_BUILD_EXT=1 pip install --no-build-isolation .``.
"""

import os
import re

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _version() -> str:
    with open(os.path.join(HERE, "fasttrans", "version.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


class BuildPyWithExtension(build_py):
    """build_py that, when FASTTRANS_BUILD_EXT=1, also compiles the extension ahead of time."""

    def run(self):
        super().run()
        if os.environ.get("FASTTRANS_BUILD_EXT") == "1":
            import sys

            sys.path.insert(0, self.build_lib)
            from fasttrans import extension  # needs torch: only with --no-build-isolation

            extension.load(verbose=True)


with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
    long_description = f.read()

setup(
    name="fasttrans",
    version=_version(),
    description="The textbook Transformer for PyTorch on fused Triton, C++ and CUDA kernels; a drop-in for torch.nn",
    long_description=long_description,
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["fasttrans", "fasttrans.backends", "fasttrans.nn", "fasttrans.models", "fasttrans.tasks",
              "fasttrans.integrations", "fasttrans.kernels", "fasttrans.csrc"],
    package_dir={"fasttrans.kernels": "kernels", "fasttrans.csrc": "csrc"},
    package_data={"fasttrans.csrc": ["*.cpp", "*.cu", "*.h", "*.cuh"]},
    install_requires=["torch>=2.4", "triton>=3.0; platform_system == 'Linux'", "ninja"],
    # the demo and training command (progress bars, the loss plot) and the test suite need more than the library
    extras_require={
        "demo": ["tqdm", "matplotlib"],
        "test": ["pytest", "pytest-xdist==3.8.0", "hypothesis", "threadpoolctl", "numpy", "tqdm", "matplotlib",
                 "transformers>=5,<6"],
        # the range fasttrans.integrations.transformers supports (SUPPORTED_VERSIONS there)
        "transformers": ["transformers>=5,<6"],
    },
    entry_points={"console_scripts": ["fasttrans=fasttrans.cli:main"]},
    cmdclass={"build_py": BuildPyWithExtension},
)

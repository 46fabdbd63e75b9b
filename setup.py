"""Install dearopt; builds the csrc NCCL extension when CUDA and NCCL are found.

``DEAROPT_WITH_NCCL=1`` forces the extension (an error if it cannot be built),
``DEAROPT_WITH_NCCL=0`` skips it; see csrc/build_ext.py and csrc/README.md.
"""

import importlib.util
import os

from setuptools import find_packages, setup

_HERE = os.path.dirname(os.path.abspath(__file__))


def _native_extensions():
    spec = importlib.util.spec_from_file_location("dearopt_csrc_build_ext", os.path.join(_HERE, "csrc", "build_ext.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.configure()


ext_modules, cmdclass = _native_extensions()

setup(
    name="dearopt",
    version="0.1.0",
    description="Communication scheduling (DeAR BackPipe/FeedPipe) for data-parallel PyTorch training",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["dearopt", "dearopt.*"]),
    install_requires=["torch>=2.1", "numpy"],
    extras_require={
        "mpi": ["mpi4py>=3.1"],
        "tune": ["bayesian-optimization>=2.0"],
        "cuda": ["cupy"],
        "lightning": ["lightning"],
        "transformers": ["transformers", "accelerate"],
        "test": [
            "pytest>=7",
            "pytest-timeout",
            "pytest-xdist",
            "scikit-learn",
            "matplotlib",
            "bayesian-optimization>=2.0",
            "mpi4py>=3.1",
        ],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)

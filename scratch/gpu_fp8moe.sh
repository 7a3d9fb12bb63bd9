#!/bin/bash
# GPU checks of the fp8moe branch (issue 24 part 2: MoeConfig(fp8_gemm=True) in the MoE layer and the block's step).
# Run from the repo root on one H100 / H200 (report the card); each command is independent.
set -x
# 1. The new tests with the compiled kernels (conftest sets implementation "pallas" on a GPU): reference vs kernel
#    MoE layer, gradients vs dense float32 (e4m3 tolerances), EP one-device mesh, H100 lowering.
python -m pytest -p no:cacheprovider -q -x tests/modeling/test_moe_fp8_gemm.py
# 2. The training step, bf16 ragged_dot GEMMs vs FP8 GEMMs (same model; --fp8-gemm also sets alignment 128, which
#    gpu_config already uses), "auto" only (the XLA paths of the FP8 GEMMs are the jnp references: slow).
python -m benchmarks.train_step --iterations 10 --implementations auto
python -m benchmarks.train_step --iterations 10 --implementations auto --fp8-gemm

"""FP8 grouped GEMMs on the fused MoE layout: the forward product of each 128-row block with
its expert's weights, with DeepGEMM's per-token 1x128 x 128x128 block-scale numerics, and the two backward
GEMMs (input gradient through transposed weights, weight gradient over each expert's ragged row range).

Inputs are what :mod:`jaxkern.quant` and :mod:`jaxkern.moe` produce (see :func:`fp8_grouped_gemm`).
"""

from jaxkern.gemm._backward import fp8_grouped_gemm_input_grad, fp8_grouped_gemm_weight_grad, transpose_weights
from jaxkern.gemm._grouped import fp8_grouped_gemm

__all__ = ["fp8_grouped_gemm", "fp8_grouped_gemm_input_grad", "fp8_grouped_gemm_weight_grad", "transpose_weights"]

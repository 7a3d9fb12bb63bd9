"""Trainable layers built from the jaxkern ops; layers land here as they are built."""

from jaxkern.modeling.block import (Batch, BlockConfig, BlockParams, init_block_params, loss_fn, model_apply, moe_ffn,
                                    synthetic_batch, train_step)
from jaxkern.modeling.engram import engram_gate
from jaxkern.modeling._fp8_linear import fp8_grouped_linear
from jaxkern.modeling._swiglu import swiglu
from jaxkern.modeling.mhc import expand_from_embedding, mhc_block, mhc_head, mhc_post, mhc_pre
from jaxkern.modeling.moe import (MoeConfig, MoeParams, apply_experts, apply_experts_dense, balance_router_bias,
                                  expand_fp8, init_moe_params, moe_layer, moe_layer_dense, route_tokens, swiglu_experts)

__all__ = [
    "Batch",
    "BlockConfig",
    "BlockParams",
    "MoeConfig",
    "MoeParams",
    "apply_experts",
    "apply_experts_dense",
    "engram_gate",
    "expand_fp8",
    "expand_from_embedding",
    "fp8_grouped_linear",
    "balance_router_bias",
    "init_block_params",
    "init_moe_params",
    "loss_fn",
    "mhc_block",
    "mhc_head",
    "mhc_post",
    "mhc_pre",
    "model_apply",
    "moe_ffn",
    "moe_layer",
    "moe_layer_dense",
    "route_tokens",
    "swiglu",
    "swiglu_experts",
    "synthetic_batch",
    "train_step",
]

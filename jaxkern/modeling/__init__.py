"""Trainable layers built from the jaxkern ops; layers land here as they are built."""

from jaxkern.modeling.block import (Batch, BlockConfig, BlockParams, block_param_specs, ep_params, init_block_params,
                                    loss_fn, merge_ep_params, model_apply, moe_ffn, moe_ffn_ep, sharded_train_step,
                                    synthetic_batch, train_step)
from jaxkern.modeling.engram import engram_gate
from jaxkern.modeling._fp8_linear import fp8_grouped_linear
from jaxkern.modeling._swiglu import swiglu
from jaxkern.modeling.mhc import expand_from_embedding, mhc_block, mhc_head, mhc_post, mhc_pre
from jaxkern.modeling.sharding import (MoeEpParams, init_optimizer_state, make_sharded_train_step, merge_shared_experts,
                                       moe_layer_ep, moe_param_specs, shard_params, sharded_value_and_grad,
                                       split_shared_experts, storage_specs)
from jaxkern.modeling.moe import (MoeConfig, MoeParams, apply_experts, apply_experts_dense, balance_router_bias,
                                  expand_fp8, init_moe_params, moe_layer, moe_layer_dense, route_tokens, swiglu_experts)

__all__ = [
    "Batch",
    "BlockConfig",
    "BlockParams",
    "MoeConfig",
    "MoeEpParams",
    "MoeParams",
    "apply_experts",
    "apply_experts_dense",
    "balance_router_bias",
    "block_param_specs",
    "engram_gate",
    "ep_params",
    "expand_fp8",
    "expand_from_embedding",
    "fp8_grouped_linear",
    "init_block_params",
    "init_moe_params",
    "loss_fn",
    "init_optimizer_state",
    "make_sharded_train_step",
    "merge_ep_params",
    "merge_shared_experts",
    "mhc_block",
    "mhc_head",
    "mhc_post",
    "mhc_pre",
    "model_apply",
    "moe_ffn",
    "moe_ffn_ep",
    "moe_layer",
    "moe_layer_dense",
    "moe_layer_ep",
    "moe_param_specs",
    "route_tokens",
    "shard_params",
    "sharded_train_step",
    "sharded_value_and_grad",
    "split_shared_experts",
    "storage_specs",
    "swiglu",
    "swiglu_experts",
    "synthetic_batch",
    "train_step",
]

"""MoE gating and routing (see docs/moe.md)."""

from jaxkern.moe._aux_fi import aux_fi
from jaxkern.moe._expand_to_fused import expand_to_fused, expand_to_fused_with_sf
from jaxkern.moe._get_fused_mapping import get_fused_mapping
from jaxkern.moe._group_count import group_count
from jaxkern.moe._mask_indices_by_tp import mask_indices_by_tp
from jaxkern.moe._normalize_weight import normalize_weight
from jaxkern.moe._reduce_fused import reduce_fused
from jaxkern.moe._top2_sum_gate import top2_sum_gate
from jaxkern.moe._topk_gate import topk_gate
from jaxkern.moe._topk_sum_and_topk_group_idx import topk_sum_and_topk_group_idx
from jaxkern.moe._unique_group_indices import unique_group_indices
from jaxkern.types import FusedMapping, NormalizedWeights, QuantTensor, TopkRouting, TopkRoutingWithUnmapped

__all__ = [
    "FusedMapping",
    "NormalizedWeights",
    "QuantTensor",
    "TopkRouting",
    "TopkRoutingWithUnmapped",
    "aux_fi",
    "expand_to_fused",
    "expand_to_fused_with_sf",
    "get_fused_mapping",
    "group_count",
    "mask_indices_by_tp",
    "normalize_weight",
    "reduce_fused",
    "top2_sum_gate",
    "topk_gate",
    "topk_sum_and_topk_group_idx",
    "unique_group_indices",
]

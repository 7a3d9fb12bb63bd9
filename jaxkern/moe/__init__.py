"""MoE gating and routing (see ../shared/spec/moe_transpose.md); ops land here as they are ported."""

from jaxkern.moe.top2_sum_gate import top2_sum_gate
from jaxkern.moe.topk_gate import topk_gate
from jaxkern.moe.topk_sum_and_topk_group_idx import topk_sum_and_topk_group_idx

__all__ = ["top2_sum_gate", "topk_gate", "topk_sum_and_topk_group_idx"]

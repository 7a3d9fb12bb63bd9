"""MoE gating and routing (see ../shared/spec/moe_transpose.md); ops land here as they are ported."""

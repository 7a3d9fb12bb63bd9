"""Manifold-constrained hyper-connections (mHC); ops land here as they are ported."""

# pre_norm_fn (engram_mhc.md §4.2, §4.3)
from jaxkern.mhc._norm_fn import fn_normw_merge, pre_norm_fn, pre_norm_fn_bwd, pre_norm_fn_fwd, round_to_tf32  # noqa: F401

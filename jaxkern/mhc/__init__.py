"""Manifold-constrained hyper-connections (mHC, docs/mhc.md): residual streams, their mixes, the
Sinkhorn normalisation, the RMS-normalised projection ``pre_norm_fn``, the fused inference path
``pre_big_fuse`` and ``multilayer_recompute``; each differentiable op is a ``jax.custom_vjp`` whose backward is the matching
``*_bwd`` op."""

from jaxkern.mhc._norm_fn import fn_normw_merge, pre_norm_fn, pre_norm_fn_bwd, pre_norm_fn_fwd, round_to_tf32
from jaxkern.mhc._apply import pre_apply_mix, pre_apply_mix_bwd
from jaxkern.mhc._fused import multilayer_recompute, pre_big_fuse
from jaxkern.mhc._expand import expand_to_mhc, expand_to_mhc_bwd
from jaxkern.mhc._mixes import head_compute_mix, head_compute_mix_bwd, pre_split_mixes, pre_split_mixes_bwd
from jaxkern.mhc._post import post, post_bwd
from jaxkern.mhc._sinkhorn import sinkhorn_normalize, sinkhorn_normalize_bwd

__all__ = [
    "expand_to_mhc",
    "expand_to_mhc_bwd",
    "fn_normw_merge",
    "head_compute_mix",
    "head_compute_mix_bwd",
    "multilayer_recompute",
    "post",
    "post_bwd",
    "pre_norm_fn",
    "pre_norm_fn_bwd",
    "pre_norm_fn_fwd",
    "pre_apply_mix",
    "pre_apply_mix_bwd",
    "pre_big_fuse",
    "pre_split_mixes",
    "pre_split_mixes_bwd",
    "round_to_tf32",
    "sinkhorn_normalize",
    "sinkhorn_normalize_bwd",
]

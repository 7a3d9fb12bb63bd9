"""Manifold-constrained hyper-connections (mHC, engram_mhc.md §4): residual streams, their mixes and the
Sinkhorn normalisation; each differentiable op is a ``jax.custom_vjp`` whose backward is the matching
``*_bwd`` op."""

# --- mhc-a: expand, split / apply / post mixes, Sinkhorn, head mix (§4.1, §4.4-§4.8) ---
from jaxkern.mhc._apply import pre_apply_mix, pre_apply_mix_bwd
from jaxkern.mhc._expand import expand_to_mhc, expand_to_mhc_bwd
from jaxkern.mhc._mixes import head_compute_mix, head_compute_mix_bwd, pre_split_mixes, pre_split_mixes_bwd
from jaxkern.mhc._post import post, post_bwd
from jaxkern.mhc._sinkhorn import sinkhorn_normalize, sinkhorn_normalize_bwd

__all__ = [
    # mhc-a
    "expand_to_mhc",
    "expand_to_mhc_bwd",
    "head_compute_mix",
    "head_compute_mix_bwd",
    "post",
    "post_bwd",
    "pre_apply_mix",
    "pre_apply_mix_bwd",
    "pre_split_mixes",
    "pre_split_mixes_bwd",
    "sinkhorn_normalize",
    "sinkhorn_normalize_bwd",
]

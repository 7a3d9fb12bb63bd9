"""Result and argument types of the jaxkern ops: NamedTuples, so pytrees that unpack positionally.

Plain tuples are accepted wherever a :class:`QuantTensor` is an input. The ``jnp`` references in
:mod:`jaxkern.reference` return the same types as the ops.
"""

from __future__ import annotations

from typing import NamedTuple

import jax


class QuantTensor(NamedTuple):
  """Quantised data and its scale factors (``sf``); the layouts are those of :mod:`jaxkern.quant`."""

  data: jax.Array
  sf: jax.Array


class QuantTensorWithClampedCount(NamedTuple):
  """A :class:`QuantTensor` and the updated SwiGLU clamp counters
  (:func:`jaxkern.quant.swiglu_forward_and_per_token_cast` with ``clamped_count``)."""

  data: jax.Array
  sf: jax.Array
  clamped_count: jax.Array  # (3,): the given counts plus #(left > C), #(right > C), #(right < -C)


class SwigluBackward(NamedTuple):
  """:func:`jaxkern.quant.swiglu_backward_and_per_token_cast`: the recomputed forward output and the
  gradients of the SwiGLU input ``x = [left | right]`` and of the top-k weights (upstream returns
  ``(out, (x_grad_q, x_grad_sf), x_grad, weight_grad)``; the fields unpack in that order)."""

  out: jax.Array  # (E, h) bfloat16: the weighted activation silu(l')·r'·w, recomputed from the FP8 x
  x_grad_quant: QuantTensor  # ((E, 2h) e4m3, (E, 2h/npc) float32 layout A): per-token cast of [dx | dy]
  x_grad: jax.Array  # (E, 2h) bfloat16: [dx | dy], the gradient of x
  weight_grad: jax.Array  # (T, k) float32: the gradient of the top-k weights (zeros for unused slots)


class FusedMapping(NamedTuple):
  """The fused (expert-major) row layout of :func:`jaxkern.moe.get_fused_mapping`."""

  pos_to_expert: jax.Array  # (N,) int32: expert of each fused row, -1 for padding
  pos_to_token: jax.Array  # (N,) int32: token of each fused row, -1 for padding
  pos_to_token_topk: jax.Array  # (N,) int32: flat slot t*K + k of each fused row, -1 for padding
  token_topk_to_pos: jax.Array  # (T, K) int32: fused row of each slot, -1 for an unused slot
  expert_start: jax.Array  # (E,) int32: first row of each expert's segment
  expert_end: jax.Array  # (E,) int32: one past the segment's last row
  num_tokens_per_expert: jax.Array  # (E,) int32: segment lengths (counts rounded up to the alignment)
  num_tokens_per_expert_list: list  # the same as Python ints when sized on the host, else []


class TopkRouting(NamedTuple):
  """Routed experts and their weights (:func:`jaxkern.moe.top2_sum_gate`)."""

  topk_idx: jax.Array  # (T, K+S) int32, -1 for a masked slot
  topk_weights: jax.Array  # (T, K+S) float32


class TopkRoutingWithUnmapped(NamedTuple):
  """:class:`TopkRouting` plus the updated logical ids, when ``unmapped_topk_idx`` was passed."""

  topk_idx: jax.Array
  topk_weights: jax.Array
  unmapped_topk_idx: jax.Array  # (T, K) int32


class NormalizedWeights(NamedTuple):
  """:func:`jaxkern.moe.normalize_weight`: the row sums and the weights divided by them."""

  denominator: jax.Array  # (T,) float32
  normalized_weights: jax.Array  # (T, K) float32


class EngramGateOutput(NamedTuple):
  """:func:`jaxkern.engram.engram_gate_fwd`: the gated residual and, with ``save_for_backward``, the four
  float32 ``(T, M)`` intermediates the backward needs (``None`` otherwise)."""

  output: jax.Array  # (T, M, D) bf16: x + g·v
  dot: jax.Array | None  # (T, M) float32: the unscaled Σ x·wf·k
  gate_score: jax.Array | None  # (T, M) float32: g
  rstd_x: jax.Array | None  # (T, M) float32
  rstd_k: jax.Array | None  # (T, M) float32


class EngramGateGrads(NamedTuple):
  """:func:`jaxkern.engram.engram_gate_bwd`: input cotangents and the partial weight gradient."""

  grad_hidden_states: jax.Array  # (T, M, D) bf16
  grad_k: jax.Array  # (T, M, D) bf16
  grad_v: jax.Array  # (T, D) bf16
  grad_w_partial: jax.Array  # (P, M, D) float32: per token range, the sum of G·x⊙k (gradient of weight_fused)


class EngramWeightGrads(NamedTuple):
  """:func:`jaxkern.engram.grad_w_reduce`: the updated float32 accumulators of both RMSNorm weights."""

  grad_weight_hidden: jax.Array  # (M, D) float32
  grad_weight_embed: jax.Array  # (M, D) float32


# ---- mHC (docs/mhc.md): split / apply / post mixes ----

class PreSplitMixes(NamedTuple):
  """:func:`jaxkern.mhc.pre_split_mixes`: the three per-token mixes, float32."""

  pre_layer_mix: jax.Array  # (..., M, 1): σ(a) + pre_eps
  post_layer_mix: jax.Array  # (..., M, 1): σ(a)·post_mult_value
  comb_res_mix: jax.Array  # (..., M, M): the comb logits (before Sinkhorn)


class PreSplitMixesGrads(NamedTuple):
  """:func:`jaxkern.mhc.pre_split_mixes_bwd`: cotangents of the inputs."""

  input_mixes_grad: jax.Array  # (..., J) float32
  mhc_scale_grad: jax.Array  # (3,) float32
  mhc_base_grad: jax.Array  # (J,) float32


class PreApplyMixGrads(NamedTuple):
  """:func:`jaxkern.mhc.pre_apply_mix_bwd`: cotangents of the residual and of the mix."""

  x_grad: jax.Array  # (..., M, H), x's dtype (accumulated onto x_grad_acc when given)
  mix_grad: jax.Array  # (..., M, 1) float32


class PostGrads(NamedTuple):
  """:func:`jaxkern.mhc.post_bwd`: cotangents of the four inputs of :func:`jaxkern.mhc.post`."""

  d_x: jax.Array  # (..., H), x's dtype
  d_residual: jax.Array  # (..., M, H), residual's dtype
  d_post_layer_mix: jax.Array  # (..., M, 1) float32
  d_comb_res_mix: jax.Array  # (..., M, M) float32


class HeadComputeMixGrads(NamedTuple):
  """:func:`jaxkern.mhc.head_compute_mix_bwd`: cotangents of the inputs."""

  input_mix_grad: jax.Array  # (..., M) float32
  mhc_scale_grad: jax.Array  # (1,) float32
  mhc_base_grad: jax.Array  # (M,) float32


class PreNormFnFwd(NamedTuple):
  """:func:`jaxkern.mhc.pre_norm_fn_fwd`: the mixing logits and the two sums the backward needs."""

  mixes: jax.Array  # (…, J) float32: out_mul · rsqrt(sqrsum / K + eps)
  out_mul: jax.Array  # (…, J) float32: vec(R) @ tf32(fn)^T
  sqrsum: jax.Array  # (…,) float32: Σ vec(R)²


class PreNormFnGrads(NamedTuple):
  """:func:`jaxkern.mhc.pre_norm_fn_bwd`: cotangents of the residual and of the (merged) weight."""

  grad_residual: jax.Array  # (…, M, H), the residual's dtype
  grad_fn: jax.Array  # (J, K) float32


class PreBigFuse(NamedTuple):
  """:func:`jaxkern.mhc.pre_big_fuse` (upstream's output order)."""

  post_mix: jax.Array  # (…, M, 1) float32: σ(a_post)·post_mult_value
  comb_mix: jax.Array  # (…, M, M) float32: after Sinkhorn
  layer_input: jax.Array  # (…, H), the residual's dtype: Σ_m pre[m]·R[m]


class MultilayerRecompute(NamedTuple):
  """:func:`jaxkern.mhc.multilayer_recompute`: the rebuilt sublayer inputs and residuals."""

  layer_input_list: tuple  # L arrays (…, H), the residual's dtype
  residual_list: tuple  # Lp arrays (…, M, H), the residual's dtype: R_1 .. R_Lp

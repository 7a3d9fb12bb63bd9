"""``jnp`` references of the :mod:`jaxkern.moe` ops: gating (docs/moe.md, "Gating") and
routing (docs/moe.md, "The fused layout", "Expand", "Reduce", "Helpers").

Index inputs may be int32 or int64; index outputs are int32 (docs/moe.md, "Conventions"). Scores are ranked with
NaN treated as ``-inf`` and ``-0.0`` equal to ``+0.0``; ties go to the smaller index (a stable
descending sort). Shapes and static arguments are assumed valid: the public ops in
:mod:`jaxkern.moe` check them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkern.reference import ieee
from jaxkern.types import FusedMapping, NormalizedWeights, QuantTensor, TopkRouting, TopkRoutingWithUnmapped


def _canonical(v: jax.Array) -> jax.Array:
  v = jnp.where(jnp.isnan(v), -jnp.inf, v)
  return jnp.where(v == 0, 0.0, v)


def stable_topk(values: jax.Array, k: int) -> jax.Array:
  """Indices of the ``k`` largest entries along the last axis, best first, ties -> smaller index."""
  v = _canonical(values)
  idx = lax.broadcasted_iota(jnp.int32, v.shape, v.ndim - 1)
  _, order = lax.sort((-v, idx), dimension=v.ndim - 1, num_keys=2)
  return order[..., :k]


def topk_gate(scores: jax.Array, num_topk: int) -> jax.Array:
  """``(T, E)`` float32 -> ``(T, num_topk)`` int32 indices of the largest scores (docs/moe.md, "topk_gate")."""
  return stable_topk(scores, num_topk)


def group_scores(scores: jax.Array, num_topk_sum: int) -> jax.Array:
  """``(..., G, Epg)`` -> ``(..., G)``: the best value, or the fp32 sum of the two best values."""
  v = _canonical(scores)
  best = jnp.take_along_axis(v, stable_topk(v, num_topk_sum), axis=-1)
  return best[..., 0] if num_topk_sum == 1 else best[..., 0] + best[..., 1]


def topk_sum_and_topk_group_idx(scores: jax.Array, num_topk_sum: int, num_topk_groups: int) -> jax.Array:
  """``(T, G, Epg)`` float32 -> ``(T, num_topk_groups)`` int32 best groups in rank order (docs/moe.md, "topk_sum_and_topk_group_idx")."""
  return stable_topk(group_scores(scores, num_topk_sum), num_topk_groups)


SCORING_FUNCS = ("sigmoid", "sqrtsoftplus", "softmax")
HASH_MULTIPLIER = 23333
_WEIGHT_EPS = 1e-20  # fp32 bits 0x1E3CE508: seed of the weight sum


def softplus(x: jax.Array) -> jax.Array:
  """Thresholded softplus: ``x`` above 20, else ``log1p(exp(x))`` (docs/moe.md, "top2_sum_gate")."""
  return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(x)))


def softmax_denominator(z: jax.Array) -> jax.Array:
  """Row sums of ``(T, E)`` in upstream's order: 32 lane sums of ``z[128 i + 4 l + j]``, then a butterfly."""
  t, e = z.shape
  z = jnp.pad(z, ((0, 0), (0, -e % 128))).reshape(t, -1, 32, 4)  # adding +0.0 is exact
  p = jnp.zeros((t, 32), z.dtype)
  for i in range(z.shape[1]):
    for j in range(4):
      p = p + z[:, i, :, j]
  lanes = jnp.arange(32)
  for b in (16, 8, 4, 2, 1):
    p = p + p[:, lanes ^ b]
  return p[:, 0]


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def elementwise_scores(logits: jax.Array, scoring_func: str) -> jax.Array:
  """Sigmoid or sqrtsoftplus scores ``u`` (docs/moe.md, "top2_sum_gate"), with correctly rounded division and sqrt.

  Differentiable with :func:`score_derivative` (``jax.custom_jvp``): the chain rule through ``exp``
  and ``sqrt`` gives NaN where ``exp`` overflows or ``u`` underflows to 0 (e.g. sigmoid logits below
  -88), even for experts that get no cotangent.
  """
  if scoring_func == "sigmoid":
    return ieee.div(jnp.ones_like(logits), 1.0 + jnp.exp(-logits))
  return ieee.sqrt(softplus(logits))


@elementwise_scores.defjvp
def _elementwise_scores_jvp(scoring_func, primals, tangents):
  (x,), (dx,) = primals, tangents
  u = elementwise_scores(x, scoring_func)
  return u, score_derivative(x, u, scoring_func) * dx


def score_derivative(logits: jax.Array, u: jax.Array, scoring_func: str) -> jax.Array:
  """``du/dx`` of a sigmoid or sqrtsoftplus score ``u`` at logit ``x``: ``u (1 - u)``, or
  ``sigmoid(x) / (2u)`` (``1 / (2u)`` above the softplus threshold 20), and 0 where ``u`` is 0 (the
  true value, ``exp(x / 2) / 2``, is below 1e-22 there)."""
  if scoring_func == "sigmoid":
    return u * (1.0 - u)
  slope = jnp.where(logits > 20.0, 1.0, jax.nn.sigmoid(logits))
  return jnp.where(u > 0, slope / (2.0 * jnp.where(u > 0, u, 1.0)), 0.0)


def gate_scores(logits: jax.Array, scoring_func: str) -> jax.Array:
  """Unbiased scores ``u`` (docs/moe.md, "top2_sum_gate"), with correctly rounded division and sqrt; differentiable."""
  if scoring_func != "softmax":
    return elementwise_scores(logits, scoring_func)
  # The barriers keep exp out of reduction fusions, where XLA:CPU evaluates it differently.
  m = lax.optimization_barrier(jnp.max(logits, axis=1, keepdims=True))
  z = lax.optimization_barrier(jnp.exp(logits - m))
  return ieee.div(z, softmax_denominator(z)[:, None])


def ranking_scores(logits: jax.Array, u: jax.Array, bias: jax.Array, scoring_func: str) -> jax.Array:
  """``u + bias``, or ``logits + bias`` for softmax (docs/moe.md, "top2_sum_gate", step 2)."""
  return (logits if scoring_func == "softmax" else u) + bias


def group_limited_topk(b: jax.Array, num_topk: int, num_groups: int, num_topk_groups: int) -> jax.Array:
  """Top-k of ``b`` among the experts of the ``num_topk_groups`` best groups (two-best sums)."""
  if num_groups != num_topk_groups:
    t, e = b.shape
    groups = stable_topk(group_scores(b.reshape(t, num_groups, e // num_groups), 2), num_topk_groups)
    keep = (groups[:, :, None] == jnp.arange(num_groups)).any(axis=1)
    b = jnp.where(jnp.repeat(keep, e // num_groups, axis=1), b, -jnp.inf)
  return stable_topk(b, num_topk)


def normalized_weights(u_sel: jax.Array, routed_scaling_factor: float | jax.Array) -> jax.Array:
  """``u / s * rsf`` with ``s`` summed sequentially from 1e-20 in slot order (docs/moe.md, "top2_sum_gate", step 5)."""
  s = jnp.full(u_sel.shape[:1], _WEIGHT_EPS, jnp.float32)
  for k in range(u_sel.shape[1]):
    s = s + u_sel[:, k]
  return ieee.div(u_sel, s[:, None]) * jnp.float32(routed_scaling_factor)


def mask_by_tp(p: jax.Array, experts_per_rank: int, tp_rank: int | jax.Array, num_tp_ranks: int) -> jax.Array:
  """EP/TP masking and local renumbering of int32 global ids (docs/moe.md, "top2_sum_gate"); negatives -> -1.

  Truncating divisions (equal to floor division for the kept ``p >= 0``), so the Mosaic GPU and
  Triton kernels run this same function.
  """
  r, tp = jnp.int32(experts_per_rank), jnp.int32(num_tp_ranks)
  q = lax.div(p, r)
  local = lax.div(q, tp) * r + lax.rem(p, r)
  return jnp.where((p >= 0) & (lax.rem(q, tp) == tp_rank), local, jnp.int32(-1))


def to_physical(idx: jax.Array, to_physical_map: jax.Array, logical_count: jax.Array,
                ep_rank: int | jax.Array) -> jax.Array:
  """Replica choice ``map[l, (t * 23333 + ep_rank) mod count[l]]``, exact in int32 (docs/moe.md, "top2_sum_gate").

  Floor modulo, so any ``ep_rank`` picks a live replica; a negative id (a dropped slot) stays -1.
  """
  ok = idx >= 0
  safe = jnp.where(ok, idx, 0)
  c = logical_count[safe]
  t = jnp.arange(idx.shape[0], dtype=jnp.int32)[:, None]
  d = ((t % c) * (HASH_MULTIPLIER % c) + ep_rank % c) % c
  return jnp.where(ok, to_physical_map[safe, d], -1)


def finish_gate(idx: jax.Array, weights: jax.Array, *, num_experts: int, num_shared: int, ep_rank: int | jax.Array,
                num_ep_ranks: int, tp_rank: int | jax.Array, num_tp_ranks: int, mask: jax.Array,
                to_physical_map: jax.Array, logical_count: jax.Array):
  """Steps 6-8 of docs/moe.md, "top2_sum_gate" and the token mask on the routed slots: shared slots, replicas, EP/TP masking, token mask."""
  t = idx.shape[0]
  if num_shared:
    idx = jnp.concatenate([idx, jnp.broadcast_to(num_experts + jnp.arange(num_shared, dtype=jnp.int32),
                                                 (t, num_shared))], axis=1)
    weights = jnp.concatenate([weights, jnp.ones((t, num_shared), jnp.float32)], axis=1)
  extra = 0
  if to_physical_map is not None:
    idx = to_physical(idx, to_physical_map, logical_count, ep_rank)
    extra = to_physical_map.shape[1] - 1
  idx = mask_by_tp(idx, (num_experts + extra) // num_ep_ranks, tp_rank, num_tp_ranks)
  if mask is not None:
    idx = jnp.where(mask[:, None], idx, -1)
    weights = jnp.where(mask[:, None], weights, 0.0)
  return idx, weights


def top2_sum_gate(logits: jax.Array, bias: jax.Array, num_topk: int, *, scoring_func: str, num_topk_groups: int = 0,
                  num_groups: int = 0, use_shared_as_routed: bool = False, num_shared_experts: int = 0,
                  routed_scaling_factor: float | jax.Array = 1.0, ep_rank: int | jax.Array = 0, num_ep_ranks: int = 1,
                  tp_rank: int | jax.Array = 0, num_tp_ranks: int = 1, mask: jax.Array | None = None,
                  fix_routing_mask: jax.Array | None = None, to_physical_map: jax.Array | None = None,
                  logical_count: jax.Array | None = None,
                  unmapped_topk_idx: jax.Array | None = None) -> TopkRouting | TopkRoutingWithUnmapped:
  """The DeepSeek router (docs/moe.md, "top2_sum_gate"); arguments, results and the handling of fixed-routing ids outside
  ``[0, E)`` as :func:`jaxkern.moe.top2_sum_gate` (validated there).

  Runs as one jitted XLA computation (``routed_scaling_factor``, ``ep_rank`` and ``tp_rank`` traced).

  Differentiable by plain autodiff: ``topk_weights`` w.r.t. ``logits`` and an array
  ``routed_scaling_factor``, the selection held fixed (the sort yields integers); the scores through
  :func:`elementwise_scores`' rule or softmax's ops, the division through :func:`ieee.div`'s. ``bias``
  gets a zero gradient (it only moves the selection). Masked rows get zero gradients, even non-finite ones.
  """
  return _top2_sum_gate(logits, bias, routed_scaling_factor, ep_rank, tp_rank, mask, fix_routing_mask,
                        to_physical_map, logical_count, unmapped_topk_idx, num_topk=num_topk,
                        num_topk_groups=num_topk_groups, num_groups=num_groups,
                        num_shared=num_shared_experts if use_shared_as_routed else 0, num_ep_ranks=num_ep_ranks,
                        num_tp_ranks=num_tp_ranks, scoring_func=scoring_func.lower())


@functools.partial(jax.jit, static_argnames=("num_topk", "num_topk_groups", "num_groups", "num_shared",
                                             "num_ep_ranks", "num_tp_ranks", "scoring_func"))
def _top2_sum_gate(logits, bias, routed_scaling_factor, ep_rank, tp_rank, mask, fix_routing_mask, to_physical_map,
                   logical_count, unmapped_topk_idx, *, num_topk, num_topk_groups, num_groups, num_shared,
                   num_ep_ranks, num_tp_ranks, scoring_func):
  if mask is not None:  # masked rows may hold anything; their outputs are constants: zeros keep NaN out of the gradient
    logits = jnp.where(mask[:, None], logits, 0.0)
  u = gate_scores(logits, scoring_func)
  idx = group_limited_topk(ranking_scores(logits, u, bias, scoring_func), num_topk, num_groups, num_topk_groups)
  out = route_selected(u, idx, routed_scaling_factor, num_shared, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks,
                       mask, fix_routing_mask, to_physical_map, logical_count, unmapped_topk_idx)
  return out._replace(topk_weights=nan_weights_of_non_finite_rows(out.topk_weights, logits, num_topk))


def nan_weights_of_non_finite_rows(weights: jax.Array, logits: jax.Array, num_topk: int) -> jax.Array:
  """``weights`` with the ``num_topk`` routed slots of every row holding a non-finite logit set to NaN
  (docs/moe.md, "top2_sum_gate", "Non-finite logits"); masked rows' logits are zeros by then."""
  finite = jnp.all(jnp.isfinite(logits), axis=1, keepdims=True)
  routed = jnp.arange(weights.shape[1]) < num_topk
  return jnp.where(finite | ~routed, weights, jnp.nan)


def route_selected(u: jax.Array, idx: jax.Array, routed_scaling_factor: float | jax.Array, num_shared: int,
                   ep_rank: int | jax.Array, num_ep_ranks: int, tp_rank: int | jax.Array, num_tp_ranks: int,
                   mask: jax.Array, fix_routing_mask: jax.Array, to_physical_map: jax.Array, logical_count: jax.Array,
                   unmapped_topk_idx: jax.Array):
  """Everything after the selection: fixed rows, weights, shared slots, replicas, masking.

  A fixed-routing id outside ``[0, E)`` drops its slot: id -1 (also in the unmapped output), weight
  0.0, left out of the weight sum.
  """
  e = u.shape[1]
  if fix_routing_mask is not None:
    given = unmapped_topk_idx
    given = jnp.where((given >= 0) & (given < e), given, -1).astype(jnp.int32)  # range test before any cast
    idx = jnp.where(fix_routing_mask[:, None], given, idx)
    ok = idx >= 0
    u_sel = jnp.where(ok, jnp.take_along_axis(u, jnp.where(ok, idx, 0), axis=1), 0.0)
    weights = jnp.where(ok, normalized_weights(u_sel, routed_scaling_factor), 0.0)
  else:
    weights = normalized_weights(jnp.take_along_axis(u, idx, axis=1), routed_scaling_factor)
  topk_idx, topk_weights = finish_gate(
      idx, weights, num_experts=e, num_shared=num_shared, ep_rank=ep_rank, num_ep_ranks=num_ep_ranks,
      tp_rank=tp_rank, num_tp_ranks=num_tp_ranks, mask=mask, to_physical_map=to_physical_map,
      logical_count=logical_count)
  if unmapped_topk_idx is None:
    return TopkRouting(topk_idx, topk_weights)
  unmapped = idx if mask is None else jnp.where(mask[:, None], idx, -1)
  return TopkRoutingWithUnmapped(topk_idx, topk_weights, unmapped)


# Routing (docs/moe.md, "The fused layout" to "Helpers").
#
# Bad indices under jit (the kernels do the same): a token_topk_to_pos entry outside [0, N) (N fused
# rows) is an unused slot, like -1; topk_idx / group_idx entries outside [0, E) are ignored.

_E4M3_MAX = 448.0


def upper_bound_rows(num_tokens: int, num_topk: int, num_experts: int, alignment: int) -> int:
  """Fused rows needed in the worst case: ``floordiv(T*K + (a-1)*E, a) * a``."""
  return (num_tokens * num_topk + (alignment - 1) * num_experts) // alignment * alignment


def get_fused_mapping(topk_idx: jax.Array, num_experts: int, num_expanded_tokens: int, alignment: int, *,
                      force_no_sync: bool = False) -> FusedMapping:
  """The fused layout of :func:`jaxkern.moe.get_fused_mapping` (same arguments and result).

  Entries are placed in ascending flat order ``t*K + k`` inside each expert's segment (a stable
  sort by expert). ``num_expanded_tokens = 0`` sizes the layout: on the host (concrete
  ``topk_idx``) without ``force_no_sync``, else the upper bound :func:`upper_bound_rows`.
  """
  num_tokens, num_topk = topk_idx.shape
  sync = num_expanded_tokens == 0 and not force_no_sync
  n = num_expanded_tokens or upper_bound_rows(num_tokens, num_topk, num_experts, alignment)
  outs = fused_mapping(jnp.asarray(topk_idx), num_experts, n, alignment)
  if not sync:
    return FusedMapping(*outs, [])
  counts = np.asarray(outs[6]).tolist()
  used = sum(counts)
  return FusedMapping(*(o[:used] for o in outs[:3]), *outs[3:], counts)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def fused_mapping(topk_idx: jax.Array, num_experts: int, num_expanded_tokens: int, alignment: int):
  """The first seven fields of :func:`get_fused_mapping` with exactly ``num_expanded_tokens`` rows.

  Entries outside ``[0, num_experts)`` are treated as empty slots; rows past ``num_expanded_tokens``
  are dropped (their slots keep positions ``>= num_expanded_tokens`` in ``token_topk_to_pos``).
  """
  num_tokens, num_topk = topk_idx.shape
  n, e = num_expanded_tokens, num_experts
  flat = topk_idx.reshape(-1).astype(jnp.int32)
  valid = (flat >= 0) & (flat < e)
  key = jnp.where(valid, flat, e)
  counts = jnp.zeros((e + 1,), jnp.int32).at[key].add(1)[:e]
  aligned = (counts + alignment - 1) // alignment * alignment
  start = jnp.cumsum(aligned) - aligned
  raw_start = jnp.cumsum(counts) - counts
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  sorted_key = key[order]
  sorted_valid = sorted_key < e
  safe = jnp.minimum(sorted_key, e - 1) if e else sorted_key
  rank = jnp.arange(flat.shape[0], dtype=jnp.int32) - raw_start[safe] if e else sorted_key
  pos_sorted = jnp.where(sorted_valid, start[safe] + rank if e else sorted_key, -1)
  token_topk_to_pos = jnp.full(flat.shape, -1, jnp.int32).at[order].set(pos_sorted)
  dest = jnp.where(sorted_valid, pos_sorted, n)
  pos_to_token_topk = jnp.full((n,), -1, jnp.int32).at[dest].set(order, mode="drop")
  pos_to_expert = jnp.full((n,), -1, jnp.int32).at[dest].set(sorted_key, mode="drop")
  pos_to_token = jnp.where(pos_to_token_topk >= 0, pos_to_token_topk // max(num_topk, 1), -1)
  return (pos_to_expert, pos_to_token, pos_to_token_topk,
          token_topk_to_pos.reshape(num_tokens, num_topk), start, start + aligned, aligned)


def expand_to_fused(x: jax.Array, token_topk_to_pos: jax.Array, pos_to_expert: jax.Array) -> jax.Array:
  """``out[p] = x[t]`` for every ``token_topk_to_pos[t, k] = p`` in ``[0, N)`` (other entries are
  unused slots); every other row is zero. Of several slots naming one row, one wins (XLA's scatter
  order, unspecified)."""
  n = pos_to_expert.shape[0]
  num_tokens, num_topk = token_topk_to_pos.shape
  pos = token_topk_to_pos.reshape(-1)
  # Each row's source token by an integer scatter, then a gather: a copy of the bits (XLA:CPU may move a bfloat16
  # scatter through float32 and back, which turns a NaN with a payload into the canonical NaN).
  if num_tokens == 0:
    return jnp.zeros((n,) + x.shape[1:], x.dtype)
  tokens = jnp.repeat(jnp.arange(num_tokens, dtype=jnp.int32), num_topk, total_repeat_length=num_tokens * num_topk)
  src = jnp.full((n,), num_tokens, jnp.int32).at[jnp.where((pos >= 0) & (pos < n), pos, n)].set(tokens, mode="drop")
  return jnp.take(x, src, axis=0, mode="fill", fill_value=0)


def expand_to_fused_with_sf(x: jax.Array, num_per_channels: int, token_topk_to_pos: jax.Array, pos_to_expert: jax.Array,
                            *, use_tma_aligned_col_major_sf: bool = False) -> QuantTensor:
  """:func:`expand_to_fused` of ``x = (x_data, x_sf)``; the scale rows travel with the data rows.

  ``out_sf`` is ``(N, Hs)``, or with ``use_tma_aligned_col_major_sf`` the physical
  ``(Hs, align(N, 4))`` buffer whose padding columns are zero.
  """
  del num_per_channels
  x_data, x_sf = x
  out = expand_to_fused(x_data, token_topk_to_pos, pos_to_expert)
  return QuantTensor(out, expand_sf(x_sf, token_topk_to_pos, pos_to_expert, use_tma_aligned_col_major_sf))


def expand_sf(x_sf: jax.Array, token_topk_to_pos: jax.Array, pos_to_expert: jax.Array,
              use_tma_aligned_col_major_sf: bool):
  """The ``out_sf`` of :func:`expand_to_fused_with_sf`."""
  out_sf = expand_to_fused(x_sf, token_topk_to_pos, pos_to_expert)
  if use_tma_aligned_col_major_sf:
    out_sf = jnp.pad(out_sf.T, ((0, 0), (0, -out_sf.shape[0] % 4)))
  return out_sf


fma = ieee.fma  # single-rounding float32 a*b + c (moved to jaxkern.reference.ieee, shared with quant)


def reduce_fused(x: jax.Array, topk_weights: jax.Array, token_topk_to_pos: jax.Array, *, fp8_format: str = "",
                 sf: jax.Array | None = None) -> jax.Array:
  """``out[t] = cast(sf * sum_k fma-accumulated x[p_k] * w[t, k] * x_sf[p_k])`` in fp32 (docs/moe.md, "Reduce");
  slots with ``p_k`` outside ``[0, N)`` are skipped, repeated positions are summed like any other."""
  x, x_sf = x if isinstance(x, tuple) else (x, None)
  num_tokens, num_topk = token_topk_to_pos.shape
  n = x.shape[0]
  acc = jnp.zeros((num_tokens, x.shape[1]), jnp.float32)
  for k in range(num_topk):
    p = token_topk_to_pos[:, k]
    valid = (p >= 0) & (p < n)
    safe = jnp.where(valid, p, 0)
    s = jnp.ones((num_tokens,), jnp.float32) if topk_weights is None else topk_weights[:, k]
    if x_sf is not None and n:
      s = s * x_sf[safe]
    rows = x[safe].astype(jnp.float32) if n else jnp.zeros_like(acc)
    acc = jnp.where(valid[:, None], fma(rows, s[:, None], acc), acc)
  if sf is not None:
    acc = acc * sf[0]
  if fp8_format == "e4m3":
    return jnp.clip(acc, -_E4M3_MAX, _E4M3_MAX).astype(jnp.float8_e4m3fn)
  return acc.astype(x.dtype)


def normalize_weight(topk_weights: jax.Array) -> NormalizedWeights:
  """``(d, w / d[:, None])`` with ``d = ((1e-20 + w[:, 0]) + w[:, 1]) + ...`` and IEEE division;
  differentiable by plain autodiff (:func:`ieee.div` has the derivative of ``a / b``)."""
  d = jnp.full(topk_weights.shape[:1], 1e-20, jnp.float32)
  for k in range(topk_weights.shape[1]):
    d = d + topk_weights[:, k]
  return NormalizedWeights(d, ieee.div(topk_weights, d[:, None]))


def aux_fi(topk_idx: jax.Array, num_experts: int, num_aux_topk: int) -> jax.Array:
  """``fi[e] = (float(count_e) * E) / float(T * num_aux_topk)``; zeros when ``T = 0``."""
  num_tokens = topk_idx.shape[0]
  if num_tokens == 0:
    return jnp.zeros((num_experts,), jnp.float32)
  counts = group_count(topk_idx, num_experts).astype(jnp.float32)
  return ieee.div(counts * jnp.float32(num_experts), jnp.float32(num_tokens * num_aux_topk))


def group_count(group_idx: jax.Array, num_groups: int) -> jax.Array:
  """int32 histogram of the entries in ``[0, num_groups)``; other values are ignored."""
  flat = group_idx.reshape(-1).astype(jnp.int32)
  key = jnp.where((flat >= 0) & (flat < num_groups), flat, num_groups)
  return jnp.zeros((num_groups + 1,), jnp.int32).at[key].add(1)[:num_groups]


def mask_indices_by_tp(indices: jax.Array, n: int, num_ep_ranks: int, tp_rank: int | jax.Array,
                       num_tp_ranks: int) -> jax.Array:
  """EP/TP masking and local renumbering (docs/moe.md, "Helpers"); negatives become -1."""
  return mask_by_tp(indices.astype(jnp.int32), n // num_ep_ranks, tp_rank, num_tp_ranks).astype(indices.dtype)


def unique_group_indices(group_indices: jax.Array, num_groups: int) -> jax.Array:
  """Repeated non-negative values of a row, after their first occurrence, become -1."""
  del num_groups
  num_topk = group_indices.shape[1]
  earlier = jnp.tril(jnp.ones((num_topk, num_topk), bool), -1)
  same = group_indices[:, :, None] == group_indices[:, None, :]
  dup = jnp.any(same & earlier[None], axis=2) & (group_indices >= 0)
  return jnp.where(dup, jnp.asarray(-1, group_indices.dtype), group_indices)

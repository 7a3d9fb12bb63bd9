"""``jnp`` references for the gating ops of :mod:`jaxkern.moe` (spec moe_transpose.md §3, §4).

Index outputs are int32 (spec §9.1). Scores are ranked with NaN treated as ``-inf`` and
``-0.0`` equal to ``+0.0``; ties go to the smaller index (a stable descending sort).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxkern import _ieee


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
  """``(T, E)`` float32 -> ``(T, num_topk)`` int32 indices of the largest scores (spec §4.1)."""
  return stable_topk(scores, num_topk)


def group_scores(scores: jax.Array, num_topk_sum: int) -> jax.Array:
  """``(..., G, Epg)`` -> ``(..., G)``: the best value, or the fp32 sum of the two best values."""
  v = _canonical(scores)
  best = jnp.take_along_axis(v, stable_topk(v, num_topk_sum), axis=-1)
  return best[..., 0] if num_topk_sum == 1 else best[..., 0] + best[..., 1]


def topk_sum_and_topk_group_idx(scores: jax.Array, num_topk_sum: int, num_topk_groups: int) -> jax.Array:
  """``(T, G, Epg)`` float32 -> ``(T, num_topk_groups)`` int32 best groups in rank order (spec §4.2)."""
  return stable_topk(group_scores(scores, num_topk_sum), num_topk_groups)


SCORING_FUNCS = ("sigmoid", "sqrtsoftplus", "softmax")
HASH_MULTIPLIER = 23333
_WEIGHT_EPS = 1e-20  # fp32 bits 0x1E3CE508: seed of the weight sum


def softplus(x: jax.Array) -> jax.Array:
  """Thresholded softplus: ``x`` above 20, else ``log1p(exp(x))`` (spec §3.2)."""
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


def gate_scores(logits: jax.Array, scoring_func: str) -> jax.Array:
  """Unbiased scores ``u`` (spec §3.2), with correctly rounded division and sqrt."""
  if scoring_func == "sigmoid":
    return _ieee.div(jnp.ones_like(logits), 1.0 + jnp.exp(-logits))
  if scoring_func == "sqrtsoftplus":
    return _ieee.sqrt(softplus(logits))
  # The barriers keep exp out of reduction fusions, where XLA:CPU evaluates it differently.
  m = lax.optimization_barrier(jnp.max(logits, axis=1, keepdims=True))
  z = lax.optimization_barrier(jnp.exp(logits - m))
  return _ieee.div(z, softmax_denominator(z)[:, None])


def ranking_scores(logits: jax.Array, u: jax.Array, bias: jax.Array, scoring_func: str) -> jax.Array:
  """``u + bias``, or ``logits + bias`` for softmax (spec §4.3 step 2)."""
  return (logits if scoring_func == "softmax" else u) + bias


def group_limited_topk(b: jax.Array, num_topk: int, num_groups: int, num_topk_groups: int) -> jax.Array:
  """Top-k of ``b`` among the experts of the ``num_topk_groups`` best groups (two-best sums)."""
  if num_groups != num_topk_groups:
    t, e = b.shape
    groups = stable_topk(group_scores(b.reshape(t, num_groups, e // num_groups), 2), num_topk_groups)
    keep = (groups[:, :, None] == jnp.arange(num_groups)).any(axis=1)
    b = jnp.where(jnp.repeat(keep, e // num_groups, axis=1), b, -jnp.inf)
  return stable_topk(b, num_topk)


def normalized_weights(u_sel: jax.Array, routed_scaling_factor) -> jax.Array:
  """``u / s * rsf`` with ``s`` summed sequentially from 1e-20 in slot order (spec §4.3 step 6)."""
  s = jnp.full(u_sel.shape[:1], _WEIGHT_EPS, jnp.float32)
  for k in range(u_sel.shape[1]):
    s = s + u_sel[:, k]
  return _ieee.div(u_sel, s[:, None]) * jnp.float32(routed_scaling_factor)


def mask_by_tp(p: jax.Array, experts_per_rank: int, tp_rank, num_tp_ranks: int) -> jax.Array:
  """EP/TP masking and local renumbering of int32 global ids (spec §3.6); negatives -> -1.

  Truncating divisions (equal to floor division for the kept ``p >= 0``), so the Mosaic GPU and
  Triton kernels run this same function.
  """
  r, tp = jnp.int32(experts_per_rank), jnp.int32(num_tp_ranks)
  q = lax.div(p, r)
  local = lax.div(q, tp) * r + lax.rem(p, r)
  return jnp.where((p >= 0) & (lax.rem(q, tp) == tp_rank), local, jnp.int32(-1))


def to_physical(idx: jax.Array, to_physical_map: jax.Array, logical_count: jax.Array, ep_rank) -> jax.Array:
  """Replica choice ``map[l, (t * 23333 + ep_rank) mod count[l]]``, exact in int32 (spec §3.5)."""
  c = logical_count[idx]
  t = jnp.arange(idx.shape[0], dtype=jnp.int32)[:, None]
  d = ((t % c) * (HASH_MULTIPLIER % c) + ep_rank % c) % c
  return to_physical_map[idx, d]


def finish_gate(idx, weights, *, num_experts, num_shared, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks,
                mask, to_physical_map, logical_count):
  """Steps 7-10 of spec §4.3 on the routed slots: shared slots, replicas, EP/TP masking, token mask."""
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


@functools.partial(jax.jit, static_argnames=("num_topk", "num_topk_groups", "num_groups", "use_shared_as_routed",
                                             "num_shared_experts", "num_ep_ranks", "num_tp_ranks", "scoring_func"))
def top2_sum_gate(logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
                  routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, mask=None,
                  fix_routing_mask=None, to_physical_map=None, logical_count=None, unmapped_topk_idx=None):
  """The DeepSeek router (spec §4.3); arguments as :func:`jaxkern.moe.top2_sum_gate` (validated there).

  Jitted as one XLA computation (``routed_scaling_factor``, ``ep_rank`` and ``tp_rank`` are traced).

  Returns ``(topk_idx, topk_weights)``, plus the new ``unmapped_topk_idx`` when one is passed.
  """
  scoring_func = scoring_func.lower()
  u = gate_scores(logits, scoring_func)
  idx = group_limited_topk(ranking_scores(logits, u, bias, scoring_func), num_topk, num_groups, num_topk_groups)
  return route_selected(u, idx, routed_scaling_factor, num_shared_experts if use_shared_as_routed else 0,
                        ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, mask, fix_routing_mask, to_physical_map,
                        logical_count, unmapped_topk_idx)


def route_selected(u, idx, routed_scaling_factor, num_shared, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, mask,
                   fix_routing_mask, to_physical_map, logical_count, unmapped_topk_idx):
  """Everything after the selection: fixed rows, weights, shared slots, replicas, masking."""
  if fix_routing_mask is not None:
    idx = jnp.where(fix_routing_mask[:, None], unmapped_topk_idx.astype(jnp.int32), idx)
  weights = normalized_weights(jnp.take_along_axis(u, idx, axis=1), routed_scaling_factor)
  topk_idx, topk_weights = finish_gate(
      idx, weights, num_experts=u.shape[1], num_shared=num_shared, ep_rank=ep_rank, num_ep_ranks=num_ep_ranks,
      tp_rank=tp_rank, num_tp_ranks=num_tp_ranks, mask=mask, to_physical_map=to_physical_map,
      logical_count=logical_count)
  if unmapped_topk_idx is None:
    return topk_idx, topk_weights
  unmapped = idx if mask is None else jnp.where(mask[:, None], idx, -1)
  return topk_idx, topk_weights, unmapped

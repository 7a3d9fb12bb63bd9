"""``jnp`` references for the gating ops of :mod:`jaxkern.moe` (spec moe_transpose.md §3, §4).

Index outputs are int32 (spec §9.1). Scores are ranked with NaN treated as ``-inf`` and
``-0.0`` equal to ``+0.0``; ties go to the smaller index (a stable descending sort).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


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

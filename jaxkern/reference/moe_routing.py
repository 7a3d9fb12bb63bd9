"""``jnp`` references of the MoE routing ops (moe_transpose.md §5, §6).

Index inputs may be int32 or int64; index outputs are int32 (spec §9.1). Shapes and
static arguments are assumed valid: the public ops in :mod:`jaxkern.moe` check them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxkern.reference import ieee, moe

_E4M3_MAX = 448.0


def upper_bound_rows(num_tokens: int, num_topk: int, num_experts: int, alignment: int) -> int:
  """Fused rows needed in the worst case: ``floordiv(T*K + (a-1)*E, a) * a``."""
  return (num_tokens * num_topk + (alignment - 1) * num_experts) // alignment * alignment


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def get_fused_mapping(topk_idx, num_experts: int, num_expanded_tokens: int, alignment: int):
  """The fused layout of ``topk_idx`` ``(T, K)`` with exactly ``num_expanded_tokens`` rows.

  Returns the first seven outputs of :func:`jaxkern.moe.get_fused_mapping`. Entries are
  placed in ascending flat order ``t*K + k`` inside each expert's segment. Entries outside
  ``[0, num_experts)`` are treated as empty slots; rows past ``num_expanded_tokens`` are dropped.
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


def expand_to_fused(x, token_topk_to_pos, pos_to_expert):
  """``out[p] = x[t]`` for every ``token_topk_to_pos[t, k] = p >= 0``; every other row is zero."""
  n = pos_to_expert.shape[0]
  num_tokens, num_topk = token_topk_to_pos.shape
  pos = token_topk_to_pos.reshape(-1)
  rows = jnp.repeat(x, num_topk, axis=0, total_repeat_length=num_tokens * num_topk)
  return jnp.zeros((n,) + x.shape[1:], x.dtype).at[jnp.where(pos >= 0, pos, n)].set(rows, mode="drop")


def expand_to_fused_with_sf(x, num_per_channels: int, token_topk_to_pos, pos_to_expert,
                            use_tma_aligned_col_major_sf: bool = False):
  """:func:`expand_to_fused` of ``x = (x_data, x_sf)``; the scale rows travel with the data rows.

  ``out_sf`` is ``(N, Hs)``, or with ``use_tma_aligned_col_major_sf`` the physical
  ``(Hs, align(N, 4))`` buffer whose padding columns are zero.
  """
  del num_per_channels
  x_data, x_sf = x
  out = expand_to_fused(x_data, token_topk_to_pos, pos_to_expert)
  return out, expand_sf(x_sf, token_topk_to_pos, pos_to_expert, use_tma_aligned_col_major_sf)


def expand_sf(x_sf, token_topk_to_pos, pos_to_expert, use_tma_aligned_col_major_sf: bool):
  """The ``out_sf`` of :func:`expand_to_fused_with_sf`."""
  out_sf = expand_to_fused(x_sf, token_topk_to_pos, pos_to_expert)
  if use_tma_aligned_col_major_sf:
    out_sf = jnp.pad(out_sf.T, ((0, 0), (0, -out_sf.shape[0] % 4)))
  return out_sf


def fma(a, b, c):
  """Single-rounding float32 ``a*b + c``, exact on every backend.

  The product of two float32 values is exact in float64; the float64 sum is made
  round-to-odd (TwoSum error term, then nudge an even result one ulp towards the
  error), which makes the final float64 -> float32 rounding correct.
  """
  with jax.enable_x64(True):
    a, b, c = (jnp.asarray(v, jnp.float32).astype(jnp.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    bits = lax.bitcast_convert_type(s, jnp.int64)
    inexact_even = (err != 0) & ((bits & 1) == 0) & jnp.isfinite(err)
    step = jnp.where((err > 0) == (s > 0), 1, -1).astype(jnp.int64)
    s = jnp.where(inexact_even, lax.bitcast_convert_type(bits + step, jnp.float64), s)
    return s.astype(jnp.float32)


def reduce_fused(x, topk_weights, token_topk_to_pos, fp8_format: str = "", sf=None):
  """``out[t] = cast(sf * sum_k fma-accumulated x[p_k] * w[t, k] * x_sf[p_k])`` in fp32 (spec §5.4)."""
  x, x_sf = x if isinstance(x, tuple) else (x, None)
  num_tokens, num_topk = token_topk_to_pos.shape
  acc = jnp.zeros((num_tokens, x.shape[1]), jnp.float32)
  for k in range(num_topk):
    p = token_topk_to_pos[:, k]
    safe = jnp.clip(p, 0, max(x.shape[0] - 1, 0))
    s = jnp.ones((num_tokens,), jnp.float32) if topk_weights is None else topk_weights[:, k]
    if x_sf is not None:
      s = s * x_sf[safe]
    rows = x[safe].astype(jnp.float32) if x.shape[0] else jnp.zeros_like(acc)
    acc = jnp.where((p >= 0)[:, None], fma(rows, s[:, None], acc), acc)
  if sf is not None:
    acc = acc * sf[0]
  if fp8_format == "e4m3":
    return jnp.clip(acc, -_E4M3_MAX, _E4M3_MAX).astype(jnp.float8_e4m3fn)
  return acc.astype(x.dtype)


def normalize_weight(topk_weights):
  """``(d, w / d[:, None])`` with ``d = ((1e-20 + w[:, 0]) + w[:, 1]) + ...`` and IEEE division."""
  d = jnp.full(topk_weights.shape[:1], 1e-20, jnp.float32)
  for k in range(topk_weights.shape[1]):
    d = d + topk_weights[:, k]
  return d, ieee.div(topk_weights, d[:, None])


def aux_fi(topk_idx, num_experts: int, num_aux_topk: int):
  """``fi[e] = (float(count_e) * E) / float(T * num_aux_topk)``; zeros when ``T = 0``."""
  num_tokens = topk_idx.shape[0]
  if num_tokens == 0:
    return jnp.zeros((num_experts,), jnp.float32)
  counts = group_count(topk_idx, num_experts).astype(jnp.float32)
  return ieee.div(counts * jnp.float32(num_experts), jnp.float32(num_tokens * num_aux_topk))


def group_count(group_idx, num_groups: int):
  """int32 histogram of the entries in ``[0, num_groups)``; other values are ignored."""
  flat = group_idx.reshape(-1).astype(jnp.int32)
  key = jnp.where((flat >= 0) & (flat < num_groups), flat, num_groups)
  return jnp.zeros((num_groups + 1,), jnp.int32).at[key].add(1)[:num_groups]


def mask_indices_by_tp(indices, n: int, num_ep_ranks: int, tp_rank, num_tp_ranks: int):
  """EP/TP masking and local renumbering (spec §3.6, §6.4); negatives become -1."""
  return moe.mask_by_tp(indices.astype(jnp.int32), n // num_ep_ranks, tp_rank, num_tp_ranks).astype(indices.dtype)


def unique_group_indices(group_indices, num_groups: int):
  """Repeated non-negative values of a row, after their first occurrence, become -1."""
  del num_groups
  num_topk = group_indices.shape[1]
  earlier = jnp.tril(jnp.ones((num_topk, num_topk), bool), -1)
  same = group_indices[:, :, None] == group_indices[:, None, :]
  dup = jnp.any(same & earlier[None], axis=2) & (group_indices >= 0)
  return jnp.where(dup, jnp.asarray(-1, group_indices.dtype), group_indices)

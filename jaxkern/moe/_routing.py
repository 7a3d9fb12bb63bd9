"""Checks and row tiling shared by the routing ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _checks
from jaxkern.reference import moe as ref

INDEX_DTYPES = (jnp.int32, jnp.int64)
TMA_MAX_BOX = 256  # elements per dimension of one TMA copy
# For load/store_staged_rows: lane semantics (warpgroup semantics' layout inference rejects strided
# SMEM views) without the barriers Pallas would put around every store (the helpers place theirs).
LANE = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane, unsafe_no_auto_barriers=True)


def thread_rows(x, rows_per_cta: int):
  """Tiling of a ``(T, K)`` array for kernels where each thread owns whole rows: returns ``(x padded to
  at least 128 rows (tiny inputs only), rows per CTA, grid size, one-value-per-thread layout)``."""
  t = x.shape[0]
  tp = max(t, 128)
  if tp != t:
    x = jnp.pad(x, ((0, tp - t), (0, 0)))
  rt = min(rows_per_cta, tp // 128 * 128)
  return x, rt, pl.cdiv(tp, rt), plgpu.Layout.WG_STRIDED((rt,), vec_size=1)


def load_thread_rows(x_g, rt: int, layout):
  """In a :func:`thread_rows` kernel: this CTA's rows (the last CTA shifted back to end at the last
  row) and the list of their ``K`` columns, one strided load each."""
  rows = pl.ds(jnp.minimum(lax.axis_index("i") * rt, x_g.shape[0] - rt), rt)
  return rows, [plgpu.load(x_g.at[rows, j], layout=layout, optimized=False) for j in range(x_g.shape[1])]


def load_staged_rows(x_g, x_s, rt: int, layout):
  """:func:`load_thread_rows` through shared memory, for kernels compiled with ``LANE``: the CTA's
  ``(rt, K)`` block is copied into the SMEM scratch ``x_s`` with coalesced loads (consecutive
  threads, consecutive 4-, 8- or 16-byte vectors), then each thread reads its row's ``K`` columns
  from ``x_s``.
  ``rt`` must be 128 (one row per thread): a lane-semantics store into a strided SMEM column
  reads the old value with vectors of ``rt / 128`` words, which need unit stride.

  Against strided column loads straight from GMEM this took K = 8-9 rows from 3.4-5.9 us to
  2.0-2.5 us on an H200 (``normalize_weight``, ``unique_group_indices``); K = 2 rows, which a
  warp's column load covers in 2 cache lines, were 0.05-0.1 us faster without it."""
  rows = pl.ds(jnp.minimum(lax.axis_index("i") * rt, x_g.shape[0] - rt), rt)
  x_s[...] = plgpu.load(x_g.at[rows], layout=_block_layout(x_s), optimized=False)
  plgpu.commit_smem()  # the block is read by other threads than the ones that wrote it
  return rows, [plgpu.load(x_s.at[:, j], layout=layout, optimized=False) for j in range(x_s.shape[1])]


def store_staged_rows(o_g, x_s, rows, cols) -> None:
  """Writes each thread's ``K`` columns ``cols`` into ``x_s`` (the thread's own rows: no barrier
  needed after :func:`load_staged_rows`), then the block to ``o_g[rows]`` with coalesced stores."""
  for j, c in enumerate(cols):
    x_s[:, j] = c
  plgpu.commit_smem()
  o_g[rows] = plgpu.load(x_s, layout=_block_layout(x_s), optimized=False)


def _block_layout(x_s):
  """Consecutive threads, consecutive vectors of the ``(128, K)`` block: 16 or 8 bytes where K allows."""
  k = x_s.shape[1]
  return plgpu.Layout.WG_STRIDED(tuple(x_s.shape), vec_size=4 if k % 4 == 0 else 2 if k % 2 == 0 else 1)


def check_index(name: str, x, ndim: int, dtypes=INDEX_DTYPES):
  """``x`` as an array (lists converted) of rank ``ndim`` and an index dtype; returns it."""
  x = _checks.as_array(name, x)
  _checks.check_rank(name, x, ndim)
  _checks.check_dtype(name, x, dtypes)
  return x


def check_shape(name: str, x, shape) -> None:
  _checks.check_shape(name, x, shape)


def check_values_below(name: str, x, limit: int) -> None:
  """Raises if a concrete (non-traced) ``x`` holds a value ``>= limit`` or below ``-1``."""
  if not is_concrete(x) or not x.size:
    return
  v = np.asarray(x)
  if v.max() >= limit or v.min() < -1:
    raise ValueError(f"{name} must hold -1 or values in [0, {limit}), got range [{v.min()}, {v.max()}]")


def is_concrete(x) -> bool:
  """Whether ``x`` holds values known now (not traced under ``jit`` / ``vmap`` / ``checkify``)."""
  return not isinstance(x, jax.core.Tracer)


def debug_check_positions(op: str, token_topk_to_pos, n: int) -> None:
  """Opt-in checked mode of the ops that read ``token_topk_to_pos`` (``n`` fused rows).

  Under ``checkify.checkify(f, errors=checkify.user_checks)`` this reports the first slot (in
  flat order ``t*K + k``) whose entry is outside ``{-1} ∪ [0, n)`` or names the same fused row
  as an earlier slot, with its position and value. Without checkify the check is dropped
  (``checkify.debug_check``): its predicate has no use left, and XLA removes it from the compiled
  program (tests/moe/test_expand_to_fused.py compares the compiled programs). Concrete
  (non-traced) arrays are not checked here: the ops range-check them on the host.
  """
  if is_concrete(token_topk_to_pos) or not token_topk_to_pos.size:
    return
  k = token_topk_to_pos.shape[1]
  flat = token_topk_to_pos.reshape(-1)
  slot = jnp.arange(flat.shape[0], dtype=jnp.int32)
  in_range = (flat >= 0) & (flat < n)
  row = jnp.where(in_range, flat, n)
  first_slot = jnp.full((n + 1,), flat.shape[0], jnp.int32).at[row].min(slot)[row]
  out_of_range = (flat < -1) | (flat >= n)
  repeated = in_range & (first_slot < slot)
  i = jnp.argmax(out_of_range | repeated).astype(jnp.int32)  # the first bad slot (0 if none)
  where = f"{op}: token_topk_to_pos[{{}}, {{}}] = {{}}"
  checkify.debug_check(~out_of_range[i], where + f" is outside {{{{-1}}}} ∪ [0, {n}) (N = {n} fused rows); "
                       "it is the first bad entry", i // k, i % k, flat[i])
  checkify.debug_check(~repeated[i], where + " names the fused row of the earlier slot [{}, {}]; "
                       "it is the first bad entry", i // k, i % k, flat[i], first_slot[i] // k, first_slot[i] % k)


def needed_rows(topk_idx, num_experts: int, alignment: int) -> int:
  """Rows of the fused layout of a concrete ``topk_idx``: the sum of the aligned expert counts."""
  v = np.asarray(topk_idx).reshape(-1)
  counts = np.bincount(v[(v >= 0) & (v < num_experts)], minlength=num_experts)
  return int(((counts + alignment - 1) // alignment * alignment).sum())


def row_tiling(h: int, itemsize: int, name: str) -> tuple[int, int]:
  """Splits a row of ``h`` elements into ``(R, C)`` TMA-copyable pieces (``R, C <= 256``, 16-byte ``C``).

  A whole row then moves with a single 2-D TMA copy of the ``(T, R, C)`` view.
  """
  for c in range(min(h, TMA_MAX_BOX), 0, -1):
    if h % c == 0 and (c * itemsize) % 16 == 0 and h // c <= TMA_MAX_BOX:
      return h // c, c
  raise ValueError(f"{name}.shape[1] = {h} must be a multiple of {16 // itemsize} elements "
                   f"(16 bytes) and at most {TMA_MAX_BOX * TMA_MAX_BOX}")


ONE_HOT_MAX_BUCKETS = 64  # above this, one-hot counting writes too much; scatter-add instead


def histogram(idx: jax.Array, num_buckets: int) -> jax.Array:
  """int32 count of each value ``[0, num_buckets)`` in ``idx`` (other values ignored).

  For up to ``ONE_HOT_MAX_BUCKETS`` buckets it is a compare-and-sum of the flat entries
  against every bucket (one XLA reduction: no atomics, about 2x faster than the scatter-add
  on an H200); above that, the reference's scatter-add.
  """
  if num_buckets > ONE_HOT_MAX_BUCKETS:
    return ref.group_count(idx, num_buckets)
  flat = idx.reshape(-1, 1).astype(jnp.int32)
  return jnp.sum(flat == jnp.arange(num_buckets, dtype=jnp.int32)[None, :], axis=0, dtype=jnp.int32)

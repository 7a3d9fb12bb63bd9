"""In-kernel building blocks of the gating ops: row blocks, order keys, stable top-k, group ranking.

Every gating kernel is a grid of CTAs (one warpgroup each) over blocks of 64 token rows
(:func:`row_block_kernel`); a block is TMA-copied into SMEM in column chunks and held in
registers as a :class:`Row`.

Mosaic GPU has no sort/top_k/argmax, so selection is built from row max/min
reductions over arrays in the WGMMA register layout (64 rows x a multiple of 8
columns per warpgroup). Scores are compared through int32 *order keys*: the
float bits with the magnitude bits of negative values flipped, so that integer
order equals float order. NaN gets the key of ``-inf`` and ``-0.0`` that of
``+0.0``; ``TAKEN`` (below every key) marks experts that can no longer be picked,
so a row of ``-inf`` still yields distinct indices (docs/moe.md, "topk_gate").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

BLOCK_ROWS = 64  # token rows per CTA: one warpgroup, the row tile of the WGMMA layout
COL_ALIGN = 8  # the WGMMA layout needs a multiple of 8 columns
MAX_CHUNK = 64  # columns per TMA box and register chunk (256-wide chunks make lowering very slow)
TAKEN = jnp.iinfo(jnp.int32).min
_LAYOUT = plgpu.Layout.WGMMA


def padded_width(e: int) -> int:
  return -(-e // COL_ALIGN) * COL_ALIGN


def chunks(e: int) -> tuple[tuple[int, int], ...]:
  """Equal ``(start, width)`` column chunks of a row of ``e`` (a multiple of 8) values.

  The width is the largest multiple of 8 that divides ``e`` and is at most ``MAX_CHUNK``
  (a TMA box that does not divide the row is rejected by the lowering).
  """
  w = max(w for w in range(COL_ALIGN, MAX_CHUNK + 1, COL_ALIGN) if e % w == 0)
  return tuple((c, w) for c in range(0, e, w))


def block_start(num_rows: int) -> jax.Array:
  """First row of this CTA's block; the last block is shifted back to end at ``num_rows``.

  Overlapping rows are computed twice with identical results, so ragged token counts
  need no masking (requires ``num_rows >= BLOCK_ROWS``).
  """
  return jnp.minimum(lax.axis_index("i") * BLOCK_ROWS, num_rows - BLOCK_ROWS)


def row_block_kernel(body, num_rows: int, out_type, scratch_types: dict, interpret=None):
  """A Mosaic GPU kernel with one CTA per block of 64 rows: ``body(row0, *refs, **scratch)``.

  ``refs`` are the GMEM inputs then outputs, ``row0`` is :func:`block_start`.
  """

  def kernel(*refs, **scratch):
    body(block_start(num_rows), *refs, **scratch)

  return plgpu.kernel(kernel, out_type=out_type, grid=(pl.cdiv(num_rows, BLOCK_ROWS),), grid_names=("i",),
                      scratch_types=scratch_types, interpret=interpret)


def order_key(v: jax.Array) -> jax.Array:
  """float32 -> int32 with the same order; NaN -> key(-inf), -0.0 -> key(+0.0)."""
  v = jnp.where(v != v, -jnp.inf, v)
  v = jnp.where(v == 0, 0.0, v)
  bits = lax.bitcast_convert_type(v, jnp.int32)
  return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def key_value(key: jax.Array) -> jax.Array:
  """Inverse of :func:`order_key`."""
  return lax.bitcast_convert_type(key ^ ((key >> 31) & 0x7FFFFFFF), jnp.float32)


@dataclasses.dataclass
class Row:
  """A block of rows held in registers as column chunks: ``vals[c]`` is ``(BLOCK_ROWS, w_c)``."""

  vals: list
  cols: list
  spans: tuple

  def restrict(self, lo: int, hi: int) -> Row:
    """The chunks that overlap columns ``[lo, hi)``."""
    keep = [i for i, (c0, w) in enumerate(self.spans) if c0 < hi and lo < c0 + w]
    return Row([self.vals[i] for i in keep], [self.cols[i] for i in keep], tuple(self.spans[i] for i in keep))

  def map(self, f, *others: Row) -> Row:
    return Row([f(*a) for a in zip(self.vals, *(o.vals for o in others))], self.cols, self.spans)

  def map_cols(self, f) -> Row:
    return Row([f(v, c) for v, c in zip(self.vals, self.cols)], self.cols, self.spans)

  def max(self) -> jax.Array:
    return self.reduce(jnp.maximum, jnp.max)

  def min(self) -> jax.Array:
    return self.reduce(jnp.minimum, jnp.min)

  def reduce(self, combine, reduce_cols) -> jax.Array:
    """Row reduction: chunks of equal width are combined elementwise first, so that only one
    cross-lane reduction runs per width (``combine`` must be associative and exact)."""
    by_width = {}
    for v in self.vals:
      by_width[v.shape[1]] = v if v.shape[1] not in by_width else combine(by_width[v.shape[1]], v)
    return functools.reduce(combine, [reduce_cols(v, axis=1) for v in by_width.values()])


def load_rows(x_g, smem, bars, row0, e: int, each=None) -> Row:
  """TMA-loads rows ``[row0, row0 + 64)`` of ``x_g`` (``(T, e)``) and returns them in registers.

  ``smem`` and ``bars`` come from :func:`scratch`. With ``each``, the returned chunks are
  ``each(chunk)``, applied as soon as a chunk arrives (overlapping the copies of the later chunks).
  """
  spans = chunks(e)
  for i, ((c0, w), bar) in enumerate(zip(spans, bars)):
    plgpu.copy_gmem_to_smem(x_g.at[pl.ds(row0, BLOCK_ROWS), pl.ds(c0, w)], smem[i], bar)
  vals = []
  for i, bar in enumerate(bars):
    plgpu.barrier_wait(bar)
    v = plgpu.load(smem[i], layout=_LAYOUT)
    vals.append(v if each is None else each(v))
  return Row(vals, _col_numbers(spans), spans)


def _col_numbers(spans) -> list:
  return [c0 + plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS, w), 1, layout=_LAYOUT) for c0, w in spans]


def scratch(e: int, dtype=jnp.float32) -> dict:
  """The SMEM buffers (one per chunk) and barriers :func:`load_rows` needs for a row of ``e`` values."""
  spans = chunks(e)
  return dict(
      smem=[plgpu.SMEM((BLOCK_ROWS, w), dtype) for _, w in spans],
      bars=[plgpu.Barrier(num_arrivals=1) for _ in spans],
  )


def load_keys(x_g, smem, bars, row0, e: int) -> Row:
  """Order keys of the block of scores at ``row0``."""
  return load_rows(x_g, smem, bars, row0, e, order_key)


def pick_best(keys: Row, big: int) -> tuple[jax.Array, jax.Array, Row]:
  """One step of the stable top-k: per row, the largest key and the smallest column holding it.

  Returns ``(key, column, keys with that column marked TAKEN)``; ``big`` exceeds every column.
  """
  m = keys.max()
  idx = keys.map_cols(lambda k, c: jnp.where(k == m[:, None], c, big)).min()
  return m, idx, keys.map_cols(lambda k, c: jnp.where(c == idx[:, None], TAKEN, k))


def group_scores(keys: Row, num_groups: int, group_size: int, num_topk_sum: int) -> list[jax.Array]:
  """Per group: its best value, or the fp32 sum of its two best values (a multiset), as order keys."""
  big = num_groups * group_size
  out = []
  for g in range(num_groups):
    lo, hi = g * group_size, (g + 1) * group_size
    mine = keys.restrict(lo, hi).map_cols(lambda k, c: jnp.where((c >= lo) & (c < hi), k, TAKEN))
    if num_topk_sum == 1:
      out.append(mine.max())
    else:
      best, _, rest = pick_best(mine, big)
      out.append(order_key(key_value(best) + key_value(rest.max())))
  return out


def group_ranks(scores: list[jax.Array]) -> list[jax.Array]:
  """Rank of each group: score descending, ties -> smaller group index."""
  ranks = []
  for g, s in enumerate(scores):
    r = jnp.zeros_like(s)
    for h, t in enumerate(scores):
      if h != g:
        r += ((t > s) | (t == s) & (h < g)).astype(jnp.int32)
    ranks.append(r)
  return ranks

"""The n-gram hash kernel (engram_mhc.md §3.2): Mosaic GPU, 32-bit integer arithmetic only.

Each CTA takes :data:`ROWS` tokens (the last block shifted back to end at the last token; fewer tokens
than one block are padded by the wrapper). Per layer it walks the n-gram columns: the token ids of
column ``n`` (a contiguous row of the transposed ``(N, T)`` ids, one int32 per token in the per-row
vector layout) times the layer's multiplier words (scalars) give the 64-bit product as uint32
``(hi, lo)`` (:func:`jaxkern.reference.engram.mul_wide`: the high word from 16-bit pieces, as there is no
32x32 -> 64 multiply in the register ops), XOR-ed into the running hash; for ``n >= 1`` the hash is
broadcast against the ``E`` table sizes of that order (a ``(ROWS, E)`` tile, sizes and offsets loaded
as a column vector) and reduced by the floor modulo of :func:`jaxkern.reference.engram.floor_mod` (a
63-step bit-serial long division on 32-bit words, exact for every signed 64-bit hash and size in
``[1, 2^31)``), then the offsets are added and the tile stored into ``out[l, rows, (n-1)E : nE]``.
The kernel shares the pair arithmetic with the reference, so both are the same formula; the reference
is checked against Python integers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern._layouts import row_layout
from jaxkern.reference import engram as ref

ROWS = 256  # tokens per CTA


def tile(e: int):
  """``(layout of a (rows, E) int32 tile, rows it covers once)``."""
  return row_layout(e, 4, 32)


@functools.partial(jax.jit, static_argnames=("interpret",))
def hash_kernel(ids_t, words, sizes, offsets, *, interpret):
  """``ids_t`` ``(N, T)`` int32 (``T`` at least one layout block), ``words`` ``(L, N, 2)`` uint32, ``sizes`` /
  ``offsets`` ``(L, (N-1)E)`` int32 -> ``(L, T, (N-1)E)`` int32."""
  n_cols, t = ids_t.shape
  num_layers, c = sizes.shape
  e = c // (n_cols - 1)
  lay, unit = tile(e)
  rows_per_cta = max(unit, min(ROWS // unit * unit, t // unit * unit))
  num_ctas = pl.cdiv(t, rows_per_cta)

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((num_layers, t, c), jnp.int32), grid=(num_ctas,),
                     grid_names=("i",), interpret=interpret)
  def kernel(ids_g, w_g, s_g, off_g, o_g):
    rows = pl.ds(jnp.minimum(lax.axis_index("i") * rows_per_cta, t - rows_per_cta), rows_per_cta)
    ids = [plgpu.load(ids_g.at[n, rows], layout=lay.reduce(1), optimized=False) for n in range(n_cols)]
    for l in range(num_layers):
      hi = lo = None
      for n in range(n_cols):
        p_hi, p_lo = ref.mul_wide(ids[n], w_g[l, n, 0], w_g[l, n, 1])
        hi, lo = (p_hi, p_lo) if n == 0 else (hi ^ p_hi, lo ^ p_lo)
        if n:
          cols = pl.ds((n - 1) * e, e)
          size = plgpu.load(s_g.at[l, cols], layout=lay.reduce(0), optimized=False)
          off = plgpu.load(off_g.at[l, cols], layout=lay.reduce(0), optimized=False)
          full = lambda a: plgpu.layout_cast(jnp.broadcast_to(a, (rows_per_cta, e)), lay)
          r = ref.floor_mod(full(hi[:, None]), full(lo[:, None]), full(size[None, :]))
          o_g[l, rows, cols] = r + full(off[None, :])

  return kernel(ids_t, words, sizes, offsets)

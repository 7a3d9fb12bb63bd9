"""Reading a stored scale factor inside a kernel, in each of the layouts the casts write: shared by the cast-backs,
the E5M6 decoder and the per-token cast of quantised input."""

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu


def _sf_raw(sf_g, mode, s, idx, layout=None):
  """Stored sf of segment ``s`` for view rows ``idx`` (a ``pl.ds``, loaded as a vector in ``layout``)
  or for one block row ``idx`` (a scalar). ``mode``: ``"rows"`` (float32 ``(segments, R)``),
  ``"cols"`` (layout A ``(R, segments)``: a strided load) or ``"packed"`` (layout C int32 words
  ``(ceil(segments/4), R)``)."""
  at = {"rows": (s, idx), "cols": (idx, s), "packed": (s // 4, idx)}[mode]
  return sf_g[at] if layout is None else plgpu.load(sf_g.at[at], layout=layout, optimized=False)


def _sf_decode(v, mode, s):
  """Stored sf vector -> float32 (a UE8M0 byte ``b`` of a packed word decodes as ``float(b << 23)``)."""
  if mode != "packed":
    return v
  return lax.bitcast_convert_type((lax.shift_right_logical(v, 8 * (s % 4)) & 0xFF) << 23, jnp.float32)

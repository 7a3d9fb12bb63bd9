"""Checks and row tiling shared by the routing ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkern import _checks

INDEX_DTYPES = (jnp.int32, jnp.int64)
TMA_MAX_BOX = 256  # elements per dimension of one TMA copy


def check_index(name: str, x, ndim: int, dtypes=INDEX_DTYPES) -> None:
  _checks.check_rank(name, x, ndim)
  _checks.check_dtype(name, x, dtypes)


def check_shape(name: str, x, shape) -> None:
  if tuple(x.shape) != tuple(shape):
    raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def check_values_below(name: str, x, limit: int) -> None:
  """Raises if a concrete (non-traced) ``x`` holds a value ``>= limit`` or below ``-1``."""
  if isinstance(x, jax.core.Tracer) or not x.size:
    return
  v = np.asarray(x)
  if v.max() >= limit or v.min() < -1:
    raise ValueError(f"{name} must hold -1 or values in [0, {limit}), got range [{v.min()}, {v.max()}]")


def row_tiling(h: int, itemsize: int, name: str) -> tuple[int, int]:
  """Splits a row of ``h`` elements into ``(R, C)`` TMA-copyable pieces (``R, C <= 256``, 16-byte ``C``).

  A whole row then moves with a single 2-D TMA copy of the ``(T, R, C)`` view.
  """
  for c in range(min(h, TMA_MAX_BOX), 0, -1):
    if h % c == 0 and (c * itemsize) % 16 == 0 and h // c <= TMA_MAX_BOX:
      return h // c, c
  raise ValueError(f"{name}.shape[1] = {h} must be a multiple of {16 // itemsize} elements "
                   f"(16 bytes) and at most {TMA_MAX_BOX * TMA_MAX_BOX}")

"""FP4 e2m1 encoding inside the :mod:`jaxkern.quant` kernels."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def encode_e2m1(q):
  """float32 -> e2m1 nibble (int32 in 0..15), bit-identical to
  :func:`jaxkern.reference.quant.encode_e2m1` (also for ±inf and NaN) in about a third of its
  operations, for the kernels.

  ``|q|`` is saturated at 6 and rounded to nearest even on the e2m1 grid by adding and subtracting
  ``M = 2^22 · step`` (step 0.5 below 2, 1 in [2, 4), 2 from 4 up: the sum's ulp is the step); the
  rounded value ``r`` is 0, 0.5 or ``1.5·2^e``/``2^e`` whose bits ``>> 22`` minus 252 are the code
  (0.5 and 0 are fixed up by ``max(·, min(bits, 1))``). Subnormal ``|q|`` round to 0 with or without
  flushing; no multiply, so no contraction.
  """
  u = lax.bitcast_convert_type(q, jnp.int32)
  a = jnp.minimum(u & 0x7FFFFFFF, 0x40C00000)  # bit patterns of non-negative floats order like the floats
  m = jnp.maximum((a & 0x7F800000) + (22 << 23), 149 << 23)
  a_f, m_f = (lax.bitcast_convert_type(v, jnp.float32) for v in (a, m))
  r = lax.bitcast_convert_type((a_f + m_f) - m_f, jnp.int32)
  return ((u >> 28) & 8) | jnp.maximum((r >> 22) - 252, jnp.minimum(r, 1))

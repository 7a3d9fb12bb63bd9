"""``normalize_weight``: divide each token's weights by their 1e-20-seeded sum (spec §6.1).

Mosaic GPU kernel, one warpgroup per CTA and no shared memory: a CTA owns ``ROWS_PER_CTA``
tokens, each thread whole tokens. Column ``k`` of the CTA's tokens is one strided GMEM load
(a warp's loads of the ``K`` columns hit the same cache lines), the sum is accumulated column
by column in registers (``((1e-20 + w0) + w1) + ...``, each addition rounded, as the spec
asks) and each weight is divided with :func:`jaxkern.quant.common.exact_div` (an approximate
float32 quotient corrected by FMA residuals; a zero weight keeps the plain quotient, a signed
zero), so the kernel needs no float64 arithmetic (the reference divides in float64 and rounds
with a midpoint test). The last CTA starts at
``T - ROWS_PER_CTA`` (it recomputes rows of the previous one with identical results), so
ragged ``T`` needs no masking; fewer than 128 tokens are padded.

Rows wider than ``MAX_KERNEL_TOPK`` run the ``jnp`` reference (XLA code with a float64
division), which measured faster there.

The correction is exact for normal, finite quotients (spec inputs: weights in [0, 1), where
``|w| <= d``); a quotient outside the normal float32 range (only with cancelling negative
weights or a weight below ``2^-126`` of its row sum) may differ from IEEE division by an ulp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _checks, _config
from jaxkern.moe import _routing
from jaxkern.quant.common import exact_div
from jaxkern.reference import moe_routing as ref

ROWS_PER_CTA = 128  # one token per thread
# Widest K that runs the kernel. H200 (CUPTI, cold L2, spec grid): K = 2: 1.49-1.52 us vs XLA
# 2.58-2.67; K = 6: 2.40-2.53 vs 3.39-3.71; but K = 8: 3.82-4.88 vs 3.81-3.94 and K = 9: 4.29-5.97
# vs 4.03-4.94 (likely the K corrected divisions each thread runs back to back), so wider rows use
# the reference.
MAX_KERNEL_TOPK = 6
_SEED = 1e-20


@functools.partial(jax.jit, static_argnames=("rows_per_cta", "interpret"))
def _kernel(w, *, rows_per_cta=ROWS_PER_CTA, interpret=None):
  t, k = w.shape
  w, rt, grid, layout = _routing.thread_rows(w, rows_per_cta)
  tp = w.shape[0]

  @functools.partial(
      plgpu.kernel,
      out_type=(jax.ShapeDtypeStruct((tp,), jnp.float32), jax.ShapeDtypeStruct((tp, k), jnp.float32)),
      grid=(grid,),
      grid_names=("i",),
      interpret=interpret,
  )
  def kernel(w_g, d_g, o_g):
    rows, cols = _routing.load_thread_rows(w_g, rt, layout)
    d = plgpu.layout_cast(jnp.full((rt,), _SEED, jnp.float32), layout)
    for c in cols:
      d = d + c
    d_g[rows] = d
    for j, c in enumerate(cols):
      o_g[rows, j] = jnp.where(c == 0, c / d, exact_div(c, d))  # a zero weight: a signed zero

  d, out = kernel(w)
  return d[:t], out[:t]


def normalize_weight(topk_weights: jax.Array, *, implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
  """Returns ``(d, w / d[:, None])`` with ``d = ((1e-20 + w[:, 0]) + w[:, 1]) + ...`` in fp32.

  Args:
    topk_weights: ``(T, K)`` float32 weights (negative values allowed).
    implementation: see :mod:`jaxkern._config`.

  Returns:
    ``denominator (T,)`` and ``normalized_weights (T, K)``, float32, bit-exact (IEEE division;
    see the module docstring for the kernel's range condition).
  """
  _checks.check_rank("topk_weights", topk_weights, 2)
  _checks.check_dtype("topk_weights", topk_weights, (jnp.float32,))
  impl = _config.get_implementation(implementation)
  t, k = topk_weights.shape
  if impl == "reference" or t == 0 or not 0 < k <= MAX_KERNEL_TOPK:
    return ref.normalize_weight(topk_weights)
  return _kernel(topk_weights, interpret=_config.mosaic_interpret(impl))

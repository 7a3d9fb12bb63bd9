"""``normalize_weight``: divide each token's weights by their 1e-20-seeded sum (docs/moe.md, "Helpers").

Mosaic GPU kernel, one warpgroup per CTA: a CTA owns ``ROWS_PER_CTA`` tokens, each thread one
token. Rows of up to ``DIRECT_MAX_TOPK`` weights are read and written column by column straight
from GMEM (one strided load per column); wider rows go through shared memory
(:func:`jaxkern.moe._routing.load_staged_rows`): the CTA's ``(128, K)`` block moves with
coalesced vector loads and stores, and each thread reads and writes its row's columns in SMEM.
The sum is accumulated column by column in registers (``((1e-20 + w0) + w1) + ...``, each
addition rounded, as the definition asks). Division: one correctly rounded reciprocal ``y = 1 / d`` per
row (:func:`jaxkern._ieee.exact_div`), then per weight ``q = w·y`` and two FMA corrections
``q + (w - q·d)·y`` (:func:`jaxkern._ieee.div_by_reciprocal`); a zero weight keeps ``w·y``, a signed zero. No float64
arithmetic (the reference divides in float64 and rounds with a midpoint test). The last CTA
starts at ``T - 128`` (it recomputes rows of the previous one with identical results), so ragged
``T`` needs no masking; fewer than 128 tokens are padded.

H200 (CUPTI, cold L2, benchmark grid, median of 30), XLA reference in brackets: K = 2 direct
1.50-1.54 us (2.62-2.71); through SMEM 1.54-1.60. K = 6: 1.89-1.98 (3.38-3.71); K = 8: 2.08-2.27
(3.76-3.90); K = 9: 2.14-2.46 (4.00-4.90). The previous kernel (strided loads and stores, one
``exact_div`` per weight) took 2.37-2.53 us at K = 6 and 3.89-5.90 at K = 8-9, slower than XLA:
with the reciprocal scheme alone 2.24-5.74, with SMEM staging alone 2.05-2.91. Rows wider than
``MAX_KERNEL_TOPK`` (beyond the tested sizes; the kernel is unrolled over ``K``) run the XLA reference.

The division is exact for normal, finite weights and row sums whose quotients are zero or at least ``2^-102``
in magnitude (the tests' inputs: weights in [0, 1)); checked bitwise on the H200 against the reference on 2^19 x 8
and 2^19 x 9 weights (uniform, spread over 2^-40..2^4, and signed normal). A row sum beyond ``2^126`` (whose
reciprocal would be subnormal) divides the row by ``d / 4``, the weights by 4 too; a quotient that overflows
(``c·y`` infinite) is computed from ``c / 4`` and scaled back. A zero or infinite row sum (cancelling or infinite
weights) gives IEEE's quotients (``±inf``, ``±0``, NaN for ``0/0`` and ``inf/inf``), as the reference. A quotient
below ``2^-102`` in magnitude may be an ulp off: its correction ``(w - q·d)·y`` (about half an ulp of ``q``) is
subnormal (an H200 gave ``2^-122·(1 + 2^-23)`` for ``2^-122``, 2026-11-29). Subnormal weights or quotients:
interpret mode is within an ulp of IEEE division; on a GPU, whose compiled float32 arithmetic may flush subnormal
operands and results to zero, a row with a subnormal weight, quotient or row sum has unspecified quotients (an H200
gave 170 weights more than an ulp off in such rows, 2026-11-29); a subnormal row sum is itself unspecified.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _checks, _config, _dispatch, _ieee
from jaxkern.moe import _routing
from jaxkern.reference import moe as ref
from jaxkern.types import NormalizedWeights

ROWS_PER_CTA = 128  # one token per thread
DIRECT_MAX_TOPK = 2  # wider rows are staged through SMEM
MAX_KERNEL_TOPK = 32
_SEED = 1e-20


@functools.partial(jax.jit, static_argnames=("interpret",))
def _kernel(w, *, interpret=None):
  t, k = w.shape
  staged = k > DIRECT_MAX_TOPK
  w, rt, grid, layout = _routing.thread_rows(w, ROWS_PER_CTA)
  tp = w.shape[0]

  @functools.partial(
      plgpu.kernel,
      out_type=(jax.ShapeDtypeStruct((tp,), jnp.float32), jax.ShapeDtypeStruct((tp, k), jnp.float32)),
      grid=(grid,),
      grid_names=("i",),
      scratch_types=[plgpu.SMEM((rt, k), jnp.float32)] if staged else [],
      compiler_params=_routing.LANE if staged else None,
      interpret=interpret,
  )
  def kernel(w_g, d_g, o_g, *scratch):
    if staged:
      rows, cols = _routing.load_staged_rows(w_g, scratch[0], rt, layout)
    else:
      rows, cols = _routing.load_thread_rows(w_g, rt, layout)
    d = plgpu.layout_cast(jnp.full((rt,), _SEED, jnp.float32), layout)
    for c in cols:
      d = d + c
    d_g[rows] = d
    # A row sum beyond 2^126 has a subnormal reciprocal: divide by d / 4 (exact) instead, the weights / 4 too.
    scale = jnp.where(jnp.abs(d) > 2.0**126, jnp.float32(0.25), jnp.float32(1.0))
    d_scaled = d * scale
    y = _ieee.exact_div(1.0, d_scaled)
    out = [_ieee.div_by_reciprocal(c * scale, d_scaled, y) for c in cols]
    if staged:
      _routing.store_staged_rows(o_g, scratch[0], rows, out)
    else:
      for j, c in enumerate(out):
        o_g[rows, j] = c

  d, out = kernel(w)
  return NormalizedWeights(d[:t], out[:t])


def _unsupported(k: int) -> str | None:
  if k > MAX_KERNEL_TOPK:
    return f"rows of {k} weights: the kernel is unrolled over K and takes at most MAX_KERNEL_TOPK = {MAX_KERNEL_TOPK}"
  return None


def normalize_weight(topk_weights: jax.Array, *, implementation: str | None = None) -> NormalizedWeights:
  """Returns ``(d, w / d[:, None])`` with ``d = ((1e-20 + w[:, 0]) + w[:, 1]) + ...`` in fp32.

  Args:
    topk_weights: ``(T, K)`` float32 weights (negative values allowed; an array or a nested list).
    implementation: see :mod:`jaxkern._config`.

  Returns:
    :class:`jaxkern.types.NormalizedWeights` ``(denominator, normalized_weights)``: ``(T,)`` and
    ``(T, K)`` float32, bit-exact (IEEE division; see the module docstring for the kernel's range
    condition: quotients below ``2^-102`` within an ulp, subnormals on a GPU unspecified).

  Raises:
    ValueError: ``topk_weights`` not a rank-2 float32 array (bool included).
    KernelUnavailableError: ``implementation="pallas"`` / ``"interpret"`` with ``K >
      MAX_KERNEL_TOPK`` (32).

  XLA instead of a kernel: ``K > MAX_KERNEL_TOPK`` (the reference's fused XLA code), and zero-size
  weights (``T == 0`` or ``K == 0``; the denominators are then the constant 1e-20). The Mosaic GPU
  kernel runs every other case (``"auto"`` off a GPU runs the reference).

  Differentiation: both outputs are differentiable w.r.t. ``topk_weights`` (``jax.custom_vjp``), in
  every case above. With ``d = 1e-20 + sum_k w_k`` and ``n_k = w_k / d``:
  ``dw_j = dd + (dn_j - sum_k dn_k n_k) / d``. The backward runs XLA under every implementation, from
  the saved outputs: one fused ``(T, K)`` elementwise pass with a row sum, memory-bound work that needs
  no kernel.
  """
  topk_weights = _checks.as_array("topk_weights", topk_weights)
  _checks.check_rank("topk_weights", topk_weights, 2)
  _checks.check_dtype("topk_weights", topk_weights, (jnp.float32,))
  return _differentiable_normalize(topk_weights, _config.get_implementation(implementation))


def _normalize(topk_weights, implementation: str) -> NormalizedWeights:
  return _dispatch.run(
      "normalize_weight", implementation,
      kernel=lambda interpret: _kernel(topk_weights, interpret=_config.mosaic_interpret(interpret)),
      xla=lambda: ref.normalize_weight(topk_weights), unsupported=_unsupported(topk_weights.shape[1]),
      empty=topk_weights.size == 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _differentiable_normalize(topk_weights, implementation: str) -> NormalizedWeights:
  return _normalize(topk_weights, implementation)


def _differentiable_normalize_fwd(topk_weights, implementation: str):
  out = _normalize(topk_weights, implementation)
  return out, out


def _differentiable_normalize_bwd(implementation: str, out: NormalizedWeights, cotangents: NormalizedWeights):
  del implementation
  d, n = out
  dd, dn = cotangents
  return (dd[:, None] + (dn - jnp.sum(dn * n, axis=1, keepdims=True)) / d[:, None],)


_differentiable_normalize.defvjp(_differentiable_normalize_fwd, _differentiable_normalize_bwd)

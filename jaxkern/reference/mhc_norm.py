"""``jnp`` references for the RMS-normalised mHC projection (docs/mhc.md, "pre_norm_fn").

* :func:`round_to_tf32` — ``tf32_rna(v) = bitcast_f32((bitcast_u32(v) + 0x1000) & 0xFFFFE000)`` (docs/mhc.md, "pre_norm_fn"):
  round to 10 explicit mantissa bits, ties away from zero, low 13 bits cleared. Only float32 is rounded;
  other dtypes (float64 in the gradient checks) pass unchanged, so that the float64 references are the
  exact math and ``jax.grad`` of the forward reference checks the hand-written backward.
* :func:`fn_normw_merge` — ``fn * normw`` (M2); plain autodiff gives the M2 backward.
* :func:`pre_norm_fn_fwd` / :func:`pre_norm_fn` — per token ``r = vec(R)`` (stream-major, ``K = M·H``):
  ``out_mul = r @ tf32(fn)^T`` (products exact, ``precision=HIGHEST``), ``sqrsum = Σ r²``,
  ``mixes = out_mul · rsqrt(sqrsum / K + eps)``, all in ``promote(dtype, float32)``.
* :func:`pre_norm_fn_bwd` — the hand backward of docs/mhc.md, "pre_norm_fn" (``q = tf32(G·ρ)``, ``grad_r = q @ fn_r + 2 r·sqrsum_grad``,
  ``grad_fn = qᵀ @ r``).

Independent of the kernels (:mod:`jaxkern.mhc._norm_fn`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxkern.types import PreNormFnFwd, PreNormFnGrads

HIGHEST = lax.Precision.HIGHEST


def round_to_tf32(x: jax.Array) -> jax.Array:
  """``tf32_rna`` of a float32 array (docs/mhc.md, "pre_norm_fn"); other dtypes are returned unchanged.

  Differentiable as the identity (straight-through): upstream passes the weight gradient through the
  rounding unchanged (docs/mhc.md, "pre_norm_fn"), so ``jax.grad`` of :func:`pre_norm_fn` in float32 gives the same kind of
  gradient as the op's backward.
  """
  x = jnp.asarray(x)
  if x.dtype != jnp.float32:
    return x
  return _tf32(x)


@jax.custom_jvp
def _tf32(x):
  u = lax.bitcast_convert_type(x, jnp.uint32)
  return lax.bitcast_convert_type((u + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000), jnp.float32)


@_tf32.defjvp
def _tf32_jvp(primals, tangents):
  return _tf32(primals[0]), tangents[0]


def fn_normw_merge(fn: jax.Array, normw: jax.Array) -> jax.Array:
  """``fn (J, K) * normw (K,)`` broadcast over rows (docs/mhc.md, "pre_norm_fn")."""
  return fn * normw[None, :]


def _flat(residual, k):
  lead = residual.shape[:-2]
  return residual.reshape(-1, k), lead


def _compute_dtype(residual, fn):
  return jnp.promote_types(jnp.promote_types(residual.dtype, fn.dtype), jnp.float32)


def pre_norm_fn_fwd(residual: jax.Array, fn: jax.Array, *, norm_eps: float = 1e-6, n_splits: int = 16) -> PreNormFnFwd:
  """``residual (…, M, H)``, merged ``fn (J, M·H)`` -> ``PreNormFnFwd(mixes (…, J), out_mul (…, J), sqrsum (…,))``.

  ``fn`` is rounded with :func:`round_to_tf32` here (idempotent, so an already rounded weight is fine).
  ``n_splits`` (the kernels' split-K knob) does not change the math and is ignored.
  """
  del n_splits
  j, k = fn.shape
  dt = _compute_dtype(residual, fn)
  r, lead = _flat(residual, k)
  r = r.astype(dt)
  fn_r = round_to_tf32(fn.astype(dt))
  out_mul = jnp.einsum("tk,jk->tj", r, fn_r, precision=HIGHEST)
  sqrsum = jnp.sum(r * r, axis=-1)
  mixes = out_mul * lax.rsqrt(sqrsum / k + jnp.asarray(norm_eps, dt))[:, None]
  return PreNormFnFwd(mixes.reshape(*lead, j), out_mul.reshape(*lead, j), sqrsum.reshape(lead))


def pre_norm_fn(residual: jax.Array, fn: jax.Array, norm_weight: jax.Array | None = None, *, norm_eps: float = 1e-6,
                fuse_grad_acc: bool = True, n_splits: int = 16) -> jax.Array:
  """Upstream ``mhc_pre_norm_fn_ref`` with the TF32 rounding of the merged weight: ``(…, M, H)`` -> ``(…, J)``.

  Differentiable by plain autodiff (the rounding passes gradients unchanged; float64 inputs skip it and give
  the exact-math gradients that the hand backward is checked against). ``fuse_grad_acc`` and ``n_splits``
  do not change the math and are ignored.
  """
  del fuse_grad_acc, n_splits
  if norm_weight is not None:
    fn = fn_normw_merge(fn, norm_weight)
  return pre_norm_fn_fwd(residual, fn, norm_eps=norm_eps).mixes


def pre_norm_fn_bwd(grad_mixes: jax.Array, residual: jax.Array, fn: jax.Array, out_mul: jax.Array, sqrsum: jax.Array, *,
                    norm_eps: float = 1e-6) -> PreNormFnGrads:
  """The backward of docs/mhc.md, "pre_norm_fn" -> ``PreNormFnGrads(grad_residual (residual's shape and dtype), grad_fn (J, K))``.

  ``fn`` is the merged weight (rounded here); ``grad_fn`` is the gradient w.r.t. it (the rounding is passed
  through as the identity). ``out_mul``, ``sqrsum`` as returned by :func:`pre_norm_fn_fwd`.
  """
  j, k = fn.shape
  dt = _compute_dtype(residual, fn)
  r, _ = _flat(residual, k)
  r = r.astype(dt)
  g = grad_mixes.reshape(-1, j).astype(dt)
  om = out_mul.reshape(-1, j).astype(dt)
  sq = sqrsum.reshape(-1).astype(dt)
  eps = jnp.asarray(norm_eps, dt)
  fn_r = round_to_tf32(fn.astype(dt))
  rho = lax.rsqrt(sq / k + eps)
  out_mul_grad = g * rho[:, None]
  rho_grad = jnp.sum(g * om, axis=-1)
  sqrsum_grad = rho_grad * rho / (sq + eps * k) / -2
  q = round_to_tf32(out_mul_grad)
  grad_r = jnp.einsum("tj,jk->tk", q, fn_r, precision=HIGHEST) + 2 * r * sqrsum_grad[:, None]
  grad_fn = jnp.einsum("tj,tk->jk", q, r, precision=HIGHEST)
  return PreNormFnGrads(grad_r.reshape(residual.shape).astype(residual.dtype), grad_fn.astype(fn.dtype))

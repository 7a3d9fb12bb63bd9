"""``post`` (docs/mhc.md, "post"): write the sublayer output into the streams and recombine them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkern import _autodiff, _config, _dispatch
from jaxkern.mhc import _common, _stream_kernels as sk
from jaxkern.reference import mhc as ref
from jaxkern.types import PostGrads

MAX_M = 4


def _unsupported(residual, mixes, others):
  """Why the kernels cannot run (None where they can); ``mixes`` / ``others``: ``(argument name, array)`` of the
  float32 mixes and the further bfloat16 arrays."""
  for name, a in (("residual", residual), *others):
    if a.dtype != jnp.bfloat16:
      return f"{name} has dtype {a.dtype.name}; the kernels take bfloat16"
  for name, a in mixes:
    if a.dtype != jnp.float32:
      return f"{name} has dtype {a.dtype.name}; the kernels take float32"
  if residual.shape[-2] > MAX_M:
    return f"residual.shape[-2] (M) = {residual.shape[-2]}; the kernels take M <= {MAX_M}"
  return None


def _mixes(post_layer_mix, comb_res_mix):
  return (("post_layer_mix", post_layer_mix), ("comb_res_mix", comb_res_mix))


def _check(x, residual, post_layer_mix, comb_res_mix):
  residual, lead, m, h = _common.streams("residual", residual)
  x = _common.array("x", x, 1)
  _common.shape("x", x, (*lead, h))
  post_layer_mix = _common.array("post_layer_mix", post_layer_mix, 2)
  _common.shape("post_layer_mix", post_layer_mix, (*lead, m, 1))
  comb_res_mix = _common.array("comb_res_mix", comb_res_mix, 2)
  _common.shape("comb_res_mix", comb_res_mix, (*lead, m, m))
  return x, residual, post_layer_mix, comb_res_mix, lead, m, h


def post_bwd(d_o: jax.Array, x: jax.Array, residual: jax.Array, post_layer_mix: jax.Array, comb_res_mix: jax.Array, *,
             implementation: str | None = None) -> PostGrads:
  """Backward of :func:`post` (docs/mhc.md, "post").

  ``d_residual[m] = bf16(Σ_n comb[m, n]·dO[n])``, ``d_x = bf16(Σ_n post[n]·dO[n])`` (float32, ``n`` in order),
  ``d_comb[m, n] = Σ_h residual[m]·dO[n]``, ``d_post[n] = Σ_h x·dO[n]`` (float32).

  Args:
    d_o: ``(..., M, H)`` cotangent of the output (bfloat16 for the kernel).
    x, residual, post_layer_mix, comb_res_mix: the forward's inputs (see :func:`post`).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``PostGrads(d_x, d_residual, d_post_layer_mix (..., M, 1), d_comb_res_mix (..., M, M))`` (upstream's order);
    the first two in the dtypes of ``x`` / ``residual``, the mix gradients float32 (wider for float64 inputs).

  Raises:
    ValueError (naming the argument): shapes that do not match ``residual``, non-floating dtypes.

  XLA (the reference) instead of the kernel: zero tokens; under ``"auto"`` also other dtypes and ``M > 4``.
  Kernel (any ``H``): Mosaic GPU, one pass over ``dO``, ``x``, ``residual`` (20 per-token float32 reductions
  for ``M = 4``: row sums of ``(8, 128)`` tiles where ``H`` is a multiple of 128 of at least 1024, else of
  register tiles of up to 128 tokens x a divisor of ``H``; then one warpgroup sum each): the mix gradients'
  summation order differs from the reference's (float32 rounding only; where a partial sum overflows float32,
  ±inf or NaN as the order decides, in either). ``d_x`` and ``d_residual`` contract each add into an FMA, as the
  forward: where a product ``post[n]·dO[n]`` or ``comb[m, n]·dO[n]`` of finite factors overflows float32, that
  element is unspecified (±inf, NaN or finite; an H200 gave inf against XLA's NaN, 2026-11-29).

  Differentiation: none (a backward pass): :class:`jaxkern.NotDifferentiableError`.
  """
  x, residual, post_layer_mix, comb_res_mix, lead, m, h = _check(x, residual, post_layer_mix, comb_res_mix)
  d_o = _common.array("d_o", d_o, 2)
  _common.shape("d_o", d_o, residual.shape)
  return _bwd_op(d_o, x, residual, post_layer_mix, comb_res_mix, implementation, xla_d_o=lambda: d_o,
                 checked=(("x", x), ("d_o", d_o)))


def _bwd_op(d_o, x, residual, post_layer_mix, comb_res_mix, implementation, *, xla_d_o, checked) -> PostGrads:
  """The dispatch of :func:`post_bwd`: the kernel reads ``d_o`` as given, the XLA path ``xla_d_o()``; ``checked``:
  ``(argument name, array)`` of the arrays besides the mixes whose dtypes the kernel constrains."""
  d_o, x, residual, post_layer_mix, comb_res_mix = _autodiff.guard(
      "post_bwd", _common.BWD_ADVICE, d_o, x, residual, post_layer_mix, comb_res_mix)
  lead, (m, h) = residual.shape[:-2], residual.shape[-2:]
  t = _common.tokens(lead)

  def kernel(interpret):
    bwd = sk.post_bwd_kernel if sk.tiles_fit(h) else sk.post_bwd_rows_kernel
    dx, dr, dp, dc = bwd(d_o.reshape(t, m, h), x.reshape(t, h), residual.reshape(t, m, h),
                                        post_layer_mix.reshape(t, m), comb_res_mix.reshape(t, m, m),
                                        interpret=_config.mosaic_interpret(interpret))
    return PostGrads(dx.reshape(x.shape), dr.reshape(residual.shape), dp.reshape(post_layer_mix.shape),
                     dc.reshape(comb_res_mix.shape))

  return _dispatch.run("post_bwd", implementation, kernel=kernel,
                       xla=lambda: ref.post_bwd(xla_d_o(), x, residual, post_layer_mix, comb_res_mix), empty=t == 0,
                       unsupported=_unsupported(residual, _mixes(post_layer_mix, comb_res_mix), checked))


def _fwd_op(x, residual, post_layer_mix, comb_res_mix, implementation):
  lead, (m, h) = residual.shape[:-2], residual.shape[-2:]
  t = _common.tokens(lead)

  def kernel(interpret):
    fwd = sk.post_fwd_kernel if sk.tiles_fit(h) else sk.post_fwd_rows_kernel
    out = fwd(x.reshape(t, h), residual.reshape(t, m, h), post_layer_mix.reshape(t, m),
                             comb_res_mix.reshape(t, m, m), interpret=_config.mosaic_interpret(interpret))
    return out.reshape(residual.shape)

  return _dispatch.run("post", implementation, kernel=kernel,
                       xla=lambda: ref.post(x, residual, post_layer_mix, comb_res_mix), empty=t == 0,
                       unsupported=_unsupported(residual, _mixes(post_layer_mix, comb_res_mix), (("x", x),)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _post(x, residual, post_layer_mix, comb_res_mix, implementation):
  return _fwd_op(x, residual, post_layer_mix, comb_res_mix, implementation)


def _post_fwd(x, residual, post_layer_mix, comb_res_mix, implementation):
  return _fwd_op(x, residual, post_layer_mix, comb_res_mix, implementation), (x, residual, post_layer_mix,
                                                                               comb_res_mix)


def _cotangent_bwd(d_o, x, residual, post_layer_mix, comb_res_mix, implementation) -> PostGrads:
  """:func:`post_bwd` of ``d_o`` rounded to ``residual``'s dtype, for a float32 cotangent of bfloat16 streams (a loss
  that upcasts the output): the kernel reads the float32 ``d_o`` and rounds it in registers (bit-identical to
  casting first, one pass over ``dO`` less); the XLA path casts first."""
  return _bwd_op(d_o, x, residual, post_layer_mix, comb_res_mix, implementation,
                 xla_d_o=lambda: d_o.astype(residual.dtype), checked=(("x", x),))


def _post_bwd(implementation, residuals, d_o):
  if d_o.dtype == jnp.float32 and residuals[1].dtype == jnp.bfloat16:
    g = _cotangent_bwd(d_o, *residuals, implementation)
  else:
    g = post_bwd(d_o.astype(residuals[1].dtype), *residuals, implementation=implementation)
  return tuple(a.astype(p.dtype) for a, p in zip(g, residuals))


_post.defvjp(_post_fwd, _post_bwd)


def post(x: jax.Array, residual: jax.Array, post_layer_mix: jax.Array, comb_res_mix: jax.Array, *,
         implementation: str | None = None) -> jax.Array:
  """The new residual ``out[..., n, h] = bf16(post[n]·x[h] + Σ_m comb[m, n]·residual[m, h])`` (docs/mhc.md, "post").

  float32: the post term first, then ``m = 0..M-1`` in order (input stream ``m`` is the *row* of ``comb``).

  Args:
    x: ``(..., H)`` the sublayer output (bfloat16 for the kernel); any leading dims (upstream: exactly two).
    residual: ``(..., M, H)`` the streams, ``x``'s dtype for the kernel.
    post_layer_mix: ``(..., M, 1)`` float32.
    comb_res_mix: ``(..., M, M)`` float32 (after Sinkhorn).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``(..., M, H)`` in ``residual``'s dtype.

  Raises:
    ValueError (naming the argument): shapes that do not match ``residual``, non-floating dtypes, ``M`` or
      ``H`` 0.

  XLA (the reference) instead of the kernel: zero tokens; under ``"auto"`` also dtypes other than bfloat16
  ``x`` / ``residual`` with float32 mixes and ``M > 4`` (upstream's backward supports only 4). Kernel (any
  ``H``): Mosaic GPU (see :mod:`jaxkern.mhc._stream_kernels`),
  bandwidth-bound (``2·H·(2M+1)`` bytes per token). The GPU contracts each add into an FMA (as in
  :func:`pre_apply_mix`; where the products cancel, the float32 sums of the kernel and XLA on a GPU differ by at
  most ``(M+1)·2^-23`` of the products' magnitudes, docs/mhc.md). Where a product (``post[n]·x`` or
  ``comb[m, n]·residual[m]``) of finite factors overflows float32, that column ``h`` of every output stream is
  unspecified: the FMA's unrounded product may give ±inf or a finite value where XLA's rounded one gives ±inf,
  or ±inf where XLA gives NaN from ``inf + (-inf)`` (an H200 found inf against NaN, 2026-11-29). Elsewhere
  non-finite inputs propagate alike (IEEE).

  Differentiation: ``jax.custom_vjp``; residuals ``x, residual, post_layer_mix, comb_res_mix``; backward
  :func:`post_bwd` (a kernel) with the same implementation, on the output's cotangent rounded to the residual's
  dtype (a float32 cotangent of bfloat16 streams is read by the kernel and rounded in registers). Cotangents
  come back in the inputs' dtypes.
  """
  args = _check(x, residual, post_layer_mix, comb_res_mix)[:4]
  return _post(*_autodiff.vary_like(*args), _config.get_implementation(implementation))

"""The trainable mHC layers (docs/modeling.md, "mHC layers"): ``expand_from_embedding``, ``mhc_pre``, ``mhc_post``,
``mhc_head`` and the block form ``mhc_block`` (``mhc_pre -> sublayer -> mhc_post`` with the fused residual
gradient; docs/modeling.md, "mHC layers").

* :func:`expand_from_embedding` and :func:`mhc_post` are :func:`jaxkern.mhc.expand_to_mhc` and
  :func:`jaxkern.mhc.post` (each its own ``jax.custom_vjp``).
* :func:`mhc_pre` is one ``jax.custom_vjp`` (docs/modeling.md, "mHC layers"): its primal (run when no derivative is taken) is
  :func:`jaxkern.mhc.pre_big_fuse`, its forward rule the unfused chain ``pre_norm_fn_fwd -> pre_split_mixes ->
  sinkhorn_normalize -> pre_apply_mix`` saving ``residual, fn_eff, out_mul, sqrsum, mixes, post, comb_logits,
  pre`` (bit-identical values: the same ops), and its backward the parts' ``*_bwd`` ops in reverse order; the
  residual's two cotangents (``pre_apply_mix`` and ``pre_norm_fn``) are added in float32 and rounded once.
  The RMSNorm weight is merged into ``fn`` on both paths (docs/mhc.md, "pre_big_fuse").
* :func:`mhc_head` composes the ops' own custom_vjps (``pre_norm_fn`` on the zero-padded ``fn``,
  ``head_compute_mix``, ``pre_apply_mix``); JAX sums the residual's cotangents, so the backward works without
  upstream's ``grad_from_mhc_post`` buffer (docs/modeling.md, "mHC layers").
* :func:`mhc_block` is the functional form of upstream's ``grad_from_mhc_post`` trick (docs/modeling.md, "mHC layers"):
  one ``jax.custom_vjp`` over ``mhc_pre -> sublayer -> mhc_post`` whose backward runs ``post_bwd``, the
  sublayer's VJP, then ``pre_apply_mix_bwd(..., x_grad_acc=d_residual)`` (``bf16(d_post + d_apply)`` in one
  pass) and adds ``pre_norm_fn``'s residual gradient: ``bf16(bf16(d_post + d_apply) + d_norm)``, upstream's
  rounding sequence (with ``d_norm`` itself rounded to bf16 first).

With the separate functions (``mhc_pre`` then ``mhc_post``) JAX adds the residual's cotangents itself
(docs/modeling.md, "mHC layers"; bf16 double rounding only).

Each call runs the implementation chosen when it is traced (``implementation=`` or the active setting) in
forward and backward; ``"reference"`` runs the ``jnp`` references inside the same custom_vjps (any float dtype,
e.g. float64 for gradient checks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxkern import _checks, _config, mhc
from jaxkern._autodiff import vary_like
from jaxkern.mhc import _common
from jaxkern.mhc._norm_fn import _check_residual_fn, _check_splits


class _Cfg(NamedTuple):
  norm_eps: float
  mhc_mult: int
  post_mult_value: float
  pre_eps: float
  sinkhorn_eps: float
  sinkhorn_repeat: int
  n_splits: int


def expand_from_embedding(x: jax.Array, mhc_mult: int = 4, *, implementation: str | None = None) -> jax.Array:
  """``(..., H)`` -> ``(..., M, H)``: ``M`` copies of the embedding (:func:`jaxkern.mhc.expand_to_mhc`).

  Differentiation: ``expand_to_mhc``'s custom_vjp (the cotangent is the float32 stream sum, rounded once).
  Raises ValueError as :func:`jaxkern.mhc.expand_to_mhc`.
  """
  return mhc.expand_to_mhc(x, mhc_mult=mhc_mult, implementation=implementation)


def mhc_post(x: jax.Array, residual: jax.Array, post_layer_mix: jax.Array, comb_res_mix: jax.Array, *,
             implementation: str | None = None) -> jax.Array:
  """The new residual after a sublayer: :func:`jaxkern.mhc.post` (docs/mhc.md, "post"); differentiable (its
  custom_vjp). Raises ValueError as :func:`jaxkern.mhc.post`."""
  return mhc.post(x, residual, post_layer_mix, comb_res_mix, implementation=implementation)


def _check_pre(residual, fn, scale, base, norm_weight, mhc_mult, norm_eps, post_mult_value, pre_eps, sinkhorn_eps,
               sinkhorn_repeat, n_splits):
  residual, fn = _check_residual_fn(residual, fn)
  if _common.mhc_mult(mhc_mult) != residual.shape[-2]:
    raise ValueError(f"mhc_mult must equal residual.shape[-2] = {residual.shape[-2]}, got {mhc_mult}")
  scale = _common.array("scale", scale, 1)
  _common.shape("scale", scale, (3,))
  base = _common.array("base", base, 1)
  _common.shape("base", base, (fn.shape[0],))
  if norm_weight is not None:
    norm_weight = _common.array("norm_weight", norm_weight, 1)
    _common.shape("norm_weight", norm_weight, (fn.shape[1],))
  check = _checks.check_float
  cfg = _Cfg(check("norm_eps", norm_eps, nonnegative=True), int(mhc_mult),
             check("post_mult_value", post_mult_value, nonzero=True), check("pre_eps", pre_eps),
             check("sinkhorn_eps", sinkhorn_eps, nonnegative=True), _common.repeat(sinkhorn_repeat),
             _check_splits(n_splits))
  return residual, fn, scale, base, norm_weight, cfg


def _merged(fn, norm_weight):
  return fn if norm_weight is None else mhc.fn_normw_merge(fn, norm_weight)


def _pre_primal(residual, fn, scale, base, norm_weight, cfg, impl):
  out = mhc.pre_big_fuse(residual, fn, scale, base, norm_weight, rms_eps=cfg.norm_eps, mhc_pre_eps=cfg.pre_eps,
                         mhc_sinkhorn_eps=cfg.sinkhorn_eps, mhc_post_mult_value=cfg.post_mult_value,
                         sinkhorn_repeat=cfg.sinkhorn_repeat, n_splits=cfg.n_splits, implementation=impl)
  return out.layer_input, (out.post_mix, out.comb_mix)


def _pre_forward(residual, fn, scale, base, norm_weight, cfg, impl):
  """The unfused chain (values bit-identical to :func:`jaxkern.mhc.pre_big_fuse`) and the backward's residuals."""
  fn_eff = _merged(fn, norm_weight)
  f = mhc.pre_norm_fn_fwd(residual, fn_eff, norm_eps=cfg.norm_eps, n_splits=cfg.n_splits, implementation=impl)
  pre, post_mix, comb_logits = mhc.pre_split_mixes(f.mixes, scale, base, mhc_mult=cfg.mhc_mult,
                                                   mhc_post_mult_value=cfg.post_mult_value, mhc_pre_eps=cfg.pre_eps,
                                                   implementation=impl)
  comb = mhc.sinkhorn_normalize(comb_logits, repeat=cfg.sinkhorn_repeat, eps=cfg.sinkhorn_eps, implementation=impl)
  layer_input = mhc.pre_apply_mix(residual, pre, implementation=impl)
  res = (residual, fn, scale, base, norm_weight, fn_eff, f.out_mul, f.sqrsum, f.mixes, post_mix, comb_logits, pre)
  return (layer_input, (post_mix, comb)), res


def _pre_backward(cfg, impl, res, g_input, g_post, g_comb, x_grad_acc=None):
  """The parts' backward ops in reverse order; ``x_grad_acc`` (optional) is added to the residual gradient by
  ``pre_apply_mix_bwd``. Returns the cotangents of ``(residual, fn, scale, base, norm_weight)``."""
  residual, fn, scale, base, norm_weight, fn_eff, out_mul, sqrsum, mixes, post_mix, comb_logits, pre = res
  g_logits = mhc.sinkhorn_normalize_bwd(g_comb.astype(comb_logits.dtype), comb_logits, repeat=cfg.sinkhorn_repeat,
                                        eps=cfg.sinkhorn_eps, implementation=impl)
  applied = mhc.pre_apply_mix_bwd(g_input.astype(residual.dtype), residual, pre, x_grad_acc, implementation=impl)
  split = mhc.pre_split_mixes_bwd(applied.mix_grad.astype(pre.dtype), g_post.astype(post_mix.dtype), g_logits, mixes,
                                  post_mix, scale, base, mhc_mult=cfg.mhc_mult,
                                  mhc_post_mult_value=cfg.post_mult_value, implementation=impl)
  normed = mhc.pre_norm_fn_bwd(split.input_mixes_grad.astype(mixes.dtype), residual, fn_eff, out_mul, sqrsum,
                               norm_eps=cfg.norm_eps, implementation=impl)
  wide = jnp.promote_types(residual.dtype, jnp.float32)
  g_res = (applied.x_grad.astype(wide) + normed.grad_residual.astype(wide)).astype(residual.dtype)
  g_eff = normed.grad_fn.astype(jnp.promote_types(fn_eff.dtype, jnp.float32))
  if norm_weight is None:
    g_fn, g_nw = g_eff, None
  else:  # the product rule of fn_eff = fn * norm_weight (docs/mhc.md, "pre_norm_fn")
    g_fn = g_eff * norm_weight[None, :]
    g_nw = jnp.sum(g_eff * fn, axis=0).astype(norm_weight.dtype)
  return (g_res, g_fn.astype(fn.dtype), split.mhc_scale_grad.astype(scale.dtype),
          split.mhc_base_grad.astype(base.dtype), g_nw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _pre(residual, fn, scale, base, norm_weight, cfg, impl):
  return _pre_primal(residual, fn, scale, base, norm_weight, cfg, impl)


def _pre_fwd(residual, fn, scale, base, norm_weight, cfg, impl):
  return _pre_forward(residual, fn, scale, base, norm_weight, cfg, impl)


def _pre_bwd(cfg, impl, res, g):
  g_input, (g_post, g_comb) = g
  return _pre_backward(cfg, impl, res, g_input, g_post, g_comb)


_pre.defvjp(_pre_fwd, _pre_bwd)


def mhc_pre(residual: jax.Array, fn: jax.Array, scale: jax.Array, base: jax.Array, *,
            norm_weight: jax.Array | None = None, norm_eps: float = 1e-6, mhc_mult: int = 4,
            post_mult_value: float = 1.0, pre_eps: float = 1e-6, sinkhorn_eps: float = 1e-6, sinkhorn_repeat: int = 10,
            n_splits: int = 16, implementation: str | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  """mHC pre-processing of one sublayer (docs/modeling.md, "mHC layers"): the sublayer input and the mixes for :func:`mhc_post`.

  ``mixes = pre_norm_fn(residual, fn, norm_weight)``; ``pre, post, comb_logits = pre_split_mixes(mixes, scale,
  base)``; ``comb = sinkhorn_normalize(comb_logits)``; ``layer_input = pre_apply_mix(residual, pre)``.

  Args:
    residual: ``(..., M, H)`` bfloat16 residual streams (``M = 4``); any leading dims.
    fn: ``(J, M·H)`` float32, ``J = M(M+2) = 24``; scale: ``(3,)``; base: ``(J,)`` float32.
    norm_weight: optional ``(M·H,)`` RMSNorm weight, merged into ``fn`` on both paths (docs/mhc.md, "pre_big_fuse").
    norm_eps, post_mult_value (non-zero), pre_eps, sinkhorn_eps, sinkhorn_repeat, n_splits: as the parts.
    mhc_mult: must equal ``residual.shape[-2]`` (only 4 is supported).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``(layer_input (..., H) in the residual's dtype, (post_mix (..., M, 1), comb_mix (..., M, M)) float32)``.

  Raises:
    ValueError (naming the argument): shapes, dtypes, ``mhc_mult``, scalars (as the parts).

  Forward: without a derivative :func:`jaxkern.mhc.pre_big_fuse`; under ``jax.grad`` / ``jax.vjp`` the unfused
  chain of the same ops (bit-identical values).

  Differentiation: one ``jax.custom_vjp`` (module docstring); cotangents of ``residual``, ``fn``, ``scale``,
  ``base`` and ``norm_weight`` in their dtypes.
  """
  residual, fn, scale, base, norm_weight, cfg = _check_pre(residual, fn, scale, base, norm_weight, mhc_mult,
                                                           norm_eps, post_mult_value, pre_eps, sinkhorn_eps,
                                                           sinkhorn_repeat, n_splits)
  residual, fn, scale, base, norm_weight = vary_like(residual, fn, scale, base, norm_weight)
  return _pre(residual, fn, scale, base, norm_weight, cfg, _config.get_implementation(implementation))


def mhc_head(residual: jax.Array, fn: jax.Array, scale: jax.Array, base: jax.Array, *,
             norm_weight: jax.Array | None = None, norm_eps: float = 1e-6, mhc_mult: int = 4, pre_eps: float = 1e-6,
             n_splits: int = 16, implementation: str | None = None) -> jax.Array:
  """mHC head (docs/modeling.md, "mHC layers"): the streams mixed into one hidden state for the LM head.

  ``fn (M, M·H)`` is zero-padded to ``(J, M·H)`` for :func:`jaxkern.mhc.pre_norm_fn`; the first ``M`` mixes go
  through :func:`jaxkern.mhc.head_compute_mix` (``σ(z·scale + base) + pre_eps``) and
  :func:`jaxkern.mhc.pre_apply_mix`. No post / comb mixes, no Sinkhorn.

  Args:
    residual: ``(..., M, H)`` bfloat16 (``M = 4``); fn: ``(M, M·H)`` float32; scale: ``(1,)`` or a scalar;
      base: ``(M,)``; norm_weight: optional ``(M·H,)``; norm_eps, pre_eps, n_splits: as the parts;
      mhc_mult: must equal ``residual.shape[-2]``.
    implementation: as :func:`mhc_pre`.

  Returns:
    ``(..., H)`` in the residual's dtype.

  Raises:
    ValueError (naming the argument): ``fn`` not ``(M, M·H)``, ``scale`` not one value, ``base`` not ``(M,)``,
      and as the parts.

  Differentiation: the composition of the parts' custom_vjps (JAX sums the residual's cotangents; the padded
  rows' gradient is dropped by the slice; docs/modeling.md, "mHC layers").
  """
  residual = _common.array("residual", residual, 2)
  m, h = residual.shape[-2:]
  if _common.mhc_mult(mhc_mult) != m:
    raise ValueError(f"mhc_mult must equal residual.shape[-2] = {m}, got {mhc_mult}")
  fn = _common.array("fn", fn, 2)
  _common.shape("fn", fn, (m, m * h))
  scale = _common.array("scale", scale, 0)
  if scale.size != 1:
    raise ValueError(f"scale must hold one value (shape (1,) or ()), got shape {tuple(scale.shape)}")
  base = _common.array("base", base, 1)
  _common.shape("base", base, (m,))
  impl = _config.get_implementation(implementation)
  j = m * (m + 2)
  fn_pad = jnp.pad(fn, ((0, j - m), (0, 0)))
  mixes = mhc.pre_norm_fn(residual, fn_pad, norm_weight, norm_eps=norm_eps, n_splits=n_splits, implementation=impl)
  mix = mhc.head_compute_mix(mixes[..., :m], scale.reshape(1), base, mhc_pre_eps=pre_eps, implementation=impl)
  return mhc.pre_apply_mix(residual, mix[..., None], implementation=impl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _block(residual, fn, scale, base, norm_weight, params, sublayer, cfg, impl):
  layer_input, (post_mix, comb) = _pre_primal(residual, fn, scale, base, norm_weight, cfg, impl)
  return mhc.post(sublayer(params, layer_input), residual, post_mix, comb, implementation=impl)


def _block_fwd(residual, fn, scale, base, norm_weight, params, sublayer, cfg, impl):
  (layer_input, (post_mix, comb)), res = _pre_forward(residual, fn, scale, base, norm_weight, cfg, impl)
  y, sub_vjp = jax.vjp(sublayer, params, layer_input)
  out = mhc.post(y, residual, post_mix, comb, implementation=impl)
  return out, (res, sub_vjp, y, post_mix, comb)


def _block_bwd(sublayer, cfg, impl, saved, d_out):
  del sublayer
  res, sub_vjp, y, post_mix, comb = saved
  residual = res[0]
  pg = mhc.post_bwd(d_out.astype(residual.dtype), y, residual, post_mix, comb, implementation=impl)
  g_params, g_input = sub_vjp(pg.d_x.astype(y.dtype))
  g_res, g_fn, g_scale, g_base, g_nw = _pre_backward(cfg, impl, res, g_input, pg.d_post_layer_mix,
                                                     pg.d_comb_res_mix, x_grad_acc=pg.d_residual)
  return g_res, g_fn, g_scale, g_base, g_nw, g_params


_block.defvjp(_block_fwd, _block_bwd)


def mhc_block(residual: jax.Array, fn: jax.Array, scale: jax.Array, base: jax.Array,
              sublayer: Callable[[Any, jax.Array], jax.Array], params: Any, *, norm_weight: jax.Array | None = None,
              norm_eps: float = 1e-6, mhc_mult: int = 4, post_mult_value: float = 1.0, pre_eps: float = 1e-6,
              sinkhorn_eps: float = 1e-6, sinkhorn_repeat: int = 10, n_splits: int = 16,
              implementation: str | None = None) -> jax.Array:
  """One mHC-wrapped sublayer: ``x, (post, comb) = mhc_pre(residual, ...)``, ``y = sublayer(params, x)``,
  ``mhc_post(y, residual, post, comb)``, as one ``jax.custom_vjp`` with the fused residual gradient
  (module docstring; docs/modeling.md, "mHC layers").

  Args:
    residual, fn, scale, base and the keyword options: as :func:`mhc_pre`.
    sublayer: ``sublayer(params, x) -> y`` with ``x``, ``y`` ``(..., H)`` in the residual's dtype; a hashable
      callable (a static argument: a new function object means a new trace). Its VJP is taken with
      ``jax.vjp`` in the forward rule and kept as a residual.
    params: the sublayer's parameters (a pytree of arrays); they get cotangents.

  Returns:
    The new residual ``(..., M, H)`` in the residual's dtype.

  Raises:
    ValueError (naming the argument): as :func:`mhc_pre`.

  Differentiation: ``jax.custom_vjp``; cotangents of ``residual``, ``fn``, ``scale``, ``base``, ``params`` (and
  ``norm_weight``). Equal to the gradient of ``mhc_pre -> sublayer -> mhc_post`` up to bf16 rounding of the
  residual gradient's sum (the order of the three additions differs).
  """
  residual, fn, scale, base, norm_weight, cfg = _check_pre(residual, fn, scale, base, norm_weight, mhc_mult,
                                                           norm_eps, post_mult_value, pre_eps, sinkhorn_eps,
                                                           sinkhorn_repeat, n_splits)
  residual, fn, scale, base, norm_weight, params = vary_like(residual, fn, scale, base, norm_weight, params)
  return _block(residual, fn, scale, base, norm_weight, params, sublayer, cfg,
                _config.get_implementation(implementation))

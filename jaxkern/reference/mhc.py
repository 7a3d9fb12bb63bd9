"""``jnp`` references for the mHC mix ops of :mod:`jaxkern.mhc` (docs/mhc.md).

Ports of ``tile_kernels/torch/mhc.py`` plus the backward formulas of each op (docs/mhc.md). Every
function is dtype-generic: floating inputs are widened to ``promote(dtype, float32)`` (float32 for the
usual bf16 / fp32 inputs, float64 when the caller passes float64, as the gradient tests do) and
outputs that upstream stores in bf16 come back in the input's dtype (rounded once). Any leading dims
(``...``) are allowed, including none and zero-size ones.

Accumulation orders follow the kernels (docs/mhc.md, "pre_apply_mix", "post"): stream sums run ``m = 0..M-1`` (``post``
starts with the post term), written as explicit loops, so no fp32 ``dot`` / ``einsum`` (and no XLA
matmul precision) is involved. Backward formulas (``*_bwd``) are those of docs/mhc.md, written out
(not autodiff); the tests check them against ``jax.grad`` of the forward references in float64.

The RMS-normalised projection (``pre_norm_fn``, ``fn_normw_merge``) lives in
:mod:`jaxkern.reference.mhc_norm`. The fused inference path (``pre_big_fuse``, docs/mhc.md, "pre_big_fuse") and the multilayer
recompute (docs/mhc.md, "multilayer_recompute") are written here as the compositions that define them.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxkern.reference import mhc_norm
from jaxkern.types import (HeadComputeMixGrads, MultilayerRecompute, PostGrads, PreApplyMixGrads, PreBigFuse,
                           PreSplitMixes, PreSplitMixesGrads)


def _wide(*arrays):
  """The arrays widened to the common compute dtype ``promote(dtypes..., float32)``."""
  dt = jnp.promote_types(jnp.result_type(*arrays), jnp.float32)
  return tuple(jnp.asarray(a).astype(dt) for a in arrays)


def _sigmoid(z):
  return 1 / (1 + jnp.exp(-z))


# ----------------------------------------------------------------------------------------------
# M1 expand (docs/mhc.md, "expand_to_mhc")

def expand_to_mhc(hidden: jax.Array, *, mhc_mult: int) -> jax.Array:
  """``(..., H)`` -> ``(..., M, H)``: ``M`` exact copies of each row."""
  hidden = jnp.asarray(hidden)
  return jnp.broadcast_to(hidden[..., None, :], (*hidden.shape[:-1], mhc_mult, hidden.shape[-1]))


def expand_to_mhc_bwd(out_grad: jax.Array):
  """``(..., M, H)`` -> ``(..., H)``: ``Σ_m grad[..., m, :]`` in float32 (m in order), rounded once."""
  g = jnp.asarray(out_grad)
  (w,) = _wide(g)
  acc = w[..., 0, :]
  for m in range(1, g.shape[-2]):
    acc = acc + w[..., m, :]
  return acc.astype(g.dtype)


# ----------------------------------------------------------------------------------------------
# M4 split mixes (docs/mhc.md, "pre_split_mixes")

def _scale_per_mix(mhc_scale, mhc_mult):
  m = mhc_mult
  return jnp.concatenate([jnp.broadcast_to(mhc_scale[0], (m,)), jnp.broadcast_to(mhc_scale[1], (m,)),
                          jnp.broadcast_to(mhc_scale[2], (m * m,))])


def pre_split_mixes(input_mixes: jax.Array, mhc_scale: jax.Array, mhc_base: jax.Array, *, mhc_mult: int,
                    mhc_post_mult_value: float = 1.0, mhc_pre_eps: float = 1e-6) -> PreSplitMixes:
  """``(..., J)`` logits -> ``(pre (..., M, 1), post (..., M, 1), comb (..., M, M))`` with
  ``a = z·scale[grp] + base``, ``pre = σ(a) + pre_eps``, ``post = σ(a)·post_mult_value``, ``comb = a``."""
  z, scale, base = _wide(input_mixes, mhc_scale, mhc_base)
  m = mhc_mult
  lead = z.shape[:-1]
  a = z * _scale_per_mix(scale, m) + base
  pre = _sigmoid(a[..., :m]) + mhc_pre_eps
  post = _sigmoid(a[..., m:2 * m]) * mhc_post_mult_value
  comb = a[..., 2 * m:].reshape(*lead, m, m)
  return PreSplitMixes(pre[..., None], post[..., None], comb)


def pre_split_mixes_bwd(pre_layer_mix_grad: jax.Array, post_layer_mix_grad: jax.Array, comb_res_mix_grad: jax.Array,
                        input_mixes: jax.Array, post_layer_mix: jax.Array, mhc_scale: jax.Array, mhc_base: jax.Array, *,
                        mhc_mult: int, mhc_post_mult_value: float) -> PreSplitMixesGrads:
  """docs/mhc.md, "pre_split_mixes" backward: ``da_pre = g·σ(1-σ)`` (σ recomputed), ``da_post = g·post·(1 - post/pmv)`` (from the
  saved ``post``), ``da_comb = g``; ``grad_base = Σ_tokens da``, ``grad_scale[g] = Σ_tokens Σ_{j in g} da·z``,
  ``grad_z = da·scale[grp]``."""
  z, scale, base, gpre, gpost, gcomb, post = _wide(input_mixes, mhc_scale, mhc_base, pre_layer_mix_grad,
                                                   post_layer_mix_grad, comb_res_mix_grad, post_layer_mix)
  m = mhc_mult
  lead = z.shape[:-1]
  per = _scale_per_mix(scale, m)
  s = _sigmoid(z[..., :m] * per[:m] + base[:m])
  post = post.reshape(*lead, m)
  da = jnp.concatenate([gpre.reshape(*lead, m) * s * (1 - s),
                        gpost.reshape(*lead, m) * post * (1 - post / mhc_post_mult_value),
                        gcomb.reshape(*lead, m * m)], axis=-1)
  flat_da, flat_z = da.reshape(-1, da.shape[-1]), z.reshape(-1, z.shape[-1])
  by_mix = jnp.sum(flat_da * flat_z, axis=0)
  scale_grad = jnp.stack([jnp.sum(by_mix[:m]), jnp.sum(by_mix[m:2 * m]), jnp.sum(by_mix[2 * m:])])
  return PreSplitMixesGrads(da * per, scale_grad, jnp.sum(flat_da, axis=0))


# ----------------------------------------------------------------------------------------------
# M5 Sinkhorn (docs/mhc.md, "sinkhorn_normalize")

def sinkhorn_normalize(x: jax.Array, *, repeat: int = 10, eps: float = 1e-6):
  """``(..., M, M)`` logits -> softmax over the last axis, ``+ eps``, a column normalisation, then
  ``repeat - 1`` (row, column) normalisation pairs; every denominator is ``sum + eps``."""
  (x,) = _wide(x)
  x = jax.nn.softmax(x, axis=-1) + eps
  x = x / (jnp.sum(x, axis=-2, keepdims=True) + eps)
  for _ in range(repeat - 1):
    x = x / (jnp.sum(x, axis=-1, keepdims=True) + eps)
    x = x / (jnp.sum(x, axis=-2, keepdims=True) + eps)
  return x


def sinkhorn_normalize_bwd(grad_output: jax.Array, x: jax.Array, *, repeat: int = 10, eps: float = 1e-6):
  """docs/mhc.md, "sinkhorn_normalize" backward: recompute the chain (softmax ``P``; the input ``X_i`` and sum ``Σ_i`` of each of the
  ``2·repeat - 1`` normalisations), then walk it backwards; finally the softmax backward."""
  g, x = _wide(grad_output, x)
  p = jax.nn.softmax(x, axis=-1)
  steps = []  # (axis of the sum, X_i, Σ_i)
  cur = p + eps
  for i in range(1, 2 * repeat):
    axis = -2 if i % 2 else -1  # odd steps normalise columns (sum over m), even steps rows
    s = jnp.sum(cur, axis=axis, keepdims=True)
    steps.append((axis, cur, s))
    cur = cur / (s + eps)
  for axis, xi, s in reversed(steps):
    t = jnp.sum(g * xi, axis=axis, keepdims=True) / (s + eps)
    g = (g - t) / (s + eps)
  return (g - jnp.sum(g * p, axis=-1, keepdims=True)) * p


# ----------------------------------------------------------------------------------------------
# M6 apply mix (docs/mhc.md, "pre_apply_mix")

def pre_apply_mix(x: jax.Array, mix: jax.Array):
  """``x (..., M, H)``, ``mix (..., M, 1)`` -> ``(..., H)`` in ``x``'s dtype: ``Σ_m mix[m]·x[m]`` (m in order)."""
  x = jnp.asarray(x)
  xw, mw = _wide(x, mix)
  acc = mw[..., 0, :] * xw[..., 0, :]
  for m in range(1, x.shape[-2]):
    acc = acc + mw[..., m, :] * xw[..., m, :]
  return acc.astype(x.dtype)


def pre_apply_mix_bwd(o_grad: jax.Array, x: jax.Array, mix: jax.Array,
                      x_grad_acc: jax.Array | None = None) -> PreApplyMixGrads:
  """docs/mhc.md, "pre_apply_mix" backward: ``x_grad[m] = (x_grad_acc[m] +) mix[m]·og`` (rounded once to ``x``'s dtype),
  ``mix_grad[m] = Σ_h og·x[m]`` (float32)."""
  x = jnp.asarray(x)
  og, xw, mw = _wide(o_grad, x, mix)
  xg = mw * og[..., None, :]
  if x_grad_acc is not None:
    (acc,) = _wide(x_grad_acc)
    xg = acc + xg
  mix_grad = jnp.sum(og[..., None, :] * xw, axis=-1, keepdims=True)
  return PreApplyMixGrads(xg.astype(x.dtype), mix_grad)


# ----------------------------------------------------------------------------------------------
# M7 post (docs/mhc.md, "post")

def post(x: jax.Array, residual: jax.Array, post_layer_mix: jax.Array, comb_res_mix: jax.Array):
  """``out[n] = post[n]·x + Σ_m comb[m, n]·residual[m]`` (float32, post term first, then m in order),
  rounded once to ``residual``'s dtype. ``x (..., H)``, ``residual (..., M, H)``, ``post (..., M, 1)``,
  ``comb (..., M, M)`` (row ``m`` = input stream)."""
  residual = jnp.asarray(residual)
  xw, rw, pw, cw = _wide(x, residual, post_layer_mix, comb_res_mix)
  mm = residual.shape[-2]
  outs = []
  for n in range(mm):
    acc = pw[..., n, :] * xw
    for m in range(mm):
      acc = acc + cw[..., m, n, None] * rw[..., m, :]
    outs.append(acc)
  return jnp.stack(outs, axis=-2).astype(residual.dtype)


def post_bwd(d_o: jax.Array, x: jax.Array, residual: jax.Array, post_layer_mix: jax.Array,
             comb_res_mix: jax.Array) -> PostGrads:
  """docs/mhc.md, "post" backward: ``d_residual[m] = Σ_n comb[m, n]·dO[n]``, ``d_x = Σ_n post[n]·dO[n]`` (n in order,
  rounded once), ``d_comb[m, n] = Σ_h residual[m]·dO[n]``, ``d_post[n] = Σ_h x·dO[n]`` (float32)."""
  x, residual = jnp.asarray(x), jnp.asarray(residual)
  dw, xw, rw, pw, cw = _wide(d_o, x, residual, post_layer_mix, comb_res_mix)
  mm = residual.shape[-2]
  d_res = []
  for m in range(mm):
    acc = cw[..., m, 0, None] * dw[..., 0, :]
    for n in range(1, mm):
      acc = acc + cw[..., m, n, None] * dw[..., n, :]
    d_res.append(acc)
  d_x = pw[..., 0, :] * dw[..., 0, :]
  for n in range(1, mm):
    d_x = d_x + pw[..., n, :] * dw[..., n, :]
  d_comb = jnp.sum(rw[..., :, None, :] * dw[..., None, :, :], axis=-1)
  d_post = jnp.sum(xw[..., None, :] * dw, axis=-1, keepdims=True)
  return PostGrads(d_x.astype(x.dtype), jnp.stack(d_res, axis=-2).astype(residual.dtype), d_post, d_comb)


# ----------------------------------------------------------------------------------------------
# M8 head mix (docs/mhc.md, "head_compute_mix")

def head_compute_mix(input_mix: jax.Array, mhc_scale: jax.Array, mhc_base: jax.Array, *, mhc_pre_eps: float = 1e-6):
  """``(..., M)`` -> ``σ(z·scale + base) + pre_eps`` (``scale (1,)``, ``base (M,)``)."""
  z, scale, base = _wide(input_mix, mhc_scale, mhc_base)
  return _sigmoid(z * scale[0] + base) + mhc_pre_eps


def head_compute_mix_bwd(output_mix_grad: jax.Array, input_mix: jax.Array, mhc_scale: jax.Array,
                         mhc_base: jax.Array) -> HeadComputeMixGrads:
  """docs/mhc.md, "head_compute_mix" backward: ``dz = go·σ(1-σ)``; ``grad_input = dz·scale``, ``grad_scale = Σ dz·z``,
  ``grad_base = Σ_tokens dz``."""
  go, z, scale, base = _wide(output_mix_grad, input_mix, mhc_scale, mhc_base)
  s = _sigmoid(z * scale[0] + base)
  dz = go * s * (1 - s)
  flat_dz, flat_z = dz.reshape(-1, dz.shape[-1]), z.reshape(-1, z.shape[-1])
  return HeadComputeMixGrads(dz * scale[0], jnp.sum(flat_dz * flat_z).reshape(1), jnp.sum(flat_dz, axis=0))


# ----------------------------------------------------------------------------------------------
# M9 fused inference path (docs/mhc.md, "pre_big_fuse")

def pre_big_fuse(residual: jax.Array, fn: jax.Array, mhc_scale: jax.Array, mhc_base: jax.Array,
                 norm_weight: jax.Array | None = None, *, rms_eps: float = 1e-6, mhc_pre_eps: float = 1e-6,
                 mhc_sinkhorn_eps: float = 1e-6, mhc_post_mult_value: float = 1.0, sinkhorn_repeat: int = 10,
                 n_splits: int = 16) -> PreBigFuse:
  """``pre_norm_fn`` (``norm_weight`` merged into ``fn`` if given, docs/mhc.md, "pre_big_fuse") -> ``pre_split_mixes`` ->
  ``sinkhorn_normalize`` of the comb logits -> ``pre_apply_mix`` with the pre mix, as
  ``PreBigFuse(post_mix (…, M, 1), comb_mix (…, M, M), layer_input (…, H))``. ``n_splits`` is ignored."""
  del n_splits
  residual = jnp.asarray(residual)
  m = residual.shape[-2]
  mixes = mhc_norm.pre_norm_fn(residual, fn, norm_weight, norm_eps=rms_eps)
  pre, post_mix, comb = pre_split_mixes(mixes, mhc_scale, mhc_base, mhc_mult=m, mhc_post_mult_value=mhc_post_mult_value,
                                        mhc_pre_eps=mhc_pre_eps)
  comb = sinkhorn_normalize(comb, repeat=sinkhorn_repeat, eps=mhc_sinkhorn_eps)
  return PreBigFuse(post_mix, comb, pre_apply_mix(residual, pre))


# ----------------------------------------------------------------------------------------------
# M10 multilayer recompute (docs/mhc.md, "multilayer_recompute")

def multilayer_recompute(initial_residual: jax.Array, pre_mix_list: Sequence[jax.Array],
                         layer_output_list: Sequence[jax.Array], post_mix_list: Sequence[jax.Array],
                         comb_mix_list: Sequence[jax.Array]) -> MultilayerRecompute:
  """``R_0 = initial_residual``; for ``i < L``: ``layer_input[i] = pre_apply_mix(R_i, pre_mix[i])`` and, for
  ``i < Lp``, ``R_{i+1} = post(layer_output[i], R_i, post_mix[i], comb_mix[i])`` (each residual rounded to
  the residual's dtype before the next layer reads it). Returns
  ``MultilayerRecompute(layer_input_list (L,), residual_list (Lp,))`` as tuples."""
  r = jnp.asarray(initial_residual)
  inputs, residuals = [], []
  for i, pre in enumerate(pre_mix_list):
    inputs.append(pre_apply_mix(r, pre))
    if i < len(layer_output_list):
      r = post(layer_output_list[i], r, post_mix_list[i], comb_mix_list[i])
      residuals.append(r)
  return MultilayerRecompute(tuple(inputs), tuple(residuals))

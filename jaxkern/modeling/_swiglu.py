"""Trainable FP8 SwiGLU: a ``jax.custom_vjp`` whose forward is the fused forward kernel and whose backward is the
fused backward kernel, with the FP8 e4m3 input and its scales as the residuals (as upstream saves them)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkern import _checks, quant
from jaxkern._autodiff import vary_like

NUM_PER_CHANNELS = (32, 128)
OUT_NUM_PER_CHANNELS = 128  # groups of the FP8 activation (the forward kernel's per-token cast)


@functools.lru_cache(maxsize=None)
def _swiglu_vjp(npc: int, clamp, implementation, weighted: bool, out_fmt: str):
  """The custom_vjp of one static configuration: ``f(x, topk_weights, pos_to_token_topk)``."""

  x_dtype = jnp.bfloat16 if out_fmt == "bf16" else jnp.float32

  def forward(x, topk_weights, pos_to_token_topk):
    act = quant.swiglu_forward_and_per_token_cast(
        x, "e4m3", OUT_NUM_PER_CHANNELS, *((pos_to_token_topk, topk_weights) if weighted else (None, None)),
        swiglu_clamp_value=clamp, implementation=implementation)
    y = quant.per_token_cast_back(act, out_fmt, OUT_NUM_PER_CHANNELS, implementation=implementation)
    return y.astype(x.dtype)

  @jax.custom_vjp
  def f(x, topk_weights, pos_to_token_topk):
    return forward(x, topk_weights, pos_to_token_topk)

  def fwd(x, topk_weights, pos_to_token_topk):
    residual = quant.per_token_cast(x, "e4m3", npc, implementation=implementation)
    return forward(x, topk_weights, pos_to_token_topk), (residual, topk_weights, pos_to_token_topk)

  def bwd(res, ct):
    residual, topk_weights, pos_to_token_topk = res
    e = pos_to_token_topk.shape[0]
    if weighted:
      weight, pos = topk_weights, pos_to_token_topk
    else:  # weight 1 for every row: RN(g · 1) = g, act · 1 = act
      weight, pos = jnp.ones((e, 1), jnp.float32), jnp.arange(e, dtype=jnp.int32)
    grads = quant.swiglu_backward_and_per_token_cast(
        residual, ct.astype(jnp.bfloat16), weight, pos, jnp.zeros(weight.shape, jnp.int32), npc,
        swiglu_clamp_value=clamp, implementation=implementation)
    return grads.x_grad.astype(x_dtype), (grads.weight_grad if weighted else None), None

  f.defvjp(fwd, bwd)
  return f


def swiglu(x: jax.Array, pos_to_token_topk: jax.Array | None = None, topk_weights: jax.Array | None = None, *,
           num_per_channels: int = 128, swiglu_clamp_value: float | None = None,
           implementation: str | None = None) -> jax.Array:
  """SwiGLU ``silu(left) · right · w`` of ``x = [left | right]`` with FP8 e4m3 numerics, trainable.

  Forward: :func:`jaxkern.quant.swiglu_forward_and_per_token_cast` (float32 ``silu(l') · r'``, times the row's
  top-k weight, cast per token to e4m3 with groups of 128: the FP8 tensor the next FP8 GEMM would consume), then
  :func:`jaxkern.quant.per_token_cast_back` to ``x.dtype``. So the output **is the FP8 activation, dequantised**:
  each element carries the e4m3 rounding of its 128-group (relative error at most 2^-4, plus the underflow of
  elements below 2^-9 of the group's scale), then a bf16 / float32 rounding. Residuals: the FP8 input
  ``per_token_cast(x, "e4m3", num_per_channels)`` (data and float32 scales, as upstream saves them), the weights and
  the mapping.

  Backward: :func:`jaxkern.quant.swiglu_backward_and_per_token_cast` on the FP8 residual: the cotangent of ``x`` is
  its bf16 ``x_grad`` (the exact SwiGLU derivative at the dequantised input, zero where the clamp bites; cast to
  ``x.dtype``), that of ``topk_weights`` its ``weight_grad`` (``Σ_c g · act``); both quantisations are
  straight-through (their rounding is not differentiated). The gradient therefore differs from the float32
  gradient of ``silu(l) · r · w`` by the e4m3 error of the residual (relative 2^-4 per input element at most,
  about 2^-4/√3 in RMS) and the bf16 rounding of the incoming cotangent and of ``x_grad``; with a clamp, elements whose e4m3 rounding
  crosses ``±C`` take the other branch of the (discontinuous) clamped derivative. No clamp counters.

  Args:
    x: ``(E, 2h)`` bfloat16 or float32, ``h % 128 == 0`` (and ``h % num_per_channels == 0``).
    pos_to_token_topk: ``(E,)`` int32 with ``topk_weights`` ``(T, k)`` float32 (both or neither): row ``p`` is
      scaled by ``topk_weights.reshape(-1)[pos_to_token_topk[p]]``, and is 0 where that index is negative.
      Without them every row has weight 1.
    num_per_channels: 32 or 128: the group width of the FP8 residual (and of the backward's gradient cast).
    swiglu_clamp_value: the clamp ``C`` (``left`` clamped to ``C`` from above, ``right`` to ``[-C, C]``) or None.
    implementation: passed to every :mod:`jaxkern.quant` op, forward and backward (``"reference"`` runs the ``jnp``
      references: the same FP8 numerics, not an unquantised SwiGLU).

  Returns:
    ``(E, h)`` of ``x.dtype``.

  Raises:
    ValueError (naming the argument): another rank or dtype, ``h`` not a multiple of 128 or of
      ``num_per_channels``, ``num_per_channels`` not 32 / 128, only one of ``pos_to_token_topk`` / ``topk_weights``,
      shapes that do not match.

  Differentiation: w.r.t. ``x`` and ``topk_weights`` (``jax.custom_vjp``); ``pos_to_token_topk`` has none. Works
  under ``jax.jit`` and ``jax.vmap`` (the kernels take a batch as a grid axis).
  """
  x = _checks.as_array("x", x)
  _checks.check_rank("x", x, 2)
  _checks.check_dtype("x", x, (jnp.bfloat16, jnp.float32))
  if num_per_channels not in NUM_PER_CHANNELS:
    raise ValueError(f"num_per_channels must be 32 or 128, got {num_per_channels}")
  e, h2 = x.shape
  if h2 % 256:
    raise ValueError(f"x must have 2h columns with h % 128 == 0, got x.shape {tuple(x.shape)}")
  if (pos_to_token_topk is None) != (topk_weights is None):
    raise ValueError("pos_to_token_topk and topk_weights must be given together")
  weighted = topk_weights is not None
  if weighted:
    pos_to_token_topk = _checks.as_array("pos_to_token_topk", pos_to_token_topk)
    topk_weights = _checks.as_array("topk_weights", topk_weights)
    _checks.check_rank("pos_to_token_topk", pos_to_token_topk, 1)
    _checks.check_dtype("pos_to_token_topk", pos_to_token_topk, (jnp.int32,))
    _checks.check_rank("topk_weights", topk_weights, 2)
    _checks.check_dtype("topk_weights", topk_weights, (jnp.float32,))
    _checks.check_shape("pos_to_token_topk", pos_to_token_topk, (e,))
  else:
    topk_weights, pos_to_token_topk = jnp.zeros((0, 1), jnp.float32), jnp.zeros((e,), jnp.int32)
  out_fmt = "bf16" if x.dtype == jnp.bfloat16 else "fp32"
  f = _swiglu_vjp(num_per_channels, None if swiglu_clamp_value is None else float(swiglu_clamp_value),
                  implementation, weighted, out_fmt)
  return f(*vary_like(x, topk_weights, pos_to_token_topk))  # under shard_map: one vma type

"""Trainable FP8 grouped linear layer on the fused MoE layout: a ``jax.custom_vjp`` over bf16 activations and
bf16 / float32 weights whose forward quantises with the jaxkern casts and runs :func:`jaxkern.gemm.fp8_grouped_gemm`,
and whose backward runs both backward GEMMs in FP8 on the saved FP8 tensors (DeepSeek-V3's FP8 training recipe)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkern import _checks, gemm, quant
from jaxkern.types import QuantTensor

BLOCK = 128


WEIGHT_LAYOUTS = ("nk", "kn")


def quantize_weights(w, *, implementation=None) -> QuantTensor:
  """``(G, A, B)`` bf16 / float32 weights -> e4m3 with 128x128 block sf ``(G, A/128, B/128)`` (one
  :func:`jaxkern.quant.per_block_cast` of the ``(G·A, B)`` view: A is a multiple of 128, so no block spans two
  experts). A 128x128 block cast commutes with transposing the last two axes (same block amax, elementwise
  cast), so the e4m3 weights of either layout are the transpose of the other's."""
  g, a, b = w.shape
  q = quant.per_block_cast(w.reshape(g * a, b), "e4m3", (BLOCK, BLOCK), implementation=implementation)
  return QuantTensor(q.data.reshape(g, a, b), q.sf.reshape(g, a // BLOCK, b // BLOCK))


@functools.lru_cache(maxsize=None)
def _linear_vjp(implementation, weight_layout):
  impl = dict(implementation=implementation)
  kn = weight_layout == "kn"

  def forward(x, w, block_expert):
    xq = quant.per_token_cast(x, "e4m3", BLOCK, **impl)
    wq = quantize_weights(w, **impl)  # the stored layout: the residual
    w_nk = gemm.transpose_weights(wq, **impl) if kn else wq  # the forward GEMM's K-major (G, N, K)
    return gemm.fp8_grouped_gemm(xq, w_nk, block_expert, out_dtype=x.dtype, **impl), wq

  @jax.custom_vjp
  def f(x, w, block_expert):
    return forward(x, w, block_expert)[0]

  def fwd(x, w, block_expert):
    y, wq = forward(x, w, block_expert)
    xt = quant.per_channel_cast_and_transpose(x, "e4m3", BLOCK, **impl)  # (K, M), sf (M/128, K)
    return y, (xt, wq, block_expert, jnp.zeros((0,), w.dtype))

  def bwd(res, dy):
    xt, wq, block_expert, w_dtype = res
    dy = dy.astype(jnp.bfloat16)
    dyq = quant.per_token_cast(dy, "e4m3", BLOCK, **impl)  # (M, N), sf (M, N/128)
    dyt = quant.per_channel_cast_and_transpose(dy, "e4m3", BLOCK, **impl)  # (N, M), sf (M/128, N)
    wgrad = functools.partial(gemm.fp8_grouped_gemm_weight_grad, block_expert=block_expert,
                              num_experts=wq.data.shape[0], out_dtype=w_dtype.dtype, **impl)  # rounded once
    if kn:  # (G, K, N) is the input gradient's K-major layout already; dw comes out (G, K, N)
      dx = gemm.fp8_grouped_gemm(dyq, wq, block_expert, out_dtype=jnp.bfloat16, **impl)
      dw = wgrad(xt, dyt)
    else:
      dx = gemm.fp8_grouped_gemm_input_grad(dyq, wq, block_expert, out_dtype=jnp.bfloat16, **impl)
      dw = wgrad(dyt, xt)
    return dx, dw, None

  f.defvjp(fwd, bwd)
  return f


def fp8_grouped_linear(x: jax.Array, w: jax.Array | QuantTensor, block_expert: jax.Array, *, weight_layout: str = "nk",
                       implementation: str | None = None) -> jax.Array:
  """``y[r] = x[r] · w[block_expert[r // 128]]ᵀ`` (``weight_layout="nk"``) or ``x[r] · w[block_expert[r // 128]]``
  (``"kn"``) in FP8, trainable: the expert matmul of an FP8 MoE layer.

  Forward: ``x`` cast per token (1x128, :func:`jaxkern.quant.per_token_cast`), ``w`` per 128x128 block
  (:func:`quantize_weights`), then :func:`jaxkern.gemm.fp8_grouped_gemm` (float32 accumulation with DeepGEMM's
  per-K-step promotion, bf16 output). Residuals (FP8, as DeepSeek-V3 saves them): ``x`` cast per channel and
  transposed (:func:`jaxkern.quant.per_channel_cast_and_transpose`, ``(K, M)`` with ``(M/128, K)`` sf) and the
  FP8 weights with their sf.

  Backward (both GEMMs in FP8): the bf16 cotangent ``dy`` is cast per token along N for the input gradient
  (:func:`jaxkern.gemm.fp8_grouped_gemm_input_grad` with the transposed FP8 weights) and per channel, transposed,
  for the weight gradient (:func:`jaxkern.gemm.fp8_grouped_gemm_weight_grad`, float32 accumulation written as
  ``w.dtype``). Every
  quantisation is straight-through: the gradients are those of the unquantised product ``x · wᵀ`` evaluated on
  e4m3-rounded operands (each operand element relative error ≤ 2^-4, and different roundings of ``x`` in the
  forward (per token) and in the weight gradient (per channel)), so they match the float32 gradients only to a
  few percent of their largest entry; ``block_expert`` gets no gradient.

  Args:
    x: ``(M, K)`` bfloat16 rows in the fused layout (``M``, ``K`` multiples of 128).
    w: bfloat16 or float32 weights, ``N`` a multiple of 128: ``(G, N, K)`` with ``weight_layout="nk"`` (``(N, K)``
      per expert, as ``torch.nn.Linear`` / DeepGEMM store them) or ``(G, K, N)`` with ``"kn"`` (the right-hand side
      of ``jax.lax.ragged_dot``; ``w.dtype`` gradients in the same layout). With ``"kn"`` the e4m3 weights are
      transposed (1 byte an element each way) for the forward GEMM, and the saved ``(G, K, N)`` copy is already the
      K-major operand of the input gradient, whose GEMM then needs no transpose; the weight gradient comes out
      ``(G, K, N)`` (the same kernel with the operands' roles swapped: each element the same products and scale
      products, possibly summed in another order by the wgmma). No bf16 / float32 transpose of the weights or
      their gradients either way.
    block_expert: ``(M/128,)`` int32 expert of each 128-row block, -1 to skip (zero output rows and zero ``dx``
      rows); any layout, concrete or traced (the blocks of one expert need not be contiguous). Precondition:
      entries in ``{-1} ∪ [0, G)``, checked as in :func:`jaxkern.gemm.fp8_grouped_gemm` (concrete: ``ValueError``;
      traced: treated as -1, reported under ``checkify.checkify(f, errors=checkify.user_checks)``).
    weight_layout: ``"nk"`` (default) or ``"kn"``, the layout of ``w`` (above).
    implementation: passed to every jaxkern op inside (see :mod:`jaxkern._dispatch`).

  Returns ``(M, N)`` bfloat16.

  Raises ValueError as the ops inside (:func:`jaxkern.gemm.fp8_grouped_gemm`, the casts), for a non-bf16 ``x`` and
  an unknown ``weight_layout``.
  """
  if weight_layout not in WEIGHT_LAYOUTS:
    raise ValueError(f"weight_layout must be one of {WEIGHT_LAYOUTS}, got {weight_layout!r}")
  x = _checks.as_array("x", x)
  w = _checks.as_array("w", w)
  _checks.check_dtype("x", x, (jnp.bfloat16,))
  _checks.check_dtype("w", w, (jnp.bfloat16, jnp.float32))
  _checks.check_rank("x", x, 2)
  _checks.check_rank("w", w, 3)
  block_expert = _checks.as_array("block_expert", block_expert)
  return _linear_vjp(implementation, weight_layout)(x, w, block_expert)

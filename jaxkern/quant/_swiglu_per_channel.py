"""Fused SwiGLU forward and per-channel e4m3 cast (quant.md §8.2).

The kernel is the per-channel cast's (:func:`jaxkern.quant._per_channel_cast._kernel`, ``swiglu=True``): each CTA
TMA-loads the gate tile ``x[rows, c:c+bk]`` and the value tile ``x[rows, h+c:h+c+bk]`` (128 rows, ``bk`` = 128
columns, 64 where 128 does not divide ``h``) into SMEM; its column-maxima pass reads both in the same register
layout, so each value meets its partner in one thread, computes the float32 activation (optional clamp,
``e = exp(-l)``, ``d = 1 + e``, ``g = l / d`` correctly rounded by :func:`jaxkern._ieee.exact_div`, ``act = g · r``),
rounds it to bf16, takes the column maxima of that and stores it over the gate tile; the second pass quantises the
stored bf16 activation exactly as :func:`jaxkern.quant.per_channel_cast_and_transpose` quantises its input (the
transposed store through SMEM and TMA, or rows straight to GMEM with ``without_transpose``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxkern import _checks, _dispatch
from jaxkern.quant import _validate as validate
from jaxkern.quant._per_channel_cast import _kernel
from jaxkern.reference import quant as ref
from jaxkern.types import QuantTensor


def _check(x, fmt, num_per_tokens):
  x = _checks.as_array("x", x)
  validate.check_fmt(fmt, ("e4m3",))
  if num_per_tokens not in (32, 128):
    raise ValueError(f"num_per_tokens must be 32 or 128, got {num_per_tokens}")
  _checks.check_rank("x", x, 2)
  _checks.check_dtype("x", x, (jnp.bfloat16,))
  _checks.check_multiple("x", x, 0, 128)
  if x.shape[1] % 128:
    raise ValueError(f"x must have 2h columns with h % 64 == 0, got x.shape {tuple(x.shape)}")
  return x


def swiglu_forward_and_per_channel_cast_and_transpose(x, fmt: str, num_per_tokens: int, *, round_sf: bool = False,
                                                      without_transpose: bool = False,
                                                      swiglu_clamp_value: float | None = None,
                                                      implementation: str | None = None) -> QuantTensor:
  """SwiGLU forward of ``x = [left | right]``, rounded to bf16, fused with a per-channel e4m3 cast whose data come
  back transposed (quant.md §8.2).

  Per element (float32, each step one IEEE rounding): with a clamp ``C``, ``l = min(left, C)``,
  ``r = clip(right, -C, C)``; ``act = (l / (1 + exp(-l))) · r``; ``b = bf16(act)`` (round to nearest even). Then
  one scale per column and block of ``num_per_tokens`` rows, as :func:`jaxkern.quant.per_channel_cast_and_transpose`
  of ``b``: ``sf = max(amax, 1e-4) / 448`` (or its power of two up with ``round_sf``), ``data = e4m3(b · sf_inv)``.

  Args:
    x: ``(M, 2h)`` bfloat16, ``M % 128 == 0``, ``h % 64 == 0``; ``left = x[:, :h]`` (gate),
      ``right = x[:, h:]`` (value).
    fmt: ``"e4m3"``.
    num_per_tokens: 32 or 128 (rows per scale).
    round_sf: power-of-two scales (``2^ceil(log2(amax/448))``).
    without_transpose: return the data ``(M, h)`` instead of ``(h, M)``.
    swiglu_clamp_value: the clamp ``C`` (a float, taken as float32) or None. The clamp is applied in float32
      (upstream clamps the bf16 inputs; the same for every ``C`` exactly representable in bf16, such as the tested
      10.0 and 0.5: quant.md §12.14).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``QuantTensor(data (h, M) float8_e4m3fn, or (M, h) with without_transpose, sf (M/num_per_tokens, h) float32)``
    (sf row-major, never transposed).

  Raises:
    ValueError (naming the argument): another rank or dtype (float32 included), ``M % 128 != 0``,
      ``h % 64 != 0``, ``fmt != "e4m3"``, ``num_per_tokens`` not 32 / 128, a non-array ``x``.

  Mosaic GPU kernel: the per-channel cast's with a SwiGLU prologue (:mod:`jaxkern.quant._swiglu_per_channel`). XLA
  (the reference) instead of the kernel: only zero-size arrays (``M = 0`` gives data ``(h, 0)`` / ``(0, h)`` and
  sf ``(0, h)``).

  Numerics: bit-identical to :func:`jaxkern.reference.quant.swiglu_forward_and_per_channel_cast_and_transpose` run on
  the same backend (``exp`` differs between XLA's CPU and CUDA's ``expf``, which the GPU kernel and XLA on GPU
  share). Non-finite values (inputs, or products that overflow) are outside the contract.

  Differentiation: not differentiable; ``jax.grad`` through it raises :class:`jaxkern.NotDifferentiableError`.
  """
  x = validate.guard("swiglu_forward_and_per_channel_cast_and_transpose", _check(x, fmt, num_per_tokens))
  clamp = None if swiglu_clamp_value is None else float(np.float32(swiglu_clamp_value))

  def kernel(interpret):
    return QuantTensor(*_kernel(x, npt=num_per_tokens, round_sf=round_sf, transpose_out=not without_transpose,
                                swiglu=True, clamp=clamp, interpret=interpret))

  def reference():
    return ref.swiglu_forward_and_per_channel_cast_and_transpose(
        x, fmt, num_per_tokens, round_sf=round_sf, without_transpose=without_transpose, swiglu_clamp_value=clamp)

  return _dispatch.run("swiglu_forward_and_per_channel_cast_and_transpose", implementation, kernel=kernel,
                       xla=reference, empty=x.size == 0)

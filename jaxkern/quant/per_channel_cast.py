"""Per-channel e4m3 casts: one scale per column and group of ``num_per_tokens`` rows (quant.md §7).

No Pallas kernel yet: every implementation runs the ``jnp`` reference (:mod:`jaxkern.reference.quant`).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxkern import _checks, _config
from jaxkern.quant import common
from jaxkern.reference import quant as ref


def per_channel_cast_fused(x, fmt: str, num_per_tokens: int, round_sf: bool = False, num_per_channels=None,
                           pos_to_token=None, *, implementation: str | None = None):
  """Per-channel (128-row) e4m3 cast with an optional row gather and dequantisation of the input.

  Args:
    x: ``(M, K)`` bf16 / float32 (``K % 64 == 0``), or a QuantTensor ``(q e4m3 (M, K), sf float32
      (M, K/128))`` with ``num_per_channels=128`` (``K % 128 == 0``).
    fmt: ``"e4m3"``. num_per_tokens: 128.
    pos_to_token: optional int32 ``(Mo,)``, ``Mo % 16 == 0``; row ``p`` is ``x[pos_to_token[p]]``, or
      zeros where negative. Without it ``M % 128 == 0``.

  Returns:
    ``(out (Mo, K) e4m3, out_sf (ceil(Mo/128), K) float32)``.
  """
  common.check_fmt(fmt, ("e4m3",))
  if num_per_tokens != 128:
    raise ValueError(f"num_per_tokens must be 128, got {num_per_tokens}")
  if isinstance(x, tuple):
    if num_per_channels != 128:
      raise ValueError("num_per_channels must be 128 for a QuantTensor input")
    q, sf = x
    _checks.check_rank("x[0]", q, 2)
    _checks.check_dtype("x[0]", q, (jnp.float8_e4m3fn,))
    _checks.check_multiple("x[0]", q, 1, 128)
    common.check_sf("x[1]", sf, (q.shape[0], q.shape[1] // 128), jnp.float32)
    rows = q.shape[0]
  else:
    if num_per_channels is not None:
      raise ValueError("num_per_channels must be None for a plain input")
    _checks.check_rank("x", x, 2)
    _checks.check_dtype("x", x, (jnp.bfloat16, jnp.float32))
    _checks.check_multiple("x", x, 1, 64)
    rows = x.shape[0]
  if pos_to_token is None:
    if rows % 128:
      raise ValueError(f"x must have a multiple of 128 rows without pos_to_token, got {rows}")
  else:
    _checks.check_rank("pos_to_token", pos_to_token, 1)
    _checks.check_dtype("pos_to_token", pos_to_token, (jnp.int32,))
    _checks.check_multiple("pos_to_token", pos_to_token, 0, 16)
  _config.get_implementation(implementation)
  return ref.per_channel_cast_fused(x, num_per_tokens, round_sf, pos_to_token)


def _check_plain(x, fmt, num_per_tokens, allowed, dtypes):
  common.check_fmt(fmt, ("e4m3",))
  if num_per_tokens not in allowed:
    raise ValueError(f"num_per_tokens must be in {allowed}, got {num_per_tokens}")
  _checks.check_rank("x", x, 2)
  _checks.check_dtype("x", x, dtypes)
  _checks.check_multiple("x", x, 0, 128)
  _checks.check_multiple("x", x, 1, 64)


def per_channel_cast(x, fmt: str, num_per_tokens: int, round_sf: bool = False, *,
                     implementation: str | None = None):
  """Per-channel e4m3 cast of ``x`` ``(M, K)`` (``M % 128 == 0``, ``K % 64 == 0``), 128-row blocks.

  Returns ``(out (M, K) e4m3, out_sf (M/128, K) float32)``.
  """
  _check_plain(x, fmt, num_per_tokens, (128,), (jnp.bfloat16, jnp.float32))
  return per_channel_cast_fused(x, fmt, num_per_tokens, round_sf, implementation=implementation)


def per_channel_cast_and_transpose(x, fmt: str, num_per_tokens: int, round_sf: bool = False, *,
                                   implementation: str | None = None):
  """Per-channel e4m3 cast of bf16 ``x`` ``(M, K)`` with ``num_per_tokens ∈ {32, 128}``, data transposed.

  Returns ``(out (K, M) e4m3, out_sf (M/npt, K) float32)``.
  """
  _check_plain(x, fmt, num_per_tokens, (32, 128), (jnp.bfloat16,))
  _config.get_implementation(implementation)
  out, sf = ref.cast(x, "e4m3", (num_per_tokens, 1), round_sf=round_sf)
  return out.T, sf

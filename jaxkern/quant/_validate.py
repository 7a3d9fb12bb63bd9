"""Argument checks shared by the :mod:`jaxkern.quant` ops (each raises ``ValueError`` naming the argument), and
the guard that makes them refuse differentiation."""

from __future__ import annotations

import jax.numpy as jnp

from jaxkern import _autodiff, _checks
from jaxkern.reference.quant import cdiv
from jaxkern.types import QuantTensor

FMTS = ("e4m3", "e2m1")


def check_fmt(fmt: str, allowed=FMTS) -> None:
  if fmt not in allowed:
    raise ValueError(f"fmt must be one of {allowed}, got {fmt!r}")


def check_sf_flags(use_tma_aligned_col_major_sf: bool, round_sf: bool, use_packed_ue8m0: bool) -> None:
  if use_packed_ue8m0 and not (use_tma_aligned_col_major_sf and round_sf):
    raise ValueError("use_packed_ue8m0 requires use_tma_aligned_col_major_sf=True and round_sf=True")


def check_sf(name: str, sf, shape, dtype) -> None:
  _checks.check_dtype(name, sf, (dtype,))
  _checks.check_shape(name, sf, shape)


def sf_shape(num_rows: int, num_cols: int, *, col_major: bool, packed: bool) -> tuple[int, int]:
  """Shape of a layout A / B / C sf for a logical ``(num_rows, num_cols)`` matrix."""
  if not col_major:
    return num_rows, num_cols
  mp = cdiv(num_rows, 4) * 4
  return (cdiv(num_cols, 4), mp) if packed else (num_cols, mp)


def check_quant_tensor(name: str, x, block_size, *, col_major: bool = False, fp4: bool = True) -> int:
  """Checks a QuantTensor ``(q, sf)`` for blocks ``block_size``; returns the logical width ``K``."""
  if not (isinstance(x, tuple) and len(x) == 2):
    raise ValueError(f"{name} must be a QuantTensor (data, sf)")
  q, sf = x
  if block_size is None or len(block_size) != 2 or min(block_size) < 1:
    raise ValueError(f"x_block_size must be a pair of positive ints for a QuantTensor, got {block_size}")
  _checks.check_rank(f"{name}[0]", q, 2)
  _checks.check_dtype(f"{name}[0]", q, (jnp.float8_e4m3fn, jnp.int8, jnp.uint8) if fp4 else (jnp.float8_e4m3fn,))
  m, k = q.shape[0], q.shape[1] * (1 if q.dtype == jnp.float8_e4m3fn else 2)
  _checks.check_rank(f"{name}[1]", sf, 2)
  _checks.check_dtype(f"{name}[1]", sf, (jnp.float32, jnp.int32))
  mb, kb = cdiv(m, block_size[0]), cdiv(k, block_size[1])
  packed = sf.dtype == jnp.int32
  want = sf_shape(mb, kb, col_major=col_major or packed, packed=packed)
  _checks.check_shape(f"{name}[1] (sf)", sf, want, f" for blocks {tuple(block_size)}")
  return k


def guard(op: str, *inputs, advice: str = _autodiff.CAST_ADVICE):
  """The inputs unchanged (one, or a tuple of them; a QuantTensor or pair comes back as a QuantTensor), their
  arrays through :func:`jaxkern._autodiff.guard`: differentiating through a floating-point one raises
  :class:`jaxkern.NotDifferentiableError` naming the cast ``op``."""
  out = tuple(_guard_one(op, x, advice) for x in inputs)
  return out[0] if len(inputs) == 1 else out


def _guard_one(op: str, x, advice: str):
  if isinstance(x, tuple):
    return QuantTensor(*_autodiff.guard(op, advice, *x))
  return _autodiff.guard(op, advice, x)

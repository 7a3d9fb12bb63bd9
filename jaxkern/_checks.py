"""Trace-time argument checks shared by the public ops; each raises ``ValueError`` naming the argument.

Checks chex covers (rank) go through chex; its ``AssertionError`` becomes the ``ValueError`` here. chex's
``dtype`` check takes one dtype, not a set, and it has no divisibility check: those two stay plain."""

from __future__ import annotations

from collections.abc import Iterable

import chex
import jax.numpy as jnp
import numpy as np


def check_rank(name: str, x, ndim: int) -> None:
  try:
    chex.assert_rank(x, ndim)
    ok = len(x.shape) == ndim  # chex.disable_asserts() switches chex off; the op's own check must stay on
  except AssertionError:
    ok = False
  if not ok:
    raise ValueError(f"{name} must have rank {ndim}, got shape {tuple(x.shape)}")


def check_dtype(name: str, x, allowed: Iterable) -> None:
  allowed = tuple(jnp.dtype(d) for d in allowed)
  if x.dtype not in allowed:
    names = ", ".join(d.name for d in allowed)
    raise ValueError(f"{name} must have dtype in ({names}), got {x.dtype}")


def check_multiple(name: str, x, axis: int, multiple: int) -> None:
  if x.shape[axis] % multiple:
    raise ValueError(
        f"{name}.shape[{axis}] must be a multiple of {multiple}, got shape {tuple(x.shape)}")


def as_array(name: str, x):
  """``x`` as an array: arrays (and tracers) pass, a (nested) list is converted with ``jnp.asarray``,
  anything else raises."""
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return x
  if isinstance(x, list):
    try:
      return jnp.asarray(x)
    except (TypeError, ValueError) as e:
      raise ValueError(f"{name}: cannot convert the list to an array ({e})") from None
  raise ValueError(f"{name} must be an array, got {type(x).__name__}")


def check_float(name: str, value, *, nonzero: bool = False, nonnegative: bool = False) -> float:
  """A static float option (a Python or numpy number): finite, optionally non-zero / non-negative; returns it as a
  Python float."""
  try:
    value = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a Python float, got {type(value).__name__}") from None
  if not np.isfinite(value) or (nonzero and value == 0) or (nonnegative and value < 0):
    cond = "finite" + (" and non-zero" if nonzero else "") + (" and >= 0" if nonnegative else "")
    raise ValueError(f"{name} must be {cond}, got {value}")
  return value

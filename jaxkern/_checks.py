"""Trace-time argument checks shared by the public ops; each raises ``ValueError`` naming the argument."""

from __future__ import annotations

from collections.abc import Iterable

import jax.numpy as jnp


def check_rank(name: str, x, ndim: int) -> None:
  if x.ndim != ndim:
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

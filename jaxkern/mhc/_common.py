"""Argument checks shared by the mHC mix ops (each raises ``ValueError`` naming the argument)."""

from __future__ import annotations

import os

import numpy as np
import jax.numpy as jnp

from jaxkern import _checks

FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)
BWD_ADVICE = ("it is a backward pass; differentiate the forward op (its jax.custom_vjp runs this backward)")


def array(name, a, min_rank=1):
  a = _checks.as_array(name, a)
  if a.ndim < min_rank:
    raise ValueError(f"{name} must have rank >= {min_rank}, got shape {tuple(a.shape)}")
  _checks.check_dtype(name, a, FLOATS)
  return a


def shape(name, a, want):
  _checks.check_shape(name, a, want)


def mhc_mult(value, name="mhc_mult"):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be an int >= 1, got {value!r}")
  return int(value)


def repeat(value):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"repeat must be an int >= 1, got {value!r}")
  return int(value)


def tokens(lead) -> int:
  return int(np.prod(lead, dtype=np.int64))


def streams(name, x, min_rank=2):
  """A ``(..., M, H)`` stream array: returns ``(x, lead, M, H)``."""
  x = array(name, x, min_rank)
  m, h = x.shape[-2:]
  if m == 0 or h == 0:
    raise ValueError(f"{name} must have non-empty M and H, got shape {tuple(x.shape)}")
  return x, x.shape[:-2], m, h


FORCE_KERNEL_ENV = "_JAXKERN_MHC_FORCE_KERNEL"


def xla_faster(op: str, reason: str) -> str | None:
  """``reason`` (why "auto" runs XLA for ``op``), or None where the private timing override forces the kernel.

  The override is for timing scripts only (not an API): the environment variable ``_JAXKERN_MHC_FORCE_KERNEL``,
  a comma-separated list of op names or ``all``, read when the op is traced, makes "auto" run these ops'
  kernels although XLA measured faster, so ``python -m benchmarks.run`` times the kernels (its rows then say
  ``path: pallas``); it exists so that the kernels "auto" passes over can still be timed.
  """
  names = {n.strip() for n in os.environ.get(FORCE_KERNEL_ENV, "").split(",")}
  return None if op in names or "all" in names else reason

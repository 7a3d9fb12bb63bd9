"""``jnp`` references for :mod:`jaxkern.transpose`."""

import jax
import jax.numpy as jnp


def transpose(x: jax.Array) -> jax.Array:
  """``(M, N) -> (N, M)``."""
  return x.T


def batched_transpose(x: jax.Array) -> jax.Array:
  """``(B, M, N) -> (B, N, M)``."""
  return jnp.swapaxes(x, 1, 2)

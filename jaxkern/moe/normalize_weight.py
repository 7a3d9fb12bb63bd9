"""``normalize_weight``: divide each token's weights by their 1e-20-seeded sum (spec §6.1).

No Pallas kernel: the op is one pass over a ``(T, K)`` array with ``K <= 9``, which XLA
already fuses into a single bandwidth-bound loop. The division is exact IEEE on every
backend (:func:`jaxkern.reference.ieee.div`), as the bit-exact spec requires.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkern import _checks, _config
from jaxkern.reference import moe_routing as ref


def normalize_weight(topk_weights: jax.Array, *, implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
  """Returns ``(d, w / d[:, None])`` with ``d = ((1e-20 + w[:, 0]) + w[:, 1]) + ...`` in fp32.

  Args:
    topk_weights: ``(T, K)`` float32 weights (negative values allowed).
    implementation: see :mod:`jaxkern._config` (every choice runs the same XLA code).

  Returns:
    ``denominator (T,)`` and ``normalized_weights (T, K)``, float32, bit-exact.
  """
  _checks.check_rank("topk_weights", topk_weights, 2)
  _checks.check_dtype("topk_weights", topk_weights, (jnp.float32,))
  _config.get_implementation(implementation)
  return ref.normalize_weight(topk_weights)

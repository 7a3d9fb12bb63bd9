"""``aux_fi``: per-expert load fraction for the auxiliary balance loss (spec §6.2).

No Pallas kernel: a deterministic XLA int32 histogram (``group_count``'s compare-and-sum for up
to 64 experts) followed by the reference's fp32 formula with an exact IEEE division (upstream's float atomics are not deterministic; the spec asks for
the reference formula).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkern import _config
from jaxkern.moe import _routing
from jaxkern.reference import ieee
from jaxkern.reference import moe as ref


def aux_fi(topk_idx: jax.Array, num_experts: int, num_aux_topk: int, *,
           implementation: str | None = None) -> jax.Array:
  """``fi[e] = (float32(count_e) * E) / float32(T * num_aux_topk)``, zeros when ``T = 0``.

  Args:
    topk_idx: ``(T, K)`` int32 or int64 expert ids in ``{-1} ∪ [0, num_experts)`` (concrete
      arrays are range-checked; traced out-of-range ids are ignored).
    num_experts: ``E`` (static).
    num_aux_topk: normaliser (static; need not equal ``K``).
    implementation: see :mod:`jaxkern._config` (``reference``: the reference; otherwise the
      XLA formulation above).

  Returns:
    ``(E,)`` float32.
  """
  _routing.check_index("topk_idx", topk_idx, 2)
  if num_experts < 1:
    raise ValueError(f"num_experts must be positive, got {num_experts}")
  if num_aux_topk < 1:
    raise ValueError(f"num_aux_topk must be positive, got {num_aux_topk}")
  _routing.check_values_below("topk_idx", topk_idx, num_experts)
  if _config.get_implementation(implementation) == "reference" or topk_idx.shape[0] == 0:
    return ref.aux_fi(topk_idx, num_experts, num_aux_topk)
  counts = _routing.histogram(topk_idx, num_experts).astype(jnp.float32)
  return ieee.div(counts * jnp.float32(num_experts), jnp.float32(topk_idx.shape[0] * num_aux_topk))

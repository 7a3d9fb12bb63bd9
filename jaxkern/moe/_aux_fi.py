"""``aux_fi``: per-expert load fraction for the auxiliary balance loss (docs/moe.md, "Helpers").

No Pallas kernel: a deterministic XLA int32 histogram (``group_count``'s compare-and-sum for up
to 64 experts) followed by the reference's fp32 formula with an exact IEEE division (upstream's float atomics are not deterministic; jaxkern asks for
the reference formula).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkern import _checks, _dispatch
from jaxkern.moe import _routing
from jaxkern.reference import ieee
from jaxkern.reference import moe as ref


def aux_fi(topk_idx: jax.Array, num_experts: int, num_aux_topk: int, *,
           implementation: str | None = None) -> jax.Array:
  """``fi[e] = (float32(count_e) * E) / float32(T * num_aux_topk)``, zeros when ``T = 0``.

  Args:
    topk_idx: ``(T, K)`` int32 or int64 array (or nested list) of expert ids in
      ``{-1} ∪ [0, num_experts)`` (precondition). Concrete arrays are range-checked; under ``jit`` ids
      outside that range are ignored (not counted), and ``checkify.checkify(f, errors=checkify.user_checks)``
      reports the first of them (docs/usage.md, "Bad values under jit").
    num_experts: ``E`` (static, positive).
    num_aux_topk: normaliser (static, positive; need not equal ``K``).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``
      (see :mod:`jaxkern._config`): every one but ``"reference"`` (the reference's scatter-add; also
      what ``"auto"`` runs off a GPU) runs the XLA code above.

  Returns:
    ``(E,)`` float32.

  Raises:
    ValueError: ``topk_idx`` not of rank 2 or of another dtype (bool included); ``num_experts`` or
      ``num_aux_topk`` not positive; a concrete ``topk_idx`` with an id below -1 or ``>= E``.

  No Pallas kernel: the XLA code is the implementation.
  """
  topk_idx = _routing.check_index("topk_idx", topk_idx, 2)
  if num_experts < 1:
    raise ValueError(f"num_experts must be positive, got {num_experts}")
  if num_aux_topk < 1:
    raise ValueError(f"num_aux_topk must be positive, got {num_aux_topk}")
  _routing.check_values_below("topk_idx", topk_idx, num_experts)
  _checks.debug_check_entries("aux_fi", "topk_idx", topk_idx, lambda v: (v < -1) | (v >= num_experts),
                              f"-1 or an expert id in [0, {num_experts}) (num_experts; not counted)")

  def xla():
    if topk_idx.shape[0] == 0:
      return jnp.zeros((num_experts,), jnp.float32)
    counts = _routing.histogram(topk_idx, num_experts).astype(jnp.float32)
    return ieee.div(counts * jnp.float32(num_experts), jnp.float32(topk_idx.shape[0] * num_aux_topk))

  return _dispatch.run("aux_fi", implementation, kernel=None, xla=xla,
                       reference=lambda: ref.aux_fi(topk_idx, num_experts, num_aux_topk))

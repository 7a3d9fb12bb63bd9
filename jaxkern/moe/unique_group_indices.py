"""``unique_group_indices``: functional form of upstream's ``inplace_unique_group_indices`` (spec §6.5).

No Pallas kernel: a ``(T, K, K)`` comparison (``K <= 9``) that XLA fuses into one pass.
"""

from __future__ import annotations

import jax

from jaxkern import _config
from jaxkern.moe import _routing
from jaxkern.reference import moe_routing as ref


def unique_group_indices(group_indices: jax.Array, num_groups: int, *,
                         implementation: str | None = None) -> jax.Array:
  """Replaces each repeated non-negative value of a row (after its first occurrence) by -1.

  Negative values are kept unchanged (the upstream kernel's behaviour).

  Args:
    group_indices: ``(T, K)`` int32 or int64.
    num_groups: number of groups (static; upstream requires ``<= 128``).
    implementation: see :mod:`jaxkern._config` (every choice runs the same XLA code).

  Returns:
    The new array (same shape and dtype); upstream modifies its argument in place.
  """
  _routing.check_index("group_indices", group_indices, 2)
  if not 1 <= num_groups <= 128:
    raise ValueError(f"num_groups must be in [1, 128], got {num_groups}")
  _config.get_implementation(implementation)
  return ref.unique_group_indices(group_indices, num_groups)

"""``group_count``: int32 histogram of indices, ignoring -1 (docs/moe.md, "Helpers").

No Pallas kernel: up to 64 buckets, one XLA compare-and-sum reduction over the entries (about
2x faster than the reference's scatter-add on an H200, whose atomics contend on a few bins);
above that, the scatter-add of int32 ones. Both are exact integers.
"""

from __future__ import annotations

import jax

from jaxkern import _checks, _dispatch
from jaxkern.moe import _routing
from jaxkern.reference import moe as ref


def group_count(group_idx: jax.Array, num_groups: int, *, implementation: str | None = None) -> jax.Array:
  """Counts the entries equal to each ``g`` in ``[0, num_groups)``.

  Args:
    group_idx: ``(T, K)`` int32 or int64 array (or nested list), entries in
      ``{-1} ∪ [0, num_groups)`` (precondition). Concrete arrays are range-checked; under ``jit``
      entries outside that range are ignored (not counted), and ``checkify.checkify(f,
      errors=checkify.user_checks)`` reports the first of them (docs/usage.md, "Bad values under jit").
    num_groups: number of buckets (static, positive).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``
      (see :mod:`jaxkern._config`): every one but ``"reference"`` (the reference's scatter-add; also
      what ``"auto"`` runs off a GPU) runs the XLA code above.

  Returns:
    ``(num_groups,)`` int32 counts.

  Raises:
    ValueError: ``group_idx`` not of rank 2 or of another dtype (bool included); ``num_groups`` not
      positive; a concrete ``group_idx`` with an entry below -1 or ``>= num_groups``.

  No Pallas kernel: the XLA code is the implementation.
  """
  group_idx = _routing.check_index("group_idx", group_idx, 2)
  if num_groups < 1:
    raise ValueError(f"num_groups must be positive, got {num_groups}")
  _routing.check_values_below("group_idx", group_idx, num_groups)
  _checks.debug_check_entries("group_count", "group_idx", group_idx, lambda v: (v < -1) | (v >= num_groups),
                              f"-1 or a group in [0, {num_groups}) (num_groups; not counted)")
  return _dispatch.run("group_count", implementation, kernel=None,
                       xla=lambda: _routing.histogram(group_idx, num_groups),
                       reference=lambda: ref.group_count(group_idx, num_groups))

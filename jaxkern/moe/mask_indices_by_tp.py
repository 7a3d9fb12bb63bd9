"""``mask_indices_by_tp``: EP/TP masking and local renumbering of expert ids (spec §3.6, §6.4).

No Pallas kernel: an elementwise integer map that XLA fuses into one pass.
"""

from __future__ import annotations

import jax

from jaxkern import _config
from jaxkern.moe import _routing
from jaxkern.reference import moe_routing as ref


def mask_indices_by_tp(indices: jax.Array, n: int, num_ep_ranks: int, tp_rank, num_tp_ranks: int, *,
                       implementation: str | None = None) -> jax.Array:
  """Keeps the experts of EP ranks ``q`` with ``q % num_tp_ranks == tp_rank``, renumbered densely.

  With ``R = n // num_ep_ranks`` and ``q = p // R``: ``p -> (q // num_tp_ranks) * R + p % R`` when
  kept, else -1; negative entries become -1.

  Args:
    indices: ``(T, K)`` int32 or int64 global expert ids.
    n: total experts over all EP ranks (static).
    num_ep_ranks, num_tp_ranks: static rank counts.
    tp_rank: this TP rank (int or traced int32 scalar).
    implementation: see :mod:`jaxkern._config` (every choice runs the same XLA code).

  Returns:
    Array of the shape and dtype of ``indices``.
  """
  _routing.check_index("indices", indices, 2)
  if num_ep_ranks < 1 or n < num_ep_ranks:
    raise ValueError(f"num_ep_ranks must be in [1, n], got num_ep_ranks={num_ep_ranks}, n={n}")
  if num_tp_ranks < 1:
    raise ValueError(f"num_tp_ranks must be positive, got {num_tp_ranks}")
  if isinstance(tp_rank, int) and not 0 <= tp_rank < num_tp_ranks:
    raise ValueError(f"tp_rank must be in [0, {num_tp_ranks}), got {tp_rank}")
  _config.get_implementation(implementation)
  return ref.mask_indices_by_tp(indices, n, num_ep_ranks, tp_rank, num_tp_ranks)

"""``get_fused_mapping``: the expert-major fused row layout and the token <-> row maps (spec §5.1).

No Pallas kernel yet: the layout is computed with deterministic XLA code (an int32
scatter-add histogram, prefix sums, and a stable sort of the flat entries by expert, which
gives the canonical in-segment order). A Mosaic GPU version would need per-block histograms
and in-block ranks built from compares and loops (no sort/cumsum/scatter lowering).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkern import _config
from jaxkern.moe import _routing
from jaxkern.reference import moe_routing as ref


def get_fused_mapping(topk_idx: jax.Array, num_experts: int, num_expanded_tokens: int, alignment: int,
                      force_no_sync: bool = False, *, implementation: str | None = None):
  """Builds the fused layout: expert ``e`` owns rows ``[expert_start[e], expert_end[e])``.

  The segment length is the expert's entry count rounded up to ``alignment`` (0 for an unused
  expert); its first rows hold the entries ``(t, k)`` with ``topk_idx[t, k] = e`` in ascending
  flat order ``t*K + k`` (upstream's order is a hardware-dependent permutation, spec §5.1;
  every downstream result is independent of it), the rest are padding (-1 in the ``pos_to_*``
  maps), as are rows past the last segment.

  Args:
    topk_idx: ``(T, K)`` int32 or int64 expert ids in ``{-1} ∪ [0, num_experts)``. Concrete
      arrays are range-checked; for traced ones, ids outside that range are treated as -1.
    num_experts: local expert count ``E`` (static).
    num_expanded_tokens: rows ``N`` of the fused layout (static, ``>= sum of aligned counts``;
      rows beyond ``N`` are dropped). ``0`` sizes the layout: with ``force_no_sync=False`` it
      returns exactly ``sum(n_e)`` rows, which needs concrete ``topk_idx`` (not under ``jit``);
      with ``force_no_sync=True`` it allocates the upper bound ``floor((T*K + (a-1)*E) / a) * a``.
    alignment: segment alignment ``a >= 1`` (static).
    force_no_sync: see ``num_expanded_tokens``.
    implementation: see :mod:`jaxkern._config`.

  Returns:
    ``(pos_to_expert (N,), pos_to_token (N,), pos_to_token_topk (N,), token_topk_to_pos (T, K),
    expert_start (E,), expert_end (E,), num_tokens_per_expert (E,), num_tokens_per_expert_list)``,
    all int32 arrays; the list holds the aligned counts as Python ints when the layout was sized
    on the host (``N = 0`` without ``force_no_sync``), else ``[]``.
  """
  _routing.check_index("topk_idx", topk_idx, 2)
  if num_experts < 1:
    raise ValueError(f"num_experts must be positive, got {num_experts}")
  if alignment < 1:
    raise ValueError(f"alignment must be positive, got {alignment}")
  if num_expanded_tokens < 0:
    raise ValueError(f"num_expanded_tokens must be non-negative, got {num_expanded_tokens}")
  _routing.check_values_below("topk_idx", topk_idx, num_experts)
  t, k = topk_idx.shape
  sync = num_expanded_tokens == 0 and not force_no_sync
  if sync and isinstance(topk_idx, jax.core.Tracer):
    raise ValueError("num_expanded_tokens=0 sizes the layout on the host and cannot be traced (jit/vmap): "
                     "pass a static num_expanded_tokens, or force_no_sync=True for the upper bound")
  n = num_expanded_tokens or ref.upper_bound_rows(t, k, num_experts, alignment)
  _config.get_implementation(implementation)
  outs = ref.get_fused_mapping(jnp.asarray(topk_idx), num_experts, n, alignment)
  if not sync:
    return (*outs, [])
  counts = np.asarray(outs[6]).tolist()
  used = sum(counts)
  return (*(o[:used] for o in outs[:3]), *outs[3:], counts)

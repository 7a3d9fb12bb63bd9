"""``top2_sum_gate``: the DeepSeek router (spec moe_transpose.md §4.3).

Split of the work: the group-limited stable top-k over the ranking scores (the part
XLA can only do with a sort) is a Mosaic GPU kernel with the row blocking of
:mod:`jaxkern.moe.topk_gate` (groups ranked by their two-best sums, experts of the
other groups marked taken, then ``K`` rounds of row max / smallest index). The
elementwise parts run in XLA around it, shared with the reference: the scores
(``exp``/``log1p`` as in CUDA; Mosaic GPU has no ``log1p``), the weight
normalisation, shared slots, replica hash, EP/TP masking and the token mask.
Division and sqrt use :mod:`jaxkern._ieee` (correctly rounded from integer
arithmetic), since XLA's are not on GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxkern import _checks, _config
from jaxkern.moe import _select
from jaxkern.moe.topk_gate import pad_rows_and_cols
from jaxkern.reference import moe as ref


@functools.partial(jax.jit, static_argnames=("num_experts", "num_topk", "num_groups", "num_topk_groups",
                                             "interpret"))
def _select_kernel(b: jax.Array, num_experts: int, num_topk: int, num_groups: int, num_topk_groups: int,
                   interpret=None) -> jax.Array:
  t, e = b.shape

  def body(row0, b_g, o_g, smem, bars):
    keys = _select.load_keys(b_g, smem, bars, row0, e)
    if num_groups != num_topk_groups:
      size = num_experts // num_groups
      ranks = _select.group_ranks(_select.group_scores(keys, num_groups, size, 2))
      for g, rank in enumerate(ranks):
        lo, hi = g * size, (g + 1) * size
        cap = jnp.where(rank >= num_topk_groups, _select.TAKEN, jnp.iinfo(jnp.int32).max)
        keys = keys.map_cols(
            lambda k, c, lo=lo, hi=hi, cap=cap: jnp.where((c >= lo) & (c < hi), jnp.minimum(k, cap[:, None]), k))
    for k in range(num_topk):
      _, idx, keys = _select.pick_best(keys, num_experts)
      o_g[pl.ds(row0, _select.BLOCK_ROWS), k] = idx

  out_type = jax.ShapeDtypeStruct((t, num_topk), jnp.int32)
  return _select.row_block_kernel(body, t, out_type, _select.scratch(e), interpret)(b)


@functools.partial(jax.jit, static_argnames=("num_topk", "num_topk_groups", "num_groups", "num_shared",
                                             "num_ep_ranks", "num_tp_ranks", "scoring_func", "interpret"))
def _gate(logits, bias, rsf, ep_rank, tp_rank, mask, fix, to_physical_map, logical_count, unmapped, *, num_topk,
          num_topk_groups, num_groups, num_shared, num_ep_ranks, num_tp_ranks, scoring_func, interpret):
  """Scores, the selection kernel and the routing glue as one XLA computation.

  One computation matters on CPU: eager ops after an interpret-mode kernel each hold a slot of
  XLA:CPU's in-flight execution semaphore while they wait, and the kernel's host callbacks then
  find no slot (a deadlock).
  """
  t, e = logits.shape
  u = ref.gate_scores(logits, scoring_func)
  b = pad_rows_and_cols(ref.ranking_scores(logits, u, bias, scoring_func), -jnp.inf)
  idx = _select_kernel(b, e, num_topk, num_groups, num_topk_groups, interpret=interpret)[:t]
  return ref.route_selected(u, idx, rsf, num_shared, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, mask, fix,
                            to_physical_map, logical_count, unmapped)


def _check_static(e, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
                  num_ep_ranks, num_tp_ranks, tp_rank, scoring_func):
  if e % 4:
    raise ValueError(f"logits.shape[1] must be a multiple of 4, got {e}")
  if not 1 <= num_topk <= e:
    raise ValueError(f"num_topk must be in [1, {e}] (the number of experts), got {num_topk}")
  if (num_groups == 0) != (num_topk_groups == 0) or num_groups < 0 or num_topk_groups > num_groups:
    raise ValueError(f"num_groups and num_topk_groups must both be 0, or 0 < num_topk_groups <= num_groups; "
                     f"got {num_groups} and {num_topk_groups}")
  if num_groups and e % num_groups:
    raise ValueError(f"num_groups ({num_groups}) must divide the number of experts ({e})")
  if num_groups != num_topk_groups:
    if e // num_groups < 2:
      raise ValueError(f"num_groups: grouped routing needs at least 2 experts per group, got {e // num_groups}")
    if num_topk > num_topk_groups * (e // num_groups):
      raise ValueError(f"num_topk ({num_topk}) exceeds the experts of the kept groups "
                       f"({num_topk_groups} x {e // num_groups})")
  if use_shared_as_routed:
    s = num_shared_experts
    if s not in (1, 2) or num_topk % s or e % (num_topk // s):
      raise ValueError(f"num_shared_experts must be 1 or 2 with num_topk % S == 0 and E % (num_topk / S) == 0; "
                       f"got S={s}, num_topk={num_topk}, E={e}")
  if num_ep_ranks < 1 or num_tp_ranks < 1:
    raise ValueError(f"num_ep_ranks and num_tp_ranks must be >= 1, got {num_ep_ranks} and {num_tp_ranks}")
  if isinstance(tp_rank, int) and not 0 <= tp_rank < num_tp_ranks:
    raise ValueError(f"tp_rank must be in [0, {num_tp_ranks}), got {tp_rank}")
  if not isinstance(scoring_func, str) or scoring_func.lower() not in ref.SCORING_FUNCS:
    raise ValueError(f"scoring_func must be one of {ref.SCORING_FUNCS}, got {scoring_func!r}")


def _check_arrays(logits, bias, num_topk, num_shared, mask, fix_routing_mask, to_physical_map, logical_count,
                  unmapped_topk_idx):
  t, e = logits.shape
  _checks.check_dtype("bias", bias, (jnp.float32,))
  if bias.shape != (e,):
    raise ValueError(f"bias must have shape ({e},), got {bias.shape}")
  for name, m in (("mask", mask), ("fix_routing_mask", fix_routing_mask)):
    if m is not None:
      _checks.check_dtype(name, m, (jnp.bool_,))
      if m.shape != (t,):
        raise ValueError(f"{name} must have shape ({t},), got {m.shape}")
  if fix_routing_mask is not None and unmapped_topk_idx is None:
    raise ValueError("fix_routing_mask needs unmapped_topk_idx (the stored indices)")
  if unmapped_topk_idx is not None:
    _checks.check_dtype("unmapped_topk_idx", unmapped_topk_idx, (jnp.int32, jnp.int64))
    if unmapped_topk_idx.shape != (t, num_topk):
      raise ValueError(f"unmapped_topk_idx must have shape ({t}, {num_topk}), got {unmapped_topk_idx.shape}")
  if (to_physical_map is None) != (logical_count is None):
    raise ValueError("to_physical_map and logical_count must be given together")
  if num_shared and to_physical_map is None:
    raise ValueError("to_physical_map is required with shared experts (use_shared_as_routed)")
  if to_physical_map is not None:
    _checks.check_rank("to_physical_map", to_physical_map, 2)
    _checks.check_dtype("to_physical_map", to_physical_map, (jnp.int32,))
    _checks.check_dtype("logical_count", logical_count, (jnp.int32,))
    if to_physical_map.shape[0] != e + num_shared or logical_count.shape != (e + num_shared,):
      raise ValueError(f"to_physical_map must have {e + num_shared} rows and logical_count shape "
                       f"({e + num_shared},); got {to_physical_map.shape} and {logical_count.shape}")
    if num_shared > to_physical_map.shape[1] - 1:
      raise ValueError(f"to_physical_map needs at least {num_shared + 1} columns, got {to_physical_map.shape[1]}")


def top2_sum_gate(logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
                  routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, mask=None,
                  fix_routing_mask=None, to_physical_map=None, logical_count=None, unmapped_topk_idx=None, *,
                  implementation: str | None = None):
  """DeepSeek router: scores, bias, group-limited top-k, normalised weights, shared experts, EP/TP masking.

  Args:
    logits: ``(T, E)`` float32 router logits (finite on unmasked rows); ``E % 4 == 0``.
    bias: ``(E,)`` float32; shifts the ranking only.
    num_topk: routed slots ``K`` (static).
    num_topk_groups, num_groups: both 0 (no grouping) or ``0 < num_topk_groups <= num_groups``,
      ``num_groups | E``; groups are ranked by the sum of their two best ranking scores (static).
    use_shared_as_routed, num_shared_experts: append ``S`` shared slots (ids ``E..E+S-1``, weight 1.0) (static).
    routed_scaling_factor: multiplies the routed weights (traceable).
    ep_rank, tp_rank: traceable ints; num_ep_ranks, num_tp_ranks: static.
    scoring_func: ``"sigmoid"``, ``"sqrtsoftplus"`` or ``"softmax"`` (case-insensitive).
    mask: optional ``(T,)`` bool; False rows get ids -1 and weights 0.
    fix_routing_mask: optional ``(T,)`` bool; True rows reuse ``unmapped_topk_idx``.
    to_physical_map, logical_count: optional ``(E+S, X+1)`` / ``(E+S,)`` int32 replica tables.
    unmapped_topk_idx: optional ``(T, K)`` int32 stored logical ids (read for fixed rows).
    implementation: see :mod:`jaxkern._config`.

  Returns:
    ``(topk_idx, topk_weights)``: ``(T, K+S)`` int32 (int64 upstream) and float32; plus the new
    ``unmapped_topk_idx`` ``(T, K)`` int32 when one was passed (spec §9.2).
  """
  _checks.check_rank("logits", logits, 2)
  _checks.check_dtype("logits", logits, (jnp.float32,))
  t, e = logits.shape
  _check_static(e, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
                num_ep_ranks, num_tp_ranks, tp_rank, scoring_func)
  num_shared = num_shared_experts if use_shared_as_routed else 0
  _check_arrays(logits, bias, num_topk, num_shared, mask, fix_routing_mask, to_physical_map, logical_count,
                unmapped_topk_idx)
  args = (logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
          routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, mask,
          fix_routing_mask, to_physical_map, logical_count, unmapped_topk_idx)
  impl = _config.get_implementation(implementation)
  if impl == "reference" or t == 0:
    return ref.top2_sum_gate(*args)
  return _gate(logits, bias, routed_scaling_factor, ep_rank, tp_rank, mask, fix_routing_mask, to_physical_map,
               logical_count, unmapped_topk_idx, num_topk=num_topk,
               num_topk_groups=num_topk_groups, num_groups=num_groups, num_shared=num_shared,
               num_ep_ranks=num_ep_ranks, num_tp_ranks=num_tp_ranks, scoring_func=scoring_func.lower(),
               interpret=_config.mosaic_interpret(impl))

"""``top2_sum_gate``: the DeepSeek router as one Pallas-Triton kernel (docs/moe.md, "top2_sum_gate").

Backend: Pallas' Triton lowering, not Mosaic GPU. The cost of this op is per-thread serial
work in the ``K`` picks (row max, then smallest index holding it). Mosaic GPU holds 64 rows
per warpgroup in the WGMMA layout, so a thread serially scans 128 values of a row per pick:
a fully fused Mosaic GPU kernel (tried, not kept) took 65.9 us at the DeepSeek-V3 shape
(8192 x 256, sigmoid, 8 groups, top-4 groups, top-8) on an H200, and the Mosaic GPU
selection kernel with XLA glue 81.8 us, against a 15 us target: about 4x too slow. Triton
spreads a row over the lanes of a warp and lowers row reductions to warp shuffles: this kernel
takes 14.2 us there (XLA reference: 222 us), bit-exact.

One program of one warp per block of ``BLOCK_ELEMENTS`` logits, whole rows: one row per program
from 32 experts on (the small-token shapes are latency-bound). With 256 experts per row and
several warps, Triton's layout spreads a row over two warps, so every row reduction
crosses warps through shared memory; one warp keeps each row in its lanes. The logits are read as
``(rows, groups, experts per group)`` (one group without grouping), padded to powers of two
with masked loads. The kernel

1. scores every expert (sigmoid ``1 / (1 + exp(-x))``; sqrtsoftplus ``sqrt(softplus(x))``;
   softmax ``exp(x - max) / Z`` with ``Z`` summed in upstream's lane order: 32 lane partials
   of strided columns, then the butterfly as halving sums) with CUDA's ``expf``/``log1pf``
   (libdevice, as XLA) and correctly rounded ``div.rn``/``sqrt.rn`` (inline PTX);
2. ranks by ``u + bias`` (``x + bias`` for softmax) through int32 order keys
   (:func:`jaxkern.moe._select.order_key`);
3. with grouping, ranks the groups by the fp32 sum of their two best values and sets the
   experts of the dropped groups to ``-inf`` (as the reference does);
4. picks ``K`` experts best first, lower index first on ties, on the flat ``(rows, experts)`` view;
5. takes the given ids on fixed-routing rows (an id outside ``[0, E)`` drops its slot: id -1,
   weight 0, nothing read at it); on a ``(rows, K+S)`` slot tile (one slot per lane),
   recomputes the picked experts' scores from their logits (one gathered load per slot: same
   formula, same bits), sums them sequentially from 1e-20 and forms the weights ``u / s * rsf``
   (NaN on rows holding a non-finite logit, as the reference: see :func:`top2_sum_gate`);
6. appends the shared slots, maps logical to physical ids (replica hash, ``ep_rank`` taken as a
   floor modulo), applies the EP/TP masking and the token mask, and stores ``(rows, K+S)`` tiles.

In interpret mode (CPU) the inline PTX is replaced by :mod:`jaxkern._ieee`, which computes the
same correctly rounded results from integer arithmetic.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxkern import _autodiff, _checks, _config, _dispatch, _ieee
from jaxkern.moe._select import TAKEN, order_key
from jaxkern.reference import moe as ref
from jaxkern.types import TopkRouting, TopkRoutingWithUnmapped

# Logits per program (block rows = BLOCK_ELEMENTS / padded experts) and warps. H200, V3 sigmoid
# (one measurement each, +-1 us): (256, 1) 18.3 us, (512, 1) 17.4, (1024, 1) 22.2, (2048, 1) 51.0,
# (1024, 4) 23.7; softmax (256, 1) 16.6, (512, 1) 19.0. T=36 rows are latency-bound: one row per
# program is fastest (E=32 sigmoid / sqrtsoftplus / softmax 2.62 / 2.99 / 2.78 us at 32 logits,
# 7.39 / 10.94 / 10.66 at 256; E=72 3.98 / 4.22 / 4.18 vs 4.58 / 5.50 / 5.04). Picking by one
# argmax reduction (value and index) was 3-8 us slower at every setting.
BLOCK_ELEMENTS = 32
NUM_WARPS = 1
_LANES = 32  # upstream's softmax sums a row in 32 lane partials of 4 consecutive columns
_KEY_NEG_INF = -0x7F800001  # order_key(-inf)


class _Config(NamedTuple):
  """Static configuration of the kernel."""

  num_tokens: int
  num_experts: int
  num_groups: int  # groups of the logits view (1 without grouping)
  num_topk_groups: int
  num_topk: int
  num_shared: int
  scoring_func: str
  num_ep_ranks: int
  num_tp_ranks: int
  num_extra: int  # replicas beyond the first (to_physical_map.shape[1] - 1), -1 without a map
  has_mask: bool
  has_fix: bool
  want_unmapped: bool
  block_rows: int
  interpret: bool


def _pow2(n: int) -> int:
  return pl.next_power_of_2(n)


def _fence(x, interpret):
  """In interpret mode, keeps ``x`` out of XLA:CPU's fusions: inside reduction fusions XLA:CPU
  evaluates exp differently from the reference, and merges chained reductions (reordering sums)."""
  return lax.optimization_barrier(x) if interpret else x


def _exp(x, interpret):
  return _fence(jnp.exp(x), interpret)


def _rmax(x):
  """Max over every axis but the first."""
  while x.ndim > 1:
    x = jnp.max(x, axis=-1)
  return x


def _softmax_denominator(x_ref, row_ok, m, cfg: _Config):
  """The softmax denominator ``Z`` (docs/moe.md, "top2_sum_gate"): lane ``l`` adds ``exp(x - m)`` of columns ``128 i + 4 l + j`` in order,
  then the butterfly (lane sums combined as halves). The row is read flat, ``(rows, 128 n)``, and
  each term is taken out of its ``(rows, n, 32, 4)`` view by an exact masked sum."""
  br, width = x_ref.shape
  cols = jnp.arange(width)[None, :]
  x = plt.load(x_ref, mask=row_ok[:, None] & (cols < cfg.num_experts), other=-jnp.inf)
  z = _exp(x - m[:, None], cfg.interpret).reshape(br, width // (4 * _LANES), _LANES, 4)
  block = jnp.arange(width // (4 * _LANES))[None, :, None, None]
  col = jnp.arange(4)[None, None, None, :]
  p = jnp.zeros((br, _LANES), jnp.float32)
  for i in range(-(-cfg.num_experts // (4 * _LANES))):
    for j in range(4):
      p = p + jnp.sum(jnp.sum(jnp.where((block == i) & (col == j), z, 0.0), axis=3), axis=1)
  for b in (16, 8, 4, 2, 1):
    p = _fence(jnp.sum(p.reshape(br, 2, b), axis=1), cfg.interpret)
  return p.reshape(br)


def _unbiased(x, m, z, cfg: _Config):
  """Elementwise scores ``u`` of logits ``x`` (``m``, ``z``: the softmax row max and denominator)."""
  if cfg.scoring_func == "sigmoid":
    u = _ieee.triton_div(jnp.ones_like(x), 1.0 + _exp(-x, cfg.interpret), cfg.interpret)
    return _ieee_at_non_finite(u, x, 1.0, cfg.interpret)
  if cfg.scoring_func == "sqrtsoftplus":
    u = _ieee.triton_sqrt(jnp.where(x > 20.0, x, jnp.log1p(_exp(x, cfg.interpret))), cfg.interpret)
    return _ieee_at_non_finite(u, x, jnp.inf, cfg.interpret)
  return _ieee.triton_div(_exp(x - m, cfg.interpret), z, cfg.interpret)


def _ieee_at_non_finite(u, x, at_inf, interpret):
  """In interpret mode, the IEEE scores at non-finite logits ``x`` (NaN; ``at_inf`` at +Inf; 0 at -Inf), which
  the GPU's ``div.rn``/``sqrt.rn`` give and :mod:`jaxkern._ieee`'s integer emulation (finite operands) does not."""
  if not interpret:
    return u
  u = jnp.where(x == jnp.inf, jnp.float32(at_inf), jnp.where(x == -jnp.inf, 0.0, u))
  return jnp.where(x != x, jnp.nan, u)


def _scores(x, x_ref, row_ok, ok, cfg: _Config):
  """The ranking values (``u``, ``x`` for softmax) and the softmax row max and denominator."""
  if cfg.scoring_func != "softmax":
    return _unbiased(x, None, None, cfg), None, None
  m = _rmax(jnp.where(ok, x, -jnp.inf))
  return x, m, _softmax_denominator(x_ref, row_ok, m, cfg)


def _drop_groups(b, ok, cfg: _Config):
  """Keys of the ranking values ``b`` with the experts of all but the best groups at ``-inf``."""
  br, gp, ep = b.shape
  j = jnp.arange(ep)[None, None, :]
  v = jnp.where(ok, jnp.where(b != b, -jnp.inf, b), -jnp.inf)
  best = jnp.max(v, axis=2)
  first = jnp.min(jnp.where(v == best[:, :, None], j, ep), axis=2)
  s = best + jnp.max(jnp.where(j == first[:, :, None], -jnp.inf, v), axis=2)
  s = jnp.where(s != s, -jnp.inf, s)
  g = jnp.arange(gp)[None, :, None]
  h = jnp.arange(gp)[None, None, :]
  sg, sh = s[:, :, None], s[:, None, :]
  beats = ((sh > sg) | (sh == sg) & (h < g)) & (h < cfg.num_groups)
  kept = jnp.sum(beats.astype(jnp.int32), axis=2) < cfg.num_topk_groups
  return jnp.where(kept[:, :, None], order_key(b), _KEY_NEG_INF)


def _non_finite_rows(x, ok):
  """Rows of the ``(rows, groups, experts)`` logits ``x`` holding a NaN or an infinity among the ``ok`` experts."""
  bad = jnp.where(ok & ~(jnp.abs(x) < jnp.inf), 1, 0)
  return jnp.sum(jnp.sum(bad, axis=2), axis=1) > 0


def _kernel(*refs, cfg: _Config):
  refs = list(refs)
  x_ref, x2_ref, bias_ref, rsf_ref, ep_ref, tp_ref = refs[:6]
  rest = refs[6:]
  mask_ref = rest.pop(0) if cfg.has_mask else None
  fix_ref, unm_in_ref = (rest.pop(0), rest.pop(0)) if cfg.has_fix else (None, None)
  pmap_ref, count_ref = (rest.pop(0), rest.pop(0)) if cfg.num_extra >= 0 else (None, None)
  idx_ref, w_ref, *unm_ref = rest

  br, (_, gp, ep) = cfg.block_rows, x_ref.shape
  e, epg, k, s = cfg.num_experts, cfg.num_experts // cfg.num_groups, cfg.num_topk, cfg.num_shared
  rows = pl.program_id(0) * br + jnp.arange(br)
  row_ok = rows < cfg.num_tokens
  g = jnp.arange(gp)[None, :, None]
  j = jnp.arange(ep)[None, None, :]
  ok = (g < cfg.num_groups) & (j < epg)
  expert = jnp.where(ok, g * epg + j, e)

  x = plt.load(x_ref, mask=row_ok[:, None, None] & ok, other=0.0)
  bias = plt.load(bias_ref, mask=ok[0], other=0.0)[None]
  b, m, z = _scores(x, x2_ref, row_ok, ok, cfg)
  b = b + bias
  keys = _drop_groups(b, ok, cfg) if cfg.num_groups != cfg.num_topk_groups else order_key(b)
  keys = jnp.where(ok, keys, TAKEN)

  idx = []  # the picks run on the flat (rows, experts) view: one reduction axis per step
  keys = keys.reshape(br, gp * ep)
  expert = jnp.broadcast_to(expert, (1, gp, ep)).reshape(1, gp * ep)
  for _ in range(k):
    best = jnp.max(keys, axis=1)
    i = jnp.min(jnp.where(keys == best[:, None], expert, e), axis=1)
    keys = jnp.where(expert == i[:, None], TAKEN, keys)
    idx.append(i)
  if cfg.has_fix:
    fixed = plt.load(fix_ref, mask=row_ok, other=False)
    slot = jnp.arange(unm_in_ref.shape[1])[None, :]
    given = plt.load(unm_in_ref, mask=row_ok[:, None] & (slot < k), other=0)
    idx = [jnp.where(fixed, jnp.sum(jnp.where(slot == c, given, 0), axis=1), i) for c, i in enumerate(idx)]

  # The post-pick stage runs on (rows, K+S) slot tiles, one slot per lane: one gathered load, score
  # and division per slot instead of K per lane.
  slot = jnp.arange(idx_ref.shape[1])[None, :]
  utile = jnp.zeros((br, idx_ref.shape[1]), jnp.int32)
  for c, i in enumerate(idx):
    utile = jnp.where(slot == c, i[:, None], utile)
  hit = (slot < k) & (utile >= 0) & (utile < e)
  if cfg.has_fix:  # a given id outside [0, E) drops its slot: id -1, weight 0, left out of the sum
    utile = jnp.where((slot < k) & ~hit, -1, utile)
  xi = plt.load(x2_ref.at[jnp.arange(br)[:, None], jnp.where(hit, utile, 0)], mask=row_ok[:, None] & hit, other=0.0)
  u = _unbiased(xi, None if m is None else m[:, None], None if z is None else z[:, None], cfg)
  picked = jnp.where(hit, u, 0.0)  # u of each pick (adding the 0.0 of a dropped slot to the sum is exact)
  total = jnp.full((br,), 1e-20, jnp.float32)
  for c in range(k):  # upstream's sequential order; each term is taken out of its slot by an exact masked sum
    total = total + jnp.sum(jnp.where(slot == c, picked, 0.0), axis=1)
  wtile = _ieee.triton_div(picked, total[:, None], cfg.interpret) * rsf_ref[0]
  if cfg.has_fix:
    wtile = jnp.where(hit, wtile, 0.0)
  wtile = jnp.where(slot < k, wtile, 1.0)
  wtile = jnp.where(_non_finite_rows(x, ok)[:, None] & (slot < k), jnp.nan, wtile)
  tile = jnp.where(slot < k, utile, e + slot - k)
  extra = 0
  if cfg.num_extra >= 0:
    extra = cfg.num_extra
    tile_ok = row_ok[:, None] & (slot < k + s)
    if cfg.has_fix:
      tile_ok = tile_ok & (tile >= 0)
    safe = jnp.where(tile_ok, tile, 0)
    count = plt.load(count_ref.at[safe], mask=tile_ok, other=1)
    ep = lax.rem(ep_ref[0], count)
    ep = jnp.where(ep < 0, ep + count, ep)  # floor modulo: any traced ep_rank picks a live replica
    d = lax.rem(lax.rem(rows[:, None], count) * lax.rem(ref.HASH_MULTIPLIER, count) + ep, count)
    phys = plt.load(pmap_ref.at[safe, d], mask=tile_ok, other=0)
    tile = jnp.where(tile >= 0, phys, -1) if cfg.has_fix else phys
  tile = ref.mask_by_tp(tile, (e + extra) // cfg.num_ep_ranks, tp_ref[0], cfg.num_tp_ranks)
  if cfg.has_mask:
    valid = plt.load(mask_ref, mask=row_ok, other=False)[:, None]
    tile = jnp.where(valid, tile, -1)
    wtile = jnp.where(valid, wtile, 0.0)
    utile = jnp.where(valid, utile, -1)
  plt.store(idx_ref, tile, mask=row_ok[:, None] & (slot < k + s))
  plt.store(w_ref, wtile, mask=row_ok[:, None] & (slot < k + s))
  if cfg.want_unmapped:
    plt.store(unm_ref[0], utile, mask=row_ok[:, None] & (slot < k))


@functools.partial(jax.jit, static_argnames=("num_topk", "num_topk_groups", "num_groups", "num_shared",
                                             "num_ep_ranks", "num_tp_ranks", "scoring_func", "interpret"))
def _gate(logits, bias, rsf, ep_rank, tp_rank, mask, fix, to_physical_map, logical_count, unmapped, *, num_topk,
          num_topk_groups, num_groups, num_shared, num_ep_ranks, num_tp_ranks, scoring_func, interpret):
  t, e = logits.shape
  grouped = num_groups != num_topk_groups
  groups = num_groups if grouped else 1
  epg = e // groups
  gp, ep = _pow2(groups), _pow2(epg)
  br = max(1, min(BLOCK_ELEMENTS // (gp * ep), _pow2(t)))
  cfg = _Config(num_tokens=t, num_experts=e, num_groups=groups, num_topk_groups=num_topk_groups if grouped else 1,
                num_topk=num_topk, num_shared=num_shared, scoring_func=scoring_func, num_ep_ranks=num_ep_ranks,
                num_tp_ranks=num_tp_ranks, num_extra=-1 if to_physical_map is None else to_physical_map.shape[1] - 1,
                has_mask=mask is not None, has_fix=fix is not None, want_unmapped=unmapped is not None,
                block_rows=br, interpret=interpret)
  scalar = lambda v, dtype: jnp.asarray(v, dtype).reshape(1)
  whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)
  rows = lambda a, width=None: pl.BlockSpec((br,) + ((width,) if width else ()), lambda i: (i,) + (0,) * (a.ndim - 1))
  inputs = [logits.reshape(t, groups, epg), logits, bias.reshape(groups, epg), scalar(rsf, jnp.float32),
            scalar(ep_rank, jnp.int32), scalar(tp_rank, jnp.int32)]
  specs = [pl.BlockSpec((br, gp, ep), lambda i: (i, 0, 0)), rows(logits, max(4 * _LANES, _pow2(e))),
           pl.BlockSpec((gp, ep), lambda i: (0, 0))] + [whole(a) for a in inputs[3:]]
  if mask is not None:
    inputs.append(mask)
    specs.append(rows(mask))
  if fix is not None:
    if unmapped.dtype != jnp.int32:  # int64: out-of-range ids become -1 before the cast (they would wrap)
      unmapped = jnp.where((unmapped >= 0) & (unmapped < e), unmapped, -1).astype(jnp.int32)
    inputs += [fix, unmapped]
    specs += [rows(fix), rows(unmapped, _pow2(num_topk))]
  if to_physical_map is not None:
    inputs += [to_physical_map, logical_count]
    specs += [whole(to_physical_map), whole(logical_count)]
  width = _pow2(num_topk + num_shared)
  out_shape = [jax.ShapeDtypeStruct((t, num_topk + num_shared), jnp.int32),
               jax.ShapeDtypeStruct((t, num_topk + num_shared), jnp.float32)]
  out_specs = [pl.BlockSpec((br, width), lambda i: (i, 0))] * 2
  if unmapped is not None:
    out_shape.append(jax.ShapeDtypeStruct((t, num_topk), jnp.int32))
    out_specs.append(pl.BlockSpec((br, width), lambda i: (i, 0)))
  return tuple(pl.pallas_call(
      functools.partial(_kernel, cfg=cfg), out_shape=out_shape, grid=(pl.cdiv(t, br),), in_specs=specs,
      out_specs=out_specs, compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
      interpret=interpret)(*inputs))


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _check_static(e, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
                  num_ep_ranks, num_tp_ranks, ep_rank, tp_rank, scoring_func):
  if not _is_int(num_topk) or not 1 <= num_topk <= e:
    raise ValueError(f"num_topk must be an int in [1, {e}] (the number of experts), got {num_topk!r}")
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
  if _is_int(ep_rank) and not 0 <= ep_rank < num_ep_ranks:
    raise ValueError(f"ep_rank must be in [0, {num_ep_ranks}) (num_ep_ranks), got {ep_rank}")
  if _is_int(tp_rank) and not 0 <= tp_rank < num_tp_ranks:
    raise ValueError(f"tp_rank must be in [0, {num_tp_ranks}) (num_tp_ranks), got {tp_rank}")
  if not isinstance(scoring_func, str) or scoring_func.lower() not in ref.SCORING_FUNCS:
    raise ValueError(f"scoring_func must be one of {ref.SCORING_FUNCS}, got {scoring_func!r}")


def _check_arrays(logits, bias, num_topk, num_shared, mask, fix_routing_mask, to_physical_map, logical_count,
                  unmapped_topk_idx):
  t, e = logits.shape
  _checks.check_dtype("bias", bias, (jnp.float32,))
  _checks.check_shape("bias", bias, (e,))
  for name, m in (("mask", mask), ("fix_routing_mask", fix_routing_mask)):
    if m is not None:
      _checks.check_dtype(name, m, (jnp.bool_,))
      _checks.check_shape(name, m, (t,))
  if fix_routing_mask is not None and unmapped_topk_idx is None:
    raise ValueError("fix_routing_mask needs unmapped_topk_idx (the stored indices)")
  if unmapped_topk_idx is not None:
    _checks.check_dtype("unmapped_topk_idx", unmapped_topk_idx, (jnp.int32, jnp.int64))
    _checks.check_shape("unmapped_topk_idx", unmapped_topk_idx, (t, num_topk))
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


def _debug_check_fixed_ids(fix_routing_mask, mask, unmapped_topk_idx, num_experts: int) -> None:
  """Under ``checkify.checkify(..., errors=checkify.user_checks)``, reports the first fixed-routing id
  outside ``[0, E)``; otherwise XLA drops it (dead code, see the tests)."""
  t, k = unmapped_topk_idx.shape
  if t == 0:
    return
  active = fix_routing_mask if mask is None else fix_routing_mask & mask
  bad = active[:, None] & ((unmapped_topk_idx < 0) | (unmapped_topk_idx >= num_experts))
  first = jnp.argmax(bad.reshape(-1))
  checkify.debug_check(
      ~jnp.any(bad), "top2_sum_gate: fixed-routing id unmapped_topk_idx[{row}, {slot}] = {value} is outside "
      f"[0, {num_experts}) (its slot is dropped: id -1, weight 0)",
      row=first // k, slot=first % k, value=unmapped_topk_idx.reshape(-1)[first])


def _debug_check_finite_logits(logits, mask) -> None:
  """Under ``checkify.checkify(..., errors=checkify.user_checks)``, reports the first non-finite logit of an
  unmasked row; otherwise XLA drops it (dead code)."""
  if not logits.size:
    return
  e = logits.shape[1]
  bad = ~jnp.isfinite(logits) if mask is None else mask[:, None] & ~jnp.isfinite(logits)
  first = jnp.argmax(bad.reshape(-1))
  checkify.debug_check(
      ~jnp.any(bad), "top2_sum_gate: logits[{row}, {expert}] = {value} is not finite (the row's routed weights "
      "are NaN)", row=first // e, expert=first % e, value=logits.reshape(-1)[first])


def top2_sum_gate(logits: jax.Array, bias: jax.Array, num_topk: int, *, scoring_func: str, num_topk_groups: int = 0,
                  num_groups: int = 0, use_shared_as_routed: bool = False, num_shared_experts: int = 0,
                  routed_scaling_factor: float | jax.Array = 1.0, ep_rank: int | jax.Array = 0, num_ep_ranks: int = 1,
                  tp_rank: int | jax.Array = 0, num_tp_ranks: int = 1,
                  mask: jax.Array | None = None, fix_routing_mask: jax.Array | None = None,
                  to_physical_map: jax.Array | None = None, logical_count: jax.Array | None = None,
                  unmapped_topk_idx: jax.Array | None = None,
                  implementation: str | None = None) -> TopkRouting | TopkRoutingWithUnmapped:
  """DeepSeek router: scores, bias, group-limited top-k, normalised weights, shared experts, EP/TP masking.

  ``E`` experts, ``K = num_topk`` routed slots, ``S = num_shared_experts`` shared slots if
  ``use_shared_as_routed`` else 0, ``X + 1`` replica columns of ``to_physical_map``.

  Args:
    logits: ``(T, E)`` float32 router logits (see "Non-finite logits" below); the kernel takes ``E % 4 == 0``,
      the XLA path any ``E``.
    bias: ``(E,)`` float32; shifts the ranking only. Expected finite: a NaN / inf bias ranks (in kernel and
      reference alike) as the sum says, and the weights look valid; under ``checkify.checkify(f,
      errors=checkify.user_checks)`` the first non-finite bias is reported.
    num_topk: routed slots ``K``, ``1 <= K <= E`` (static).
    scoring_func: ``"sigmoid"``, ``"sqrtsoftplus"`` or ``"softmax"`` (case-insensitive); required.
    num_topk_groups, num_groups: both 0 (no grouping, the default) or ``0 < num_topk_groups <=
      num_groups``, ``num_groups | E``, at least 2 experts per group and ``K <= num_topk_groups * E /
      num_groups``; groups are ranked by the sum of their two best ranking scores (static).
    use_shared_as_routed, num_shared_experts: append ``S`` shared slots (``S`` 1 or 2, ``K % S == 0``,
      ``E % (K / S) == 0``; ids ``E..E+S-1``, weight 1.0); need ``to_physical_map`` (static).
    routed_scaling_factor: multiplies the routed weights (traceable; default 1.0).
    ep_rank, tp_rank: ints or traced int32 scalars. A Python int outside ``[0, num_ep_ranks)`` /
      ``[0, num_tp_ranks)`` raises. A traced ``ep_rank`` is used as is: it only enters the replica hash
      ``(t * 23333 + ep_rank) mod count`` (floor modulo), so any value picks a live replica; a traced
      ``tp_rank`` outside ``[0, num_tp_ranks)`` matches no TP rank, so every slot gets id -1 (checkify reports it).
    num_ep_ranks, num_tp_ranks: ``>= 1`` (static; default 1: no EP/TP split).
    mask: optional ``(T,)`` bool; False rows get ids -1 and weights 0 (and unmapped ids -1).
    fix_routing_mask: optional ``(T,)`` bool; True rows (with a True ``mask``) take their ``K`` ids from
      ``unmapped_topk_idx`` as given (no sorting, no de-duplication, no group check).
    to_physical_map, logical_count: optional ``(E+S, X+1)`` / ``(E+S,)`` int32 replica tables, given
      together; ``1 <= logical_count <= X + 1`` (precondition: a concrete count outside raises
      ``ValueError``; a traced one gives unspecified ids, the kernel may read outside the row, and checkify
      reports the first such count; docs/usage.md, "Bad values under jit").
    unmapped_topk_idx: optional ``(T, K)`` int32 (or int64) logical ids, read on fixed-routing rows;
      required with ``fix_routing_mask``.
    implementation: see :mod:`jaxkern._config`.

  Returns:
    :class:`jaxkern.types.TopkRouting` ``(topk_idx, topk_weights)``: ``(T, K+S)`` int32 (int64
    upstream) physical, EP/TP-local ids (-1 = not on this TP rank or masked token; the weight of a
    slot masked by EP/TP is kept) and float32 weights ``u / (1e-20 + sum u) * routed_scaling_factor``
    (summed sequentially in slot order). With ``unmapped_topk_idx``:
    :class:`jaxkern.types.TopkRoutingWithUnmapped`, adding the new ``unmapped_topk_idx`` ``(T, K)``
    int32 (the logical id of each routed slot; docs/moe.md, "top2_sum_gate").

  Bad fixed-routing ids: an id outside ``[0, E)`` on a fixed-routing row drops its slot, in the kernel
  and the reference alike: id -1 in ``topk_idx`` and ``unmapped_topk_idx``, weight 0.0, left out of
  the weight sum (the other slots are normalised without it); nothing is read at that id. Wrap the
  call in ``checkify.checkify(f, errors=checkify.user_checks)`` to have the first such id reported
  (``jax.experimental.checkify.debug_check``; without checkify it compiles to nothing).

  Non-finite logits: on an unmasked row holding a NaN, +Inf or -Inf logit, the ``K`` routed weights
  are NaN (shared slots keep 1.0); the ids are still ranked, NaN ranking as ``-inf``. Kernel and
  reference give the same bits. Masked rows keep ids -1 and weights 0 whatever their logits. Under
  ``checkify.checkify(f, errors=checkify.user_checks)`` the first such logit is reported
  (``jax.experimental.checkify.debug_check``; without checkify it compiles to nothing).

  Raises:
    ValueError: a non-array argument (lists are converted), a wrong rank, shape or dtype (bool
      logits included), an option outside the ranges above, or a concrete ``logical_count`` outside
      ``[1, X + 1]``.
    KernelUnavailableError: ``implementation="pallas"`` or ``"interpret"`` with ``E % 4 != 0``.

  XLA instead of a kernel: ``T == 0`` (empty outputs), and under ``"auto"`` ``E % 4 != 0``. The
  Pallas-Triton kernel runs every other case (``"auto"`` off a GPU runs the reference).

  Differentiation: ``topk_weights`` is differentiable (``jax.custom_vjp``) w.r.t. ``logits`` and
  ``routed_scaling_factor`` (a Python float is a constant), with the selected experts held constant. Routed
  slot ``k`` of logical expert ``e_k`` weighs ``w_k = u_{e_k} / s * rsf``, ``s = 1e-20 + sum_j u_{e_j}``, so
  ``dU[e_k] += rsf (dw_k - sum_j dw_j u_{e_j} / s) / s`` (repeated fixed-routing ids add up), then ``dU``
  reaches the logits through ``du/dx``, and ``drsf = sum_k dw_k u_{e_k} / s``. This holds on grouped rows,
  fixed-routing rows and for slots that EP/TP masking set to -1 (they keep their weight, so their gradient).
  Constants, with zero gradients: the shared slots (1.0), masked tokens (0.0, whatever their logits) and
  dropped fixed-routing slots. ``bias`` gets a zero gradient: it only moves the selection (DeepSeek-V3's
  auxiliary-loss-free balancing updates it outside autodiff). Integer inputs and outputs have no cotangent.
  When differentiated, the forward (the path above) also returns the unmapped output, the logical ids the
  weights belong to (one more ``(T, K)`` int32 store in the kernel). The backward runs XLA under every
  implementation: one ``(T, E)`` elementwise pass with a ``K``-slot one-hot sum, memory-bound work that
  needs no kernel (H200, DeepSeek-V3 shape 8192 x 256: forward kernel plus this backward 25.6-33.4 µs,
  6.3-7.7x ``jax.vjp`` of the reference; benchmarks/NOTES.md). It recomputes the scores from ``logits``:
  the reference's exact ones under ``implementation="reference"``, plain float32 ones otherwise.
  """
  logits = _checks.as_array("logits", logits)
  bias = _checks.as_array("bias", bias)
  mask, fix_routing_mask, to_physical_map, logical_count, unmapped_topk_idx = (
      None if a is None else _checks.as_array(name, a) for name, a in (
          ("mask", mask), ("fix_routing_mask", fix_routing_mask), ("to_physical_map", to_physical_map),
          ("logical_count", logical_count), ("unmapped_topk_idx", unmapped_topk_idx)))
  _checks.check_rank("logits", logits, 2)
  _checks.check_dtype("logits", logits, (jnp.float32,))
  e = logits.shape[1]
  _check_static(e, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
                num_ep_ranks, num_tp_ranks, ep_rank, tp_rank, scoring_func)
  num_shared = num_shared_experts if use_shared_as_routed else 0
  _check_arrays(logits, bias, num_topk, num_shared, mask, fix_routing_mask, to_physical_map, logical_count,
                unmapped_topk_idx)
  if not _is_int(tp_rank):
    _checks.debug_check_entries("top2_sum_gate", "tp_rank", jnp.asarray(tp_rank),
                                lambda v: (v < 0) | (v >= num_tp_ranks),
                                f"a TP rank in [0, {num_tp_ranks}) (num_tp_ranks; otherwise every slot gets id -1)")
  if logical_count is not None:
    replicas = to_physical_map.shape[1]
    _checks.check_and_debug_check("top2_sum_gate", "logical_count", logical_count,
                                  lambda v: (v < 1) | (v > replicas),
                                  f"a replica count in [1, {replicas}] (to_physical_map.shape[1])")
  if fix_routing_mask is not None:
    _debug_check_fixed_ids(fix_routing_mask, mask, unmapped_topk_idx, e)
  _debug_check_finite_logits(logits, mask)
  _checks.debug_check_entries("top2_sum_gate", "bias", bias, lambda v: ~jnp.isfinite(v),
                              "finite (a NaN or inf bias moves the ranking; the weights would look valid)")
  static = _Static(num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts, num_ep_ranks,
                   num_tp_ranks, scoring_func.lower(), _config.get_implementation(implementation))
  constants = _NonDifferentiable(ep_rank, tp_rank, mask, fix_routing_mask, to_physical_map, logical_count,
                                 unmapped_topk_idx)
  # Under shard_map: one varying-axes type for all inputs, so that the custom_vjp's cotangents match them.
  logits, bias, rsf, constants = _autodiff.vary_like(
      logits, bias, jnp.asarray(routed_scaling_factor, jnp.float32), constants)
  return _differentiable_gate(static, logits, bias, rsf, constants)


class _Static(NamedTuple):
  """The static arguments of one call, with the requested implementation."""

  num_topk: int
  num_topk_groups: int
  num_groups: int
  use_shared_as_routed: bool
  num_shared_experts: int
  num_ep_ranks: int
  num_tp_ranks: int
  scoring_func: str  # lower case
  implementation: str


class _NonDifferentiable(NamedTuple):
  """The arguments without a derivative: ranks, masks, replica tables and given ids."""

  ep_rank: jax.Array | int
  tp_rank: jax.Array | int
  mask: jax.Array | None
  fix_routing_mask: jax.Array | None
  to_physical_map: jax.Array | None
  logical_count: jax.Array | None
  unmapped_topk_idx: jax.Array | None


def _route(static: _Static, logits, bias, rsf, constants: _NonDifferentiable) -> TopkRouting | TopkRoutingWithUnmapped:
  """The forward: the kernel, the XLA path or the reference, as :mod:`jaxkern._dispatch` decides."""
  ep_rank, tp_rank, mask, fix, pmap, count, unmapped = constants
  result = TopkRouting if unmapped is None else TopkRoutingWithUnmapped

  def kernel(interpret):
    return result(*_gate(logits, bias, rsf, *constants, num_topk=static.num_topk,
                         num_topk_groups=static.num_topk_groups, num_groups=static.num_groups,
                         num_shared=static.num_shared_experts if static.use_shared_as_routed else 0,
                         num_ep_ranks=static.num_ep_ranks, num_tp_ranks=static.num_tp_ranks,
                         scoring_func=static.scoring_func, interpret=interpret))

  def xla():
    return ref.top2_sum_gate(
        logits, bias, static.num_topk, scoring_func=static.scoring_func, num_topk_groups=static.num_topk_groups,
        num_groups=static.num_groups, use_shared_as_routed=static.use_shared_as_routed,
        num_shared_experts=static.num_shared_experts, routed_scaling_factor=rsf, ep_rank=ep_rank,
        num_ep_ranks=static.num_ep_ranks, tp_rank=tp_rank, num_tp_ranks=static.num_tp_ranks, mask=mask,
        fix_routing_mask=fix, to_physical_map=pmap, logical_count=count, unmapped_topk_idx=unmapped)

  return _dispatch.run("top2_sum_gate", static.implementation, kernel=kernel, xla=xla,
                       unsupported=_unsupported(logits.shape[1]), empty=logits.shape[0] == 0)


def _unsupported(num_experts: int) -> str | None:
  """Why the kernel cannot take ``num_experts`` (``logits.shape[1]``), or None."""
  if num_experts % 4:
    return (f"num_experts (logits.shape[1]) = {num_experts}; the kernel takes a multiple of 4 "
            "(implementation='xla' / 'auto' run any number of experts)")
  return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _differentiable_gate(static: _Static, logits, bias, rsf, constants: _NonDifferentiable):
  return _route(static, logits, bias, rsf, constants)


def _differentiable_gate_fwd(static: _Static, logits, bias, rsf, constants: _NonDifferentiable):
  """The forward, asking for the unmapped output too: the logical id of each routed slot (-1 on masked rows
  and dropped slots), which the weights belong to. Only the forward knows them (the physical, EP/TP-local
  ``topk_idx`` cannot be mapped back without redoing the selection); the kernel stores them for ``(T, K)``
  int32, and dummy ids are not read where ``fix_routing_mask`` is None."""
  given = constants.unmapped_topk_idx
  asked = given if given is not None else jnp.zeros((logits.shape[0], static.num_topk), jnp.int32)
  out = _route(static, logits, bias, rsf, constants._replace(unmapped_topk_idx=asked))
  result = out if given is not None else TopkRouting(out.topk_idx, out.topk_weights)
  return result, (logits, rsf, constants.mask, out.unmapped_topk_idx)


def _differentiable_gate_bwd(static: _Static, residuals, cotangents):
  logits, rsf, mask, logical_ids = residuals
  dw = cotangents.topk_weights[:, :static.num_topk]  # the shared slots' weights are constants
  dlogits, drsf = _routed_weights_vjp(logits, logical_ids, rsf, mask, dw, static.scoring_func,
                                      exact=static.implementation == "reference")
  return dlogits, None, drsf, None  # bias only moves the selection: zero cotangent


_differentiable_gate.defvjp(_differentiable_gate_fwd, _differentiable_gate_bwd)


def _routed_weights_vjp(logits, logical_ids, rsf, mask, dw, scoring_func: str, *, exact: bool):
  """Cotangents of ``logits`` and ``rsf`` from those of the routed weights (see :func:`top2_sum_gate`).

  Args:
    logits: ``(T, E)`` float32.
    logical_ids: ``(T, K)`` int32 logical expert of each routed slot; -1 for a slot of constant weight 0.
    rsf: the float32 routed scaling factor.
    mask: optional ``(T,)`` bool; False rows get zero cotangents (their logits may be anything).
    dw: ``(T, K)`` float32 cotangents of the routed weights.
    scoring_func: ``"sigmoid"``, ``"sqrtsoftplus"`` or ``"softmax"``.
    exact: take the reference's correctly rounded scores, else plain float32 ones.
  """
  if mask is not None:
    logits = jnp.where(mask[:, None], logits, 0.0)
  u = ref.gate_scores(logits, scoring_func) if exact else _float32_scores(logits, scoring_func)
  valid = logical_ids >= 0
  ids = jnp.where(valid, logical_ids, 0)
  u_sel = jnp.where(valid, jnp.take_along_axis(u, ids, axis=1), 0.0)
  s = jnp.full(u_sel.shape[:1], 1e-20, jnp.float32)
  for k in range(u_sel.shape[1]):  # the forward's sequential sum
    s = s + u_sel[:, k]
  q = u_sel / s[:, None]  # the weights without rsf
  dq = jnp.where(valid, dw * rsf, 0.0)
  du_sel = jnp.where(valid, (dq - jnp.sum(dq * q, axis=1, keepdims=True)) / s[:, None], 0.0)
  drsf = jnp.sum(jnp.where(valid, dw * q, 0.0)).reshape(jnp.shape(rsf))
  return _scores_vjp(logits, u, _slots_to_experts(du_sel, ids, u.shape[1]), scoring_func), drsf


def _float32_scores(logits, scoring_func: str):
  """The scores (docs/moe.md, "top2_sum_gate") in plain float32 (within an ulp or so of the exact ones)."""
  if scoring_func == "sigmoid":
    return jax.nn.sigmoid(logits)
  if scoring_func == "sqrtsoftplus":
    return jnp.sqrt(ref.softplus(logits))
  return jax.nn.softmax(logits, axis=1)


def _slots_to_experts(du_sel, ids, num_experts: int):
  """``(T, E)`` sums of the slot values ``du_sel`` over the slots naming each expert (one-hot, no scatter)."""
  experts = jnp.arange(num_experts, dtype=ids.dtype)[None, :]
  du = jnp.zeros((ids.shape[0], num_experts), jnp.float32)
  for k in range(ids.shape[1]):
    du = du + jnp.where(ids[:, k:k + 1] == experts, du_sel[:, k:k + 1], 0.0)
  return du


def _scores_vjp(logits, u, du, scoring_func: str):
  """The cotangent of the logits from that of the scores ``u``."""
  if scoring_func == "softmax":
    return u * (du - jnp.sum(du * u, axis=1, keepdims=True))
  return du * ref.score_derivative(logits, u, scoring_func)

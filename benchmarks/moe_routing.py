"""MoE routing ops on upstream's benchmark shapes: every op's full benchmark grid.

Grid sizes: get_fused_mapping 12, expand_to_fused 84, expand_to_fused_with_sf 4 x 84,
reduce_fused 4 x 36, normalize_weight 12, aux_fi 24, group_count 12, mask_indices_by_tp 36,
unique_group_indices 24. Most of a full run is compile time (two programs per shape).

The routing of each ``(local experts, EP ranks, K)`` config comes from upstream's generator
(4001 tokens sent per rank) with a fixed key, so byte counts are known when cases are built.
Static arguments the jitted benchmark wrappers need (``E``, ``fp8_format``, ...) travel as
the shape of a small placeholder array or are closed over per op.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.registry import BenchOp, Case, register, upstream_topk_idx
from jaxkern import moe
from jaxkern.reference import moe as ref
from jaxkern.testing import hidden_sizes, moe_topk_idx, randn

MOE_PARAMS = [(e, r, k) for (e, r), k in itertools.product(((9, 8), (32, 8), (4, 64)), (2, 6, 8, 9))]
SEND_TOKENS = 4001


def _routing(experts: int, ranks: int, num_topk: int, send_tokens: int = SEND_TOKENS, alignment: int = 16):
  """``(topk_idx, token_topk_to_pos, pos_to_expert)`` as NumPy arrays, computed once per config (however
  the arguments are spelled)."""
  return _routing_of(experts, ranks, num_topk, send_tokens, alignment)


@functools.lru_cache(maxsize=None)
def _routing_of(experts, ranks, num_topk, send_tokens, alignment):
  idx = upstream_topk_idx(send_tokens, num_topk, experts, ranks)
  m = ref.get_fused_mapping(jnp.asarray(idx), experts, 0, alignment)
  return idx, np.asarray(m.token_topk_to_pos), np.asarray(m.pos_to_expert)


def _label(experts, ranks, num_topk, t, extra=""):
  return f"E={experts}x{ranks} K={num_topk} T={t}" + (f" {extra}" if extra else "")


def _mapping(topk_idx, experts_like):
  """get_fused_mapping without host sync: N is the upper bound; E is ``experts_like.shape[0]``."""
  return moe.get_fused_mapping(topk_idx, experts_like.shape[0], 0, 128, force_no_sync=True)


def _mapping_ref(topk_idx, experts_like):
  return ref.get_fused_mapping(topk_idx, experts_like.shape[0], 0, 128, force_no_sync=True)


def _mapping_case(experts, ranks, num_topk, send_tokens=SEND_TOKENS):
  idx = _routing(experts, ranks, num_topk, send_tokens)[0]
  t, k = idx.shape
  n = sum(-(-int((idx == e).sum()) // 128) * 128 for e in range(experts))
  nbytes = t * k * 8 + 3 * n * 4 + t * k * 4 + 3 * experts * 4
  return Case(_label(experts, ranks, num_topk, t),
              lambda key: (jnp.asarray(idx), jnp.zeros((experts,), jnp.int8)), nbytes)


register(BenchOp(
    "get_fused_mapping", _mapping, _mapping_ref,
    lambda: [_mapping_case(*p) for p in MOE_PARAMS],
    lambda: [_mapping_case(9, 8, 6, 4)]))


def _expand_case(experts, ranks, num_topk, hidden, send_tokens=SEND_TOKENS):
  idx, pos, pte = _routing(experts, ranks, num_topk, send_tokens)
  t, n = idx.shape[0], pte.shape[0]
  nbytes = t * hidden * 2 + t * num_topk * 4 + n * 4 + n * hidden * 2
  return Case(_label(experts, ranks, num_topk, t, f"H={hidden} bf16"),
              lambda key: (randn(key, (t, hidden), jnp.bfloat16), jnp.asarray(pos), jnp.asarray(pte)), nbytes)


register(BenchOp(
    "expand_to_fused", moe.expand_to_fused, ref.expand_to_fused,
    lambda: [_expand_case(*p, h) for p in MOE_PARAMS for h in hidden_sizes(64)],
    lambda: [_expand_case(9, 8, 2, 576, 2)]))


def _expand_sf_fn(impl_fn, npc, col_major):
  return lambda x, x_sf, pos, pte: impl_fn((x, x_sf), npc, pos, pte, use_tma_aligned_col_major_sf=col_major)


def _expand_sf_case(experts, ranks, num_topk, hidden, npc, col_major, send_tokens=SEND_TOKENS):
  idx, pos, pte = _routing(experts, ranks, num_topk, send_tokens)
  t, n = idx.shape[0], pte.shape[0]
  blocks = -(-hidden // npc)
  hs, sf_dtype = (-(-blocks // 4), jnp.int32) if col_major else (blocks, jnp.float32)
  nbytes = (t + n) * (hidden + hs * 4) + t * num_topk * 4 + n * 4

  def make_args(key):
    k1, k2 = jax.random.split(key)
    sf = jax.random.randint(k2, (t, hs), 0, 2**31 - 1) if col_major else jax.random.uniform(k2, (t, hs))
    return randn(k1, (t, hidden), jnp.float8_e4m3fn), sf.astype(sf_dtype), jnp.asarray(pos), jnp.asarray(pte)

  return Case(_label(experts, ranks, num_topk, t, f"H={hidden} e4m3 npc={npc}"), make_args, nbytes)


for _npc, _col in itertools.product((32, 128), (False, True)):
  register(BenchOp(
      f"expand_to_fused_with_sf:npc{_npc}:{'col_ue8m0' if _col else 'row_fp32'}",
      _expand_sf_fn(moe.expand_to_fused_with_sf, _npc, _col), _expand_sf_fn(ref.expand_to_fused_with_sf, _npc, _col),
      functools.partial(lambda npc, col: [_expand_sf_case(*p, h, npc, col) for p in MOE_PARAMS for h in hidden_sizes(64)],
                        _npc, _col),
      functools.partial(lambda npc, col: [_expand_sf_case(9, 8, 2, 576, npc, col, 2)], _npc, _col)))


def _reduce_fn(impl_fn, fp8_format, use_x_sf):
  def fn(x, x_sf, w, pos, sf):
    return impl_fn((x, x_sf) if use_x_sf else x, w, pos, fp8_format=fp8_format, sf=sf if fp8_format else None)
  return fn


@functools.lru_cache(maxsize=None)
def _unaligned_positions(experts, ranks, num_topk, send_tokens):
  """``token_topk_to_pos`` of the config at alignment 1 (NumPy), computed once per config: the reduce_fused grids
  repeat each config over 4 ops, hidden sizes and dtypes."""
  idx = _routing(experts, ranks, num_topk, send_tokens)[0]
  return np.asarray(moe.get_fused_mapping(jnp.asarray(idx), experts, 0, 1).token_topk_to_pos)


def _reduce_case(experts, ranks, num_topk, hidden, in_dtype, fp8, use_x_sf, send_tokens=SEND_TOKENS):
  idx, _, _ = _routing(experts, ranks, num_topk, send_tokens)
  pos = _unaligned_positions(experts, ranks, num_topk, send_tokens)
  t = idx.shape[0]
  itemsize = jnp.dtype(in_dtype).itemsize
  out_size = 1 if fp8 else itemsize
  nbytes = (t * num_topk * 4 + (t * num_topk * 4 if use_x_sf else 0) + t * hidden * out_size
            + int((pos >= 0).sum()) * hidden * itemsize + t * num_topk * 4)

  def make_args(key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return (randn(k1, (t * num_topk, hidden), in_dtype), randn(k2, (t * num_topk,), jnp.float32),
            jax.random.uniform(k3, (t, num_topk), jnp.float32), jnp.asarray(pos), randn(k4, (1,), jnp.float32))

  name = jnp.dtype(in_dtype).name
  return Case(_label(experts, ranks, num_topk, t, f"H={hidden} {name}->{'e4m3' if fp8 else name}"), make_args, nbytes)


for _fp8, _xsf in itertools.product(("", "e4m3"), (False, True)):
  register(BenchOp(
      f"reduce_fused:{_fp8 or 'same'}{':x_sf' if _xsf else ''}",
      _reduce_fn(moe.reduce_fused, _fp8, _xsf), _reduce_fn(ref.reduce_fused, _fp8, _xsf),
      functools.partial(lambda fp8, xsf: [_reduce_case(e, r, k, h, d, fp8, xsf)
                                          for (e, r, k) in MOE_PARAMS if k == 6
                                          for h in hidden_sizes(256) for d in (jnp.float32, jnp.bfloat16)],
                        _fp8, _xsf),
      functools.partial(lambda fp8, xsf: [_reduce_case(9, 8, 6, 256, jnp.bfloat16, fp8, xsf, 1)], _fp8, _xsf)))


def _index_case(experts, ranks, num_topk, nbytes_of, extra="", transform=None, **kwargs):
  idx = _routing(experts, ranks, num_topk)[0]
  if transform is not None:
    idx = transform(idx)
  return Case(_label(experts, ranks, num_topk, idx.shape[0], extra), lambda key: (jnp.asarray(idx),),
              nbytes_of(idx), kwargs)


def _small_index_case(**kwargs):
  idx = moe_topk_idx(jax.random.key(0), 2, 2, 9, 8)
  return Case("E=9x8 K=2 small", lambda key: (jnp.asarray(idx),), idx.size * 8, kwargs)


def _normalize_case(experts, ranks, num_topk):
  t = _routing(experts, ranks, num_topk)[0].shape[0]
  return Case(_label(experts, ranks, num_topk, t),
              lambda key: (jax.random.uniform(key, (t, num_topk), jnp.float32),), t * num_topk * 8 + t * 4)


register(BenchOp(
    "normalize_weight", moe.normalize_weight, ref.normalize_weight,
    lambda: [_normalize_case(*p) for p in MOE_PARAMS],
    lambda: [Case("T=5 K=6", lambda key: (jax.random.uniform(key, (5, 6), jnp.float32),), 5 * 52)]))

register(BenchOp(
    "aux_fi", moe.aux_fi, ref.aux_fi,
    lambda: [_index_case(e, r, k, lambda i: i.size * 8, f"aux_topk={a}", num_experts=e, num_aux_topk=a)
             for e, r, k in MOE_PARAMS for a in sorted({1, k})],
    lambda: [_small_index_case(num_experts=9, num_aux_topk=2)]))

register(BenchOp(
    "group_count", moe.group_count, ref.group_count,
    lambda: [_index_case(e, r, k, lambda i: i.size * 8, num_groups=e) for e, r, k in MOE_PARAMS],
    lambda: [_small_index_case(num_groups=9)]))

register(BenchOp(
    "mask_indices_by_tp", moe.mask_indices_by_tp, ref.mask_indices_by_tp,
    lambda: [_index_case(e, r, k, lambda i: i.size * 16, f"tp={tp}", n=e * r, num_ep_ranks=r, tp_rank=1 % tp,
                         num_tp_ranks=tp)
             for e, r, k in MOE_PARAMS for tp in (2, 4, 8)],
    lambda: [_small_index_case(n=72, num_ep_ranks=8, tp_rank=1, num_tp_ranks=2)]))


def _group_ids(experts, ranks, groups):
  per_group = experts * ranks // groups
  return lambda idx: np.where(idx >= 0, idx // per_group, -1).astype(np.int32)


def _changed(groups):
  return lambda ids: np.asarray(ref.unique_group_indices(jnp.asarray(ids), groups) != jnp.asarray(ids)).sum()


register(BenchOp(
    "unique_group_indices", moe.unique_group_indices, ref.unique_group_indices,
    lambda: [_index_case(e, r, k, lambda i, g=g: i.size * 8 + 4 * int(_changed(g)(i)), f"groups={g}",
                         _group_ids(e, r, g), num_groups=g)
             for e, r, k in MOE_PARAMS for g in (8, 16, 72) if (e * r) % g == 0],
    lambda: [_small_index_case(num_groups=8)]))

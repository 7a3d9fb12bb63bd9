"""MoE gating ops on upstream's benchmark grids. Byte counts follow upstream's
(int64 index outputs upstream, so 8 bytes per index although jaxkern writes int32)."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp

from benchmarks.registry import BenchOp, Case, register
from jaxkern import moe, reference
from jaxkern.testing import num_tokens


@functools.partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=["kwargs"])
@dataclasses.dataclass(frozen=True)
class Config:
  """Static keyword arguments passed through ``jax.jit`` as a leafless pytree."""

  kwargs: tuple


def _scores(key, shape):
  return jax.random.normal(key, shape, jnp.float32)


def _topk_case(t, e, k):
  return Case(f"T={t} E={e} K={k}", lambda key: (_scores(key, (t, e)), Config((("num_topk", k),))),
              t * e * 4 + t * k * 8)


_TOPK_EK = [(72, 6), (32, 6), (64, 6), (96, 6), (16, 6), (36, 6), (108, 6), (128, 6), (144, 6), (256, 8)]

register(BenchOp(
    "topk_gate",
    lambda x, cfg: moe.topk_gate(x, **dict(cfg.kwargs)),
    lambda x, cfg: reference.moe.topk_gate(x, **dict(cfg.kwargs)),
    lambda: [_topk_case(t, e, k) for t, (e, k) in itertools.product(num_tokens(), _TOPK_EK)],
    lambda: [_topk_case(70, 72, 6), _topk_case(64, 36, 6)]))


def _group_case(t, e, g, s, n):
  cfg = Config((("num_topk_sum", s), ("num_topk_groups", n)))
  return Case(f"T={t} E={e} G={g} sum={s} groups={n}", lambda key: (_scores(key, (t, g, e // g)), cfg),
              t * e * 4 + t * n * 8)


_GROUP_EG = [(72, 4), (72, 8), (72, 12), (256, 4), (256, 8), (256, 16)]

register(BenchOp(
    "topk_sum_and_topk_group_idx",
    lambda x, cfg: moe.topk_sum_and_topk_group_idx(x, **dict(cfg.kwargs)),
    lambda x, cfg: reference.moe.topk_sum_and_topk_group_idx(x, **dict(cfg.kwargs)),
    lambda: [_group_case(t, e, g, s, n)
             for t, (e, g), s, n in itertools.product(num_tokens(), _GROUP_EG, (1, 2), (2, 4))],
    lambda: [_group_case(70, 72, 8, 2, 4)]))


# (num_groups, num_topk_groups, E, S, K) of upstream's test of top2_sum_gate; shared experts where valid.
_GATE_CONFIGS = [(0, 0, 72, 1, 6), (0, 0, 32, 2, 6), (0, 0, 64, 2, 6), (0, 0, 96, 2, 6), (0, 0, 16, 2, 6),
                 (0, 0, 36, 2, 6), (0, 0, 108, 2, 6), (0, 0, 128, 2, 6), (0, 0, 144, 2, 6), (8, 8, 256, 2, 8),
                 (8, 4, 256, 2, 8)]


def _gate_case(g, ntg, e, s, k, func, active=32, masked=4):
  s = s if s and k % s == 0 and e % (k // s) == 0 else 0
  t = active + masked
  x = 32

  def make_args(key):
    k1, k2 = jax.random.split(key)
    logits, bias = _scores(k1, (t, e)), _scores(k2, (e,))
    arrays = dict(mask=jnp.arange(t) < active)
    if s:
      arrays.update(to_physical_map=jnp.broadcast_to(jnp.arange(e + s, dtype=jnp.int32)[:, None], (e + s, x + 1)),
                    logical_count=jnp.ones((e + s,), jnp.int32))
    cfg = Config((("num_topk", k), ("num_topk_groups", ntg), ("num_groups", g), ("use_shared_as_routed", s > 0),
                  ("num_shared_experts", s), ("routed_scaling_factor", 1.5), ("ep_rank", 0), ("num_ep_ranks", 4),
                  ("tp_rank", 1), ("num_tp_ranks", 2), ("scoring_func", func)))
    return logits, bias, arrays, cfg

  return Case(f"T={t} E={e} G={g}/{ntg} S={s} K={k} {func}", make_args, t * e * 4 + e * 4)


def _gate_fn(f):
  return lambda logits, bias, arrays, cfg: f(logits, bias, **dict(cfg.kwargs), **arrays)


register(BenchOp(
    "top2_sum_gate",
    _gate_fn(moe.top2_sum_gate),
    _gate_fn(reference.moe.top2_sum_gate),
    lambda: [_gate_case(*c, func) for c in _GATE_CONFIGS for func in ("sigmoid", "sqrtsoftplus", "softmax")]
    + [_gate_case(8, 4, 256, 0, 8, "sigmoid", active=8192, masked=0)],
    lambda: [_gate_case(8, 4, 64, 2, 8, "softmax"), _gate_case(0, 0, 72, 1, 6, "sqrtsoftplus")]))

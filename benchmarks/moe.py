"""MoE gating ops on the spec's benchmark grids (moe_transpose.md §4). Byte counts follow the spec
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

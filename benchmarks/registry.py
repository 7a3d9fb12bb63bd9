"""Registry of benchmarked ops: each op module registers its spec shapes here."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax

from jaxkern.testing import assert_bitwise_equal


@dataclasses.dataclass(frozen=True)
class Case:
  """One benchmark shape: ``make_args(key)`` builds the array inputs, ``kwargs`` are the op's static
  keyword arguments; ``nbytes`` counts each input read and each output written once (upstream's
  byte count); ``flops`` (GEMMs) the arithmetic, reported as TF/s when non-zero."""

  label: str
  make_args: Callable[[jax.Array], tuple]
  nbytes: int
  kwargs: dict = dataclasses.field(default_factory=dict)
  flops: int = 0


def bitwise_check(out, expected) -> None:
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True):
    assert_bitwise_equal(a, b)


@dataclasses.dataclass(frozen=True)
class BenchOp:
  """``fn`` is the public jaxkern op (it follows the implementation switch), ``reference`` the
  ``jnp`` reference; ``cases()`` gives upstream's benchmark shapes and ``small_cases()`` the
  shapes of the CPU correctness pass; ``check(out, expected)`` raises on a mismatch."""

  name: str
  fn: Callable
  reference: Callable
  cases: Callable[[], Sequence[Case]]
  small_cases: Callable[[], Sequence[Case]]
  check: Callable = bitwise_check


REGISTRY: dict[str, BenchOp] = {}


def register(op: BenchOp) -> BenchOp:
  if op.name in REGISTRY:
    raise ValueError(f"benchmark op {op.name!r} is registered twice")
  REGISTRY[op.name] = op
  return op


# The widest top-k of upstream's MoE benchmark configs (K in 2, 6, 8, 9).
_WIDEST_TOPK = 9


def upstream_topk_idx(send_tokens: int, num_topk: int, experts: int, ranks: int):
  """``moe_topk_idx(jax.random.key(0), ...)`` of an upstream MoE benchmark config (read-only NumPy), the same
  values, computed once per process: several ops' grids (the SwiGLU casts, per_channel_cast_fused, the routing
  ops) build cases over the same configs, and one draw and top-k over all ranks' tokens took 1-6 CPU seconds
  (2026-11-29). The configs that differ only in ``num_topk`` share one draw: the routing of ``K`` is the first ``K``
  columns of the routing of a wider ``K`` (``lax.top_k`` is stable, so the top ``K`` of the scores are the first
  ``K`` of the top ``K'`` for ``K' >= K``; ids of other ranks become -1 column by column), less the rows left all
  -1 (tests/test_benchmarks.py)."""
  if num_topk > _WIDEST_TOPK or experts * ranks < _WIDEST_TOPK:
    return _topk_idx(send_tokens, num_topk, experts, ranks)
  wide = _topk_idx(send_tokens, _WIDEST_TOPK, experts, ranks)
  idx = wide[:, :num_topk]
  idx = idx[(idx >= 0).any(axis=1)]
  idx.setflags(write=False)
  return idx


@functools.lru_cache(maxsize=None)
def _topk_idx(send_tokens, num_topk, experts, ranks):
  from jaxkern.testing import moe_topk_idx

  idx = moe_topk_idx(jax.random.key(0), send_tokens, num_topk, experts, ranks)
  idx.setflags(write=False)
  return idx

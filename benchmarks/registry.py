"""Registry of benchmarked ops: each op module registers its spec shapes here."""

from __future__ import annotations

import dataclasses
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

"""Comparisons used by the tests: raw-bit equality and upstream's relative-difference metric."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def _bits(x) -> np.ndarray:
  x = np.asarray(x)
  if x.dtype.itemsize == 0 or x.dtype == np.bool_:
    return x
  return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def assert_bitwise_equal(actual: Any, expected: Any, err_msg: str = "") -> None:
  """Asserts equal dtype, shape and raw bytes (NaN payloads and signed zeros must match).

  Works for any dtype numpy can view as unsigned integers of the same width,
  including float8 (ml_dtypes) and bfloat16. Packed sub-byte data (float4)
  should be compared through its uint8 container. Pytrees (a ``QuantTensor``, a ``FusedMapping``, ...)
  must have the same structure (NamedTuple types included) and are compared leaf by leaf.
  """
  if isinstance(actual, (tuple, list, dict)) or isinstance(expected, (tuple, list, dict)):
    (a_leaves, a_tree), (e_leaves, e_tree) = jax.tree.flatten(actual), jax.tree.flatten(expected)
    if a_tree != e_tree:
      raise AssertionError(f"pytree structure mismatch: {a_tree} != {e_tree}. {err_msg}")
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
      assert_bitwise_equal(a, e, f"leaf {i} of {a_tree}. {err_msg}")
    return
  actual, expected = np.asarray(actual), np.asarray(expected)
  if actual.dtype != expected.dtype:
    raise AssertionError(f"dtype mismatch: {actual.dtype} != {expected.dtype}. {err_msg}")
  if actual.shape != expected.shape:
    raise AssertionError(f"shape mismatch: {actual.shape} != {expected.shape}. {err_msg}")
  a, e = _bits(actual), _bits(expected)
  bad = a != e
  if bad.any():
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    raise AssertionError(
        f"{int(bad.sum())} of {bad.size} elements differ bitwise; first at {idx}: "
        f"{actual[idx]!r} (0x{int(a[idx]):x}) != {expected[idx]!r} (0x{int(e[idx]):x}). {err_msg}")


def calc_diff(x: jax.typing.ArrayLike, y: jax.typing.ArrayLike) -> float:
  """``1 - 2·Σxy / Σ(x² + y²)`` in float64 (0 when both are all zero)."""
  x = np.asarray(x, dtype=np.float64)
  y = np.asarray(y, dtype=np.float64)
  denom = float(np.sum(x * x + y * y))
  if denom == 0.0:
    return 0.0
  return 1.0 - 2.0 * float(np.sum(x * y)) / denom


def assert_diff_below(actual: jax.typing.ArrayLike, expected: jax.typing.ArrayLike, tol: float,
                      err_msg: str = "") -> None:
  """Asserts ``calc_diff(actual, expected) <= tol`` and that neither side has NaN."""
  if np.isnan(np.asarray(actual, np.float64)).any() or np.isnan(np.asarray(expected, np.float64)).any():
    raise AssertionError(f"NaN in the compared values. {err_msg}")
  d = calc_diff(actual, expected)
  if not d <= tol:
    raise AssertionError(f"calc_diff = {d:.3e} > {tol:.1e}. {err_msg}")

"""Trace-time argument checks shared by the public ops; each raises ``ValueError`` naming the argument.

Checks chex covers (rank, exact shape) go through chex; its ``AssertionError`` becomes the ``ValueError`` here. chex's
``dtype`` check takes one dtype, not a set, and it has no divisibility check: those two stay plain.

Value checks (ranges, finiteness) come in pairs: a ``ValueError`` for a concrete array and a
``checkify.debug_check`` for a traced one (reported under ``checkify.user_checks``, free otherwise)."""

from __future__ import annotations

from collections.abc import Iterable

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify


def _chex_holds(assertion, x, expected, holds: bool) -> bool:
  """Whether chex's ``assertion(x, expected)`` passes and ``holds`` (the same condition computed here:
  ``chex.disable_asserts()`` switches chex off, and the op's own check must stay on)."""
  try:
    assertion(x, expected)
  except AssertionError:
    return False
  return holds


def check_rank(name: str, x, ndim: int) -> None:
  if not _chex_holds(chex.assert_rank, x, ndim, len(x.shape) == ndim):
    raise ValueError(f"{name} must have rank {ndim}, got shape {tuple(x.shape)}")


def check_shape(name: str, x, expected, note: str = "") -> None:
  """``x.shape == expected``, else ``"{name} must have shape {expected}{note}, got {x.shape}"`` (``note``: where
  the expected shape comes from, e.g. ``" (the shape of weight_hidden)"``)."""
  expected = tuple(int(d) for d in expected)
  if not _chex_holds(chex.assert_shape, x, expected, tuple(x.shape) == expected):
    raise ValueError(f"{name} must have shape {expected}{note}, got {tuple(x.shape)}")


def check_dtype(name: str, x, allowed: Iterable) -> None:
  allowed = tuple(jnp.dtype(d) for d in allowed)
  if x.dtype not in allowed:
    names = ", ".join(d.name for d in allowed)
    raise ValueError(f"{name} must have dtype in ({names}), got {x.dtype}")


def check_multiple(name: str, x, axis: int, multiple: int) -> None:
  if x.shape[axis] % multiple:
    raise ValueError(
        f"{name}.shape[{axis}] must be a multiple of {multiple}, got shape {tuple(x.shape)}")


def as_array(name: str, x):
  """``x`` as an array: arrays (and tracers) pass, a (nested) list is converted with ``jnp.asarray``,
  anything else raises."""
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return x
  if isinstance(x, list):
    try:
      return jnp.asarray(x)
    except (TypeError, ValueError) as e:
      raise ValueError(f"{name}: cannot convert the list to an array ({e})") from None
  raise ValueError(f"{name} must be an array, got {type(x).__name__}")


def check_float(name: str, value, *, nonzero: bool = False, nonnegative: bool = False) -> float:
  """A static float option (a Python or numpy number): finite, optionally non-zero / non-negative; returns it as a
  Python float."""
  try:
    value = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a Python float, got {type(value).__name__}") from None
  if not np.isfinite(value) or (nonzero and value == 0) or (nonnegative and value < 0):
    cond = "finite" + (" and non-zero" if nonzero else "") + (" and >= 0" if nonnegative else "")
    raise ValueError(f"{name} must be {cond}, got {value}")
  return value


# Value checks. A precondition on the values of an array argument is checked twice: on the host when the array is
# concrete (``ValueError`` naming the argument, the allowed values and the first bad entry), and, when it is traced,
# by a ``checkify.debug_check`` that ``checkify.checkify(f, errors=checkify.user_checks)`` reports and that is
# dropped otherwise (XLA removes its now unused predicate). docs/usage.md, "Bad values under jit", lists the ops.


def is_traced(x) -> bool:
  """Whether ``x`` is traced (under ``jit`` / ``vmap`` / ``checkify``): its values are not known now."""
  return isinstance(x, jax.core.Tracer)


def _entry(name: str, index) -> str:
  return f"{name}[{', '.join(str(int(i)) for i in index)}]" if len(index) else name


def check_entries(name: str, x, bad, requirement: str) -> None:
  """Raises ``ValueError`` if a concrete ``x`` has an entry where ``bad(values)`` (a numpy predicate) holds:
  ``"{name} must hold {requirement}; {name}[i, j] = v is not (the first such entry)"``. Traced ``x``: no-op."""
  if is_traced(x) or not x.size:
    return
  v = np.asarray(x)
  flags = np.asarray(bad(v))
  if flags.any():
    index = np.unravel_index(int(np.argmax(flags.reshape(-1))), v.shape)
    raise ValueError(f"{name} must hold {requirement}; {_entry(name, index)} = {v[index]} is not "
                     "(the first such entry)")


def debug_check_entries(op: str, name: str, x, bad, requirement: str) -> None:
  """The traced counterpart of :func:`check_entries`: under ``checkify.checkify(f,
  errors=checkify.user_checks)`` reports ``"{op}: {name}[i, j] = v is not {requirement}"`` for the first entry (in
  flat order) where ``bad(x)`` (a ``jnp`` predicate) holds. Without checkify the check is dropped and costs nothing
  in a compiled program. Concrete ``x``: no-op (:func:`check_entries` covers it)."""
  if not is_traced(x) or not x.size:
    return
  flags = jnp.asarray(bad(x)).reshape(-1)
  i = jnp.argmax(flags)
  index = jnp.unravel_index(i, x.shape)
  where = f"{name}[{', '.join('{}' for _ in x.shape)}]" if x.ndim else name
  requirement = requirement.replace("{", "{{").replace("}", "}}")
  checkify.debug_check(~flags[i], f"{op}: {where} = {{}} is not {requirement} (the first such entry)",
                       *index, x.reshape(-1)[i])


def check_and_debug_check(op: str, name: str, x, bad, requirement: str) -> None:
  """:func:`check_entries` for a concrete ``x``, :func:`debug_check_entries` for a traced one; ``bad`` must work
  on numpy and jax arrays alike."""
  check_entries(name, x, bad, requirement)
  debug_check_entries(op, name, x, bad, requirement)


def check_ids(op: str, name: str, x, limit: int, what: str = "ids") -> None:
  """``x`` holds -1 or ``what`` in ``[0, limit)``: concrete ``ValueError`` / traced checkify report."""
  check_and_debug_check(op, name, x, lambda v: (v < -1) | (v >= limit), f"-1 or {what} in [0, {limit})")


def zero_or_not_finite(v):
  """Elementwise ``v == 0 or v is inf / NaN``, for numpy and jax arrays alike."""
  return (v == 0) | ~(abs(v) < np.inf)


def not_power_of_two(v):
  """Elementwise ``v`` is not a positive power of two (zero, negative, inf and NaN included), for numpy and jax
  arrays alike (numpy's ``frexp`` on the host: XLA on a CPU may flush subnormals)."""
  return (np if isinstance(v, np.ndarray) else jnp).frexp(v)[0] != 0.5


def debug_check_nan(op: str, name: str, x, consequence: str) -> None:
  """Under checkify, reports the first NaN of a traced float ``x`` (``consequence``: what the op does with it)."""
  debug_check_entries(op, name, x, jnp.isnan, f"a number ({consequence})")

"""Helpers of the routing tests: checkify errors, compiled-program comparison."""

from __future__ import annotations

import collections
import contextlib
import re

import jax
from jax.experimental import checkify

from jaxkern.moe import _routing


def checkify_error(f, *args) -> str | None:
  """The message of the first failed user check of ``jax.jit(checkify(f))(*args)``, or None."""
  err, _ = jax.jit(checkify.checkify(f, errors=checkify.user_checks))(*args)
  return err.get()


@contextlib.contextmanager
def without_debug_checks():
  """The routing ops with their opt-in checks removed (the baseline of :func:`compiled_program`)."""
  original = _routing.debug_check_positions
  _routing.debug_check_positions = lambda *args: None
  try:
    yield
  finally:
    _routing.debug_check_positions = original


def compiled_program(f, *args) -> collections.Counter:
  """The instructions of the optimised XLA program of ``jax.jit(f)(*args)``, as a multiset of text
  lines with source metadata, instruction / region numbering and callback ids removed: equal for two
  programs that compute the same thing in the same way."""
  text = jax.jit(f).lower(*args).compile().as_text()
  lines = text.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith(("%", "ENTRY")))
  text = "\n".join(lines[start:])
  text = re.sub(r", metadata=\{[^}]*\}", "", text)
  text = re.sub(r"(region)_\d+\b", r"\1", text)
  text = re.sub(r"\.\d+\b", "", text)
  text = re.sub(r"index = \d+ : ui64", "index", text)
  return collections.Counter(line.strip() for line in text.splitlines() if line.strip())


def assert_checks_compile_away(f, *args) -> None:
  """``jax.jit(f)`` compiles to the same program with and without the opt-in checks."""
  checked = compiled_program(f, *args)
  with without_debug_checks():
    assert compiled_program(f, *args) == checked

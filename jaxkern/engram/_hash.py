"""``make_offsets`` and ``engram_hash`` (docs/engram.md, "Hash"): checks, dispatch, docstrings. Both are
XLA code (the ``jnp`` references); see :func:`engram_hash` for why the hash has no Pallas kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkern import _checks, _dispatch
from jaxkern.reference import engram as ref

split_multipliers = ref.split_multipliers


def make_offsets(vocab_sizes: jax.typing.ArrayLike, *, implementation: str | None = None) -> jax.Array:
  """Exclusive prefix sums of the table sizes per layer (docs/engram.md, "Hash").

  Args:
    vocab_sizes: ``(L, N-1, E)`` int32.
    implementation: accepted for uniformity; the op has no kernel (a cumulative sum over a few dozen
      values per layer) and runs its XLA code (the reference) under every implementation.

  Returns:
    ``(L, (N-1)·E)`` int32: ``off[l, 0] = 0``, ``off[l, c] = Σ_{c' < c} sizes[l].flat[c']`` (int32 wrap-around).

  Raises:
    ValueError: ``vocab_sizes`` not rank 3 or not int32.

  Differentiation: integer, no cotangent.
  """
  sizes = _checks.as_array("vocab_sizes", vocab_sizes)
  _checks.check_rank("vocab_sizes", sizes, 3)
  _checks.check_dtype("vocab_sizes", sizes, (jnp.int32,))
  run = lambda: ref.make_offsets(sizes)
  return _dispatch.run("make_offsets", implementation, kernel=None, xla=run)


def _multiplier_words(multipliers, num_layers, n):
  """The ``(L, N, 2)`` uint32 words of ``multipliers`` (see :func:`engram_hash`), checked."""
  if isinstance(multipliers, (list, tuple)) or isinstance(multipliers, np.ndarray):
    a = np.asarray(multipliers) if not isinstance(multipliers, np.ndarray) else multipliers
    if not (a.dtype == object or np.issubdtype(a.dtype, np.integer)):
      raise ValueError(f"multipliers must hold integers, got dtype {a.dtype}")
    if a.dtype == np.uint32 and a.shape == (num_layers, n, 2):
      return jnp.asarray(a)
    _checks.check_shape("multipliers", a, (num_layers, n), f" (or ({num_layers}, {n}, 2) uint32 words)")
    return ref.split_multipliers(a)
  m = _checks.as_array("multipliers", multipliers)
  if m.dtype == jnp.uint32 and m.ndim == 3:
    _checks.check_shape("multipliers", m, (num_layers, n, 2), " (as uint32 words)")
    return m
  if m.dtype not in (jnp.dtype(jnp.int64), jnp.dtype(jnp.uint64)):
    raise ValueError(f"multipliers as a jax array must be int64 / uint64 (x64 on) or (L, N, 2) uint32 words, got "
                     f"{m.dtype} {tuple(m.shape)}; with x64 off pass a numpy int64 array, Python ints, or "
                     "jaxkern.engram.split_multipliers(...)")
  _checks.check_shape("multipliers", m, (num_layers, n))
  return ref.split_multipliers(m)


def engram_hash(ngram_token_ids: jax.Array, multipliers: jax.typing.ArrayLike, vocab_sizes: jax.typing.ArrayLike,
                offsets: jax.Array, *, implementation: str | None = None) -> jax.Array:
  """N-gram hash indices into the per-layer concatenated embedding tables (docs/engram.md, "Hash").

  For layer ``l``, token ``t`` and order ``n = 1..N-1``: ``h_n = XOR_{i <= n} int64(ids[t, i])·mult[l, i]``
  with int64 two's-complement wrap-around, and ``out[l, t, (n-1)E + j] = int32(h_n mod V[l, n-1, j]) +
  offsets[l, (n-1)E + j]`` (floor modulo, in ``[0, V)``; the offset add wraps in int32).

  The 64-bit arithmetic is emulated on pairs of uint32 words, so the op works with
  ``jax_enable_x64`` off; results are bit-identical to the int64 definition for every id, multiplier and
  size ``V >= 1``. Precondition: every size ``>= 1``; a concrete ``vocab_sizes`` with a size ``<= 0`` raises
  ``ValueError``, a traced one gives unspecified indices and ``checkify.checkify(f,
  errors=checkify.user_checks)`` reports the first such size (docs/usage.md, "Bad values under jit").

  Args:
    ngram_token_ids: ``(T, N)`` int32, ``N >= 2`` (column 0 starts every n-gram).
    multipliers: the ``(L, N)`` int64 multipliers as any of: a numpy integer array (e.g. int64 / uint64) or
      nested lists of Python ints (converted exactly on the host; values in ``[-2^63, 2^64)``), a jax
      int64 / uint64 array (x64 on; may be traced), or ``(L, N, 2)`` uint32 words ``[lo, hi]`` of the
      two's complement (:func:`jaxkern.engram.split_multipliers`; the little-endian view
      ``m.view(np.uint32).reshape(L, N, 2)`` of an int64 array; may be traced with x64 off).
    vocab_sizes: ``(L, N-1, E)`` int32, each ``>= 1``.
    offsets: ``(L, (N-1)E)`` int32 (:func:`make_offsets`).
    implementation: accepted for uniformity; XLA code under every implementation (see below).

  Returns:
    ``(L, T, (N-1)E)`` int32.

  Raises:
    ValueError (naming the argument): ranks, dtypes or shapes that do not match, a jax int32 ``(L, N)``
      multiplier array (possibly truncated by x64 being off: pass numpy int64 or the uint32 words), values
      outside ``[-2^63, 2^64)``, a concrete ``vocab_sizes`` entry below 1.

  No Pallas kernel: under every implementation but ``"reference"`` the op is XLA code that computes in native
  int64 (``jax.enable_x64`` inside the op only, whatever the caller's setting): one fusion whose
  ``L·T·(N-1)E`` modulos are the GPU's 64-bit remainder routine, one per thread. The reference emulates the
  same arithmetic on 32-bit words (a 63-step bit-serial floor modulo), 6.4 µs against TileKernels' 4.6 at
  ``T = 8001`` on an H200 (2026-11-28). An earlier Mosaic GPU kernel (256 tokens per CTA, the bit-serial
  modulo) took 76 µs against XLA's 5.3 µs at ``T = 4001`` on an H100: the op moves ``140·T`` bytes and is
  integer-ALU bound, so the work per modulo is what counts.

  Differentiation: integer, no cotangent.
  """
  ids = _checks.as_array("ngram_token_ids", ngram_token_ids)
  _checks.check_rank("ngram_token_ids", ids, 2)
  _checks.check_dtype("ngram_token_ids", ids, (jnp.int32,))
  sizes = _checks.as_array("vocab_sizes", vocab_sizes)
  _checks.check_rank("vocab_sizes", sizes, 3)
  _checks.check_dtype("vocab_sizes", sizes, (jnp.int32,))
  offsets = _checks.as_array("offsets", offsets)
  _checks.check_rank("offsets", offsets, 2)
  _checks.check_dtype("offsets", offsets, (jnp.int32,))
  n = ids.shape[1]
  num_layers, n1, e = sizes.shape
  if n < 2 or n1 != n - 1:
    raise ValueError(f"vocab_sizes must have shape (L, N-1, E) = (L, {n - 1}, E) with N = ngram_token_ids.shape[1] "
                     f">= 2, got {tuple(sizes.shape)}")
  _checks.check_shape("offsets", offsets, (num_layers, n1 * e))
  words = _multiplier_words(multipliers, num_layers, n)
  _checks.check_and_debug_check("engram_hash", "vocab_sizes", sizes, lambda v: v < 1,
                                "a table size >= 1 (the hash is taken modulo it)")

  def reference():
    return ref.engram_hash(ids, words, sizes, offsets)

  return _dispatch.run("engram_hash", implementation, kernel=None,
                       xla=lambda: _hash_int64(ids, words, sizes, offsets), reference=reference)


def _hash_int64(ids, words, sizes, offsets):
  """:func:`engram_hash` in native int64 arithmetic (bit-identical to the reference's 32-bit-word emulation:
  two's-complement wrap-around products and XORs, floor modulo by sizes ``>= 1``)."""
  num_layers, n1, e = sizes.shape
  with jax.enable_x64(True):
    w = words.astype(jnp.uint64)
    mult = jax.lax.bitcast_convert_type(w[..., 0] | (w[..., 1] << 32), jnp.int64)  # (L, N)
    products = ids.astype(jnp.int64)[None, :, :] * mult[:, None, :]  # (L, T, N)
    hashes = [products[:, :, 0]]
    for n in range(1, n1 + 1):
      hashes.append(hashes[-1] ^ products[:, :, n])
    h = jnp.stack(hashes[1:], axis=2)[..., None]  # (L, T, N-1, 1): orders 1..N-1
    cols = jnp.mod(h, sizes.astype(jnp.int64)[:, None, :, :]).astype(jnp.int32)  # (L, T, N-1, E)
  return cols.reshape(num_layers, ids.shape[0], n1 * e) + offsets[:, None, :]

"""``jnp`` references for :mod:`jaxkern.engram` (docs/engram.md).

Hashing (docs/engram.md, "Hash"): the int64 two's-complement hash is computed on pairs of uint32 words, so it
needs no ``jax_enable_x64``: a 64-bit value is ``(hi, lo)`` with ``value = hi·2^32 + lo`` (mod 2^64).
:func:`split_multipliers` turns int64 multipliers (numpy, Python ints, or a traced int64 / uint64
array under x64) into the ``(L, N, 2)`` uint32 word pairs ``[..., 0] = lo``, ``[..., 1] = hi`` (the
little-endian view of an int64 array). The pair arithmetic (:func:`mul_wide`, :func:`floor_mod`) uses
only 32-bit multiplies, shifts, masks, compares and selects.

Gate (docs/engram.md, "Gate"): written for any floating dtype. Inputs are widened to ``promote(x.dtype, float32)``
(float32 for the usual bf16 inputs, float64 when the caller passes float64, which the gradient tests
use), outputs go back to the input dtype. Per (token, stream) with ``s = D^-1/2``:

* ``rx = rsqrt(Σx²/D + eps)``, ``rk = rsqrt(Σk²/D + eps)``, ``raw = Σ x·wf·k``, ``d = raw·rx·rk·s``;
* ``u = sqrt(max(|d|, c))·sign(d)`` (upstream's reference: ``u = 0`` at ``d = 0``; the Pallas kernel
  uses ``copysign`` there, docs/engram.md, "Gate"), ``g = σ(u)``, ``out = x + g·v`` rounded once;
* backward (docs/engram.md, "Gate"): ``G = 0`` if ``|raw|·s·rx·rk < c`` else ``dldg·g(1-g)·0.5·sqrt(s·rx·rk/|raw|)``, with
  ``dldg = Σ go·v``; ``grad_x = go + G(k·wf - x·raw·rx²/D)``, ``grad_k = G(x·wf - k·raw·rk²/D)``,
  ``grad_v = Σ_m go_m·g_m`` (m in order), ``grad_wf = Σ_t G·x·k`` per token range of ``P`` partials.

:func:`engram_gate` is the differentiable composite (upstream ``engram_gate_ref``): plain autodiff
through it gives the exact gradients (the clamp is written ``where(|d| >= c, |d|, c)`` so that the
gradient passes at ``|d| = c`` like torch's ``clamp_min``).
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from jaxkern.types import EngramGateGrads, EngramGateOutput, EngramWeightGrads

U32_MASK = 0xFFFFFFFF
DEFAULT_NUM_PARTIALS = 132  # P of engram_gate_bwd off a GPU: the SMs of an H100 / H200 SXM


# ----------------------------------------------------------------------------------------------
# Hashing on uint32 word pairs.

def make_offsets(vocab_sizes: jax.typing.ArrayLike):
  """``(L, N-1, E)`` int32 table sizes -> ``(L, (N-1)·E)`` int32 exclusive prefix sums per layer
  (order-major, table-minor; int32 wrap-around)."""
  s = jnp.asarray(vocab_sizes).astype(jnp.int32)
  flat = s.reshape(s.shape[0], -1)
  return jnp.concatenate([jnp.zeros((flat.shape[0], 1), jnp.int32), jnp.cumsum(flat, axis=1, dtype=jnp.int32)[:, :-1]],
                         axis=1)


def split_multipliers(multipliers: jax.typing.ArrayLike):
  """int64 multipliers ``(L, N)`` -> ``(L, N, 2)`` uint32 ``[lo, hi]`` words of their two's complement.

  Accepts: a numpy integer array or nested lists of Python ints (converted exactly on the host; values
  outside ``[-2^63, 2^64)`` raise ``ValueError``), a jax int64 / uint64 array (needs x64), or an
  ``(L, N, 2)`` uint32 array, returned as is. A jax int32 / uint32 ``(L, N)`` array is taken as the
  sign- / zero-extended value.
  """
  if isinstance(multipliers, (list, tuple, int, np.integer)) or isinstance(multipliers, np.ndarray):
    a = np.asarray(multipliers, dtype=object) if not isinstance(multipliers, np.ndarray) else multipliers
    if isinstance(multipliers, np.ndarray) and multipliers.dtype == np.uint32 and multipliers.ndim == 3:
      return jnp.asarray(multipliers)
    if a.dtype != object and not np.issubdtype(a.dtype, np.integer):
      raise ValueError(f"multipliers must hold integers, got dtype {a.dtype}")
    vals = np.vectorize(int, otypes=[object])(a) if a.size else a.astype(object)
    if a.size and (min(vals.flat) < -2**63 or max(vals.flat) >= 2**64):
      raise ValueError("multipliers must lie in [-2^63, 2^64) (int64 / uint64 values)")
    u = np.vectorize(lambda x: x % 2**64, otypes=[object])(vals) if a.size else vals
    lo = np.array([x & U32_MASK for x in u.flat], np.uint32).reshape(a.shape)
    hi = np.array([x >> 32 for x in u.flat], np.uint32).reshape(a.shape)
    return jnp.asarray(np.stack([lo, hi], axis=-1))
  m = multipliers
  if m.dtype == jnp.uint32 and m.ndim == 3:
    return m
  if m.dtype in (jnp.dtype(jnp.int64), jnp.dtype(jnp.uint64)):
    u = m.astype(jnp.uint64)
    return jnp.stack([(u & U32_MASK).astype(jnp.uint32), (u >> 32).astype(jnp.uint32)], axis=-1)
  if m.dtype in (jnp.dtype(jnp.int32), jnp.dtype(jnp.uint32)):
    lo = lax.bitcast_convert_type(m, jnp.uint32) if m.dtype == jnp.int32 else m
    hi = jnp.where(m < 0, jnp.uint32(U32_MASK), jnp.uint32(0)) if m.dtype == jnp.int32 else jnp.zeros_like(m)
    return jnp.stack([lo, hi.astype(jnp.uint32)], axis=-1)
  raise ValueError(f"multipliers must be integers, got dtype {m.dtype}")


def mul_hi(a: jax.Array, b: jax.Array):
  """High word of the 64-bit product of uint32 ``a``, ``b`` (16-bit pieces; no intermediate overflows)."""
  a0, a1 = a & 0xFFFF, a >> 16
  b0, b1 = b & 0xFFFF, b >> 16
  t = a0 * b0
  u = a1 * b0 + (t >> 16)
  w = a0 * b1 + (u & 0xFFFF)
  return a1 * b1 + (u >> 16) + (w >> 16)


def mul_wide(x: jax.Array, m_lo: jax.Array, m_hi: jax.Array):
  """``int64(x) * m`` mod 2^64 as ``(hi, lo)`` uint32, for int32 ``x`` (sign-extended) and ``m = (m_hi, m_lo)``."""
  a = lax.bitcast_convert_type(x, jnp.uint32)
  neg = lax.bitcast_convert_type(x >> 31, jnp.uint32)  # 0 or 0xFFFFFFFF: the high word of int64(x)
  hi = mul_hi(a, m_lo) + a * m_hi + neg * m_lo
  return hi, a * m_lo


def floor_mod(hi: jax.Array, lo: jax.Array, size: jax.Array):
  """``h mod size`` (floor modulo, in ``[0, size)``) of the signed 64-bit ``h = (hi, lo)`` and an int32
  ``size >= 1``, as int32. A negative ``h`` uses ``h mod V = V - 1 - ((~h) mod V)`` (``~h = -h - 1 >= 0``);
  the unsigned remainder is a bit-serial long division (63 steps: ``~h`` and a non-negative ``h`` have
  bit 63 clear), whose partial remainder stays below ``V < 2^31``, so ``2r + 1`` fits 32 bits."""
  v = lax.bitcast_convert_type(size, jnp.uint32)
  neg = (hi >> 31) == 1
  hi = jnp.where(neg, ~hi, hi)
  lo = jnp.where(neg, ~lo, lo)
  r = None
  for word, top in ((hi, 30), (lo, 31)):
    for bit in range(top, -1, -1):
      r = (word >> bit) & 1 if r is None else (r << 1) | ((word >> bit) & 1)
      r = jnp.where(r >= v, r - v, r)
  r = jnp.where(neg, v - 1 - r, r)
  return lax.bitcast_convert_type(r, jnp.int32)


def engram_hash(ngram_token_ids: jax.Array, multipliers: jax.typing.ArrayLike, vocab_sizes: jax.typing.ArrayLike,
                offsets: jax.Array):
  """N-gram hash indices (docs/engram.md, "Hash"): ``(T, N)`` int32 ids, int64 ``(L, N)`` multipliers (any form
  :func:`split_multipliers` accepts), ``(L, N-1, E)`` int32 sizes, ``(L, (N-1)E)`` int32 offsets ->
  ``(L, T, (N-1)E)`` int32: ``int32(h_n mod V[l, n-1, j]) + offsets[l, (n-1)E + j]`` with
  ``h_n = XOR_{i <= n} int64(ids[t, i]) * mult[l, i]`` (wrap-around, floor-mod; sizes must be >= 1)."""
  ids = jnp.asarray(ngram_token_ids).astype(jnp.int32)
  m = split_multipliers(multipliers)
  sizes = jnp.asarray(vocab_sizes).astype(jnp.int32)
  offsets = jnp.asarray(offsets).astype(jnp.int32)
  num_layers, n1, e = sizes.shape
  cols = []
  hi = lo = None
  for n in range(n1 + 1):
    p_hi, p_lo = mul_wide(ids[None, :, n], m[:, n, 0][:, None], m[:, n, 1][:, None])  # (L, T)
    hi, lo = (p_hi, p_lo) if n == 0 else (hi ^ p_hi, lo ^ p_lo)
    if n > 0:
      cols.append(floor_mod(hi[..., None], lo[..., None], sizes[:, n - 1, None, :]))  # (L, T, E)
  if not cols:
    return jnp.zeros((num_layers, ids.shape[0], 0), jnp.int32)
  return jnp.concatenate(cols, axis=-1) + offsets[:, None, :]


# ----------------------------------------------------------------------------------------------
# Gate.

def _compute_dtype(x):
  return jnp.promote_types(x.dtype, jnp.float32)


def fused_weight(weight_hidden: jax.Array, weight_embed: jax.Array):
  """``f32(w_h) · f32(w_e)`` (docs/engram.md, "Gate"; exact for bf16 weights); float64 weights give float64."""
  dt = jnp.promote_types(jnp.promote_types(weight_hidden.dtype, weight_embed.dtype), jnp.float32)
  return weight_hidden.astype(dt) * weight_embed.astype(dt)


def _scalar(d, dt):
  return jnp.asarray(np.float64(d) ** -0.5, dt)


def signed_sqrt(d: jax.Array, clamp_value: float):
  """``sqrt(max(|d|, c))·sign(d)``: upstream's reference (0 at ``d = 0``); the clamp as ``where(|d| >= c, ...)``."""
  a = jnp.abs(d)
  return jnp.sqrt(jnp.where(a >= clamp_value, a, jnp.asarray(clamp_value, d.dtype))) * jnp.sign(d)


def engram_gate_fwd(hidden_states: jax.Array, k: jax.Array, v: jax.Array, weight_fused: jax.Array, *, eps: float,
                    clamp_value: float, save_for_backward: bool = True):
  """Gate forward (docs/engram.md, "Gate") on ``(T, M, D)`` x, k, ``(T, D)`` v and ``(M, D)`` weight_fused -> EngramGateOutput."""
  dt = _compute_dtype(hidden_states)
  d = hidden_states.shape[-1]
  x, kf, vf, wf = (a.astype(dt) for a in (hidden_states, k, v, weight_fused))
  rstd_x = lax.rsqrt(jnp.sum(x * x, axis=-1) / d + jnp.asarray(eps, dt))
  rstd_k = lax.rsqrt(jnp.sum(kf * kf, axis=-1) / d + jnp.asarray(eps, dt))
  raw = jnp.sum(x * wf * kf, axis=-1)
  dot = raw * rstd_x * rstd_k * _scalar(d, dt)
  gate = jax.nn.sigmoid(signed_sqrt(dot, clamp_value))
  out = (x + gate[..., None] * vf[..., None, :]).astype(hidden_states.dtype)
  if not save_for_backward:
    return EngramGateOutput(out, None, None, None, None)
  return EngramGateOutput(out, raw, gate, rstd_x, rstd_k)


def gate_factor(dldg: jax.Array, dot: jax.Array, gate_score: jax.Array, rstd_x: jax.Array, rstd_k: jax.Array,
                clamp_value: float, d: int):
  """``G = (∂L/∂d)·s·rx·rk`` (docs/engram.md, "Gate"), 0 where ``|raw|·s·rx·rk < c`` (no division by zero at ``raw = 0``)."""
  dt = dldg.dtype
  sc = _scalar(d, dt) * rstd_x * rstd_k
  a = jnp.abs(dot)
  active = a * _scalar(d, dt) * rstd_x * rstd_k >= clamp_value
  safe = jnp.where(active, a, jnp.ones_like(a))
  return jnp.where(active, dldg * gate_score * (1 - gate_score) * 0.5 * jnp.sqrt(sc / safe), jnp.zeros_like(a))


def token_ranges(num_tokens: int, num_partials: int):
  """``(per, P)``: partial ``p`` sums tokens ``[p·per, min((p+1)·per, T))`` with ``per = ceil(T/P)``."""
  return -(-num_tokens // num_partials) if num_tokens else 0, num_partials


def engram_gate_bwd(grad_out: jax.Array, hidden_states: jax.Array, k: jax.Array, v: jax.Array, weight_fused: jax.Array,
                    dot: jax.Array, gate_score: jax.Array, rstd_x: jax.Array, rstd_k: jax.Array, *, clamp_value: float,
                    num_partials: int | None = None):
  """Gate backward (docs/engram.md, "Gate") -> EngramGateGrads; ``grad_w_partial`` has ``num_partials`` rows (default 132),
  row ``p`` the token range of :func:`token_ranges`."""
  p = DEFAULT_NUM_PARTIALS if num_partials is None else num_partials
  dt = _compute_dtype(hidden_states)
  t, m, d = hidden_states.shape
  go, x, kf, vf, wf = (a.astype(dt) for a in (grad_out, hidden_states, k, v, weight_fused))
  dot, gate_score, rstd_x, rstd_k = (a.astype(dt) for a in (dot, gate_score, rstd_x, rstd_k))
  dldg = jnp.sum(go * vf[:, None, :], axis=-1)
  big_g = gate_factor(dldg, dot, gate_score, rstd_x, rstd_k, clamp_value, d)[..., None]
  cx = (dot * rstd_x * rstd_x / d)[..., None]
  ck = (dot * rstd_k * rstd_k / d)[..., None]
  grad_x = (go + big_g * (kf * wf - x * cx)).astype(hidden_states.dtype)
  grad_k = (big_g * (x * wf - kf * ck)).astype(k.dtype)
  grad_v = go[:, 0] * gate_score[:, 0, None]
  for j in range(1, m):
    grad_v = grad_v + go[:, j] * gate_score[:, j, None]
  per, _ = token_ranges(t, p)
  terms = big_g * x * kf
  if t == 0:
    partial = jnp.zeros((p, m, d), dt)
  else:
    terms = jnp.pad(terms, ((0, p * per - t), (0, 0), (0, 0)))
    partial = jnp.sum(terms.reshape(p, per, m, d), axis=1)
  return EngramGateGrads(grad_x, grad_k, grad_v.astype(v.dtype), partial)


def grad_w_reduce(grad_w_partial: jax.Array, weight_hidden: jax.Array, weight_embed: jax.Array,
                  grad_weight_hidden: jax.Array, grad_weight_embed: jax.Array):
  """``gwf = Σ_p partial[p]``; returns ``(acc_h + gwf·w_e, acc_e + gwf·w_h)`` (functional; docs/engram.md, "Gate")."""
  dt = grad_weight_hidden.dtype
  gwf = jnp.sum(grad_w_partial.astype(dt), axis=0)
  return EngramWeightGrads(grad_weight_hidden + gwf * weight_embed.astype(dt),
                           grad_weight_embed + gwf * weight_hidden.astype(dt))


def engram_gate(hidden_states: jax.Array, k: jax.Array, v: jax.Array, weight_hidden: jax.Array, weight_embed: jax.Array,
                *, clamp_value: float, eps: float):
  """The gate (docs/engram.md, "The trainable gate"; upstream ``engram_gate_ref``) on ``[*, M, D]`` x, k and ``[*, D]`` v, written for
  plain autodiff: ``x + σ(signed_sqrt(<x·w_h, k·w_e>·rx·rk·s))·v``, computed in
  ``promote(x.dtype, float32)``, returned in ``x.dtype``."""
  dt = _compute_dtype(hidden_states)
  d = hidden_states.shape[-1]
  x, kf, vf, wh, we = (a.astype(dt) for a in (hidden_states, k, v, weight_hidden, weight_embed))
  rstd_x = lax.rsqrt(jnp.mean(x * x, axis=-1) + jnp.asarray(eps, dt))
  rstd_k = lax.rsqrt(jnp.mean(kf * kf, axis=-1) + jnp.asarray(eps, dt))
  raw = jnp.sum((x * wh) * (kf * we), axis=-1)
  gate = jax.nn.sigmoid(signed_sqrt(raw * rstd_x * rstd_k * _scalar(d, dt), clamp_value))
  return (x + gate[..., None] * vf[..., None, :]).astype(hidden_states.dtype)


engram_hash_ref = engram_hash
engram_gate_ref = engram_gate

"""jaxkern.reference.engram checked independently: the hash against Python-int arithmetic, the gate against a
numpy float64 transcription of the formulas (docs/engram.md), the hand-written backward against
autodiff of the composite reference in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern.reference import engram as ref


def python_hash(ids, mult, sizes, offsets):
  """The hash (docs/engram.md) with Python ints: int64 wrap-around products and XOR, floor modulo, int32 offset add."""
  num_layers, n1, e = sizes.shape
  out = np.zeros((num_layers, ids.shape[0], n1 * e), np.int64)
  for l in range(num_layers):
    for t in range(ids.shape[0]):
      h = 0
      for n in range(n1 + 1):
        h ^= (int(ids[t, n]) * int(mult[l, n])) % 2**64
        if n:
          signed = h - 2**64 if h >= 2**63 else h
          for j in range(e):
            out[l, t, (n - 1) * e + j] = signed % int(sizes[l, n - 1, j]) + int(offsets[l, (n - 1) * e + j])
  return ((out + 2**31) % 2**32 - 2**31).astype(np.int32)


def hash_inputs(rng, t, n=3, num_layers=2, e=8, full_range=True):
  if full_range:  # negative and huge ids, multipliers anywhere in int64, sizes up to 2^31 - 1
    ids = rng.integers(-2**31, 2**31, (t, n), dtype=np.int64).astype(np.int32)
    mult = rng.integers(-2**63, 2**63, (num_layers, n), dtype=np.int64)
    sizes = rng.integers(1, 2**31, (num_layers, n - 1, e), dtype=np.int64).astype(np.int32)
    sizes.flat[:2] = (1, 2**31 - 1)
  else:  # upstream's test distribution
    ids = rng.integers(0, 100000, (t, n), dtype=np.int32)
    mult = rng.integers(0, 100000, (num_layers, n), dtype=np.int64)
    sizes = rng.integers(100000, 1000000, (num_layers, n - 1, e), dtype=np.int32)
  return ids, mult, sizes


@pytest.mark.parametrize("full_range", [True, False])
def test_hash_against_python_ints(full_range):
  rng = np.random.default_rng(1 + full_range)
  ids, mult, sizes = hash_inputs(rng, 40, full_range=full_range)
  offsets = np.asarray(ref.make_offsets(sizes))
  want = python_hash(ids, mult, sizes, offsets)
  np.testing.assert_array_equal(np.asarray(jax.jit(ref.engram_hash)(ids, ref.split_multipliers(mult), sizes,
                                                                    offsets)), want)
  # every multiplier form gives the same words
  words = np.asarray(ref.split_multipliers(mult))
  np.testing.assert_array_equal(words, mult.view(np.uint32).reshape(*mult.shape, 2))
  np.testing.assert_array_equal(np.asarray(ref.split_multipliers(mult.astype(np.uint64))), words)
  np.testing.assert_array_equal(np.asarray(ref.split_multipliers([[int(v) for v in r] for r in mult])), words)
  np.testing.assert_array_equal(np.asarray(ref.split_multipliers(mult.view(np.uint32).reshape(2, 3, 2))), words)


def test_hash_against_numpy_uint64():
  """Non-negative hashes (the upstream distribution, multipliers >= 2^31): numpy uint64 arithmetic."""
  rng = np.random.default_rng(3)
  ids = rng.integers(0, 2**31, (64, 3), dtype=np.int64).astype(np.int32)
  mult = rng.integers(2**31, 2**62, (2, 3), dtype=np.int64)
  sizes = rng.integers(100000, 2**31, (2, 2, 8), dtype=np.int64).astype(np.int32)
  offsets = np.asarray(ref.make_offsets(sizes))
  prod = ids.astype(np.uint64)[None] * mult.astype(np.uint64)[:, None]  # wraps mod 2^64
  h1 = prod[..., 0] ^ prod[..., 1]
  h2 = h1 ^ prod[..., 2]
  cols = [h % sizes[:, i].astype(np.uint64)[:, None, :] for i, h in enumerate((h1[..., None], h2[..., None]))]
  signed = [np.where(h >= 2**63, 1, 0) for h in (h1, h2)]
  got = np.asarray(ref.engram_hash(ids, mult, sizes, offsets))
  want = np.concatenate(cols, -1).astype(np.int64) + offsets[:, None]
  keep = np.repeat(np.stack(signed, -1) == 0, 8, axis=-1)  # uint64 % equals floor-mod only for h < 2^63
  assert keep.mean() > 0.3
  np.testing.assert_array_equal(got[keep], want.astype(np.int32)[keep])


def test_make_offsets():
  sizes = np.random.default_rng(0).integers(1, 1000, (3, 2, 5)).astype(np.int32)
  want = np.concatenate([np.zeros((3, 1), np.int64), np.cumsum(sizes.reshape(3, -1), 1)[:, :-1]], 1)
  got = ref.make_offsets(sizes)
  assert got.dtype == jnp.int32 and got.shape == (3, 10)
  np.testing.assert_array_equal(np.asarray(got), want)


def gate_inputs(key, t, m, d, dtype=jnp.bfloat16, weight_dtype=None):
  ks = jax.random.split(key, 5)
  x, k = (jax.random.normal(kk, (t, m, d)).astype(dtype) for kk in ks[:2])
  v = jax.random.normal(ks[2], (t, d)).astype(dtype)
  wh, we = (jax.random.normal(kk, (m, d)).astype(weight_dtype or dtype) for kk in ks[3:])
  return x, k, v, wh, we


def numpy_gate(x, k, v, wf, eps, c):
  x, k, v, wf = (np.asarray(a, np.float64) for a in (x, k, v, wf))
  d = x.shape[-1]
  rx = 1 / np.sqrt((x * x).sum(-1) / d + eps)
  rk = 1 / np.sqrt((k * k).sum(-1) / d + eps)
  raw = (x * wf * k).sum(-1)
  dd = raw * rx * rk / np.sqrt(d)
  g = 1 / (1 + np.exp(-np.sqrt(np.maximum(np.abs(dd), c)) * np.sign(dd)))
  return x + g[..., None] * v[:, None], raw, g, rx, rk


def test_gate_fwd_against_numpy(key):
  x, k, v, wh, we = gate_inputs(key, 24, 4, 256)
  wf = ref.fused_weight(wh, we)
  assert wf.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(wf), np.asarray(wh, np.float32) * np.asarray(we, np.float32))
  got = ref.engram_gate_fwd(x, k, v, wf, eps=1e-20, clamp_value=1e-6)
  want = numpy_gate(x, k, v, wf, 1e-20, 1e-6)
  assert got.output.dtype == jnp.bfloat16 and got.dot.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got.output, np.float32), want[0], rtol=2**-8, atol=1e-2)
  for a, b in zip(got[1:], want[1:]):
    np.testing.assert_allclose(np.asarray(a), b, rtol=2e-5)
  comp = ref.engram_gate(x, k, v, wh, we, clamp_value=1e-6, eps=1e-20)
  assert np.mean(np.asarray(comp, np.float32) == np.asarray(got.output, np.float32)) > 0.99
  no_save = ref.engram_gate_fwd(x, k, v, wf, eps=1e-20, clamp_value=1e-6, save_for_backward=False)
  assert no_save[1:] == (None,) * 4


def numpy_gate_bwd(go, x, k, v, wf, raw, g, rx, rk, c, p):
  go, x, k, v, wf = (np.asarray(a, np.float64) for a in (go, x, k, v, wf))
  raw, g, rx, rk = (np.asarray(a, np.float64) for a in (raw, g, rx, rk))
  t, m, d = x.shape
  s = d ** -0.5
  dldg = (go * v[:, None]).sum(-1)
  active = np.abs(raw) * s * rx * rk >= c
  big_g = np.where(active, dldg * g * (1 - g) * 0.5 * np.sqrt(s * rx * rk / np.where(active, np.abs(raw), 1)), 0)
  big_g = big_g[..., None]
  gx = go + big_g * (k * wf - x * (raw * rx * rx / d)[..., None])
  gk = big_g * (x * wf - k * (raw * rk * rk / d)[..., None])
  gv = (go * g[..., None]).sum(1)
  per = -(-t // p)
  part = np.zeros((p, m, d))
  for i in range(p):
    part[i] = (big_g * x * k)[i * per:(i + 1) * per].sum(0)
  return gx, gk, gv, part


def test_gate_bwd_against_numpy(key):
  x, k, v, wh, we = gate_inputs(key, 21, 4, 256)
  wf = ref.fused_weight(wh, we)
  x = x.at[3].multiply(0)  # raw = 0: G = 0 (no division by zero)
  saved = ref.engram_gate_fwd(x, k, v, wf, eps=1e-20, clamp_value=1e-6)
  go = jax.random.normal(jax.random.fold_in(key, 9), x.shape).astype(jnp.bfloat16)
  got = ref.engram_gate_bwd(go, x, k, v, wf, *saved[1:], clamp_value=0.05, num_partials=4)  # clamp active
  want = numpy_gate_bwd(go, x, k, v, wf, *saved[1:], 0.05, 4)
  assert got.grad_w_partial.shape == (4, 4, 256)
  for a, b in zip(got, want):
    assert np.all(np.isfinite(np.asarray(a, np.float32)))
    np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=1e-2, atol=1e-2 * np.abs(b).max())
  active = np.abs(np.asarray(saved.dot)) * 256**-0.5 * np.asarray(saved.rstd_x * saved.rstd_k) >= 0.05
  assert 0.1 < active.mean() < 0.9  # both branches taken


@pytest.mark.parametrize("t, p", [(21, 4), (3, 8), (0, 4)])
def test_hand_written_backward_equals_autodiff_float64(key, t, p):
  """engram_gate_bwd + grad_w_reduce (the references) equal jax.vjp of the composite engram_gate in float64."""
  with jax.enable_x64(True):
    x, k, v, wh, we = gate_inputs(key, t, 4, 64, jnp.float64)
    c = 0.05
    out, vjp = jax.vjp(lambda *a: ref.engram_gate(*a, clamp_value=c, eps=1e-20), x, k, v, wh, we)
    go = jax.random.normal(jax.random.fold_in(key, 1), out.shape, jnp.float64)
    want = vjp(go)
    wf = ref.fused_weight(wh, we)
    saved = ref.engram_gate_fwd(x, k, v, wf, eps=1e-20, clamp_value=c)
    np.testing.assert_allclose(np.asarray(saved.output), np.asarray(out), rtol=1e-14, atol=1e-14)
    gx, gk, gv, part = ref.engram_gate_bwd(go, x, k, v, wf, *saved[1:], clamp_value=c, num_partials=p)
    zeros = jnp.zeros((4, 64), jnp.float64)
    gwh, gwe = ref.grad_w_reduce(part, wh, we, zeros, zeros)
    for a, b in zip((gx, gk, gv, gwh, gwe), want):
      assert a.dtype == jnp.float64 and a.shape == b.shape
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)


def test_grad_w_reduce_accumulates(key):
  ks = jax.random.split(key, 5)
  part = jax.random.normal(ks[0], (8, 4, 256))
  wh, we = (jax.random.normal(kk, (4, 256)).astype(jnp.bfloat16) for kk in ks[1:3])
  ah, ae = (jax.random.normal(kk, (4, 256)) for kk in ks[3:])
  gh, ge = ref.grad_w_reduce(part, wh, we, ah, ae)
  s = np.asarray(part, np.float64).sum(0)
  np.testing.assert_allclose(np.asarray(gh), np.asarray(ah) + s * np.asarray(we, np.float64), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ge), np.asarray(ae) + s * np.asarray(wh, np.float64), rtol=1e-5, atol=1e-5)

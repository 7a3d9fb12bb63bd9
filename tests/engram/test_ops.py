"""jaxkern.engram ops: kernels in interpret mode vs the references (bitwise where upstream is exact,
else upstream's calc_diff tolerances), H100 lowering, argument checks, zero tokens."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkern
from jaxkern import engram
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern.engram import _gate
from jaxkern.reference import engram as ref
from jaxkern.testing import assert_bitwise_equal, assert_diff_below, capture_mosaic_modules, lower_for_h100
from tests.engram.test_reference import gate_inputs, hash_inputs, python_hash

sds = jax.ShapeDtypeStruct


@pytest.mark.parametrize("t, full_range", [(300, True), (37, False)])
def test_hash_bit_exact_every_implementation(t, full_range):
  rng = np.random.default_rng(t)
  ids, mult, sizes = hash_inputs(rng, t, full_range=full_range)
  offsets = engram.make_offsets(jnp.asarray(sizes))
  want = python_hash(ids[:12], mult, sizes, np.asarray(offsets))
  for impl in ("pallas", "xla", "auto", "reference"):  # no kernel: XLA code (native int64) or the reference
    got = jax.jit(lambda i, s, o: engram.engram_hash(i, mult, s, o, implementation=impl))(ids, sizes, offsets)
    assert_bitwise_equal(got, ref.engram_hash(ids, mult, sizes, offsets))
    assert_bitwise_equal(got[:, :12], want)
  d = jaxkern.explain(lambda i: engram.engram_hash(i, mult, sizes, offsets, implementation="pallas"), ids)
  assert d[0].path == "xla" and "no Pallas kernel" in d[0].reason


def test_hash_multiplier_forms_and_traced_words():
  rng = np.random.default_rng(5)
  ids, mult, sizes = hash_inputs(rng, 20)
  offsets = ref.make_offsets(sizes)
  want = ref.engram_hash(ids, mult, sizes, offsets)
  words = engram.split_multipliers(mult)
  for m in (mult, mult.astype(np.uint64), [[int(v) for v in r] for r in mult], np.asarray(words)):
    assert_bitwise_equal(engram.engram_hash(ids, m, sizes, offsets, implementation="reference"), want)
  traced = jax.jit(lambda w: engram.engram_hash(ids, w, sizes, offsets, implementation="interpret"))(words)
  assert_bitwise_equal(traced, want)
  with jax.enable_x64(True):
    for impl in ("reference", "xla"):  # the caller's x64 on
      assert_bitwise_equal(engram.engram_hash(ids, jnp.asarray(mult), sizes, offsets, implementation=impl), want)


def test_hash_zero_tokens_and_offsets():
  sizes = jnp.full((2, 2, 8), 100000, jnp.int32)
  out = engram.engram_hash(jnp.zeros((0, 3), jnp.int32), np.ones((2, 3), np.int64), sizes,
                           engram.make_offsets(sizes), implementation="interpret")
  assert out.shape == (2, 0, 16) and out.dtype == jnp.int32
  assert_bitwise_equal(engram.make_offsets(sizes), ref.make_offsets(sizes))


@pytest.mark.parametrize("args, match", [
    ((jnp.zeros((4, 3), jnp.int64 if jax.config.jax_enable_x64 else jnp.float32), np.ones((2, 3), np.int64),
      jnp.ones((2, 2, 8), jnp.int32), jnp.zeros((2, 16), jnp.int32)), "ngram_token_ids must have dtype"),
    ((jnp.zeros((4, 3), jnp.int32), np.ones((2, 4), np.int64), jnp.ones((2, 2, 8), jnp.int32),
      jnp.zeros((2, 16), jnp.int32)), "multipliers must have shape"),
    ((jnp.zeros((4, 3), jnp.int32), jnp.ones((2, 3), jnp.int32), jnp.ones((2, 2, 8), jnp.int32),
      jnp.zeros((2, 16), jnp.int32)), "multipliers as a jax array"),
    ((jnp.zeros((4, 3), jnp.int32), np.ones((2, 3)), jnp.ones((2, 2, 8), jnp.int32),
      jnp.zeros((2, 16), jnp.int32)), "multipliers must hold integers"),
    ((jnp.zeros((4, 3), jnp.int32), np.ones((2, 3), np.int64), jnp.ones((2, 3, 8), jnp.int32),
      jnp.zeros((2, 16), jnp.int32)), "vocab_sizes must have shape"),
    ((jnp.zeros((4, 3), jnp.int32), np.ones((2, 3), np.int64), jnp.ones((2, 2, 8), jnp.int32),
      jnp.zeros((2, 8), jnp.int32)), "offsets must have shape"),
    ((jnp.zeros((4, 3), jnp.int32), [[2**64, 1, 1], [1, 1, 1]], jnp.ones((2, 2, 8), jnp.int32),
      jnp.zeros((2, 16), jnp.int32)), r"multipliers must lie in"),
])
def test_hash_bad_inputs(args, match):
  with pytest.raises(ValueError, match=match):
    engram.engram_hash(*args)


def test_fused_weight_bit_exact(key):
  _, _, _, wh, we = gate_inputs(key, 1, 4, 512)
  got = engram.fused_weight(wh, we, implementation="interpret")
  assert_bitwise_equal(got, jnp.asarray(np.asarray(wh, np.float32) * np.asarray(we, np.float32)))


def _fwd(x, k, v, wf, save, implementation="interpret", eps=1e-20, clamp=1e-6):
  return jax.jit(lambda *a: engram.engram_gate_fwd(*a, eps=eps, clamp_value=clamp, save_for_backward=save,
                                                   implementation=implementation))(x, k, v, wf)


# M = 4: one warp per stream where the flat kernel would need vectors narrower than 16 bytes (512, 2560), the flat
# kernel with 16-byte vectors (4096: M·D above PRELOAD_MAX_VALUES, stream by stream, one reduction per stream); M = 3:
# the flat kernel, 2560 a 2048-column 16-byte chunk + a 512-column 8-byte one, M·D <= PRELOAD_MAX_VALUES (2560,
# preloaded, three reductions per stream) or not (3584); the TMA kernel from D = 6144
# (test_gate_fwd_tma_kernel_matches_flat). Bit for bit on exact inputs: test_gate_fwd_flat_kernel_bit_exact
@pytest.mark.parametrize("t, m, d", [(5, 4, 512), (3, 4, 2560), (2, 4, 4096), (3, 3, 2560), (2, 3, 3584)])
def test_gate_fwd_kernel(key, t, m, d):
  assert _gate.fwd_rows_applies(d, m) == (m == 4 and d in (512, 2560))
  x, k, v, wh, we = gate_inputs(key, t, m, d)
  wf = engram.fused_weight(wh, we)
  got = _fwd(x, k, v, wf, True)
  want = ref.engram_gate_fwd(x, k, v, wf, eps=1e-20, clamp_value=1e-6)
  for a, b in zip(got, want):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert_diff_below(a, b, 2e-10)
  assert np.mean(np.asarray(got.output, np.float32) == np.asarray(want.output, np.float32)) > 0.98
  no_save = _fwd(x, k, v, wf, False)
  assert no_save[1:] == (None,) * 4
  assert_bitwise_equal(no_save.output, got.output)  # bit-identical with and without the saved intermediates


# The rows kernel's token ranges: 7 tokens in 1 CTA (one range), 3 (3, 3, 1: ragged), 4 (2, 2, 2, 1), 7 (one token
# each); 5 tokens in 4 CTAs (2, 2, 1, and an empty range)
@pytest.mark.parametrize("t, ctas", [(7, 1), (7, 3), (7, 4), (7, 7), (5, 4)])
def test_gate_fwd_rows_kernel_token_ranges(key, t, ctas):
  assert _gate.fwd_rows_ctas(t) == t  # T below the CTA count: one token per CTA by default
  x, k, v, wh, we = gate_inputs(key, t, 4, 512)
  wf = engram.fused_weight(wh, we)
  got = _gate.gate_fwd_rows_kernel(x, k, v, wf, eps=1e-20, clamp_value=1e-6, save=True, num_ctas=ctas,
                                   interpret=plgpu.InterpretGPUParams())
  want = _fwd(x, k, v, wf, True)  # the default: fwd_rows_ctas(t) CTAs
  for a, b in zip(got, want):
    assert_bitwise_equal(a, b)


# The TMA kernel against the flat kernel (one token per CTA): 7 tokens over 3 CTAs (3, 3, 1) and 4 (2, 2, 2, 1), 5
# over 4 (2, 2, 1 and an empty range), 2 tokens in one CTA with 3 streams (units wrap the 2-slot ring mid-token) and
# D = 2560 in two chunks (16- and 8-byte vectors). All with M·D <= PRELOAD_MAX_VALUES: the flat kernel's other form
# (one reduction of a (3, n) block per stream) sums in XLA's order in interpret mode, not in the TMA kernel's.
@pytest.mark.parametrize("t, m, d, ctas", [(7, 4, 1024, 3), (7, 4, 1024, 4), (5, 4, 1024, 4), (2, 3, 2560, 1),
                                           (3, 3, 512, 2)])
def test_gate_fwd_tma_kernel_matches_flat(key, t, m, d, ctas):
  x, k, v, wh, we = gate_inputs(key, t, m, d)
  wf = engram.fused_weight(wh, we)
  for save in (True, False):
    kw = dict(eps=1e-20, clamp_value=1e-6, save=save, interpret=plgpu.InterpretGPUParams())
    got = _gate.gate_fwd_tma_kernel(x, k, v, wf, num_ctas=ctas, **kw)
    want = _gate.gate_fwd_flat_kernel(x, k, v, wf, **kw)
    assert len(got) == len(want) == (5 if save else 1)
    for a, b in zip(got, want):
      assert_bitwise_equal(a, b)


def exact_fwd_inputs(key, t, m, d):
  """Forward inputs on which every row sum is exact in any order (integer ``x``, ``k`` in [-2, 2] and ``wf`` in
  [-3, 3]), so that a kernel gives the reference's bits where it computes the same formulas from the sums; ``v``
  any bf16."""
  ks = jax.random.split(key, 4)
  x, k = (jax.random.randint(kk, (t, m, d), -2, 3).astype(jnp.bfloat16) for kk in ks[:2])
  v = jax.random.normal(ks[2], (t, d)).astype(jnp.bfloat16)
  wf = jax.random.randint(ks[3], (m, d), -3, 4).astype(jnp.float32)
  return x, k, v, wf


# The flat kernel bit for bit as the reference on exact inputs, both forms, with and without the saved
# intermediates: M·D above PRELOAD_MAX_VALUES (stream by stream, one cross-warp reduction per stream, x and v as
# packed bf16): D = 3072, 4096 at M = 4 (one 16-byte chunk), 3584 at M = 3 (a 16- and an 8-byte chunk); at or below
# it (preloaded, three reductions per stream): 2048 at M = 4 and 2. The saved rows: M-wide vectors at the token's end
# (M = 4, 2: in interpret mode from every thread, _gate._store_rows_all_threads), else scalars (M = 3).
@pytest.mark.parametrize("t, m, d", [(2, 4, 3072), (2, 4, 4096), (2, 3, 3584), (3, 4, 2048), (3, 2, 2048)])
def test_gate_fwd_flat_kernel_bit_exact(key, t, m, d):
  assert not _gate.fwd_rows_applies(d, m) and not _gate.fwd_tma_applies(d)  # the flat kernel
  assert (m * d > _gate.PRELOAD_MAX_VALUES) == (d != 2048)
  x, k, v, wf = exact_fwd_inputs(key, t, m, d)
  saved = ref.engram_gate_fwd(x, k, v, wf, eps=1e-20, clamp_value=1e-6)
  dd = np.abs(np.asarray(saved.dot * saved.rstd_x * saved.rstd_k)) * np.float32(np.float64(d) ** -0.5)
  clamp = float(np.median(dd))  # active for about half the (token, stream) pairs
  assert np.all(dd > 0)  # raw = ±0 (copysign against sign) nowhere
  for save in (True, False):
    got = _fwd(x, k, v, wf, save, clamp=clamp)
    want = ref.engram_gate_fwd(x, k, v, wf, eps=1e-20, clamp_value=clamp, save_for_backward=save)
    assert len(got) == len(want)
    for name, a, b in zip(got._fields, got, want):
      if b is None:
        assert a is None, name
      else:
        assert_bitwise_equal(a, b, name)
  assert 0 < np.mean(dd >= clamp) < 1


def test_gate_fwd_kernel_choice():
  assert not _gate.fwd_rows_applies(7168, 4) and _gate.fwd_tma_applies(7168) and _gate.fwd_tma_applies(6144)
  assert not _gate.fwd_tma_applies(4096) and not _gate.fwd_tma_applies(2048)  # the flat kernel below 6144
  assert _gate.fwd_tma_applies(9216) and not _gate.fwd_tma_applies(10240)  # 2 CTAs per SM fit up to ~9500


def test_gate_fwd_signed_sqrt_at_zero(key):
  """raw = ±0 (a zero row): the kernel's copysign gives σ(±sqrt(c)), the reference's sign 0.5
  (docs/engram.md, "Gate")."""
  x, k, v, wh, we = gate_inputs(key, 2, 4, 256)
  x = x.at[0, 1].set(0).at[1, 2].set(0)
  wf = engram.fused_weight(wh, we)
  got, want = _fwd(x, k, v, wf, True, clamp=1e-2), ref.engram_gate_fwd(x, k, v, wf, eps=1e-20, clamp_value=1e-2)
  assert float(got.gate_score[0, 1]) == pytest.approx(1 / (1 + np.exp(-0.1)), rel=1e-6)
  assert float(want.gate_score[0, 1]) == 0.5 and float(got.dot[0, 1]) == 0.0


def _bwd_inputs(key, t, d, clamp, m=4):
  x, k, v, wh, we = gate_inputs(key, t, m, d)
  wf = engram.fused_weight(wh, we)
  saved = ref.engram_gate_fwd(x, k, v, wf, eps=1e-20, clamp_value=clamp)
  go = jax.random.normal(jax.random.fold_in(key, 7), x.shape).astype(jnp.bfloat16)
  return (go, x, k, v, wf, *saved[1:])


def _median_clamp(key, t, d, m=4):
  """A clamp just above the median ``|d|`` of :func:`_bwd_inputs`' data (the same key gives the same data)."""
  _, x, k, v, wf, dot, _, rx, rk = _bwd_inputs(key, t, d, 1e-6, m)
  return float(np.median(np.abs(np.asarray(dot * rx * rk, np.float64))) * d**-0.5) * 1.0001


# fused (one pass, D <= FUSED_MAX_D in 16-byte vectors): 1024 / 2048 / 3072 in 1024-column steps. One pass for large
# D (the ring kernel: two warpgroups, one half of every row each, rows staged in SMEM by TMA): 4096 (two 1024-column
# blocks per half: chunks of 2 tokens, 1), 6144 (three; p > t). Two-pass: 5120 (16-byte vectors above FUSED_MAX_D,
# halves of 2560 columns), 2560 (8-byte vectors), 512, 768 (4-byte vectors), all with the row pass one warp per
# stream; M = 3: the flat row pass, M·D above PRELOAD_MAX_VALUES. Token chunks of 3 tokens, 1, 5; p > t: empty chunks
# write zeros.
@pytest.mark.parametrize("t, d, p, m, kernel", [
    (2, 3072, 4, 4, "fused"), (5, 1024, 1, 4, "fused"), (3, 2048, 3, 4, "fused"), (3, 4096, 2, 4, "ring"),
    (2, 6144, 3, 4, "ring"), (2, 5120, 3, 4, "two_pass"), (7, 512, 3, 4, "two_pass"), (4, 768, 2, 4, "two_pass"),
    (2, 2560, 4, 4, "two_pass"), (2, 3584, 2, 3, "two_pass")])
def test_gate_bwd_kernel(key, t, d, p, m, kernel):
  assert _gate.fused_applies(d, m) == (kernel == "fused")
  assert (_gate.onepass_applies(d, m) and not _gate.fused_applies(d, m)) == (kernel == "ring")
  clamp = _median_clamp(key, t, d, m)  # the clamp is active for about half the (token, stream) pairs
  args = _bwd_inputs(key, t, d, clamp, m)
  got = jax.jit(lambda *a: engram.engram_gate_bwd(*a, clamp_value=clamp, num_partials=p,
                                                  implementation="interpret"))(*args)
  want = ref.engram_gate_bwd(*args, clamp_value=clamp, num_partials=p)
  for name, a, b in zip(got._fields, got, want):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert_diff_below(a, b, 1e-8)
    if name != "grad_w_partial":  # same formulas, other summation orders: nearly all values bit-identical
      assert np.mean(np.asarray(a, np.float32) == np.asarray(b, np.float32)) > 0.95, name
  # each chunk's partial is its own token range's sum (not only the total)
  np.testing.assert_allclose(np.asarray(got.grad_w_partial), np.asarray(want.grad_w_partial), rtol=1e-4, atol=1e-4)
  if p > t:
    assert not np.any(np.asarray(got.grad_w_partial)[t:])
  active = np.abs(np.asarray(args[5])) * d**-0.5 * np.asarray(args[7] * args[8]) >= clamp
  assert 0 < active.mean() < 1


def exact_bwd_inputs(key, t, d, m=4):
  """Backward inputs on which every sum is exact in any order, so that a kernel gives the reference's bits:
  integer ``go``, ``v``, ``x``, ``k`` (``Σ go·v`` exact), ``rx``, ``rk`` in {1/2, 1, 2}, ``gate`` in {1/4, 1/2,
  3/4} and ``|dot| = s·rx·rk / 4^n`` (``s = fp32(D^-1/2)``, ``n`` in {0, 1}), so that ``G = dldg·g(1-g)/2·2^n``
  is a short binary fraction and so is every ``G·x·k``; ``dot = 0`` for about a third of the (token, stream) pairs
  (``G = 0``). ``wf`` is any float32 (it only enters products that both sides round alike). Returns the
  arguments of :func:`jaxkern.engram.engram_gate_bwd` and a clamp at the median of the nonzero ``|d|`` (active for
  about half of those pairs too)."""
  ks = jax.random.split(key, 9)
  go, x, k = (jax.random.randint(kk, (t, m, d), -2, 3).astype(jnp.bfloat16) for kk in ks[:3])
  v = jax.random.randint(ks[3], (t, d), -2, 3).astype(jnp.bfloat16)
  wf = jax.random.normal(ks[4], (m, d), jnp.float32)

  def pick(kk, values):
    return jnp.asarray(values, jnp.float32)[jax.random.randint(kk, (t, m), 0, len(values))]

  rx, rk = pick(ks[5], [0.5, 1.0, 2.0]), pick(ks[6], [0.5, 1.0, 2.0])
  gate = pick(ks[7], [0.25, 0.5, 0.75])
  s = np.float32(np.float64(d) ** -0.5)
  scale = pick(ks[8], [1.0, 0.25, -1.0, -0.25, 0.0, 0.0])
  dot = s * rx * rk * scale
  dd = np.abs(np.asarray(dot)) * s * np.asarray(rx) * np.asarray(rk)
  return (go, x, k, v, wf, dot, gate, rx, rk), float(np.median(dd[dd > 0]))


# The ring kernel (large D, one pass) on exact inputs: every output bit for bit as the reference's. 5 tokens over 2
# CTAs (3 and 2: go / v / x / k slots refilled across tokens, nb = 2 column blocks per half, 2 x / k slots), 7 over
# 1 (the mbarriers' phases wrap many times), D = 6144 (nb = 3: the x / k units wrap the 2-slot ring mid-token), 2
# tokens over 3 CTAs (an empty range writes zeros).
@pytest.mark.parametrize("t, d, p", [(5, 4096, 2), (7, 4096, 1), (5, 6144, 1), (2, 6144, 3)])
def test_gate_bwd_ring_kernel_bit_exact(key, t, d, p):
  assert _gate.onepass_applies(d, 4) and not _gate.fused_applies(d, 4)
  args, clamp = exact_bwd_inputs(key, t, d)
  got = jax.jit(lambda *a: engram.engram_gate_bwd(*a, clamp_value=clamp, num_partials=p,
                                                  implementation="interpret"))(*args)
  want = ref.engram_gate_bwd(*args, clamp_value=clamp, num_partials=p)
  for name in ("grad_hidden_states", "grad_k", "grad_v"):
    assert_bitwise_equal(getattr(got, name), getattr(want, name), name)
  # the partials: equal values; a zero's sign may differ (the kernel's sums start from +0, the reference's sum of
  # one token keeps a -0 term)
  assert got.grad_w_partial.dtype == want.grad_w_partial.dtype and got.grad_w_partial.shape == (p, 4, d)
  np.testing.assert_array_equal(np.asarray(got.grad_w_partial), np.asarray(want.grad_w_partial))
  big_g = np.asarray(ref.gate_factor(jnp.sum(args[0].astype(jnp.float32) * args[3].astype(jnp.float32)[:, None],
                                             axis=-1), *args[5:], clamp, d))
  assert 0 < np.mean(big_g != 0) < 1 and np.any(np.asarray(got.grad_w_partial)[: min(p, t)] != 0)


@pytest.mark.parametrize("m", [4, 3])  # one warp per stream; the flat row pass
def test_gate_bwd_row_pass_factors(key, m):
  """The row pass alone: ``[g, G, raw·rx²/D, raw·rk²/D]`` per (token, stream) vs the reference's formulas."""
  clamp = _median_clamp(key, 3, 2560, m)
  go, x, k, v, wf, dot, gate, rx, rk = _bwd_inputs(key, 3, 2560, clamp, m)
  got = _gate.gate_bwd_rows_kernel(go, v, dot, gate, rx, rk, clamp_value=clamp,
                                   interpret=plgpu.InterpretGPUParams())
  dldg = jnp.sum(go.astype(jnp.float32) * v.astype(jnp.float32)[:, None], axis=-1)
  big_g = ref.gate_factor(dldg, dot, gate, rx, rk, clamp, 2560)
  assert_bitwise_equal(got[..., 0], gate)
  np.testing.assert_allclose(np.asarray(got[..., 1]), np.asarray(big_g), rtol=2e-5, atol=1e-5 * float(jnp.max(jnp.abs(big_g))))
  np.testing.assert_allclose(np.asarray(got[..., 2]), np.asarray(dot * rx * rx / 2560), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(got[..., 3]), np.asarray(dot * rk * rk / 2560), rtol=1e-6)
  assert np.any(np.asarray(big_g) == 0) and np.any(np.asarray(big_g) != 0)


def test_gate_preload_threshold_splits_the_tested_widths():
  assert 3 * 2560 <= _gate.PRELOAD_MAX_VALUES < 3 * 3584  # the flat kernels' tests (M = 3) run both loading orders


def test_gate_bwd_default_partials():
  assert _gate.column_block(7168) == 1024 and _gate.column_block(2560) == 512 and _gate.column_block(768) == 256
  assert [_gate.fused_block(d) for d in (512, 1024, 1536, 2560, 7168)] == [None, 1024, 1536, 2560, 1024]
  # fused: the persistent grid, as many (M, D) float32 accumulators per SM as fit (at most the cap), at most T
  assert _gate.fused_ctas_per_sm(3072, 4) == min(4, _gate.FUSED_MAX_CTAS_PER_SM)
  assert _gate.default_num_partials(8001, 3072) == _gate.fused_ctas_per_sm(3072, 4) * 132
  assert _gate.default_num_partials(40, 2048) == 40
  assert _gate.default_num_partials(8001, 2048) == _gate.fused_ctas_per_sm(2048, 4) * 132
  assert _gate.default_num_partials(0, 2048) == 1
  # one pass for large D (the ring kernel, where its SMEM fits one CTA): one CTA per SM, at most T
  widths = (2048, 2560, 4096, 5120, 6144, 7168, 8192)
  assert [d for d in widths if _gate.onepass_applies(d, 4)] == [2048, 4096, 6144]  # 2048: the fused kernel first
  assert not _gate.onepass_applies(4096, 3) and not _gate.onepass_applies(4096, 8)
  assert _gate.ring_smem_bytes(6144, 4) <= _gate.SMEM_PER_SM - 1024 < _gate.ring_smem_bytes(8192, 4)
  assert _gate.default_num_partials(8001, 6144) == _gate.default_num_partials(4001, 4096) == 132
  assert _gate.default_num_partials(40, 6144) == 40 and _gate.default_num_partials(0, 4096) == 1
  assert _gate.default_num_partials(40, 8192) == 3  # 8192: two-pass (the ring does not fit)
  # two-pass: column blocks x token chunks
  assert _gate.default_num_partials(8001, 7168) == 8 * 132 // 7 == 150  # 7 column blocks x 150 chunks
  assert _gate.default_num_partials(40, 7168) == 3
  assert _gate.default_num_partials(8001, 2560) == 8 * 132 // 5  # 2560: two-pass (8-byte vectors)
  assert _gate.default_num_partials(2001, 7168) == -(-2001 // 16) == 126  # 16 tokens per chunk at least
  s = jnp.zeros((0, 4))
  x = jnp.zeros((0, 4, 7168), jnp.bfloat16)
  g = engram.engram_gate_bwd(x, x, x, x[:, 0], jnp.ones((4, 7168)), s, s, s, s, clamp_value=1e-6,
                             implementation="pallas")
  assert g.grad_w_partial.shape == (1, 4, 7168) and not np.any(g.grad_w_partial)


def test_gate_zero_tokens():
  x = jnp.zeros((0, 4, 512), jnp.bfloat16)
  v, wf, s = jnp.zeros((0, 512), jnp.bfloat16), jnp.ones((4, 512)), jnp.zeros((0, 4))
  out = engram.engram_gate_fwd(x, x, v, wf, eps=1e-6, clamp_value=1e-6, implementation="pallas")
  assert out.output.shape == (0, 4, 512) and out.dot.shape == (0, 4)
  g = engram.engram_gate_bwd(x, x, x, v, wf, s, s, s, s, clamp_value=1e-6, num_partials=8, implementation="pallas")
  assert g.grad_v.shape == (0, 512) and g.grad_w_partial.shape == (8, 4, 512) and not np.any(g.grad_w_partial)


def _bwd_kernel_calls(t, d, m):
  """The Mosaic GPU kernels in ``engram_gate_bwd``'s lowering for an H100 (1 for a one-pass kernel, 2 for two)."""
  b16, f32 = (sds((t, m, d), jnp.bfloat16), sds((t, m), jnp.float32))
  args = (b16, b16, b16, sds((t, d), jnp.bfloat16), sds((m, d), jnp.float32), f32, f32, f32, f32)
  f = functools.partial(engram.engram_gate_bwd, clamp_value=1e-6, implementation="pallas")
  return lower_for_h100(f, *args).as_text().count("custom_call @mosaic_gpu")


# fwd: one warp per stream (2560, 768), the flat kernel (2048, 6144, 7168, m = 3); bwd: fused (2048), one pass for
# large D (6144), two-pass (7168, 2560, 768; flat row pass with m = 3)
@pytest.mark.parametrize("t, d, m, bwd_kernels", [(4001, 2048, 4, 1), (8001, 7168, 4, 2), (4001, 2560, 4, 2),
                                                  (8001, 6144, 4, 1), (1, 768, 4, 2), (4001, 7168, 3, 2)])
def test_gate_kernels_lower_for_h100(t, d, m, bwd_kernels):
  b16 = sds((t, m, d), jnp.bfloat16)
  args = (b16, b16, sds((t, d), jnp.bfloat16), sds((m, d), jnp.float32))
  for save in (True, False):
    f = functools.partial(engram.engram_gate_fwd, eps=1e-20, clamp_value=1e-6, save_for_backward=save,
                          implementation="pallas")
    assert "mosaic_gpu" in lower_for_h100(f, *args).as_text()
  assert _bwd_kernel_calls(t, d, m) == bwd_kernels


# The flat kernel's two forms lowered for an H100 through the op, both save values: above PRELOAD_MAX_VALUES (D =
# 3072, 4096 at M = 4) each stream's three sums in one cross-warp reduction (a barrier pair: 2·M bar.sync per
# token), at or below it (2048) in three (6·M).
@pytest.mark.parametrize("t, d, bar_syncs", [(8001, 3072, 8), (4001, 4096, 8), (8001, 4096, 8), (8001, 2048, 24)])
def test_gate_fwd_flat_kernel_forms_lower_for_h100(monkeypatch, t, d, bar_syncs):
  assert not _gate.fwd_rows_applies(d, 4) and not _gate.fwd_tma_applies(d)
  modules = capture_mosaic_modules(monkeypatch)
  b16 = sds((t, 4, d), jnp.bfloat16)
  for save in (True, False):
    f = functools.partial(engram.engram_gate_fwd, eps=1e-20, clamp_value=1e-6, save_for_backward=save,
                          implementation="pallas")
    lower_for_h100(f, b16, b16, sds((t, d), jnp.bfloat16), sds((4, d), jnp.float32))
  assert [module.count("bar.sync") for module in modules] == [bar_syncs] * 2


def _thread_branches(module, n):
  """``(line, body)`` of each ``scf.if`` of a lowered Mosaic GPU module (text) whose condition is ``thread index % n
  == 0`` (the inline Mosaic GPU stores of one thread per warpgroup, ``n = 128``, or lane 0 per warp, ``n = 32``):
  the line of the ``scf.if`` and the lines of its region."""
  lines = module.splitlines()
  defs = {m.group(1): m.group(2) for m in (re.match(r"\s*(%\w+) = (.*)", line) for line in lines) if m}
  found = []
  for a, line in enumerate(lines):
    head = re.match(r"(\s*)scf\.if (%\w+) \{$", line)
    cond = head and re.match(r"arith\.cmpi eq, (%\w+), %c0_i32", defs.get(head.group(2), ""))
    if cond and re.match(rf"arith\.remui %\w+, %c{n}_i32", defs.get(cond.group(1), "")):
      end = next(b for b in range(a + 1, len(lines)) if lines[b].startswith(head.group(1) + "}"))
      found.append((a, lines[a + 1:end]))
  return found


def _fwd_modules_with_and_without_save(monkeypatch, t, m, d):
  """The Mosaic modules of ``engram_gate_fwd`` lowered for an H100 at ``(T, M, D)``, with and without ``save``."""
  modules = capture_mosaic_modules(monkeypatch)
  b16 = sds((t, m, d), jnp.bfloat16)
  for save in (True, False):
    f = functools.partial(engram.engram_gate_fwd, eps=1e-20, clamp_value=1e-6, save_for_backward=save,
                          implementation="pallas")
    lower_for_h100(f, b16, b16, sds((t, d), jnp.bfloat16), sds((m, d), jnp.float32))
  return modules


# The flat kernel's saved intermediates lowered for an H100 through the op (D = 2048 preloaded; 3072, 4096 stream by
# stream): at M = 4 and 2 one M-wide float32 vector store per saved array, four in all, all inside one branch of
# thread 0 of the warpgroup (_gate._store_saved_rows), and no scalar store; at M = 3 each stream's four scalars by
# every thread. None of these at save=False.
@pytest.mark.parametrize("t, m, d", [(4001, 4, 2048), (8001, 4, 3072), (4001, 4, 4096), (64, 2, 2048), (64, 3, 2048)])
def test_gate_fwd_flat_kernel_saved_stores_lower_for_h100(monkeypatch, t, m, d):
  assert not _gate.fwd_rows_applies(d, m) and not _gate.fwd_tma_applies(d)
  with_save, without = _fwd_modules_with_and_without_save(monkeypatch, t, m, d)
  vector_store = re.compile(rf"llvm\.store %\w+, %\w+ : vector<{m}xf32>, !llvm\.ptr")
  branches = _thread_branches(with_save, 128)
  if _gate.saved_rows_apply(m):
    assert len(branches) == 1
    assert sum(bool(vector_store.search(line)) for line in branches[0][1]) == 4
    assert len(vector_store.findall(with_save)) == 4 and "memref.store" not in with_save
  else:
    assert not branches and not vector_store.search(with_save)
    assert with_save.count("memref.store") == 4 * m and f"memref<{t}x{m}xf32>" in with_save
  assert not _thread_branches(without, 128) and not vector_store.search(without) and "memref.store" not in without


# The rows kernel's saved intermediates lowered for an H100 through the op (D = 2560 and 512, M = 4 and 8): stored by
# lane 0 of each warp (_gate._store_rows_lane0: one branch, a scalar store per saved array and row of the warp's),
# after the token's output stores; none at save=False.
@pytest.mark.parametrize("t, m, d", [(4001, 4, 2560), (8001, 4, 2560), (64, 8, 512)])
def test_gate_fwd_rows_kernel_saved_stores_lower_for_h100(monkeypatch, t, m, d):
  assert _gate.fwd_rows_applies(d, m)
  with_save, without = _fwd_modules_with_and_without_save(monkeypatch, t, m, d)
  (line, body), = _thread_branches(with_save, 32)
  stores = [s for s in body if "memref.store" in s]
  assert len(stores) == 4 * (m // 4) and all(f"memref<{t}x{m}xf32>" in s for s in stores)
  assert with_save.count("memref.store") == len(stores) and ": vector<1xf32>, !llvm.ptr" not in with_save
  outputs = [a for a, s in enumerate(with_save.splitlines()) if re.search(r"llvm\.store .* : vector<8xbf16>", s)]
  assert outputs and max(outputs) < line  # after the output stores
  assert not _thread_branches(without, 32) and "memref.store" not in without


def test_gate_fwd_flat_kernel_lowers_for_h100():
  """The flat kernel, the forward where the TMA kernel's ring does not fit 2 CTAs per SM."""
  b16 = sds((3, 4, 10240), jnp.bfloat16)
  f = functools.partial(_gate.gate_fwd_flat_kernel, eps=1e-20, clamp_value=1e-6, save=True, interpret=False)
  args = (b16, b16, sds((3, 10240), jnp.bfloat16), sds((4, 10240), jnp.float32))
  assert "mosaic_gpu" in lower_for_h100(f, *args).as_text()


@pytest.mark.parametrize("t, d", [(8001, 6144), (8001, 4096), (4001, 4096)])
def test_gate_bwd_ring_kernel_lowers_for_h100(monkeypatch, t, d):
  """The large-D one-pass backward is the ring kernel (three / two column blocks per half, tokens over one CTA per
  SM): one Mosaic kernel, its rows brought by bulk TMA copies, its SMEM as :func:`_gate.ring_smem_bytes` counts it
  (within one CTA's)."""
  ring, calls = _gate.gate_bwd_ring_kernel, []
  monkeypatch.setattr(_gate, "gate_bwd_ring_kernel", lambda *a, **kw: calls.append(a[1].shape) or ring(*a, **kw))
  modules = capture_mosaic_modules(monkeypatch)
  assert _bwd_kernel_calls(t, d, 4) == 1
  assert calls == [(t, 4, d)] and len(modules) == 1
  assert "cp.async.bulk.shared::cta.global" in modules[0]
  smem = _gate.ring_smem_bytes(d, 4)
  assert f"dynamic_shared_memory_size %c{smem}_i32" in modules[0] and smem <= _gate.SMEM_PER_SM - 1024


def test_gate_unsupported_runs_xla():
  x = jnp.zeros((2, 4, 320), jnp.bfloat16)
  with pytest.raises(jaxkern.KernelUnavailableError, match="multiple of 256"):
    engram.engram_gate_fwd(x, x, x[:, 0], jnp.ones((4, 320)), eps=0.0, clamp_value=1e-6, implementation="interpret")
  d = jaxkern.explain(lambda *a: engram.engram_gate_fwd(*a, eps=0.0, clamp_value=1e-6, implementation="xla"),
                      x, x, x[:, 0], jnp.ones((4, 320)))
  assert d[0].path == "xla"
  x9, s9 = jnp.zeros((2, 9, 256), jnp.bfloat16), jnp.zeros((2, 9))
  with pytest.raises(jaxkern.KernelUnavailableError, match="hc_mult 9 > 8"):
    engram.engram_gate_bwd(x9, x9, x9, x9[:, 0], jnp.ones((9, 256)), s9, s9, s9, s9, clamp_value=1e-6,
                           implementation="interpret")


@pytest.mark.parametrize("x_dtype, wf_dtype, says", [
    (jnp.float32, jnp.float32, ": hidden_states, k, v are float32 (the kernels take bfloat16). Use"),
    (jnp.bfloat16, jnp.bfloat16, ": weight_fused is bfloat16 (the kernels take float32). Use"),
    (jnp.float16, jnp.bfloat16, ": hidden_states, k, v are float16 (the kernels take bfloat16); weight_fused is bfloat16"),
])
def test_gate_unsupported_dtypes_name_the_arguments(x_dtype, wf_dtype, says):
  x, wf, s = jnp.zeros((2, 4, 256), x_dtype), jnp.ones((4, 256), wf_dtype), jnp.zeros((2, 4))
  with pytest.raises(jaxkern.KernelUnavailableError, match=re.escape(says)):
    engram.engram_gate_fwd(x, x, x[:, 0], wf, eps=0.0, clamp_value=1e-6, implementation="interpret")
  says_bwd = says.replace(": hidden_states", ": grad_out, hidden_states")  # grad_out has the dtype of x
  with pytest.raises(jaxkern.KernelUnavailableError, match=re.escape(says_bwd)):
    engram.engram_gate_bwd(x, x, x, x[:, 0], wf, s, s, s, s, clamp_value=1e-6, implementation="interpret")


def test_gate_bwd_unsupported_saved_dtype_names_it():
  x, s = jnp.zeros((2, 4, 256), jnp.bfloat16), jnp.zeros((2, 4))
  with pytest.raises(jaxkern.KernelUnavailableError, match=re.escape("rstd_x is bfloat16 (the kernel takes float32")):
    engram.engram_gate_bwd(x, x, x, x[:, 0], jnp.ones((4, 256)), s, s, s.astype(jnp.bfloat16), s, clamp_value=1e-6,
                           implementation="interpret")


B16 = jnp.zeros((2, 4, 256), jnp.bfloat16)
V16 = jnp.zeros((2, 256), jnp.bfloat16)
WF = jnp.ones((4, 256))


@pytest.mark.parametrize("args, kw, match", [
    ((B16[0], B16, V16, WF), {}, "hidden_states must have rank 3"),
    ((B16, B16[:, :3], V16, WF), {}, "k must have shape"),
    ((B16, B16, V16[:1], WF), {}, "v must have shape"),
    ((B16, B16, V16, WF[:3]), {}, "weight_fused must have shape"),
    ((B16.astype(jnp.int32), B16, V16, WF), {}, "hidden_states must have dtype"),
    ((B16, B16.astype(jnp.float32), V16, WF), {}, "k must have the dtype"),
    ((B16, B16, V16, WF), dict(eps=-1.0), "eps must be"),
    ((B16, B16, V16, WF), dict(clamp_value="x"), "clamp_value must be"),
])
def test_gate_fwd_bad_inputs(args, kw, match):
  kw = dict(dict(eps=1e-6, clamp_value=1e-6), **kw)
  with pytest.raises(ValueError, match=match):
    engram.engram_gate_fwd(*args, **kw)


def test_gate_bwd_bad_inputs():
  s = jnp.zeros((2, 4))
  with pytest.raises(ValueError, match="dot must have shape"):
    engram.engram_gate_bwd(B16, B16, B16, V16, WF, s[:1], s, s, s, clamp_value=1e-6)
  with pytest.raises(ValueError, match="num_partials"):
    engram.engram_gate_bwd(B16, B16, B16, V16, WF, s, s, s, s, clamp_value=1e-6, num_partials=0)
  with pytest.raises(ValueError, match="grad_w_partial must have shape"):
    engram.grad_w_reduce(jnp.zeros((3, 4, 128)), WF, WF, WF, WF)
  with pytest.raises(ValueError, match=r"weight_embed must have shape .* \(the shape of weight_hidden\)"):
    engram.fused_weight(WF, WF[:2])


def test_grad_w_reduce_matches_reference(key):
  ks = jax.random.split(key, 5)
  part = jax.random.normal(ks[0], (132, 4, 512))
  wh, we = (jax.random.normal(kk, (4, 512)).astype(jnp.bfloat16) for kk in ks[1:3])
  ah, ae = (jax.random.normal(kk, (4, 512)) for kk in ks[3:])
  got = engram.grad_w_reduce(part, wh, we, ah, ae, implementation="interpret")
  for a, b in zip(got, ref.grad_w_reduce(part, wh, we, ah, ae)):
    assert_diff_below(a, b, 1e-10)


def test_building_blocks_refuse_grad(key):
  x, k, v, wh, we = gate_inputs(key, 2, 4, 256)
  wf = engram.fused_weight(wh, we)
  with pytest.raises(jaxkern.NotDifferentiableError, match="engram_gate_fwd"):
    jax.grad(lambda x: engram.engram_gate_fwd(x, k, v, wf, eps=1e-6, clamp_value=1e-6,
                                              implementation="reference").output.astype(jnp.float32).sum())(x)


@pytest.mark.gpu
@pytest.mark.parametrize("t, d", [(4001, 2048), (8001, 7168), (4001, 2560)])
def test_spec_shapes_gpu(key, t, d):
  args = _bwd_inputs(key, t, d, 1e-6)
  go, x, k, v, wf = args[:5]
  got = engram.engram_gate_fwd(x, k, v, wf, eps=1e-20, clamp_value=1e-6, implementation="pallas")
  want = ref.engram_gate_fwd(x, k, v, wf, eps=1e-20, clamp_value=1e-6)
  for a, b in zip(got, want):
    assert_diff_below(a, b, 2e-10)
  g = engram.engram_gate_bwd(*args, clamp_value=1e-6, implementation="pallas")
  for a, b in zip(g, ref.engram_gate_bwd(*args, clamp_value=1e-6, num_partials=g.grad_w_partial.shape[0])):
    assert_diff_below(a, b, 1e-8)

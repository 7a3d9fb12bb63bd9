import functools
from fractions import Fraction

import chex
import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from jax.experimental import checkify

from jaxkern import moe
from jaxkern.reference import moe as ref
from jaxkern.testing import assert_bitwise_equal, capture_mosaic_modules, lower_for_h100, moe_topk_idx, randn
from jaxkern.types import QuantTensor
from tests.moe.routing_checks import assert_checks_compile_away, checkify_error


def _inputs(key, tokens, num_topk, experts, ranks, hidden, dtype):
  """Upstream's test inputs: more rows than referenced, mapping with alignment 1."""
  k1, k2, k3, k4 = jax.random.split(key, 4)
  idx = moe_topk_idx(k1, tokens, num_topk, experts, ranks)
  pos = moe.get_fused_mapping(jnp.asarray(idx), experts, 0, 1).token_topk_to_pos
  t = idx.shape[0]
  x = randn(k2, (t * num_topk, hidden), dtype)
  w = jax.random.uniform(k3, (t, num_topk), jnp.float32)
  x_sf = randn(k4, (t * num_topk,), jnp.float32)
  return x, w, pos, x_sf


def _reduce(*args, **kwargs):
  out = moe.reduce_fused(*args, **kwargs)
  assert_bitwise_equal(out, ref.reduce_fused(*args, **kwargs))
  return out


@pytest.mark.parametrize("weights, in_dtype, fp8, use_x_sf", [
    (True, jnp.float32, False, False), (True, jnp.bfloat16, True, True), (False, jnp.float32, True, True),
    (True, jnp.bfloat16, False, True), (True, jnp.float32, True, False)])
def test_variants_bit_exact(key, weights, in_dtype, fp8, use_x_sf):
  x, w, pos, x_sf = _inputs(key, 1, 6, 9, 8, 256, in_dtype)
  sf = jax.random.normal(key, (1,), jnp.float32) if fp8 else None
  out = _reduce((x, x_sf) if use_x_sf else x, w if weights else None, pos, fp8_format="e4m3" if fp8 else "", sf=sf)
  assert out.shape == (pos.shape[0], 256)
  assert out.dtype == (jnp.float8_e4m3fn if fp8 else in_dtype)


@pytest.mark.parametrize("num_topk, experts, ranks", [(1, 1, 1), (2, 72, 1), (9, 32, 8), (7, 288, 1)])
def test_spec_grid(key, num_topk, experts, ranks):
  x, w, pos, x_sf = _inputs(key, 1 if ranks > 1 else 4, num_topk, experts, ranks, 768, jnp.bfloat16)
  _reduce((x, x_sf), w, pos)


def test_tiling_with_several_chunks_and_token_tail(key):
  """H = 8448 (> 8192) splits rows into two chunks; 5 tokens leave a ragged token block."""
  x = randn(key, (12, 8448), jnp.float32)
  pos = jnp.asarray(np.random.default_rng(1).integers(-1, 12, (5, 9)).astype(np.int32))
  w = jax.random.uniform(key, (5, 9), jnp.float32)
  _reduce(x, w, pos)


def test_empty_rows_and_zero_sign(key):
  """Rows without a valid slot give +0, times sf: -0 for a negative sf."""
  x = randn(key, (4, 256), jnp.float32)
  pos = jnp.array([[-1, -1], [0, 3], [-1, 2]], jnp.int32)
  out = _reduce(x, None, pos, fp8_format="e4m3", sf=jnp.array([-2.0], jnp.float32))
  assert np.signbit(np.asarray(out[0], np.float32)).all() and (np.asarray(out[0], np.float32) == 0).all()
  out = _reduce(x, None, pos)
  assert not np.signbit(np.asarray(out[0])).any()


def test_fp8_saturates(key):
  x = jnp.full((2, 256), 256.0, jnp.float32).at[1].set(jnp.nan)
  pos = jnp.array([[0, 0], [1, -1], [0, -1]], jnp.int32)
  out = np.asarray(_reduce(x, None, pos, fp8_format="e4m3", sf=jnp.array([-1.0], jnp.float32)), np.float32)
  assert (out[0] == -448).all() and np.isnan(out[1]).all() and (out[2] == -256).all()


def test_zero_tokens():
  out = moe.reduce_fused(jnp.ones((4, 256), jnp.bfloat16), None, jnp.zeros((0, 2), jnp.int32))
  assert out.shape == (0, 256) and out.dtype == jnp.bfloat16


@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**30), tokens=st.integers(1, 6), num_topk=st.integers(1, 9),
                  rows=st.integers(1, 20), scale=st.sampled_from([1e-30, 1.0, 1e30]))
def test_random_positions(seed, tokens, num_topk, rows, scale):
  """Arbitrary (even repeated) positions and weights over a wide range of magnitudes."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray((rng.standard_normal((rows, 256)) * scale).astype(np.float32))
  pos = jnp.asarray(rng.integers(-1, rows, (tokens, num_topk)).astype(np.int32))
  w = jnp.asarray(rng.standard_normal((tokens, num_topk)).astype(np.float32))
  _reduce(x, w, pos)


def test_round_trip_through_identity_experts(key):
  """get_fused_mapping -> expand -> identity experts -> reduce with normalised weights ~ x."""
  idx = moe_topk_idx(key, 2, 6, 9, 8)
  t = idx.shape[0]
  m = moe.get_fused_mapping(jnp.asarray(idx), 9, 0, 16)
  x = randn(key, (t, 256), jnp.float32)
  w = jnp.where(jnp.asarray(idx) >= 0, jax.random.uniform(key, idx.shape, jnp.float32) + 0.1, 0)
  w = w / w.sum(axis=1, keepdims=True)
  out = moe.reduce_fused(moe.expand_to_fused(x, m.token_topk_to_pos, m.pos_to_expert), w, m.token_topk_to_pos)
  np.testing.assert_allclose(np.asarray(out), np.asarray(x), rtol=1e-6, atol=1e-6)


def test_reference_fma_is_single_rounding():
  rng = np.random.default_rng(0)
  a, b, c = (rng.standard_normal(4000).astype(np.float32) * rng.choice([1e-10, 1, 1e10], 4000).astype(np.float32)
             for _ in range(3))
  a[:3], b[:3], c[:3] = [1 + 2**-23, 1 + 2**-23, 1.0], [1 - 2**-23, 1 + 2**-12, 2.0**-60], [-1.0, 0.0, -0.0]
  got = np.asarray(jax.jit(ref.fma)(a, b, c))
  for ai, bi, ci, gi in zip(a, b, c, got):
    exact = Fraction(float(ai)) * Fraction(float(bi)) + Fraction(float(ci))
    lo = np.nextafter(gi, np.float32(-np.inf))
    hi = np.nextafter(gi, np.float32(np.inf))
    assert abs(Fraction(float(gi)) - exact) <= min(abs(Fraction(float(lo)) - exact), abs(Fraction(float(hi)) - exact))


@pytest.mark.parametrize("args, kwargs, match", [
    ((jnp.ones((4, 200), jnp.float32), None, jnp.zeros((2, 2), jnp.int32)), {}, r"x.shape\[1\] must be a multiple of 256"),
    ((jnp.ones((4, 256), jnp.float16), None, jnp.zeros((2, 2), jnp.int32)), {}, "x must have dtype"),
    ((jnp.ones((4, 256)), jnp.ones((2, 3)), jnp.zeros((2, 2), jnp.int32)), {}, "topk_weights must have shape"),
    ((jnp.ones((4, 256)), None, np.zeros((2, 2), np.int64)), {}, "token_topk_to_pos must have dtype"),
    ((jnp.ones((4, 256)), None, jnp.full((2, 2), 4, jnp.int32)), {}, "token_topk_to_pos must hold"),
    ((jnp.ones((4, 256)), None, jnp.zeros((2, 2), jnp.int32)), dict(fp8_format="e5m2"), "fp8_format"),
    ((jnp.ones((4, 256)), None, jnp.zeros((2, 2), jnp.int32)), dict(sf=jnp.ones((1,))), "sf is only allowed"),
    (((jnp.ones((4, 256)), jnp.ones((3,))), None, jnp.zeros((2, 2), jnp.int32)), {}, "x_sf must have shape"),
])
def test_bad_inputs(args, kwargs, match):
  with pytest.raises(ValueError, match=match):
    moe.reduce_fused(*args, **kwargs)


_LOWER_CASES = [(jnp.float32, ""), (jnp.bfloat16, ""), (jnp.bfloat16, "e4m3"), (jnp.float32, "e4m3")]


@pytest.mark.parametrize("num_topk", [1, 6, 9])
@pytest.mark.parametrize("in_dtype, fp8", _LOWER_CASES, ids=lambda c: getattr(c, "__name__", c))
def test_lowers_for_h100(in_dtype, fp8, num_topk):
  t, hidden = 18000, 7168
  spec = jax.ShapeDtypeStruct
  f = lambda x, w, p, sf=None: moe.reduce_fused(x, w, p, fp8_format=fp8, sf=sf, implementation="pallas")
  args = [(spec((t * num_topk, hidden), in_dtype), spec((t * num_topk,), jnp.float32)),
          spec((t, num_topk), jnp.float32), spec((t, num_topk), jnp.int32)]
  if fp8:
    args.append(spec((1,), jnp.float32))
  assert "mosaic_gpu" in lower_for_h100(f, *args).as_text()
  g = lambda x, p: moe.reduce_fused(x, None, p, implementation="pallas")
  assert "mosaic_gpu" in lower_for_h100(g, args[0][0], args[2]).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [2048, 7168])
@pytest.mark.parametrize("in_dtype, fp8", _LOWER_CASES, ids=lambda c: getattr(c, "__name__", c))
@pytest.mark.parametrize("num_topk, experts, ranks", [(2, 9, 8), (6, 9, 8), (9, 32, 8)])
def test_spec_shapes_fma_bit_exact_gpu(key, num_topk, experts, ranks, in_dtype, fp8, hidden):
  """Bit-exact against the exact-FMA reference: fails if the GPU kernel does not fuse to fma.rn.f32."""
  x, w, pos, x_sf = _inputs(key, 4001, num_topk, experts, ranks, hidden, in_dtype)
  sf = jax.random.normal(key, (1,), jnp.float32) if fp8 else None
  kwargs = dict(fp8_format=fp8, sf=sf)
  want = ref.reduce_fused((x, x_sf), w, pos, **kwargs)
  assert_bitwise_equal(jax.jit(moe.reduce_fused, static_argnames="fp8_format")((x, x_sf), w, pos, **kwargs), want)


def test_lowered_accumulation_is_contractable(monkeypatch):
  """The Mosaic GPU module multiplies and accumulates with ``fastmath<contract>`` (LLVM fuses
  these into ``fma.rn.f32``): the single-rounding FMA upstream's numerics need. Checked on the MLIR
  handed to the Mosaic GPU compiler; the ``gpu`` test checks the resulting bits."""
  import re

  modules = capture_mosaic_modules(monkeypatch)
  spec = jax.ShapeDtypeStruct
  lower_for_h100(lambda x, w, p: moe.reduce_fused(x, w, p, implementation="pallas"),
                 spec((64, 256), jnp.float32), spec((4, 2), jnp.float32), spec((4, 2), jnp.int32))
  muls = re.findall(r"(%\d+) = arith.mulf .* fastmath<contract> : vector<\d+xf32>", modules[-1])
  assert muls
  for m in muls:
    assert re.search(rf"arith.addf {m}, %\d+ fastmath<contract>", modules[-1])


# Bad positions: N = 6 rows; -7 (below -1), 6 and 99 (past N) are unused slots,
# like -1; token 3 names row 2 twice and token 4 shares row 0 with token 0 (summed like any slots).
_BAD_POS = np.array([[0, 6], [1, -7], [99, 5], [2, 2], [0, -1]], np.int32)


@pytest.mark.parametrize("impl", ["interpret", "xla", "reference"])
@pytest.mark.parametrize("use_x_sf", [False, True])
def test_out_of_range_positions_are_unused_slots(key, impl, use_x_sf):
  k1, k2, k3 = jax.random.split(key, 3)
  x, x_sf = randn(k1, (6, 256), jnp.float32), randn(k2, (6,), jnp.float32)
  w = jax.random.uniform(k3, (5, 2), jnp.float32)
  xin = QuantTensor(x, x_sf) if use_x_sf else x
  f = jax.jit(functools.partial(moe.reduce_fused, implementation=impl))
  clean = jnp.asarray(np.where((_BAD_POS >= 0) & (_BAD_POS < 6), _BAD_POS, -1).astype(np.int32))
  got = f(xin, w, jnp.asarray(_BAD_POS))
  assert_bitwise_equal(got, ref.reduce_fused(xin, w, clean))
  s = np.asarray(x_sf) if use_x_sf else np.ones(6, np.float32)
  xs, ws = np.asarray(x), np.asarray(w)
  np.testing.assert_allclose(np.asarray(got[3]), xs[2] * (ws[3, 0] * s[2]) + xs[2] * (ws[3, 1] * s[2]), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(got[2]), xs[5] * (ws[2, 1] * s[5]), rtol=1e-6)


def test_checkify_reports_the_first_bad_slot(key):
  x, w = randn(key, (6, 256), jnp.float32), jnp.ones((5, 2), jnp.float32)
  f = functools.partial(moe.reduce_fused, implementation="interpret")
  msg = checkify_error(f, x, w, jnp.asarray(_BAD_POS))
  assert "reduce_fused: token_topk_to_pos[0, 1] = 6 is outside {-1} ∪ [0, 6)" in msg
  dup = np.array([[0, 1], [2, -1], [3, 4], [5, 2], [-1, -1]], np.int32)
  msg = checkify_error(f, x, w, jnp.asarray(dup))
  assert "reduce_fused: token_topk_to_pos[3, 1] = 2 names the fused row of the earlier slot [1, 0]" in msg
  assert checkify_error(f, x, w, jnp.asarray(np.array([[0, 1], [2, -1], [3, 4], [5, -1], [-1, -1]], np.int32))) is None


@pytest.mark.parametrize("impl", ["interpret", "xla"])
def test_checks_add_nothing_without_checkify(impl):
  spec = jax.ShapeDtypeStruct
  args = (spec((6, 256), jnp.float32), spec((5, 2), jnp.float32), spec((5, 2), jnp.int32))
  f = functools.partial(moe.reduce_fused, implementation=impl)
  assert_checks_compile_away(f, *args)


@pytest.mark.gpu
def test_checks_add_nothing_without_checkify_gpu():
  spec = jax.ShapeDtypeStruct
  args = ((spec((18000 * 6, 7168), jnp.bfloat16), spec((18000 * 6,), jnp.float32)), spec((18000, 6), jnp.float32),
          spec((18000, 6), jnp.int32))
  f = functools.partial(moe.reduce_fused, implementation="pallas")
  assert_checks_compile_away(f, *args)


@pytest.mark.gpu
def test_out_of_range_positions_gpu(key):
  x, x_sf = randn(key, (6, 7168), jnp.bfloat16), randn(key, (6,), jnp.float32)
  w = jax.random.uniform(key, (5, 2), jnp.float32)
  clean = jnp.asarray(np.where((_BAD_POS >= 0) & (_BAD_POS < 6), _BAD_POS, -1).astype(np.int32))
  assert_bitwise_equal(jax.jit(moe.reduce_fused)((x, x_sf), w, jnp.asarray(_BAD_POS)),
                       ref.reduce_fused((x, x_sf), w, clean))


def test_list_and_bool_inputs():
  x = [[float(i)] * 256 for i in range(3)]
  pos = [[0, 2], [1, -1]]
  assert_bitwise_equal(moe.reduce_fused(x, [[1.0, 2.0], [3.0, 0.0]], pos),
                       np.array([[4.0] * 256, [3.0] * 256], np.float32))
  with pytest.raises(ValueError, match="x must have dtype"):
    moe.reduce_fused(jnp.ones((3, 256), bool), None, pos)
  with pytest.raises(TypeError):
    moe.reduce_fused(jnp.ones((3, 256)), None, pos, "e4m3")


def test_no_retrace(key):
  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(x, w, pos):
    return moe.reduce_fused(x, w, pos)

  for seed in range(3):
    rng = np.random.default_rng(seed)
    f(randn(jax.random.key(seed), (6, 256), jnp.float32), jnp.ones((5, 2), jnp.float32),
      jnp.asarray(rng.integers(-1, 6, (5, 2)).astype(np.int32)))


def test_checked_mode_lowers_for_h100():
  spec = jax.ShapeDtypeStruct
  f = lambda x, w, p: moe.reduce_fused(x, w, p, implementation="pallas")
  text = lower_for_h100(checkify.checkify(f, errors=checkify.user_checks), spec((24064, 7168), jnp.bfloat16),
                        spec((4001, 6), jnp.float32), spec((4001, 6), jnp.int32)).as_text()
  assert "mosaic_gpu" in text

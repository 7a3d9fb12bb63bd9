"""swiglu_forward_and_per_channel_cast_and_transpose (docs/quant.md, "Fused SwiGLU"): kernel (interpret mode, under
jit) vs the reference bit for bit on the same backend, the reference vs a float64 numpy formulation (bf16 rounding of
the activation before the cast), argument checks, zero rows, lowering for an H100, the spec grid on a GPU."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxkern
from jaxkern import quant
from jaxkern.quant import _swiglu_per_channel as swpc
from jaxkern.reference import quant as ref
from jaxkern.testing import assert_bitwise_equal, capture_mosaic_modules, hidden_sizes, lower_for_h100
from jaxkern.types import QuantTensor
from tests.quant.test_swiglu import _unreconciled_casts

OP = quant.swiglu_forward_and_per_channel_cast_and_transpose
REF = ref.swiglu_forward_and_per_channel_cast_and_transpose


def _x(key, m, h, scale=4.0):
  """bf16 ``(M, 2h)`` ``randn · scale`` (clamps at 0.5 and 10 both bite), with awkward values: a gate column of
  zeros (an all-zero activation column: amax at the clamp minimum), negative-zero values in a value column
  (signed zero activations), large gates (``exp(-l)`` 0 or inf: ``act = l·r`` or a signed zero) and large
  values."""
  x = scale * jax.random.normal(key, (m, 2 * h), jnp.float32)
  x = x.at[:, 5].set(0.0).at[:, h + 7].set(-0.0)
  x = x.at[3, 9].set(150.0).at[4, 9].set(-150.0).at[5, 10].set(-100.0).at[6, h + 11].set(3e4)
  return x.astype(jnp.bfloat16)


def _assert_same(got, want):
  assert isinstance(got, QuantTensor)
  chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
  assert_bitwise_equal(got.data, want.data)
  assert_bitwise_equal(got.sf, want.sf)


def _run(m, h, npt, without_transpose, round_sf, clamp, key, implementation):
  x = _x(key, m, h)
  kw = dict(round_sf=round_sf, without_transpose=without_transpose, swiglu_clamp_value=clamp)
  got = jax.jit(lambda x: OP(x, "e4m3", npt, **kw, implementation=implementation))(x)
  want = jax.jit(lambda x: REF(x, "e4m3", npt, **kw))(x)
  return x, got, want


# CTAs of two warpgroups (module docstring of jaxkern.quant._swiglu_per_channel): 128 x 64 (npt 32: two groups per
# warpgroup; npt 128: one group over both, maxima merged through SMEM), 64 x 64 at npt 32 without the transpose (one
# group per warpgroup), 32 x 256 there where 256 divides h (one group over both, 8-row TMA steps; 64 x 256, one
# group per warpgroup, from h = swpc._WIDE_ROWS32_MIN_H on: test_kernel_rows32_bit_exact). M % 128 == 0 (the op's
# contract), so M is always a multiple of the CTA rows.
@pytest.mark.parametrize("m, h, npt, without_transpose, round_sf, clamp", [
    (256, 192, 32, False, False, None),  # h = 64·3: 3 x 2 CTAs of 128 x 64, 2 groups per warpgroup
    (256, 192, 128, True, True, 0.5),  # one group over both warpgroups, 32-row chunks on a TMA barrier each
    (256, 192, 32, True, True, None),  # 3 x 4 CTAs of 64 x 64, one group per warpgroup
    (128, 256, 32, True, False, 10.0),  # 32 x 256 CTAs: 1 x 4
    (256, 128, 128, False, True, 10.0),
    (128, 64, 128, False, False, 0.5),  # one 64-column tile
    (384, 128, 32, False, True, 0.5),  # 3 row blocks
    (128, 320, 128, True, False, None),  # h = 64·5
    (128, 128, 32, True, True, 0.3),  # a clamp that is not a bf16 value: applied in float32 (docs/quant.md, Fused SwiGLU)
    (256, 512, 32, True, False, None),  # 32 x 256 CTAs: 2 x 8
])
def test_kernel_bit_exact(key, m, h, npt, without_transpose, round_sf, clamp):
  x, got, want = _run(m, h, npt, without_transpose, round_sf, clamp, key, "interpret")
  _check_kernel_outputs(x, got, want, m, h, npt, without_transpose, round_sf)


def _check_kernel_outputs(x, got, want, m, h, npt, without_transpose, round_sf):
  """``got`` (the kernel) equals ``want`` (the reference) bit for bit, every element written, the awkward columns of
  :func:`_x` as expected."""
  _assert_same(got, want)
  assert got.data.shape == ((m, h) if without_transpose else (h, m)) and got.sf.shape == (m // npt, h)
  data = np.asarray(got.data.astype(jnp.float32))
  data = data if without_transpose else data.T
  assert not np.isnan(data).any()  # every element written (interpret mode fills unwritten memory with NaN)
  sf = np.asarray(got.sf)
  zero_sf = ref.scale_factors(jnp.float32(0.0), ref.FP8_MAX, "e4m3", round_sf)[0]
  # The all-zero activation columns (gate 0, value -0), signed zeros: +0 · r and g · -0.
  assert np.all(sf[:, [5, 7]] == zero_sf) and np.all(data[:, [5, 7]] == 0)
  x_f = np.asarray(x, np.float32)
  assert_bitwise_equal(np.signbit(data[:, 7]), ~np.signbit(x_f[:, 7]))
  assert (sf != zero_sf).sum() == sf.size - 2 * sf.shape[0]


def test_tile_choice():
  """The CTA shape is a function of the shape: without the transpose at npt 32 where 256 divides h, 16 rows x 256
  columns per warpgroup in 8-row TMA steps below swpc._WIDE_ROWS32_MIN_H, 32 rows from there on."""
  assert swpc._WIDE_ROWS32_MIN_H == 4096
  for h in (256, 512, 2048, 2560, 3072):
    assert swpc._tile(h, 32, False) == (16, 256, 8)
  for h in (4096, 6144, 7168):
    assert swpc._tile(h, 32, False) == (32, 256, 8)
  assert swpc._tile(576, 32, False) == (32, 64, 32)  # 256 does not divide h
  assert swpc._tile(7168, 32, True) == (64, 64, 64)
  assert swpc._tile(7168, 128, False) == (64, 64, 32)


# The 64 x 256 CTAs (32 rows per warpgroup, one group each, 8-row TMA steps) of h >= swpc._WIDE_ROWS32_MIN_H at a
# small h: the kernel called with that tile. M = 192 (not a multiple of 128: 3 CTA rows) is outside the op's contract
# but within the kernel's (M a multiple of the CTA rows).
@pytest.mark.parametrize("m, h, round_sf, clamp", [
    (128, 256, False, None), (192, 512, True, 10.0), (256, 256, True, 0.5), (192, 256, False, 0.3),
])
def test_kernel_rows32_bit_exact(key, m, h, round_sf, clamp):
  x = _x(key, m, h)
  got = QuantTensor(*jax.jit(lambda x: swpc._kernel(x, tile=(32, 256, 8), npt=32, round_sf=round_sf,
                                                    transpose_out=False, clamp=clamp, interpret=True))(x))
  want = jax.jit(lambda x: REF(x, "e4m3", 32, round_sf=round_sf, without_transpose=True,
                               swiglu_clamp_value=clamp))(x)
  _check_kernel_outputs(x, got, want, m, h, 32, True, round_sf)


def test_implementations_agree(key):
  x = _x(key, 128, 128)
  outs = [jax.jit(lambda x, i=i: OP(x, "e4m3", 32, swiglu_clamp_value=0.5, implementation=i))(x)
          for i in ("interpret", "xla", "reference")]
  for out in outs[1:]:
    _assert_same(outs[0], out)


def _numpy_act(x, clamp):
  """The activation in float64 numpy (clamp, silu(l)·r), rounded once to bf16 (ml_dtypes, round to nearest
  even)."""
  v = np.asarray(x, np.float64)
  h = v.shape[1] // 2
  left, right = v[:, :h], v[:, h:]
  if clamp is not None:
    left, right = np.minimum(left, clamp), np.clip(right, -clamp, clamp)
  with np.errstate(over="ignore"):
    act = left / (1 + np.exp(-left)) * right
  return act, act.astype(ml_dtypes.bfloat16).astype(np.float64)


def _numpy_cast(v, npt, round_sf):
  """Per-channel e4m3 cast of float64 ``v`` (values exact in float32) in numpy: ``(data float32, sf)``."""
  m, k = v.shape
  a = np.maximum(np.abs(v).reshape(m // npt, npt, k).max(1), np.float64(np.float32(1e-4)))
  sf = (a / 448).astype(np.float32)  # one rounding of the exact quotient
  if round_sf:
    sf = (2.0 ** np.ceil(np.log2(sf.astype(np.float64)))).astype(np.float32)
    inv = (1 / sf.astype(np.float64)).astype(np.float32)
  else:
    inv = (448 / a).astype(np.float32)
  q = (v.astype(np.float32) * np.repeat(inv, npt, 0)).astype(np.float32)
  return np.clip(q, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32), sf


@pytest.mark.parametrize("npt, round_sf, clamp", [(32, False, None), (128, True, 0.5), (32, False, 10.0)])
def test_reference_against_numpy(key, npt, round_sf, clamp):
  """The reference equals a float64 formulation with the activation rounded to bf16 before the cast (ties of the
  float32 and float64 activations at a bf16 rounding boundary aside: at most a handful of elements), and differs
  from the same cast of the unrounded activation."""
  m, h = 256, 256
  x = (4.0 * jax.random.normal(key, (m, 2 * h), jnp.float32)).astype(jnp.bfloat16)
  act, b = _numpy_act(x, clamp)
  q, sf = _numpy_cast(b, npt, round_sf)
  got = jax.jit(lambda x: REF(x, "e4m3", npt, round_sf=round_sf, without_transpose=True,
                              swiglu_clamp_value=clamp))(x)
  got_q, got_sf = np.asarray(got.data.astype(jnp.float32)), np.asarray(got.sf)
  assert (got_q != q).sum() <= 4 and (got_sf != sf).sum() <= 2
  np.testing.assert_allclose(got_sf, sf, rtol=2 ** -7)
  transposed = jax.jit(lambda x: REF(x, "e4m3", npt, round_sf=round_sf, swiglu_clamp_value=clamp))(x)
  assert_bitwise_equal(transposed.data, got.data.T)
  assert_bitwise_equal(transposed.sf, got.sf)
  # Without the bf16 rounding most scales (round_sf: many data) differ: the test sees the rounding.
  q_f32, sf_f32 = _numpy_cast(act.astype(np.float32).astype(np.float64), npt, round_sf)
  if round_sf:
    assert (got_q != q_f32).sum() > 100
  else:
    assert (got_sf != sf_f32).mean() > 0.5


def test_zero_rows():
  x = jnp.zeros((0, 384), jnp.bfloat16)
  for impl in ("interpret", "reference", "xla"):
    out = OP(x, "e4m3", 32, implementation=impl)
    assert out.data.shape == (192, 0) and out.data.dtype == jnp.float8_e4m3fn
    assert out.sf.shape == (0, 192) and out.sf.dtype == jnp.float32
    out = OP(x, "e4m3", 128, without_transpose=True, implementation=impl)
    assert out.data.shape == (0, 192) and out.sf.shape == (0, 192)
  (d,) = jaxkern.explain(lambda x: OP(x, "e4m3", 128, implementation="pallas"), x)
  assert d.path == "xla"


@pytest.mark.parametrize("args, kw, match", [
    ((jnp.ones((128, 256), jnp.float32), "e4m3", 128), {}, "x must have dtype"),
    ((jnp.ones((128, 256), jnp.float16), "e4m3", 128), {}, "x must have dtype"),
    ((jnp.ones((128, 256), jnp.bool_), "e4m3", 128), {}, "x must have dtype"),
    ((jnp.ones((100, 256), jnp.bfloat16), "e4m3", 128), {}, r"x.shape\[0\]"),
    ((jnp.ones((128, 192), jnp.bfloat16), "e4m3", 128), {}, "h % 64"),  # h = 96
    ((jnp.ones((128, 200), jnp.bfloat16), "e4m3", 128), {}, "h % 64"),
    ((jnp.ones((128, 256), jnp.bfloat16), "e4m3", 64), {}, "num_per_tokens"),
    ((jnp.ones((128, 256), jnp.bfloat16), "e4m3", 256), {}, "num_per_tokens"),
    ((jnp.ones((128, 256), jnp.bfloat16), "e2m1", 128), {}, "fmt"),
    ((jnp.ones((2, 128, 256), jnp.bfloat16), "e4m3", 128), {}, "x must have rank 2"),
    (("x", "e4m3", 128), {}, "x must be an array"),
])
def test_bad_inputs(args, kw, match):
  with pytest.raises(ValueError, match=match):
    OP(*args, **kw)


def test_keyword_only_options():
  with pytest.raises(TypeError):
    OP(jnp.ones((128, 256), jnp.bfloat16), "e4m3", 128, True)


def test_not_differentiable(key):
  x = _x(key, 128, 64).astype(jnp.float32)
  loss = lambda x: OP(x.astype(jnp.bfloat16), "e4m3", 32).sf.sum()
  with pytest.raises(jaxkern.NotDifferentiableError, match="swiglu_forward_and_per_channel_cast_and_transpose"):
    jax.jit(jax.grad(loss))(x)


@pytest.mark.parametrize("h, npt, without_transpose, round_sf, clamp", [
    (7168, 32, False, False, None), (7168, 128, True, True, 0.5), (576, 32, True, True, 10.0),  # 64 x 64 CTAs
    (576, 128, False, False, 0.5), (2048, 32, True, False, None),  # 32 x 256 CTAs
    (7168, 32, True, True, 10.0),  # 64 x 256 CTAs
])
def test_lowers_for_h100(h, npt, without_transpose, round_sf, clamp):
  f = lambda x: OP(x, "e4m3", npt, round_sf=round_sf, without_transpose=without_transpose,
                   swiglu_clamp_value=clamp, implementation="pallas")
  text = lower_for_h100(f, jax.ShapeDtypeStruct((8064, 2 * h), jnp.bfloat16)).as_text()
  assert "mosaic_gpu" in text


def _divisions(module):
  """``(values per thread through the guarded swish division, plain div.rn.f32 inline-PTX ops, the guards' bounds,
  unreconciled casts)`` of a lowered Mosaic GPU module: a guarded block
  (:func:`jaxkern.quant._swiglu.guarded_div`) is the inline PTX with ``rcp.approx.ftz.f32``, one per value."""
  asm = re.findall(r'llvm\.inline_asm(?: has_side_effects)? "([^"]*)"', str(module))
  guarded = [a for a in asm if "rcp.approx.ftz.f32" in a]
  bounds = {b for a in guarded for b in re.findall(r"setp\.gtu(?:\.or)?\.f32 p, a, (0f[0-9A-F]{8})", a)}
  return (sum(a.count("rcp.approx.ftz.f32") for a in guarded), sum(a == "div.rn.f32 $0, $1, $2;" for a in asm),
          bounds, _unreconciled_casts(module))


# Every CTA shape (swpc._tile), with and without the transpose.
@pytest.mark.parametrize("h, npt, without_transpose, round_sf", [
    (576, 32, True, False), (2048, 32, True, True), (4096, 32, True, False),  # CTAs of 64 x 64, 32 x 256, 64 x 256
    (576, 128, True, True), (576, 32, False, False), (192, 128, False, False),  # 128 x 64
])
def test_swish_division_lowers_guarded(monkeypatch, h, npt, without_transpose, round_sf):
  """The compiled kernel divides every swish quotient through :func:`jaxkern.quant._swiglu.guarded_div` (its
  bound :data:`jaxkern.quant._swiglu._SWISH_FAST_LIMIT`), not by per-value ``div.rn.f32``, which is left to the
  scale factors only (sf and sf_inv, or sf alone with round_sf, for each of the warpgroup's groups and each column
  a thread holds), and the module has no cast the GPU's pipeline cannot fold (inline PTX operands)."""
  modules = capture_mosaic_modules(monkeypatch, keep=_divisions)
  lower_for_h100(lambda x: OP(x, "e4m3", npt, round_sf=round_sf, without_transpose=without_transpose,
                              implementation="pallas"), jax.ShapeDtypeStruct((256, 2 * h), jnp.bfloat16))
  wg_rows, c, _ = swpc._tile(h, npt, not without_transpose)
  groups = 1 if wg_rows < npt else wg_rows // npt
  limit = "0f%08X" % np.float32(swpc._SWISH_FAST_LIMIT).view(np.uint32)
  assert modules == [(wg_rows * c // 128, groups * (1 if round_sf else 2) * max(1, c // 128), {limit}, [])]


@pytest.mark.gpu
@pytest.mark.parametrize("h", hidden_sizes(64))
@pytest.mark.parametrize("m, npt, without_transpose, round_sf, clamp", [
    (4096, 32, False, True, None), (8064, 128, False, False, 0.5), (8064, 32, True, False, 10.0),
    (4096, 128, True, True, 0.5),
])
def test_spec_shapes_gpu(key, h, m, npt, without_transpose, round_sf, clamp):
  """Compiled kernel vs the reference run by XLA on the same GPU (CUDA expf on both sides)."""
  x = (jax.random.normal(key, (m, 2 * h), jnp.float32)).astype(jnp.bfloat16)
  kw = dict(round_sf=round_sf, without_transpose=without_transpose, swiglu_clamp_value=clamp)
  got = jax.jit(functools.partial(OP, fmt="e4m3", num_per_tokens=npt, **kw))(x)
  want = jax.jit(functools.partial(REF, fmt="e4m3", num_per_tokens=npt, **kw))(x)
  _assert_same(got, want)
  _assert_same(jax.jit(functools.partial(OP, fmt="e4m3", num_per_tokens=npt, **kw))(_x(key, m, h)),
               jax.jit(functools.partial(REF, fmt="e4m3", num_per_tokens=npt, **kw))(_x(key, m, h)))


@pytest.mark.gpu
@pytest.mark.parametrize("m, h, npt, without_transpose", [
    (4096, 576, 32, True), (8064, 576, 32, False), (8064, 576, 32, True), (8064, 576, 128, False),
    (8064, 576, 128, True), (8064, 7168, 32, False), (8064, 7168, 32, True), (4096, 2048, 32, True),
    (8064, 2048, 32, True), (4096, 7168, 32, True),
])
def test_key_shapes_gpu(key, m, h, npt, without_transpose):
  """The shapes timed against TileKernels on an H200 (every CTA shape of the kernel), compiled on the GPU, against
  the reference run by XLA, bit for bit (awkward values, clamp 10, round_sf at npt 128)."""
  kw = dict(round_sf=npt == 128, without_transpose=without_transpose, swiglu_clamp_value=10.0)
  x = _x(key, m, h)
  got = jax.jit(functools.partial(OP, fmt="e4m3", num_per_tokens=npt, **kw))(x)
  want = jax.jit(functools.partial(REF, fmt="e4m3", num_per_tokens=npt, **kw))(x)
  _assert_same(got, want)

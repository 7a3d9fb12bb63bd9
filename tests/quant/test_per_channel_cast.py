"""Per-channel casts (kernel in interpret mode on CPU, or the implementation the run selects) against a numpy oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern import quant
from jaxkern.testing import assert_bitwise_equal, randn


def _oracle(v, npt, round_sf=False):
  """numpy: amax per (npt rows, column) over existing rows; IEEE divisions."""
  m, k = v.shape
  mb = -(-m // npt)
  a = np.abs(np.pad(v, ((0, mb * npt - m), (0, 0)))).reshape(mb, npt, k).max(1)
  a = np.maximum(a, np.float32(1e-4))
  sf = a / np.float32(448)
  if round_sf:
    e = ((sf.view(np.int32) - 1) >> 23) + 1
    sf, inv = (e << 23).view(np.float32), ((254 - e) << 23).view(np.float32)
  else:
    inv = np.float32(448) / a
  q = np.clip(v * np.repeat(inv, npt, 0)[:m], -448, 448).astype(jnp.float8_e4m3fn)
  return q, sf


@pytest.mark.parametrize("round_sf", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_per_channel_cast(key, dtype, round_sf):
  x = randn(key, (256, 576), dtype)
  out, sf = quant.per_channel_cast(x, "e4m3", 128, round_sf)
  q, s = _oracle(np.asarray(x, np.float32), 128, round_sf)
  assert_bitwise_equal(out, q)
  assert_bitwise_equal(sf, s)


@pytest.mark.parametrize("npt", [32, 128])
def test_per_channel_cast_and_transpose(key, npt):
  x = randn(key, (256, 128), jnp.bfloat16)
  out, sf = quant.per_channel_cast_and_transpose(x, "e4m3", npt, True)
  q, s = _oracle(np.asarray(x, np.float32), npt, True)
  assert_bitwise_equal(out, q.T)
  assert_bitwise_equal(sf, s)


def _gathered(v, pos):
  p = np.asarray(pos)
  ok = (p >= 0) & (p < v.shape[0])
  return np.where(ok[:, None], v[np.clip(p, 0, v.shape[0] - 1)], 0.0).astype(np.float32), ok


def test_fused_gather_and_quant_tensor_input(key):
  x = randn(key, (40, 256), jnp.bfloat16)
  q_in, sf_in = quant.per_token_cast(x, "e4m3", 128, implementation="reference")
  # Mo = 144: partial last block; -1 padding and positions >= 40 (out of range) give zero rows.
  pos = jnp.asarray(np.random.default_rng(0).integers(-1, 43, 144), jnp.int32)
  out, sf = quant.per_channel_cast_fused((q_in, sf_in), "e4m3", 128, False, 128, pos)
  g, ok = _gathered(np.asarray(q_in, np.float32) * np.repeat(np.asarray(sf_in), 128, 1), pos)
  q, s = _oracle(g, 128)
  assert_bitwise_equal(out, q)
  assert_bitwise_equal(sf, s)
  assert out.shape == (144, 256) and sf.shape == (2, 256)
  assert (~ok).any() and np.all(np.asarray(out).view(np.uint8)[~ok] == 0)


@pytest.mark.parametrize("dtype, round_sf", [(jnp.bfloat16, True), (jnp.float32, False)],
                         ids=["bf16-round", "fp32"])
def test_fused_gather_plain_input(key, dtype, round_sf):
  x = randn(key, (37, 192), dtype) * 50
  pos = jnp.asarray(np.random.default_rng(1).integers(-1, 37, 272), jnp.int32)  # 2 full blocks + 16 rows
  out, sf = quant.per_channel_cast_fused(x, "e4m3", 128, round_sf, None, pos)
  q, s = _oracle(_gathered(np.asarray(x, np.float32), pos)[0], 128, round_sf)
  assert_bitwise_equal(out, q)
  assert_bitwise_equal(sf, s)


def test_fused_gather_ragged_columns_and_padding_block(key):
  """K = 576 (64-column programs), a block of padding rows only (sf at the clamp), Mo = 208."""
  x = randn(key, (50, 576), jnp.bfloat16)
  pos = jnp.asarray(np.concatenate([np.full(128, -1), np.random.default_rng(3).integers(-1, 50, 80)]), jnp.int32)
  out, sf = quant.per_channel_cast_fused(x, "e4m3", 128, False, None, pos)
  q, s = _oracle(_gathered(np.asarray(x, np.float32), pos)[0], 128)
  assert_bitwise_equal(out, q)
  assert_bitwise_equal(sf, s)


def test_fused_gather_lowers_for_h100():
  from jaxkern.testing import lower_for_h100

  pos = jax.ShapeDtypeStruct((48128,), jnp.int32)
  f = lambda x, p: quant.per_channel_cast_fused(x, "e4m3", 128, True, None, p, implementation="pallas")
  assert "triton" in lower_for_h100(f, jax.ShapeDtypeStruct((8001, 576), jnp.bfloat16), pos).as_text()
  qt = (jax.ShapeDtypeStruct((8001, 7168), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((8001, 56), jnp.float32))
  g = lambda x, p: quant.per_channel_cast_fused(x, "e4m3", 128, False, 128, p, implementation="pallas")
  assert "triton" in lower_for_h100(g, qt, pos).as_text()


def test_fused_quant_tensor_without_gather(key):
  q_in, sf_in = quant.per_token_cast(randn(key, (128, 384), jnp.float32), "e4m3", 128, implementation="reference")
  out, sf = quant.per_channel_cast_fused((q_in, sf_in), "e4m3", 128, True, 128)
  q, s = _oracle(np.asarray(q_in, np.float32) * np.repeat(np.asarray(sf_in), 128, 1), 128, True)
  assert_bitwise_equal(out, q)
  assert_bitwise_equal(sf, s)


def test_zero_rows():
  out, sf = quant.per_channel_cast(jnp.zeros((0, 64), jnp.bfloat16), "e4m3", 128)
  assert out.shape == (0, 64) and sf.shape == (0, 64)
  out, sf = quant.per_channel_cast_and_transpose(jnp.zeros((0, 64), jnp.bfloat16), "e4m3", 32)
  assert out.shape == (64, 0) and sf.shape == (0, 64)


@pytest.mark.parametrize("call, match", [
    (lambda: quant.per_channel_cast(jnp.ones((100, 64), jnp.bfloat16), "e4m3", 128), r"x.shape\[0\]"),
    (lambda: quant.per_channel_cast(jnp.ones((128, 96), jnp.bfloat16), "e4m3", 128), r"x.shape\[1\]"),
    (lambda: quant.per_channel_cast(jnp.ones((128, 64), jnp.bfloat16), "e4m3", 32), "num_per_tokens"),
    (lambda: quant.per_channel_cast_and_transpose(jnp.ones((128, 64), jnp.float32), "e4m3", 32), "x must have dtype"),
    (lambda: quant.per_channel_cast_fused(jnp.ones((128, 64), jnp.bfloat16), "e4m3", 128, False, 128),
     "num_per_channels"),
    (lambda: quant.per_channel_cast_fused(jnp.ones((128, 64), jnp.bfloat16), "e4m3", 128,
                                          pos_to_token=jnp.zeros((20,), jnp.int32)), r"pos_to_token.shape\[0\]"),
    (lambda: quant.per_channel_cast_fused((jnp.ones((128, 64), jnp.float8_e4m3fn), jnp.ones((128, 1), jnp.float32)),
                                          "e4m3", 128, False, 128), r"x\[0\].shape\[1\]"),
])
def test_bad_inputs(call, match):
  with pytest.raises(ValueError, match=match):
    call()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("k", [576, 7168])
def test_per_channel_cast_lowers_for_h100(k, dtype):
  from jaxkern.testing import lower_for_h100

  s = jax.ShapeDtypeStruct((8064, k), dtype)
  f = lambda x: quant.per_channel_cast(x, "e4m3", 128, True, implementation="pallas")
  assert "mosaic_gpu" in lower_for_h100(f, s).as_text()
  if dtype == jnp.bfloat16:
    for npt in (32, 128):
      g = lambda x, npt=npt: quant.per_channel_cast_and_transpose(x, "e4m3", npt, implementation="pallas")
      assert "mosaic_gpu" in lower_for_h100(g, s).as_text()
  if k % 128 == 0:
    qt = (jax.ShapeDtypeStruct((8064, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((8064, k // 128), jnp.float32))
    f = lambda x: quant.per_channel_cast_fused(x, "e4m3", 128, True, 128, implementation="pallas")
    assert "mosaic_gpu" in lower_for_h100(f, qt).as_text()


def test_kernel_vs_reference_ragged_columns(key):
  """K = 576: 64-column tiles (128 does not divide K)."""
  x = randn(key, (128, 576), jnp.float32) * 1000
  for impl_out, ref_out in zip(quant.per_channel_cast(x, "e4m3", 128),
                               quant.per_channel_cast(x, "e4m3", 128, implementation="reference")):
    assert_bitwise_equal(impl_out, ref_out)


@pytest.mark.gpu
@pytest.mark.parametrize("npt", [32, 128])
def test_spec_shapes_gpu(key, npt):
  x = randn(key, (8064, 7168), jnp.bfloat16)
  out, sf = jax.jit(lambda x: quant.per_channel_cast_and_transpose(x, "e4m3", npt))(x)
  q, s = _oracle(np.asarray(x, np.float32), npt)
  assert_bitwise_equal(out, q.T)
  assert_bitwise_equal(sf, s)


@pytest.mark.gpu
@pytest.mark.parametrize("quant_input", [False, True])
def test_fused_gather_spec_shape_gpu(key, quant_input):
  x = randn(key, (8001, 7168), jnp.bfloat16)
  if quant_input:
    x = quant.per_token_cast(x, "e4m3", 128)
  pos = jnp.asarray(np.random.default_rng(2).integers(-1, 8001, 48128), jnp.int32)
  got = jax.jit(lambda x, p: quant.per_channel_cast_fused(x, "e4m3", 128, False, 128 if quant_input else None, p))(x, pos)
  want = quant.per_channel_cast_fused(x, "e4m3", 128, False, 128 if quant_input else None, pos,
                                      implementation="reference")
  for a, b in zip(got, want):
    assert_bitwise_equal(a, b)

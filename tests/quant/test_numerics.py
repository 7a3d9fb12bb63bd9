"""The shared encoders against independent oracles (ml_dtypes, upstream's tables)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from jaxkern import quant
from jaxkern.quant._encode import encode_e2m1
from jaxkern.reference import quant as ref
from jaxkern.testing import assert_bitwise_equal


def test_e4m3_matches_ml_dtypes_with_saturation():
  rng = np.random.default_rng(0)
  x = np.concatenate([
      rng.standard_normal(4096).astype(np.float32) * 100,
      np.float32([448, 449, 464, 1e9, -1e9, 2.0**-9, 2.0**-10, 2.0**-10 * 1.0001, -2.0**-11, 0.0, -0.0]),
      # midpoints between neighbouring e4m3 values and their neighbours
      np.float32([1.0625, 1.1875, 240, 272, 0.0146484375, 2.0**-6 * 1.0625]),
  ])
  got = np.asarray(ref.encode_e4m3(jnp.asarray(x)))
  want = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn)
  assert_bitwise_equal(got, want)


E2M1_CASES = [
    (0.0, 0), (-0.0, 8), (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),
    (6.0, 7), (7.5, 7), (1e30, 7), (np.inf, 7), (-np.inf, 15), (-1e-30, 8), (0.25 + 2**-20, 1),
    (0.5, 1), (-3.0, 13), (2.9, 5), (2.0**-126, 0),
]


def test_e2m1_ties_and_saturation():
  v, nibbles = zip(*E2M1_CASES)
  np.testing.assert_array_equal(np.asarray(ref.encode_e2m1(jnp.float32(v))), nibbles)


def test_e2m1_matches_ml_dtypes():
  rng = np.random.default_rng(1)
  x = np.concatenate([rng.standard_normal(8192).astype(np.float32) * 3,
                      np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 6.5, 7.9, -100])])
  got = np.asarray(ref.encode_e2m1(jnp.asarray(x)))
  want = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
  np.testing.assert_array_equal(got, want)


def test_kernel_e2m1_encoder_matches_reference():
  """The kernels' short encoder against the reference recipe (both signs): every float32 within
  2^16 ulp of each rounding boundary and of 6, a strided sweep of [2^-3, 6.5) and of all finite
  values, the tie and saturation cases, ±inf. (Measured once: every float32 in [2^-3, 6.5) agrees.)"""
  f = jax.jit(lambda u: (ref.encode_e2m1(lax.bitcast_convert_type(u, jnp.float32)),
                         encode_e2m1(lax.bitcast_convert_type(u, jnp.float32))))
  edges = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]).view(np.int32).astype(np.int64)
  u = np.concatenate([np.arange(-(1 << 16), 1 << 16) + e for e in edges] + [
      np.arange(0x3E000000, 0x40D00000, 61), np.arange(0, 0x7F800001, 4093),
      np.float32([v for v, _ in E2M1_CASES]).view(np.int32)]).astype(np.uint32).view(np.int32)
  for sign in (0, -2**31):
    want, got = f(jnp.asarray(u | np.int32(sign)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_unpack_order_and_values():
  b = jnp.asarray([0x21, 0xF8, 0x7E], jnp.uint8)  # low nibble first
  np.testing.assert_array_equal(np.asarray(quant.unpack_from_e2m1fn_x2(b)), [0.5, 1.0, -0.0, -6.0, -4.0, 6.0])
  assert quant.unpack_from_e2m1fn_x2(b.astype(jnp.int8), out_dtype=jnp.bfloat16).dtype == jnp.bfloat16
  assert np.signbit(np.asarray(quant.unpack_from_e2m1fn_x2(b))[2])
  with pytest.raises(ValueError, match="x must have rank"):
    quant.unpack_from_e2m1fn_x2(jnp.uint8(3))
  with pytest.raises(ValueError, match="x must have dtype"):
    quant.unpack_from_e2m1fn_x2(jnp.ones((4,), jnp.int32))


def test_pack_unpack_round_trip():
  n = jnp.arange(32, dtype=jnp.int32).reshape(2, 16) % 16
  packed = ref.pack_e2m1(n)
  assert packed.dtype == jnp.int8 and packed.shape == (2, 8)
  assert int(packed[0, 0]) == (0 | 1 << 4)
  table = np.float32(ref.E2M1_VALUES + tuple(-v for v in ref.E2M1_VALUES))
  assert_bitwise_equal(quant.unpack_from_e2m1fn_x2(packed), table[np.asarray(n)])


def test_round_sf_is_ceil_power_of_two():
  amax = jnp.float32([448.0, 449.0, 448 * 2.5, 0.0, 3e38, 448 * 2.0**-30])
  sf, inv = ref.scale_factors(amax, jnp.full_like(amax, 448.0), "e4m3", True)
  np.testing.assert_array_equal(np.asarray(sf), np.float32([1, 2, 4, 2.0**-22, 2.0**120, 2.0**-22]))
  np.testing.assert_array_equal(np.asarray(sf) * np.asarray(inv), 1.0)


def test_packed_ue8m0_layout():
  sf = jnp.asarray(np.ldexp(np.float32(1), [[0, 1, -1, 2, 3], [4, -22, 0, 0, 1], [1, 1, 1, 1, 1]]).astype(np.float32))
  c = ref.format_sf(sf, True, True)
  assert c.shape == (2, 4) and c.dtype == jnp.int32
  assert int(c[0, 0]) & 0xFFFFFFFF == 127 | 128 << 8 | 126 << 16 | 129 << 24
  assert int(c[1, 0]) == 130 and int(c[0, 3]) == 0 and int(c[1, 3]) == 0  # padding bytes and rows are zero
  assert_bitwise_equal(quant.sf_to_float(c, 3, 5), sf)
  b = ref.format_sf(sf, True, False)
  assert b.shape == (5, 4) and float(b[0, 3]) == 0.0
  assert_bitwise_equal(quant.sf_to_float(b, 3, 5, use_tma_aligned_col_major_sf=True), sf)
  assert_bitwise_equal(quant.sf_logical(b, 3, use_tma_aligned_col_major_sf=True), sf)


def test_ue8m0_decode_edges():
  w = jnp.int32([[0 | 255 << 8]])
  got = np.asarray(quant.sf_to_float(w, 1, 2))
  assert got[0, 0] == 0.0 and np.isposinf(got[0, 1])

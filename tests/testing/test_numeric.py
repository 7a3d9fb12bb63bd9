import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxkern.types import QuantTensor
from jaxkern.testing import align, assert_bitwise_equal, assert_diff_below, calc_diff, hidden_sizes, num_tokens, randn, random_bits


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, ml_dtypes.float8_e4m3fn, np.int32, np.uint8])
def test_bitwise_equal_detects_one_flipped_bit(dtype):
  x = np.asarray(random_bits(jax.random.key(0), (5, 7), dtype))
  assert_bitwise_equal(x, x.copy())
  y = x.copy()
  y.view(f"u{y.dtype.itemsize}")[3, 4] ^= 1
  with pytest.raises(AssertionError, match="1 of 35 elements differ bitwise; first at \\(3, 4\\)"):
    assert_bitwise_equal(y, x)


def test_bitwise_equal_nan_payload_signed_zero_dtype_shape():
  nan1 = np.array([0x7FC00000], np.uint32).view(np.float32)
  nan2 = np.array([0x7FC00001], np.uint32).view(np.float32)
  assert_bitwise_equal(nan1, nan1.copy())
  with pytest.raises(AssertionError):
    assert_bitwise_equal(nan1, nan2)
  with pytest.raises(AssertionError):
    assert_bitwise_equal(np.float32([0.0]), np.float32([-0.0]))
  with pytest.raises(AssertionError, match="dtype"):
    assert_bitwise_equal(np.float32([1.0]), np.int32([1]))
  with pytest.raises(AssertionError, match="shape"):
    assert_bitwise_equal(np.zeros((2, 3)), np.zeros((3, 2)))
  assert_bitwise_equal(np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32))


def test_calc_diff():
  x = np.random.default_rng(0).standard_normal(1000)
  assert calc_diff(x, x) == pytest.approx(0.0, abs=1e-15)
  assert calc_diff(x, -x) == pytest.approx(2.0)
  assert calc_diff(np.zeros(3), np.zeros(3)) == 0.0
  assert calc_diff(x, x * 1.01) == pytest.approx(1 - 2 * 1.01 / (1 + 1.01**2))
  assert_diff_below(x, x * (1 + 1e-9), 1e-12)
  with pytest.raises(AssertionError, match="calc_diff"):
    assert_diff_below(x, x + 1, 1e-3)
  with pytest.raises(AssertionError, match="NaN"):
    assert_diff_below(np.array([np.nan]), np.array([1.0]), 1.0)


def test_generators():
  assert num_tokens() == (4001, 8001)
  assert num_tokens(64) == (4032, 8064)
  assert hidden_sizes(64) == (576, 2048, 2560, 3072, 4096, 6144, 7168)
  assert hidden_sizes(256) == (2048, 2560, 3072, 4096, 6144, 7168)
  assert align(0, 64) == 0 and align(65, 64) == 128
  x = randn(jax.random.key(1), (4096,), jnp.float8_e4m3fn)
  assert x.dtype == jnp.float8_e4m3fn and not jnp.isnan(x.astype(jnp.float32)).any()
  assert float(jnp.std(x.astype(jnp.float32))) == pytest.approx(1.0, rel=0.1)


def test_assert_bitwise_equal_on_pytrees():
  a = QuantTensor(np.zeros(3, np.float32), np.ones(2, np.int32))
  assert_bitwise_equal(a, QuantTensor(np.zeros(3, np.float32), np.ones(2, np.int32)))
  with pytest.raises(AssertionError, match="structure mismatch"):
    assert_bitwise_equal(a, (np.zeros(3, np.float32), np.ones(2, np.int32)))
  with pytest.raises(AssertionError, match="leaf 1"):
    assert_bitwise_equal(a, QuantTensor(np.zeros(3, np.float32), np.zeros(2, np.int32)))

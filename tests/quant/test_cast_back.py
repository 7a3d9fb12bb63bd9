import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern import quant
from jaxkern.quant import common
from jaxkern.reference import quant as ref
from jaxkern.testing import assert_bitwise_equal, assert_diff_below, lower_for_h100, randn

FLAGS = {"A": (False, False, False), "B": (True, False, False), "C": (True, True, True)}


def _quantised(key, m, k, block, flags, fmt="e4m3"):
  x = jax.random.normal(key, (m, k)) * 100
  col, rnd, packed = FLAGS[flags]
  return x, ref.cast(x, fmt, block, round_sf=rnd, use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed)


@pytest.mark.parametrize("m, k, block, flags, fmt", [
    (100, 576, (1, 128), "A", "bf16"),  # ragged rows, partial last group
    (72, 576, (1, 576), "C", "fp32"),  # one packed UE8M0 sf per row
    (40, 320, (1, 32), "B", "bf16"),
    (130, 256, (128, 128), "A", "fp32"),
    (64, 192, (32, 16), "A", "bf16"),
    # sf read inside the kernel
    (1, 576, (1, 128), "A", "bf16"),  # strided layout-A sf load (partial last group), one row
    (7, 576, (1, 128), "C", "fp32"),  # packed UE8M0 words decoded in the kernel
    (65, 320, (1, 128), "B", "bf16"),  # column-major sf: contiguous loads
    (130, 576, (1, 576), "B", "fp32"),  # whole row, (1, Mp) sf
    (130, 576, (1, 576), "C", "bf16"),
    (65, 576, (32, 128), "A", "bf16"),  # block rows: scalar sf loads + select
    (130, 320, (128, 128), "C", "fp32"),
    (7, 576, (64, 576), "B", "bf16"),
    (33, 192, (1, 64), "C", "bf16"),  # several groups per view row, column-major sf: XLA decode
    (65, 576, (2, 128), "A", "fp32"),  # block rows shorter than a layout block: XLA decode
])
def test_cast_back_bit_exact(key, m, k, block, flags, fmt):
  _, q = _quantised(key, m, k, block, flags)
  col = FLAGS[flags][0]
  got = quant.cast_back(q, fmt, block, x_use_tma_aligned_col_major_sf=col)
  assert_bitwise_equal(got, quant.cast_back(q, fmt, block, x_use_tma_aligned_col_major_sf=col,
                                            implementation="reference"))


@pytest.mark.parametrize("fmt, tol", [("e4m3", 1e-3), ("e2m1", 2e-2)])
@pytest.mark.parametrize("npc", [32])
def test_per_token_round_trip(key, fmt, tol, npc):
  x = randn(key, (48, 256), jnp.bfloat16)
  q = quant.per_token_cast(x, fmt, npc, None, True, True, True)
  back = quant.per_token_cast_back(q, "fp32", npc, x_use_tma_aligned_col_major_sf=True)
  assert_diff_below(back, x.astype(jnp.float32), tol)


def test_fp4_and_per_channel_blocks_use_the_reference(key):
  x, q = _quantised(key, 128, 64, (128, 1), "A")
  assert_diff_below(quant.cast_back(q, "fp32", (128, 1)), x, 1e-3)
  x, q = _quantised(key, 16, 64, (1, 32), "C", "e2m1")
  back = quant.cast_back(q, "bf16", (1, 32))
  assert back.dtype == jnp.bfloat16 and back.shape == (16, 64)
  assert_diff_below(back, x, 2e-2)


def test_zero_tokens():
  q = (jnp.zeros((0, 128), jnp.float8_e4m3fn), jnp.zeros((0, 1), jnp.float32))
  assert quant.per_token_cast_back(q, "bf16", 128).shape == (0, 128)


def test_jit(key):
  _, q = _quantised(key, 64, 128, (1, 64), "A")
  f = jax.jit(functools.partial(quant.per_token_cast_back, fmt="bf16", num_per_channels=64))
  assert_bitwise_equal(f(q), quant.per_token_cast_back(q, "bf16", 64, implementation="reference"))


@pytest.mark.parametrize("q, block, fmt, match", [
    ((jnp.ones((8, 96), jnp.float8_e4m3fn), jnp.ones((8, 1), jnp.float32)), (1, 96), "bf16", "K % 64"),
    ((jnp.ones((8, 64), jnp.float8_e4m3fn), jnp.ones((8, 3), jnp.float32)), (1, 32), "bf16", r"x\[1\] \(sf\)"),
    ((jnp.ones((8, 64), jnp.float8_e4m3fn), jnp.ones((8, 2), jnp.float32)), (1, 32), "fp16", "fmt"),
    ((jnp.ones((8, 64), jnp.bfloat16), jnp.ones((8, 2), jnp.float32)), (1, 32), "bf16", r"x\[0\] must have dtype"),
    ((jnp.ones((8, 64), jnp.float8_e4m3fn), jnp.ones((8, 2), jnp.float16)), (1, 32), "bf16", r"x\[1\] must have dtype"),
    ((jnp.ones((8, 64), jnp.float8_e4m3fn), jnp.ones((8, 2), jnp.float32)), (0, 32), "bf16", "x_block_size"),
])
def test_bad_inputs(q, block, fmt, match):
  with pytest.raises(ValueError, match=match):
    quant.cast_back(q, fmt, block)


@pytest.mark.parametrize("fmt", ["bf16", "fp32"])
@pytest.mark.parametrize("m, k, block", [
    (4001, 576, (1, 128)), (8001, 7168, (1, 7168)), (4001, 576, (1, 32)), (8001, 7168, (128, 128)),
])
def test_lowers_for_h100(m, k, block, fmt):
  f = lambda q, s: quant.cast_back((q, s), fmt, block, implementation="pallas")
  args = (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn),
          jax.ShapeDtypeStruct((-(-m // block[0]), -(-k // block[1])), jnp.float32))
  assert "mosaic_gpu" in lower_for_h100(f, *args).as_text()


@pytest.mark.parametrize("m, k, block, flags", [
    (4001, 576, (1, 128), "C"), (4001, 576, (1, 128), "B"), (8001, 576, (128, 128), "A"), (1, 576, (1, 576), "C"),
    (130, 320, (32, 128), "C"), (8001, 576, (128, 128), "B"),
])
def test_lowers_for_h100_sf_layouts(m, k, block, flags):
  col, _, packed = FLAGS[flags]
  mb, kb = -(-m // block[0]), -(-k // block[1])
  sf = jax.ShapeDtypeStruct(common.sf_shape(mb, kb, col_major=col, packed=packed),
                            jnp.int32 if packed else jnp.float32)
  f = lambda q, s: quant.cast_back((q, s), "bf16", block, x_use_tma_aligned_col_major_sf=col,
                                   implementation="pallas")
  assert "mosaic_gpu" in lower_for_h100(f, jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), sf).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp32"])
@pytest.mark.parametrize("block", [(1, 128), (1, 7168), (128, 128)])
def test_spec_shapes_gpu(key, block, fmt):
  x = jax.random.normal(key, (8001, 7168)) * 100
  q = ref.cast(x, "e4m3", block)
  got = jax.jit(lambda q: quant.cast_back(q, fmt, block))(q)
  want = (np.asarray(q[0], np.float32) * np.repeat(np.repeat(np.asarray(q[1]), block[0], 0), block[1], 1)[:8001, :7168])
  assert_bitwise_equal(got, want.astype(jnp.bfloat16 if fmt == "bf16" else np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [4001, 8001])
@pytest.mark.parametrize("block, flags", [((1, 128), "A"), ((1, 128), "C"), ((1, 576), "C"), ((128, 128), "A"),
                                          ((128, 128), "B")])
def test_small_spec_shapes_in_kernel_sf_gpu(key, m, block, flags):
  """K=576: the sf read inside the kernel (strided, packed, per block row), against numpy."""
  x, q = _quantised(key, m, 576, block, flags)
  col = FLAGS[flags][0]
  s = np.asarray(ref.sf_to_float(q[1], -(-m // block[0]), -(-576 // block[1]), use_tma_aligned_col_major_sf=col))
  want = np.asarray(q[0], np.float32) * np.repeat(np.repeat(s, block[0], 0), block[1], 1)[:m, :576]
  for fmt, dtype in (("bf16", jnp.bfloat16), ("fp32", np.float32)):
    got = jax.jit(lambda q: quant.cast_back(q, fmt, block, x_use_tma_aligned_col_major_sf=col))(q)
    assert_bitwise_equal(got, want.astype(dtype))

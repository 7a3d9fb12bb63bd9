import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkern
from jaxkern import quant
from jaxkern.quant import _cast_back as cast_back_module
from jaxkern.quant import _validate as validate
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
    (33, 192, (1, 64), "C", "bf16"),  # one column tile of three blocks, packed sf read in the kernel
    (40, 192, (1, 32), "C", "fp32"),  # several groups per view row, column-major sf: XLA decode
    (65, 576, (2, 128), "A", "fp32"),  # block rows shorter than a layout block: XLA decode
    # column tiles of several blocks (a second grid axis)
    (130, 1536, (128, 128), "B", "fp32"),
    (65, 1280, (1, 128), "C", "bf16"),  # packed sf words of one tile start mid-word
    # per-channel blocks: column-vector sf, row chunks moved back across a block row edge
    (100, 576, (128, 1), "A", "fp32"),
    (300, 192, (128, 1), "B", "bf16"),  # strided layout-B sf loads, 3 block rows
    (5, 128, (128, 1), "C", "fp32"),  # fewer rows than a chunk; packed sf decoded by XLA
    (130, 320, (32, 1), "A", "bf16"),
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


@pytest.mark.parametrize("m, k, block, flags, fmt", [
    (100, 576, (1, 128), "A", "bf16"),  # ragged rows, partial last group (strided layout-A sf)
    (7, 576, (1, 128), "C", "fp32"),  # fewer rows than a layout block, packed UE8M0 words
    (65, 320, (1, 32), "B", "fp32"),
    (130, 576, (1, 576), "C", "bf16"),
    (65, 576, (32, 128), "A", "fp32"),  # block rows: scalar sf loads + select
    (33, 192, (1, 64), "C", "bf16"),  # several groups per view row, column-major sf: XLA decode
])
def test_cast_back_e2m1_bit_exact(key, m, k, block, flags, fmt):
  _, q = _quantised(key, m, k, block, flags, "e2m1")
  col = FLAGS[flags][0]
  got = quant.cast_back(q, fmt, block, x_use_tma_aligned_col_major_sf=col)
  assert_bitwise_equal(got, quant.cast_back(q, fmt, block, x_use_tma_aligned_col_major_sf=col,
                                            implementation="reference"))


@pytest.mark.parametrize("shape", [(3, 5, 24), (70, 288), (1, 16)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_unpack_kernel_bit_exact(key, shape, dtype):
  b = jax.random.randint(key, shape, -128, 128).astype(jnp.int8)
  assert_bitwise_equal(quant.unpack_from_e2m1fn_x2(b, dtype), ref.unpack_from_e2m1fn_x2(b, dtype))
  assert_bitwise_equal(quant.unpack_from_e2m1fn_x2(b.astype(jnp.uint8), dtype), ref.unpack_from_e2m1fn_x2(b, dtype))
  assert quant.unpack_from_e2m1fn_x2(jnp.zeros((0, 8), jnp.int8), dtype).shape == (0, 16)


def test_decode_e2m1_matches_the_table():
  n = jnp.arange(16, dtype=jnp.int32)
  want = np.array(ref.E2M1_VALUES + tuple(-v for v in ref.E2M1_VALUES), np.float32)
  assert_bitwise_equal(ref.decode_e2m1(n), want)


def test_per_channel_blocks_and_fp4_round_trip(key):
  x, q = _quantised(key, 128, 64, (128, 1), "A")
  assert_diff_below(quant.cast_back(q, "fp32", (128, 1)), x, 1e-3)
  x, q = _quantised(key, 16, 64, (1, 32), "C", "e2m1")
  back = quant.cast_back(q, "bf16", (1, 32))
  assert back.dtype == jnp.bfloat16 and back.shape == (16, 64)
  assert_diff_below(back, x, 2e-2)


def test_zero_tokens():
  q = (jnp.zeros((0, 128), jnp.float8_e4m3fn), jnp.zeros((0, 1), jnp.float32))
  assert quant.per_token_cast_back(q, "bf16", 128).shape == (0, 128)
  q = (jnp.zeros((0, 64), jnp.int8), jnp.zeros((1, 0), jnp.int32))
  assert quant.per_token_cast_back(q, "fp32", 128, x_use_tma_aligned_col_major_sf=True).shape == (0, 128)


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


@pytest.mark.parametrize("qfmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("fmt", ["bf16", "fp32"])
@pytest.mark.parametrize("m, k, block", [
    (4001, 576, (1, 128)), (8001, 7168, (1, 7168)), (4001, 576, (1, 32)), (8001, 7168, (128, 128)),
])
def test_lowers_for_h100(m, k, block, fmt, qfmt):
  f = lambda q, s: quant.cast_back((q, s), fmt, block, implementation="pallas")
  q = jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn) if qfmt == "e4m3" else jax.ShapeDtypeStruct((m, k // 2), jnp.int8)
  args = (q,
          jax.ShapeDtypeStruct((-(-m // block[0]), -(-k // block[1])), jnp.float32))
  assert "mosaic_gpu" in lower_for_h100(f, *args).as_text()


@pytest.mark.parametrize("m, k, block, flags", [
    (4001, 576, (1, 128), "C"), (4001, 576, (1, 128), "B"), (8001, 576, (128, 128), "A"), (1, 576, (1, 576), "C"),
    (130, 320, (32, 128), "C"), (8001, 576, (128, 128), "B"), (4001, 576, (128, 1), "A"), (8001, 7168, (128, 1), "B"),
    (4001, 2048, (128, 1), "C"),
])
def test_lowers_for_h100_sf_layouts(m, k, block, flags):
  col, _, packed = FLAGS[flags]
  mb, kb = -(-m // block[0]), -(-k // block[1])
  sf = jax.ShapeDtypeStruct(validate.sf_shape(mb, kb, col_major=col, packed=packed),
                            jnp.int32 if packed else jnp.float32)
  f = lambda q, s: quant.cast_back((q, s), "bf16", block, x_use_tma_aligned_col_major_sf=col,
                                   implementation="pallas")
  assert "mosaic_gpu" in lower_for_h100(f, jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), sf).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp32"])
@pytest.mark.parametrize("block", [(1, 128), (1, 7168), (128, 128), (128, 1)])
@pytest.mark.parametrize("m, k", [(8001, 7168), (4001, 2560)])  # 4001x2560: the smallest persistent-kernel size
def test_spec_shapes_gpu(key, m, k, block, fmt):
  block = (block[0], min(block[1], k))
  x = jax.random.normal(key, (m, k)) * 100
  q = ref.cast(x, "e4m3", block)
  got = jax.jit(lambda q: quant.cast_back(q, fmt, block))(q)
  want = (np.asarray(q[0], np.float32) * np.repeat(np.repeat(np.asarray(q[1]), block[0], 0), block[1], 1)[:m, :k])
  assert_bitwise_equal(got, want.astype(jnp.bfloat16 if fmt == "bf16" else np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [4001, 8001])
@pytest.mark.parametrize("block, flags", [((1, 128), "A"), ((1, 128), "C"), ((1, 576), "C"), ((128, 128), "A"),
                                          ((128, 128), "B"), ((128, 1), "A"), ((128, 1), "C")])
def test_small_spec_shapes_in_kernel_sf_gpu(key, m, block, flags):
  """K=576: the sf read inside the kernel (strided, packed, per block row), against numpy."""
  x, q = _quantised(key, m, 576, block, flags)
  col = FLAGS[flags][0]
  s = np.asarray(ref.sf_to_float(q[1], -(-m // block[0]), -(-576 // block[1]), use_tma_aligned_col_major_sf=col))
  want = np.asarray(q[0], np.float32) * np.repeat(np.repeat(s, block[0], 0), block[1], 1)[:m, :576]
  for fmt, dtype in (("bf16", jnp.bfloat16), ("fp32", np.float32)):
    got = jax.jit(lambda q: quant.cast_back(q, fmt, block, x_use_tma_aligned_col_major_sf=col))(q)
    assert_bitwise_equal(got, want.astype(dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_unpack_lowers_for_h100(dtype):
  f = lambda b: quant.unpack_from_e2m1fn_x2(b, dtype, implementation="pallas")
  assert "mosaic_gpu" in lower_for_h100(f, jax.ShapeDtypeStruct((8001, 3584), jnp.int8)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("block, flags", [((1, 128), "C"), ((1, 7168), "A"), ((128, 128), "A")])
def test_spec_shapes_e2m1_gpu(key, block, flags):
  _, q = _quantised(key, 8001, 7168, block, flags, "e2m1")
  col = FLAGS[flags][0]
  for fmt in ("bf16", "fp32"):
    got = jax.jit(lambda q: quant.cast_back(q, fmt, block, x_use_tma_aligned_col_major_sf=col))(q)
    want = jax.jit(lambda q: ref.cast_back(q, fmt, block, x_use_tma_aligned_col_major_sf=col))(q)
    assert_bitwise_equal(got, want)
  b = q[0]
  for dtype in (jnp.float32, jnp.bfloat16):
    assert_bitwise_equal(jax.jit(lambda b: quant.unpack_from_e2m1fn_x2(b, dtype))(b), ref.unpack_from_e2m1fn_x2(b, dtype))


@pytest.mark.parametrize("m, k, block, sms", [(100, 256, (1, 128), 1), (400, 384, (1, 128), 1),
                                              (300, 384, (128, 128), 1), (130, 128, (256, 128), 2)])
def test_tma_store_kernel_bit_exact(key, monkeypatch, m, k, block, sms):
  """The persistent kernel of large e4m3 -> float32 casts (threshold lowered, ``sms`` SMs): ragged
  last tile, two block rows per tile, fewer tiles than ring stages, CTAs going round the ring (11
  and 15 tiles), tiles not shared evenly."""
  monkeypatch.setattr(cast_back_module, "TMA_MIN_ELEMENTS", 0)
  monkeypatch.setattr(jaxkern._config, "num_sms", lambda: sms)
  _, q = _quantised(key, m, k, block, "A")
  assert cast_back_module._use_tma_store(q[0], q[1], block, jnp.float32, False)
  got = quant.cast_back(q, "fp32", block)  # the interpreter fills unwritten outputs with NaN
  assert_bitwise_equal(got, quant.cast_back(q, "fp32", block, implementation="reference"))


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_tma_store_kernel_lowers_for_h100(block):
  f = lambda q, s: quant.cast_back((q, s), "fp32", block, implementation="pallas")
  args = (jax.ShapeDtypeStruct((8001, 7168), jnp.float8_e4m3fn),
          jax.ShapeDtypeStruct((-(-8001 // block[0]), 56), jnp.float32))
  assert cast_back_module._use_tma_store(*args, block, jnp.float32, False)
  assert "mosaic_gpu" in lower_for_h100(f, *args).as_text()

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxkern
from jaxkern import quant
from jaxkern.reference import quant as ref
from jaxkern.testing import (assert_bitwise_equal, assert_diff_below, capture_mosaic_modules, lower_for_h100,
                             randn)
from jaxkern.types import QuantTensor

FLAGS = {"A": {}, "A-round": dict(round_sf=True), "B": dict(use_tma_aligned_col_major_sf=True),
         "C": dict(use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True)}


def assert_same(got, want):
  """Same pytree structure (QuantTensor vs QuantTensor) and bit-identical leaves."""
  chex.assert_trees_all_equal_structs(got, want)
  jax.tree.map(assert_bitwise_equal, got, want)


def _input(key, m, k, dtype):
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, (m, k)) * jnp.exp2(jax.random.randint(k2, (m, 1), -10, 10).astype(jnp.float32))
  return x.astype(dtype)


# e2m1 from bf16 (pairs as int32 words) and float32 (strided GMEM loads): partial row / column
# blocks, a chunk moved back across a block edge (45 = 32 + 13 rows), 128x128 read twice; float32
# also with fewer rows than one chunk.
E2M1_CASES = [(100, 576, (128, 128), "C"), (45, 320, (32, 32), "A-round"), (33, 192, (32, 128), "B"),
              (136, 128, (128, 32), "A")]


@pytest.mark.parametrize("m, k, block, dtype, flags, fmt", [
    (100, 576, (128, 128), jnp.bfloat16, "A-round", "e4m3"),  # ragged rows: partial row and column blocks
    (72, 320, (32, 32), jnp.float32, "C", "e4m3"),
    (40, 256, (32, 128), jnp.bfloat16, "B", "e4m3"),
    (136, 192, (128, 32), jnp.float32, "A", "e4m3"),
] + [(m, k, block, dtype, flags, "e2m1") for dtype in (jnp.bfloat16, jnp.float32) for m, k, block, flags in E2M1_CASES]
  + [(5, 64, (32, 32), jnp.float32, "A", "e2m1")])
def test_per_block_cast_bit_exact(key, m, k, block, dtype, flags, fmt):
  x = _input(key, m, k, dtype)
  got = quant.per_block_cast(x, fmt, block, **FLAGS[flags])
  want = ref.per_block_cast(x, fmt, block, **FLAGS[flags])
  assert isinstance(got, QuantTensor)
  assert_same(got, want)
  assert_bitwise_equal(quant.per_block_cast_with_sf_only(x, fmt, block, **FLAGS[flags]), want.sf)


@pytest.mark.parametrize("block, fmt, dtype", [((128, 128), "e4m3", jnp.bfloat16), ((32, 32), "e4m3", jnp.bfloat16),
                                               ((32, 32), "e2m1", jnp.bfloat16), ((128, 32), "e2m1", jnp.float32)])
def test_precomputed_sf_bit_exact(key, block, fmt, dtype):
  x = _input(key, 100, 320, dtype)
  sf = ref.per_block_cast(x, fmt, block).sf * 0.3
  got = quant.per_block_cast_with_precomputed_sf(x, fmt, block, sf)
  assert_bitwise_equal(got, ref.per_block_cast_with_precomputed_sf(x, fmt, block, sf))


@settings(max_examples=6, deadline=None)
@given(m=st.integers(1, 150), kc=st.integers(1, 5), block=st.sampled_from([(32, 32), (32, 128), (128, 32), (128, 128)]),
       fmt=st.sampled_from(["e4m3", "e2m1"]), flags=st.sampled_from(sorted(FLAGS)),
       dtype=st.sampled_from([jnp.bfloat16, jnp.float32]))
def test_hypothesis_shapes_and_cast_back(m, kc, block, fmt, flags, dtype):
  """Random row counts and widths (multiples of 64), any block, format and sf layout: the cast and
  the cast back, each against its reference."""
  x = _input(jax.random.key(m * 11 + kc), m, 64 * kc, dtype)
  q = quant.per_block_cast(x, fmt, block, **FLAGS[flags])
  assert_same(q, ref.per_block_cast(x, fmt, block, **FLAGS[flags]))
  col = flags in ("B", "C")
  for out in ("bf16", "fp32"):
    assert_bitwise_equal(quant.cast_back(q, out, block, x_use_tma_aligned_col_major_sf=col),
                         quant.cast_back(q, out, block, x_use_tma_aligned_col_major_sf=col, implementation="reference"))


@pytest.mark.parametrize("fmt, tol", [("e4m3", 1e-3), ("e2m1", 2e-2)])
def test_round_trip(key, fmt, tol):
  x = randn(key, (64, 128), jnp.float32)
  q = quant.per_block_cast(x, fmt, (32, 32), round_sf=True)
  assert_diff_below(quant.cast_back(q, "fp32", (32, 32)), x, tol)


def test_lossless_is_exact(key):
  x = randn(key, (32, 128), jnp.float32)
  amax = jnp.max(jnp.abs(x))
  x = jnp.sign(x) * jnp.maximum(jnp.abs(x), amax / 512)
  q4 = ref.cast(x, "e2m1", (1, 32), round_sf=True)
  want = quant.cast_back(q4, "fp32", (1, 32), implementation="reference")
  for out_block, flags in [((1, 128), "A"), ((32, 32), "C"), ((128, 128), "B")]:
    q8 = quant.per_block_cast_lossless(q4, "e4m3", (1, 32), out_block, **FLAGS[flags])
    assert isinstance(q8, QuantTensor) and q8.data.dtype == jnp.float8_e4m3fn
    back = quant.cast_back(q8, "fp32", out_block, x_use_tma_aligned_col_major_sf=flags in ("B", "C"),
                           implementation="reference")
    assert_bitwise_equal(back, want)


@pytest.mark.parametrize("m, k", [(37, 256), (130, 384)])
@pytest.mark.parametrize("x_flags", ["A", "C"])
def test_lossless_kernel_vs_reference(key, m, k, x_flags):
  """Rows with input sf spread over 2^8 (exponent offsets of both signs inside one output block)."""
  k1, k2 = jax.random.split(key)
  x = randn(k1, (m, k), jnp.float32) * jnp.exp2(jax.random.randint(k2, (m, 1), -4, 4)).astype(jnp.float32)
  q4 = QuantTensor(*ref.cast(x, "e2m1", (1, 32), **{**FLAGS[x_flags], "round_sf": True}))
  for out_block, flags in [((1, 128), "A"), ((32, 32), "C"), ((128, 128), "B")]:
    kw = dict(**FLAGS[flags], x_use_tma_aligned_col_major_sf=x_flags == "B")
    got = quant.per_block_cast_lossless(q4, "e4m3", (1, 32), out_block, **kw)
    assert isinstance(got, QuantTensor)
    assert_same(got, ref.per_block_cast_lossless(q4, "e4m3", (1, 32), out_block, **kw))


def test_lossless_lowers_for_h100():
  f = lambda q, s: quant.per_block_cast_lossless((q, s), "e4m3", (1, 32), (128, 128), **FLAGS["C"],
                                                 implementation="pallas")
  s = (jax.ShapeDtypeStruct((8001, 3584), jnp.int8), jax.ShapeDtypeStruct((8001, 224), jnp.float32))
  assert "mosaic_gpu" in lower_for_h100(f, *s).as_text()


@pytest.mark.gpu
def test_lossless_spec_shape_gpu(key):
  x = randn(key, (8001, 7168), jnp.float32)
  q4 = ref.cast(x, "e2m1", (1, 32), round_sf=True)
  for out_block in [(1, 128), (32, 32), (128, 128)]:
    got = jax.jit(lambda q: quant.per_block_cast_lossless(q, "e4m3", (1, 32), out_block, **FLAGS["C"]))(q4)
    assert_same(got, ref.per_block_cast_lossless(q4, "e4m3", (1, 32), out_block, **FLAGS["C"]))


def test_zero_tokens():
  x = jnp.zeros((0, 128), jnp.float32)
  out, sf = quant.per_block_cast(x, "e4m3", (128, 128))
  assert out.shape == (0, 128) and sf.shape == (0, 1)
  assert quant.per_block_cast(x, "e4m3", (32, 32), **FLAGS["C"]).sf.shape == (1, 0)
  assert quant.per_block_cast_with_sf_only(x, "e4m3", (32, 32)).shape == (0, 4)
  assert quant.per_block_cast_with_precomputed_sf(x, "e4m3", (32, 32), jnp.zeros((0, 4))).shape == (0, 128)
  assert jaxkern.explain(quant.per_block_cast, x, "e4m3", (32, 32), implementation="pallas")[0].path == "xla"
  for dtype in (jnp.bfloat16, jnp.float32):
    out, sf = quant.per_block_cast(x.astype(dtype), "e2m1", (32, 32))
    assert out.shape == (0, 64) and out.dtype == jnp.int8 and sf.shape == (0, 4)
  out, sf = quant.per_block_cast_lossless((jnp.zeros((0, 64), jnp.int8), jnp.zeros((0, 4), jnp.float32)), "e4m3",
                                          (1, 32), (32, 32))
  assert out.shape == (0, 128) and out.dtype == jnp.float8_e4m3fn and sf.shape == (0, 4)


def _non_finite(m, k, dtype):
  """NaN, -NaN, +inf, -inf in one block each of the first block column, and in rows of the last block row
  (the last block column), the rest random."""
  x = np.array(_input(jax.random.key(5), m, k, jnp.float32))
  for i, v in enumerate([np.nan, -np.float32(np.nan), np.inf, -np.inf]):
    x[32 * i + 3, 5] = x[m - 1 - i, k - 1 - 40 * i] = v
  return jnp.asarray(x).astype(dtype)


@pytest.mark.parametrize("fmt, dtype, block, flags", [
    ("e4m3", jnp.float32, (32, 32), "A"), ("e4m3", jnp.bfloat16, (32, 128), "A-round"),
    ("e4m3", jnp.float32, (128, 32), "C"), ("e2m1", jnp.bfloat16, (32, 32), "B"),
    ("e2m1", jnp.float32, (32, 32), "A"), ("e2m1", jnp.float32, (128, 128), "C"),
    ("e2m1", jnp.bfloat16, (128, 32), "A-round"),
])
def test_non_finite_inputs_bit_exact(fmt, dtype, block, flags):
  """NaN / ±inf inputs: kernel and reference give the same bits (NaN-propagating amax, saturating
  encodings, canonical NaN; documented in per_block_cast's docstring)."""
  x = _non_finite(140, 192, dtype)
  got = quant.per_block_cast(x, fmt, block, **FLAGS[flags])
  assert_same(got, ref.per_block_cast(x, fmt, block, **FLAGS[flags]))
  assert_bitwise_equal(quant.per_block_cast_with_sf_only(x, fmt, block, **FLAGS[flags]), got.sf)
  if flags == "A":
    sf = np.asarray(got.sf)
    assert sf[0, 0].view(np.uint32) == ref.CANONICAL_NAN and np.isinf(sf[2 * 32 // block[0], 0])
  sf = jnp.full((-(-140 // block[0]), -(-192 // block[1])), 0.01, jnp.float32)
  assert_bitwise_equal(quant.per_block_cast_with_precomputed_sf(x, fmt, block, sf),
                       ref.per_block_cast_with_precomputed_sf(x, fmt, block, sf))


def test_bool_and_list_inputs():
  with pytest.raises(ValueError, match="x must have dtype"):
    quant.per_block_cast(jnp.ones((32, 64), jnp.bool_), "e4m3", (32, 32))
  rows = np.asarray(_input(jax.random.key(6), 40, 64, jnp.float32))
  assert_same(quant.per_block_cast(rows.tolist(), "e4m3", (32, 32)),
              ref.per_block_cast(jnp.asarray(rows), "e4m3", (32, 32)))
  q4 = ref.cast(jnp.asarray(rows), "e2m1", (1, 32), round_sf=True)
  with pytest.raises(ValueError, match=r"x\[0\] must have dtype .* got int32"):  # a list of bytes is int32
    quant.per_block_cast_lossless((np.asarray(q4[0]).tolist(), q4[1]), "e4m3", (1, 32), (32, 32))


def test_jit_does_not_retrace(key):
  x = _input(key, 64, 256, jnp.bfloat16)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(x):
    return quant.per_block_cast(x, "e2m1", (32, 32), **FLAGS["C"])

  f(x)
  assert_same(f(x * 2), ref.per_block_cast(x * 2, "e2m1", (32, 32), **FLAGS["C"]))


def test_keyword_only_options():
  with pytest.raises(TypeError):
    quant.per_block_cast(jnp.ones((32, 64)), "e4m3", (32, 32), True)  # pylint: disable=too-many-function-args


@pytest.mark.parametrize("args, match", [
    ((jnp.ones((8, 96), jnp.float32), "e4m3", (32, 32)), r"x.shape\[1\] must be a multiple of 64"),
    ((jnp.ones((8, 64), jnp.float32), "e4m3", (64, 32)), "block_size"),
    ((jnp.ones((8, 64), jnp.float32), "e4m3", (32, 16)), "block_size"),
    ((jnp.ones((8, 64), jnp.int8), "e4m3", (32, 32)), "x must have dtype"),
    ((jnp.ones((8, 64), jnp.float32), "fp8", (32, 32)), "fmt"),
])
def test_bad_inputs(args, match):
  with pytest.raises(ValueError, match=match):
    quant.per_block_cast(*args)


def test_lossless_bad_inputs():
  q4 = (jnp.zeros((8, 32), jnp.int8), jnp.ones((8, 2), jnp.float32))
  with pytest.raises(ValueError, match="out_block_size"):
    quant.per_block_cast_lossless(q4, "e4m3", (1, 32), (1, 48))
  with pytest.raises(ValueError, match="fmt"):
    quant.per_block_cast_lossless(q4, "e2m1", (1, 32), (1, 64))
  with pytest.raises(ValueError, match=r"x\[1\] \(sf\)"):
    quant.per_block_cast_lossless(q4, "e4m3", (1, 16), (1, 64))
  with pytest.raises(ValueError, match="packed e2m1"):
    quant.per_block_cast_lossless((jnp.zeros((8, 64), jnp.float8_e4m3fn), q4[1]), "e4m3", (1, 32), (1, 64))
  with pytest.raises(ValueError, match="QuantTensor"):
    quant.per_block_cast_lossless(q4[0], "e4m3", (1, 32), (1, 64))


@pytest.mark.parametrize("dtype, fmt", [(jnp.bfloat16, "e4m3"), (jnp.float32, "e4m3"), (jnp.bfloat16, "e2m1"),
                                        (jnp.float32, "e2m1")],
                         ids=lambda v: v if isinstance(v, str) else jnp.dtype(v).name)
@pytest.mark.parametrize("m, k, block", [
    (4001, 576, (128, 128)), (8001, 7168, (32, 32)), (4001, 576, (32, 128)), (4001, 7168, (128, 32)),
])
def test_lowers_for_h100(m, k, block, dtype, fmt):
  s = jax.ShapeDtypeStruct((m, k), dtype)
  f = functools.partial(quant.per_block_cast, fmt=fmt, block_size=block, **FLAGS["C"], implementation="pallas")
  assert "mosaic_gpu" in lower_for_h100(f, s).as_text()
  g = functools.partial(quant.per_block_cast_with_sf_only, fmt=fmt, block_size=block, implementation="pallas")
  assert "mosaic_gpu" in lower_for_h100(g, s).as_text()
  sf = jax.ShapeDtypeStruct((-(-m // block[0]), -(-k // block[1])), jnp.float32)
  h = lambda x, sf: quant.per_block_cast_with_precomputed_sf(x, fmt, block, sf, implementation="pallas")
  assert "mosaic_gpu" in lower_for_h100(h, s, sf).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
def test_spec_shapes_gpu(key, block):
  """Kernel vs numpy (IEEE division) on the GPU."""
  x = randn(key, (4001, 7168), jnp.bfloat16)
  out, sf = jax.jit(functools.partial(quant.per_block_cast, fmt="e4m3", block_size=block))(x)
  bm, bk = block
  xf = np.asarray(x, np.float32)
  mb = -(-4001 // bm)
  xp = np.pad(xf, ((0, mb * bm - 4001), (0, 0))).reshape(mb, bm, -1, bk)
  a = np.maximum(np.abs(xp).max((1, 3)), np.float32(1e-4))
  assert_bitwise_equal(sf, a / np.float32(448))
  inv = np.repeat(np.repeat(np.float32(448) / a, bm, 0), bk, 1)[:4001]
  assert_bitwise_equal(out, np.clip(xf * inv, -448, 448).astype(jnp.float8_e4m3fn))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda v: jnp.dtype(v).name)
@pytest.mark.parametrize("block", [(128, 128), (32, 32), (32, 128), (128, 32)])
def test_spec_shapes_e2m1_gpu(key, block, dtype):
  """e2m1 kernels vs the reference on the GPU (4001 rows: partial last block row; K = 576 below)."""
  x = randn(key, (4001, 7168), dtype)
  got = jax.jit(functools.partial(quant.per_block_cast, fmt="e2m1", block_size=block, **FLAGS["C"]))(x)
  assert_same(got, ref.per_block_cast(x, "e2m1", block, **FLAGS["C"]))


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
def test_e2m1_f32_ragged_gpu(key, block):
  """float32 -> e2m1 with a partial last block column (K = 576) and a one-row last block row."""
  x = _input(key, 8001, 576, jnp.float32)
  for flags in ("A", "C"):
    got = jax.jit(lambda x: quant.per_block_cast(x, "e2m1", block, **FLAGS[flags]))(x)
    assert_same(got, ref.per_block_cast(x, "e2m1", block, **FLAGS[flags]))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, dtype", [("e4m3", jnp.bfloat16), ("e4m3", jnp.float32), ("e2m1", jnp.bfloat16),
                                        ("e2m1", jnp.float32)], ids=str)
@pytest.mark.parametrize("block", [(128, 128), (32, 32), (32, 128)])
@pytest.mark.parametrize("flags", ["A", "A-round", "C"])
def test_non_finite_inputs_gpu(fmt, dtype, block, flags):
  """NaN / ±inf inputs: the compiled kernels against the reference on the GPU and on the host CPU."""
  x = _non_finite(4001, 576, dtype)
  got = jax.jit(lambda x: quant.per_block_cast(x, fmt, block, **FLAGS[flags]))(x)
  assert_same(got, jax.jit(lambda x: ref.per_block_cast(x, fmt, block, **FLAGS[flags]))(x))
  assert_same(got, jax.jit(lambda x: ref.per_block_cast(x, fmt, block, **FLAGS[flags]))(
      jax.device_put(x, jax.devices("cpu")[0])))


def test_variant_choice():
  from jaxkern.quant import _per_block_cast as pbc
  assert pbc._variant(jnp.bfloat16, "e4m3", (32, 32), False) == "direct"
  assert pbc._variant(jnp.bfloat16, "e4m3", (128, 128), False) == "direct"
  assert pbc._variant(jnp.bfloat16, "e4m3", (32, 32), True) == "blocks"  # precomputed sf
  assert pbc._variant(jnp.bfloat16, "e2m1", (32, 32), False) == "blocks"
  assert pbc._variant(jnp.float32, "e4m3", (128, 128), False) == "blocks"
  assert pbc._variant(jnp.bfloat16, "e4m3", (32, 128), False) == "blocks"
  assert pbc._variant(jnp.float32, "e4m3", (32, 32), False) == "blocks"


# The direct kernel: partial last block rows (TMA path) and whole ones (register path, in row chunks), 32x32 tiles
# of 4 blocks (128 columns) with a last CTA column of 2 (K = 320, 576, 192, 448) or of 4 (K = 512, 384), one CTA
# column (K = 64), fewer rows than a block, and every sf layout: C from one word per CTA (32x32; 64 rows: the last
# block row, in registers, zeroes 2 padding rows) or byte by byte (128x128 with K > 128: K = 576 with 3 padding
# bytes in the last word, K = 512 with none; 130 / 256 rows: padding rows). 128x128 blocks in chunks for
# K <= CHUNKED_MAX_K (K = 1024 the largest), whole rows above (K = 1088: a partial last block, 3 padding bytes;
# K = 2048).
DIRECT_CASES = [(45, 320, (32, 32), "C"), (70, 576, (32, 32), "B"), (64, 512, (32, 32), "A"),
                (5, 64, (32, 32), "C"), (96, 192, (32, 32), "A-round"), (64, 384, (32, 32), "C"),
                (100, 448, (32, 32), "B"), (130, 576, (128, 128), "A"),
                (256, 320, (128, 128), "B"), (256, 256, (128, 128), "C"), (40, 64, (128, 128), "C"),
                (130, 576, (128, 128), "C"), (256, 512, (128, 128), "C"), (128, 1024, (128, 128), "A-round"),
                (130, 1088, (128, 128), "C"), (200, 2048, (128, 128), "A")]


@pytest.mark.parametrize("m, k, block, flags", DIRECT_CASES, ids=str)
def test_direct_kernel_bit_exact(key, m, k, block, flags):
  """The direct kernel ("auto" for bf16 32x32 / 128x128 blocks), data and sf, and the sf-only form."""
  x = _input(key, m, k, jnp.bfloat16)
  x = x.at[m - 1, k - 1].set(jnp.bfloat16(3e4))  # the last row's block has the largest value: a lost row shows
  want = ref.per_block_cast(x, "e4m3", block, **FLAGS[flags])
  assert_same(quant.per_block_cast(x, "e4m3", block, **FLAGS[flags]), want)
  assert_bitwise_equal(quant.per_block_cast_with_sf_only(x, "e4m3", block, **FLAGS[flags]), want.sf)


# Non-finite blocks in the last CTA column, whose sf are picked from the block vector one by one (K = 320, 192: 2 of
# 4 blocks), and a NaN block's -0 sf with round_sf (A-round, B-round); 128x128 layout C byte by byte, in chunks
# (K = 320) and whole rows (K = 1088).
NON_FINITE_FLAGS = dict(FLAGS, **{"B-round": dict(use_tma_aligned_col_major_sf=True, round_sf=True)})


@pytest.mark.parametrize("m, k, block, flags", [(140, 192, (32, 32), "C"), (140, 192, (128, 128), "A"),
                                                (140, 192, (32, 32), "A-round"), (101, 320, (32, 32), "A-round"),
                                                (128, 320, (32, 32), "B-round"), (140, 320, (128, 128), "C"),
                                                (128, 256, (32, 32), "C"), (140, 1088, (128, 128), "A-round")],
                         ids=str)
def test_direct_kernel_non_finite(m, k, block, flags):
  x = _non_finite(m, k, jnp.bfloat16)
  assert_same(quant.per_block_cast(x, "e4m3", block, **NON_FINITE_FLAGS[flags]),
              ref.per_block_cast(x, "e4m3", block, **NON_FINITE_FLAGS[flags]))


# 128x128 blocks run their block rows in reverse launch order (grid row r is block row mb - 1 - r): 4 block rows, the
# last partial (417 = 3 * 128 + 33), scaled by 8 ** r so that every block row has its own sf (a block row's data or sf
# stored at another row, or the TMA path taken by a whole row, shows); in chunks (K = 576) and whole rows (K = 1088),
# the sf stored per block row (A, B) and byte by byte (C).
@pytest.mark.parametrize("k, flags", [(576, "A"), (576, "C"), (1088, "B"), (1088, "C")], ids=str)
def test_direct_kernel_reversed_block_rows(key, k, flags):
  m = 3 * 128 + 33
  scale = jnp.exp2(3.0 * (jnp.arange(m) // 128)).astype(jnp.float32)[:, None]
  x = (jax.random.normal(key, (m, k)) * scale).astype(jnp.bfloat16)
  want = ref.per_block_cast(x, "e4m3", (128, 128), **FLAGS[flags])
  sf_a = np.asarray(ref.per_block_cast(x, "e4m3", (128, 128)).sf)
  assert all(len(set(sf_a[:, c])) == 4 for c in range(sf_a.shape[1]))  # every block row its own sf
  assert_same(quant.per_block_cast(x, "e4m3", (128, 128), **FLAGS[flags]), want)
  assert_bitwise_equal(quant.per_block_cast_with_sf_only(x, "e4m3", (128, 128), **FLAGS[flags]), want.sf)


@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
def test_direct_kernel_row_order_and_max_lowered(monkeypatch, block):
  """4001x2048 lowered for an H100: 128x128 blocks take block row ``mb - 1 - r`` in grid row ``r`` (32 block rows)
  and the e4m3 maximum 448 as a constant (no float32 scalar read from GMEM); 32x32 keeps the rows in order and reads
  the maximum from its GMEM input."""
  modules = capture_mosaic_modules(monkeypatch)
  f = functools.partial(quant.per_block_cast, fmt="e4m3", block_size=block, **FLAGS["C"], implementation="pallas")
  lower_for_h100(f, jax.ShapeDtypeStruct((4001, 2048), jnp.bfloat16))
  assert len(modules) == 1
  text = modules[0]
  mb = -(-4001 // block[0])
  row = re.search(r"(%\w+) = arith.index_cast %block_id_y : index to i32", text).group(1)  # grid row (CUDA y)
  reversed_ = re.search(rf"= arith.subi %c{mb - 1}_i32(_\d+)?, {row} : i32", text) is not None
  gmem_max = re.search(r"memref.load %\w+\[\] : memref<f32, strided<\[\]>>", text)
  if block == (128, 128):
    assert reversed_ and not gmem_max and "arith.constant 4.480000e+02 : f32" in text
  else:
    assert not reversed_ and gmem_max


def test_direct_tiles():
  from jaxkern.quant import _per_block_cast as pbc
  assert pbc._direct_tiles(576, (32, 32)) == (4, 5, (4, 32), (2, 32))
  assert pbc._direct_tiles(512, (32, 32)) == (4, 4, (4, 32), (4, 32))
  assert pbc._direct_tiles(576, (128, 128)) == (1, 5, (1, 128), (1, 64))
  assert pbc._direct_tiles(64, (32, 32)) == (2, 1, (2, 32), (2, 32))
  assert 576 <= pbc.CHUNKED_MAX_K < 1088  # the chunked 128x128 cases above end at K = 1024, whole rows from 1088


# 32x32: tiles of 4 blocks and a last one of 2 (K = 576), all of 4 (K = 384, 2048, 7168), one CTA column of 4 blocks
# (K = 128); 128x128 in chunks (K = 576) and whole rows (K = 2048, 7168).
@pytest.mark.parametrize("m, k, block", [(4001, 576, (32, 32)), (8001, 2048, (32, 32)), (4096, 7168, (32, 32)),
                                         (4001, 384, (32, 32)), (4096, 128, (32, 32)),
                                         (4001, 576, (128, 128)), (4001, 2048, (128, 128)), (8064, 7168, (128, 128))])
def test_direct_kernel_lowers_for_h100(m, k, block):
  s = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  for flags in ("A", "B", "C"):
    f = functools.partial(quant.per_block_cast, fmt="e4m3", block_size=block, **FLAGS[flags], implementation="pallas")
    assert "mosaic_gpu" in lower_for_h100(f, s).as_text()
  g = functools.partial(quant.per_block_cast_with_sf_only, fmt="e4m3", block_size=block, **FLAGS["C"],
                        implementation="pallas")
  assert "mosaic_gpu" in lower_for_h100(g, s).as_text()


@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
def test_direct_kernel_has_no_xla_epilogue(block):
  """Layout C from bf16 32x32 / 128x128 blocks: the kernel writes the final sf (no XLA packing or broadcast)."""
  f = functools.partial(quant.per_block_cast, fmt="e4m3", block_size=block, **FLAGS["C"], implementation="pallas")
  text = lower_for_h100(f, jax.ShapeDtypeStruct((4001, 576), jnp.bfloat16)).as_text()
  ops = {op for op in re.findall(r"= stablehlo\.([a-z_]+)", text)} - {"constant", "custom_call"}
  assert not ops, ops


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, block", [
    (4001, 576, (32, 32)), (8001, 576, (32, 32)), (8001, 2048, (32, 32)), (37, 64, (32, 32)), (4001, 320, (32, 32)),
    (4001, 384, (32, 32)), (4096, 128, (32, 32)), (4001, 576, (128, 128)), (8001, 576, (128, 128)),
    (4001, 2048, (128, 128)), (8064, 2560, (128, 128)), (4001, 512, (128, 128))], ids=str)
def test_direct_kernel_gpu(key, m, k, block):
  """The direct kernel, compiled, against the reference: layouts A, B, C (32x32 layout C's bytes stored per warp,
  128x128 byte by byte; the sf divisions by div.rn.f32 for 32x32 and for 128x128 with K <= CHUNKED_MAX_K, K = 2048
  and 2560 above it) and the sf-only form."""
  x = _input(key, m, k, jnp.bfloat16)
  x = x.at[m - 1, k - 1].set(jnp.bfloat16(3e4))
  for flags in ("A", "B", "C"):
    got = jax.jit(lambda x: quant.per_block_cast(x, "e4m3", block, **FLAGS[flags]))(x)
    assert_same(got, ref.per_block_cast(x, "e4m3", block, **FLAGS[flags]))
  sf = jax.jit(lambda x: quant.per_block_cast_with_sf_only(x, "e4m3", block, **FLAGS["C"]))(x)
  assert_bitwise_equal(sf, got.sf)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
@pytest.mark.parametrize("flags", ["A-round", "B-round", "C"])
def test_direct_kernel_non_finite_gpu(block, flags):
  """NaN / ±inf inputs through the direct kernel (bf16 maxima, in-kernel sf layouts; a NaN block's -0 sf with
  round_sf in a partial last CTA column) against the reference."""
  x = _non_finite(4001, 576, jnp.bfloat16)
  got = jax.jit(lambda x: quant.per_block_cast(x, "e4m3", block, **NON_FINITE_FLAGS[flags]))(x)
  assert_same(got, jax.jit(lambda x: ref.per_block_cast(x, "e4m3", block, **NON_FINITE_FLAGS[flags]))(x))

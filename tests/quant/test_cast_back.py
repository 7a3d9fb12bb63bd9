import functools

import chex
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
  q = quant.per_token_cast(x, fmt, npc, use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True)
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
  want = ref.unpack_from_e2m1fn_x2(b, out_dtype=dtype)
  assert_bitwise_equal(quant.unpack_from_e2m1fn_x2(b, out_dtype=dtype), want)
  assert_bitwise_equal(quant.unpack_from_e2m1fn_x2(b.astype(jnp.uint8), out_dtype=dtype), want)
  assert quant.unpack_from_e2m1fn_x2(jnp.zeros((0, 8), jnp.int8), out_dtype=dtype).shape == (0, 16)


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
  assert quant.per_token_cast_back(q, "bf16", 128, implementation="interpret").shape == (0, 128)
  (d,) = jaxkern.explain(lambda q: quant.per_token_cast_back(q, "bf16", 128, implementation="pallas"), q)
  assert d.path == "xla" and d.op == "per_token_cast_back" and "zero-size" in d.reason
  q = (jnp.zeros((0, 64), jnp.int8), jnp.zeros((1, 0), jnp.int32))
  assert quant.per_token_cast_back(q, "fp32", 128, x_use_tma_aligned_col_major_sf=True).shape == (0, 128)


def test_jit_does_not_retrace(key):
  _, q = _quantised(key, 64, 128, (1, 64), "A")

  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(q):
    return quant.per_token_cast_back(q, "bf16", 64), quant.cast_back(q, "fp32", (1, 64))

  # The first interpret-mode kernel run of a process changes jit's cache key once (any op, e.g.
  # transpose): warm up outside ``f``.
  quant.per_token_cast_back(q, "bf16", 64)
  got = f(q)
  chex.assert_trees_all_equal(got, (ref.per_token_cast_back(q, "bf16", 64), ref.cast_back(q, "fp32", (1, 64))))
  f((q[0], q[1] * 2))  # same shapes: no new trace (a second one raises)


UNSUPPORTED = [  # (m, k, block, flags, qfmt, reason)
    (100, 128, (128, 1), "A", "e2m1", "packed e2m1 data with .bm, 1. blocks"),
    (40, 192, (8, 1), "A", "e4m3", r"bm % 16 == 0, got bm=8"),
    (40, 192, (1, 8), "C", "e4m3", "narrower than 16 columns"),
    (24, 576, (4, 34), "B", "e4m3", "more than 16 scale groups"),
]


@pytest.mark.parametrize("m, k, block, flags, qfmt, reason", UNSUPPORTED, ids=[u[-2] + str(u[2]) for u in UNSUPPORTED])
def test_unsupported_blocks_raise_or_run_xla(key, m, k, block, flags, qfmt, reason):
  _, q = _quantised(key, m, k, block, flags, qfmt)
  col = FLAGS[flags][0]
  with pytest.raises(jaxkern.KernelUnavailableError, match=reason):
    quant.cast_back(q, "bf16", block, x_use_tma_aligned_col_major_sf=col, implementation="interpret")
  want = ref.cast_back(q, "bf16", block, x_use_tma_aligned_col_major_sf=col)
  for impl in ("xla", "auto"):
    assert_bitwise_equal(quant.cast_back(q, "bf16", block, x_use_tma_aligned_col_major_sf=col, implementation=impl),
                         want)
  if block[0] == 1:
    with pytest.raises(jaxkern.KernelUnavailableError, match=f"per_token_cast_back.*{reason}"):
      quant.per_token_cast_back(q, "bf16", block[1], x_use_tma_aligned_col_major_sf=col, implementation="pallas")


def test_unpack_other_dtypes_raise_or_run_xla():
  b = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8).reshape(4, 64)
  with pytest.raises(jaxkern.KernelUnavailableError, match="out_dtype float16"):
    quant.unpack_from_e2m1fn_x2(b, out_dtype=jnp.float16, implementation="interpret")
  for impl in ("xla", "auto"):
    got = quant.unpack_from_e2m1fn_x2(b, out_dtype=jnp.float16, implementation=impl)
    assert_bitwise_equal(got, ref.unpack_from_e2m1fn_x2(b, out_dtype=jnp.float16))
  with pytest.raises(ValueError, match="out_dtype must be a floating dtype"):
    quant.unpack_from_e2m1fn_x2(b, out_dtype=jnp.int32)


def test_list_and_bool_inputs():
  """Lists are converted (and then checked like arrays); bool data is a clear ValueError."""
  with pytest.raises(ValueError, match="x must have dtype"):
    quant.unpack_from_e2m1fn_x2([1, 2, 3])  # a list of Python ints is int32
  with pytest.raises(ValueError, match=r"x\[0\] must have dtype"):
    quant.cast_back((jnp.ones((8, 64), jnp.bool_), jnp.ones((8, 1), jnp.float32)), "bf16", (1, 64))
  q = np.ones((8, 64), np.float32).astype(jnp.float8_e4m3fn)
  got = quant.cast_back((q, np.full((8, 1), 2.0, np.float32).tolist()), "fp32", (1, 64))
  assert_bitwise_equal(got, np.full((8, 64), 2.0, np.float32))


def _non_finite_pair(key, m, k, block, flags, qfmt="e4m3"):
  """A QuantTensor with NaN data (e4m3) and NaN / inf / zero scales (UE8M0 bytes 255 and 0 for layout C)."""
  _, (q, sf) = _quantised(key, m, k, block, flags, qfmt)
  if qfmt == "e4m3":
    q = q.at[1, 3].set(jnp.nan).at[m - 1, k - 1].set(jnp.nan).at[2, :].set(0.0)
  if sf.dtype == jnp.int32:  # byte 0 of word [0, 2] (row 2's first block) 255 -> inf, row 0's 0 -> 0
    sf = sf.at[0, 2].set((sf[0, 2] & ~0xFF) | 0xFF).at[0, 0].set(sf[0, 0] & ~0xFF)
  elif FLAGS[flags][0]:  # layout B (Kb, Mp)
    sf = sf.at[0, 2 // block[0]].set(jnp.inf).at[0, 0].set(jnp.nan).at[-1, -1].set(0.0)
  else:
    sf = sf.at[2 // block[0], 0].set(jnp.inf).at[0, 0].set(jnp.nan).at[-1, -1].set(-jnp.inf)
  return q, sf


@pytest.mark.parametrize("fmt", ["bf16", "fp32"])
@pytest.mark.parametrize("m, k, block, flags, qfmt", [
    (100, 576, (1, 128), "A", "e4m3"),  # row kernel, strided sf
    (7, 576, (1, 128), "C", "e4m3"),  # packed UE8M0 words decoded in the kernel
    (130, 320, (128, 128), "B", "e4m3"),  # column tiles, block rows
    (300, 192, (128, 1), "A", "e4m3"),  # per-channel kernel
    (65, 576, (1, 128), "C", "e2m1"),  # packed e2m1, UE8M0 255 / 0
    (40, 192, (1, 32), "A", "e2m1"),
])
def test_non_finite_bit_exact(key, m, k, block, flags, qfmt, fmt):
  q = _non_finite_pair(key, m, k, block, flags, qfmt)
  col = FLAGS[flags][0]
  got = quant.cast_back(q, fmt, block, x_use_tma_aligned_col_major_sf=col)
  want = ref.cast_back(q, fmt, block, x_use_tma_aligned_col_major_sf=col)
  assert_bitwise_equal(got, want)
  g = np.asarray(got.astype(jnp.float32))
  if flags == "C":  # UE8M0 byte 0: a zero scale
    assert g[0, 0] == 0
  else:  # a NaN scale
    assert np.isnan(g[0, 0])
  if qfmt == "e4m3":  # NaN data; an inf scale on a zero row: 0 * inf
    assert np.isnan(g[1, 3]) and np.isnan(g[2, 0])
  else:  # an inf scale on e2m1 data
    assert not np.isfinite(g[2, 0])  # inf, or NaN for a zero nibble


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_non_finite_tma_store_kernel(key, monkeypatch, block):
  monkeypatch.setattr(cast_back_module, "TMA_MIN_ELEMENTS", 0)
  q = _non_finite_pair(key, 130, 256, block, "A")
  assert cast_back_module._use_tma_store(q[0], q[1], block, jnp.float32, False)
  assert_bitwise_equal(quant.cast_back(q, "fp32", block), ref.cast_back(q, "fp32", block))


@pytest.mark.parametrize("q, block, fmt, match", [
    ((jnp.ones((8, 96), jnp.float8_e4m3fn), jnp.ones((8, 1), jnp.float32)), (1, 96), "bf16", "K % 64"),
    ((jnp.ones((8, 64), jnp.float8_e4m3fn), jnp.ones((8, 3), jnp.float32)), (1, 32), "bf16", r"x\[1\] \(sf\)"),
    ((jnp.ones((8, 64), jnp.float8_e4m3fn), jnp.ones((8, 2), jnp.float32)), (1, 32), "fp16", "fmt"),
    ((jnp.ones((8, 64), jnp.bfloat16), jnp.ones((8, 2), jnp.float32)), (1, 32), "bf16", r"x\[0\] must have dtype"),
    ((jnp.ones((8, 64), jnp.float8_e4m3fn), jnp.ones((8, 2), jnp.float16)), (1, 32), "bf16", r"x\[1\] must have dtype"),
    ((jnp.ones((8, 64), jnp.float8_e4m3fn), jnp.ones((8, 2), jnp.float32)), (0, 32), "bf16", "x_block_size"),
    ([jnp.ones((8, 64), jnp.float8_e4m3fn), jnp.ones((8, 2), jnp.float32)], (1, 32), "bf16", "QuantTensor"),
])
def test_bad_inputs(q, block, fmt, match):
  with pytest.raises(ValueError, match=match):
    quant.cast_back(q, fmt, block)


def test_special_fmt_is_keyword_and_rejected():
  q = (jnp.ones((8, 64), jnp.float8_e4m3fn), jnp.ones((8, 1), jnp.float32))
  with pytest.raises(ValueError, match="x_special_fmt must be None or 'e5m6'"):
    quant.cast_back(q, "bf16", (1, 64), x_special_fmt="e4m3")
  with pytest.raises(ValueError, match="x_special_fmt must be None or 'e5m6'"):
    ref.per_token_cast_back(q, "bf16", 64, x_special_fmt="e4m3")
  with pytest.raises(TypeError):
    quant.cast_back(q, "bf16", (1, 64), None)  # keyword-only


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
  f = lambda b: quant.unpack_from_e2m1fn_x2(b, out_dtype=dtype, implementation="pallas")
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
    assert_bitwise_equal(jax.jit(lambda b: quant.unpack_from_e2m1fn_x2(b, out_dtype=dtype))(b),
                         ref.unpack_from_e2m1fn_x2(b, out_dtype=dtype))


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


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp32"])
@pytest.mark.parametrize("m, k, block, flags", [(4001, 2560, (1, 128), "A"), (4001, 576, (128, 128), "C"),
                                                (4001, 576, (128, 1), "A"), (4001, 2560, (128, 128), "A")])
def test_non_finite_gpu(key, m, k, block, flags, fmt):
  """NaN / inf data and scales through the row, per-channel and TMA-store kernels on the GPU against
  the reference compiled by XLA (canonical NaNs on both sides)."""
  q = _non_finite_pair(key, m, k, block, flags)
  col = FLAGS[flags][0]
  got = jax.jit(lambda q: quant.cast_back(q, fmt, block, x_use_tma_aligned_col_major_sf=col))(q)
  assert_bitwise_equal(got, jax.jit(lambda q: ref.cast_back(q, fmt, block, x_use_tma_aligned_col_major_sf=col))(q))

"""E5M6: the reference against an independent numpy transcription of the format (docs/quant.md, Number formats), the kernels against the
reference (interpret mode), lowering for an H100, argument checks and differentiation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkern
from jaxkern import quant
from jaxkern.quant import _validate as validate
from jaxkern.reference import quant as ref
from jaxkern.testing import assert_bitwise_equal, assert_diff_below, capture_mosaic_modules, lower_for_h100, randn

FLAGS = {"A": (False, False, False), "A_round": (False, True, False), "B": (True, False, False),
         "B_round": (True, True, False), "C": (True, True, True)}


def _flags(name):
  col, rnd, packed = FLAGS[name]
  return dict(use_tma_aligned_col_major_sf=col, round_sf=rnd, use_packed_ue8m0=packed)


# An independent numpy / Python transcription of upstream's recipe (the oracle of the reference).

def _np_fp16_rtz(u: int) -> int:
  sign, e, f = (u >> 16) & 0x8000, (u >> 23) & 0xFF, u & 0x7FFFFF
  if e == 255:
    return sign | (0x7FFF if f else 0x7C00)
  if e >= 143:
    return sign | 0x7C00
  if e >= 113:
    return sign | ((e - 112) << 10) | (f >> 13)
  if e >= 103:
    return sign | ((0x800000 | f) >> (126 - e))
  return sign


def _np_encode(v) -> np.ndarray:
  out = []
  for u in np.asarray(v, np.float32).ravel().view(np.uint32).tolist():
    t = _np_fp16_rtz(u) >> 4
    if (t & 1) + (u & 0x1FFFF) > 0x10000:
      t += 1
    out.append(t & 0xFFF)
  return np.array(out, np.int64).reshape(np.shape(v))


def _np_pack(codes) -> np.ndarray:
  """96-bit big-endian groups of 8 codes as three little-endian uint32 words, as bytes."""
  m, k = codes.shape
  words = []
  for row in codes.tolist():
    for g in range(k // 8):
      bits = 0
      for t in row[8 * g:8 * g + 8]:
        bits = (bits << 12) | t
      words += [(bits >> 64) & 0xFFFFFFFF, (bits >> 32) & 0xFFFFFFFF, bits & 0xFFFFFFFF]
  return np.array(words, "<u4").view(np.uint8).reshape(m, 3 * k // 2)


def _special_values():
  tiny = [2.0**-20, 1.5 * 2.0**-20, 2.0**-21, 2.0**-24, 2.0**-25, (63 / 64) * 2.0**-14, 2.0**-14, 2.0**-15,
          2.0**-14 * (1 + 2.0**-7), 2.0**-14 * (1 + 3 * 2.0**-7)]
  big = [65024.0, 65024.0 * (1 + 2.0**-23), 65535.0, 65536.0, 1e30, 3.4e38, 1.0, 1.0 + 2.0**-7,
         1.0 + 3 * 2.0**-7, 1.0 + 2.0**-7 + 2.0**-23, 1.0 + 2.0**-7 - 2.0**-24, 2.0 - 2.0**-8, 1e-40, 1e-45]
  mags = np.array(tiny + big + [0.0, np.inf, np.nan], np.float32)
  return np.concatenate([mags, -mags])


def test_reference_encoder_matches_numpy_recipe():
  rng = np.random.default_rng(0)
  rand = np.concatenate([
      np.ldexp(rng.standard_normal(2000), rng.integers(-30, 17, 2000)).astype(np.float32),
      rng.integers(0, 2**32, 2000, dtype=np.uint32).view(np.float32),  # any bit pattern
  ])
  v = np.concatenate([rand, _special_values()])
  assert_bitwise_equal(np.asarray(ref.encode_e5m6(jnp.asarray(v))).astype(np.int64), _np_encode(v))


def test_encoder_is_round_to_nearest_even_in_the_normal_range():
  """Above 2^-14 the recipe is RNE from float32 to E5M6: ties to even, e.g. 1 + 2^-7 -> 1, 1 + 3·2^-7 -> 1 + 2^-5."""
  v = np.array([1 + 2.0**-7, 1 + 3 * 2.0**-7, 1 + 2.0**-7 + 2.0**-23, -0.0, 65024.0, 2.0**-14, 1.5 * 2.0**-20],
               np.float32)
  codes = np.asarray(ref.encode_e5m6(jnp.asarray(v)))
  assert codes.tolist() == [0x3C0, 0x3C2, 0x3C1, 0x800, 0x7BF, 0x040, 0x001]  # the last: upstream's quirk


def test_kernel_encoder_matches_reference_encoder():
  """The kernels' shorter integer recipe (``_encode_code``) against the reference's on every exponent with
  edge and random mantissas (both signs) and on random bit patterns."""
  from jaxkern.quant._e5m6 import _encode_code
  rng = np.random.default_rng(1)
  mants = np.concatenate([np.array([0, 1, 0xFFFF, 0x10000, 0x10001, 0x1FFFF, 0x20000, 0x30000, 0x400000, 0x7E0000,
                                    0x7EFFFF, 0x7F0000, 0x7FFFFF], np.uint32),
                          rng.integers(0, 1 << 23, 64, dtype=np.uint32)])
  u = ((np.arange(256, dtype=np.uint32)[:, None] << 23) | mants[None, :]).ravel()
  u = np.concatenate([u, u | 0x80000000, rng.integers(0, 2**32, 1 << 16, dtype=np.uint32)])
  v = jnp.asarray(u.view(np.float32))
  np.testing.assert_array_equal(jax.jit(_encode_code)(v), jax.jit(ref.encode_e5m6)(v))


class _NumpyDialects:
  """Stand-ins for the MLIR dialects that the lane-level kernel code calls (``ir``, ``arith``, ``llvm``), on numpy
  uint32 arrays: the lane formulas run on the CPU. ``cvt.rz.f16x2.f32`` (a zero high half) is IEEE round toward
  zero to fp16: the recipe's integer fp16 step, except that finite magnitudes from 65536 on saturate to 65504
  (0x7BFF) instead of going to infinity (the GPU tests check the conversion itself)."""

  class IntegerType:
    get_signless = staticmethod(lambda bits: bits)

  class F32Type:
    get = staticmethod(lambda: np.float32)

  class CmpIPredicate:
    ult = "ult"

  constant = staticmethod(lambda t, v: t(v) if t is np.float32 else np.uint32(v & 0xFFFFFFFF))
  bitcast = staticmethod(lambda _, x: x.view(np.uint32))
  shli, shrui = staticmethod(np.left_shift), staticmethod(np.right_shift)
  andi, ori, addi = staticmethod(np.bitwise_and), staticmethod(np.bitwise_or), staticmethod(np.add)
  extui = staticmethod(lambda _, p: p.astype(np.uint32))

  @staticmethod
  def cmpi(pred, a, b):
    assert pred == "ult"
    return a < b

  @staticmethod
  def _cvt_rz_f16(f):
    u = f.view(np.uint32)
    h = np.asarray(ref.fp16_rtz_bits(jnp.asarray(u.view(np.int32)))).astype(np.uint32)
    a = u & 0x7FFFFFFF
    return np.where((a >= 0x47800000) & (a < 0x7F800000), (h & 0x8000) | 0x7BFF, h).astype(np.uint32)

  @staticmethod
  def inline_asm(_, args, asm, constraints):
    cvt = _NumpyDialects._cvt_rz_f16
    if asm == "cvt.rz.f16x2.f32 $0, $2, $1;":  # one value, a zero high half
      assert constraints == "=r,f,f" and args[1] == 0
      return cvt(args[0])
    if asm == "cvt.rz.f16x2.f32 $0, $1, $2;":  # the first operand into the high half
      assert constraints == "=r,f,f"
      return (cvt(args[0]) << 16) | cvt(args[1])
    assert asm.startswith("prmt.b32 $0, $1, $2, ") and constraints == "=r,r,r"
    selector = int(asm.split(", ")[-1].rstrip(";"), 16)
    source = (args[1].astype(np.uint64) << 32) | args[0].astype(np.uint64)  # byte i of b:a, a's bytes 0-3
    out = np.zeros_like(args[0])
    for i in range(4):
      out |= (((source >> np.uint64(8 * ((selector >> 4 * i) & 7))) & np.uint64(0xFF)).astype(np.uint32) << (8 * i))
    return out


def test_lane_formulas_match_reference(monkeypatch):
  """The Mosaic GPU kernels' lane-level code on numpy: codes (``_lane_code``, every exponent with edge mantissas,
  ±inf, the canonical NaN and random patterns), the words (``_lane_words``) and the decoder's fp16 pairs
  (``_lane_half_pairs``) against the reference."""
  from jaxkern.quant import _e5m6 as e5
  for name in ("ir", "arith", "llvm"):
    monkeypatch.setattr(e5, name, _NumpyDialects)
  rng = np.random.default_rng(2)
  mants = np.concatenate([np.array([0, 1, 0xFFFF, 0x10000, 0x10001, 0x1FFFF, 0x20000, 0x7FFFFF], np.uint32),
                          rng.integers(0, 1 << 23, 32, dtype=np.uint32)])
  u = ((np.arange(255, dtype=np.uint32)[:, None] << 23) | mants[None, :]).ravel()  # every finite exponent
  u = np.concatenate([np.array([0x7FFFFFFF, 0x7F800000], np.uint32), u, u | 0x80000000, np.array([0xFF800000], np.uint32),
                      rng.integers(0, 0x7F800000, 1 << 14, dtype=np.uint32) | (rng.integers(0, 2, 1 << 14,
                                                                                   dtype=np.uint32) << 31)])
  u = u[: len(u) // 8 * 8].reshape(-1, 8)
  v = u.view(np.float32)
  codes = [e5._lane_code(v[:, c].copy()) for c in range(8)]
  want = np.asarray(ref.encode_e5m6(jnp.asarray(v))).astype(np.uint32)
  assert_bitwise_equal(np.stack(codes, axis=1), want)
  words = e5._lane_words(codes)
  want_words = np.asarray(ref.pack_e5m6(jnp.asarray(want.astype(np.int32)))).view("<u4").reshape(-1, 3)
  assert_bitwise_equal(np.stack(words, axis=1), want_words)
  pairs = e5._lane_half_pairs(*words)
  halves = np.stack([h for p in pairs for h in (p >> 16, p & 0xFFFF)], axis=1)
  assert_bitwise_equal(halves, want << 4)


def test_lane_pair_formulas_match_reference(monkeypatch):
  """The encoder's pair code on numpy (:func:`_lane_pair_bits`: two values per conversion, the bumps added in
  place; :func:`_lane_pair_words`: the words as byte permutations) against the reference, on every value it is
  given on the GPU: all but the finite magnitudes from 65536 on (those rows take :func:`_lane_code`)."""
  from jaxkern.quant import _e5m6 as e5
  for name in ("ir", "arith", "llvm"):
    monkeypatch.setattr(e5, name, _NumpyDialects)
  rng = np.random.default_rng(5)
  mants = np.concatenate([np.array([0, 1, 0xFFFF, 0x10000, 0x10001, 0x1FFFF, 0x20000, 0x7FFFFF], np.uint32),
                          rng.integers(0, 1 << 23, 32, dtype=np.uint32)])
  u = ((np.arange(143, dtype=np.uint32)[:, None] << 23) | mants[None, :]).ravel()  # every exponent below 2^16
  u = np.concatenate([np.array([0x7FFFFFFF, 0x7F800000, 0xFF800000], np.uint32), u, u | 0x80000000,
                      rng.integers(0, 0x47800000, 1 << 14, dtype=np.uint32) | (rng.integers(0, 2, 1 << 14,
                                                                                   dtype=np.uint32) << 31)])
  u = np.concatenate([u, rng.permutation(u)])  # every value both first and second in a pair
  u = u[: len(u) // 8 * 8].reshape(-1, 8)
  v = u.view(np.float32)
  want = np.asarray(ref.encode_e5m6(jnp.asarray(v))).astype(np.uint32)
  blocks = [e5._lane_pair_bits(v[:, c].copy(), v[:, c + 1].copy()) for c in range(0, 8, 2)]
  assert_bitwise_equal(np.stack([b >> 20 for b in blocks] + [(b >> 8) & 0xFFF for b in blocks], axis=1),
                       want[:, [0, 2, 4, 6, 1, 3, 5, 7]])
  want_words = np.asarray(ref.pack_e5m6(jnp.asarray(want.astype(np.int32)))).view("<u4").reshape(-1, 3)
  assert_bitwise_equal(np.stack(e5._lane_pair_words(blocks), axis=1), want_words)


def test_lane_pair_exact_formula_matches_reference(monkeypatch):
  """The encoder's pair code for bf16 rows with ``round_sf`` whose ``sf_inv = 2^k`` is at least 1 (every row of
  amax up to 65024; k at most 29 from the amax clamp): :func:`_lane_pair_bits_exact`, the bumps from the bf16 pair's
  mantissa bits, on numpy, against the reference. Exhaustive: every finite bf16 pattern times every 2^k, k = 0..30,
  that keeps it up to 65024 (1,015,746 values), each once as the first and once as the second value of a pair with
  the same k; and the words of groups of eight (:func:`_lane_pair_words`)."""
  from jaxkern.quant import _e5m6 as e5

  class Dialects(_NumpyDialects):
    bitcast = staticmethod(lambda t, x: x.view(np.float32) if t is np.float32 else x.view(np.uint32))
    mulf = staticmethod(lambda a, b: (a * b).astype(np.float32))

  for name in ("ir", "arith", "llvm"):
    monkeypatch.setattr(e5, name, Dialects)
  rng = np.random.default_rng(6)
  b = np.arange(1 << 16, dtype=np.uint32)
  b = b[(b & 0x7F80) != 0x7F80]  # finite bf16 patterns
  lo, hi, scale, groups, group_scale = [], [], [], [], []
  for k in range(31):
    s = np.float32(2.0**k)
    v = b[np.abs((b << 16).view(np.float32)) <= np.float32(65024.0) / s]  # exact: a power of two
    lo.append(v)
    hi.append(rng.permutation(v))  # a partner of the same k; every value once in each half
    scale.append(np.full(len(v), s))
    g = rng.permutation(v)[: len(v) // 8 * 8].reshape(-1, 8)
    groups.append(g)
    group_scale.append(np.full((len(g), 1), s))
  lo, hi, scale = np.concatenate(lo), np.concatenate(hi), np.concatenate(scale)
  assert len(lo) == 1015746
  encode = jax.jit(lambda f: ref.encode_e5m6(f).astype(jnp.uint32))
  value = lambda h, s: (h << 16).view(np.float32) * s
  got = e5._lane_pair_bits_exact(lo | (hi << 16), scale)
  assert_bitwise_equal(np.stack([got >> 20, (got >> 8) & 0xFFF], axis=1),
                       np.stack([encode(value(lo, scale)), encode(value(hi, scale))], axis=1))
  g, gs = np.concatenate(groups), np.concatenate(group_scale)
  want_words = np.asarray(ref.pack_e5m6(encode(value(g, gs)).astype(jnp.int32))).view("<u4").reshape(-1, 3)
  blocks = [e5._lane_pair_bits_exact(g[:, c] | (g[:, c + 1] << 16), gs[:, 0]) for c in range(0, 8, 2)]
  assert_bitwise_equal(np.stack(e5._lane_pair_words(blocks), axis=1), want_words)


def test_pack_unpack_and_decode_match_numpy():
  rng = np.random.default_rng(1)
  codes = rng.integers(0, 4096, (3, 48))
  packed = ref.pack_e5m6(jnp.asarray(codes, jnp.int32))
  assert_bitwise_equal(packed, _np_pack(codes))
  assert_bitwise_equal(np.asarray(ref.unpack_e5m6(packed)).astype(np.int64), codes)
  every = np.arange(4096)
  want = (every << 4).astype(np.uint16).view(np.float16).astype(np.float32)
  got = np.asarray(ref.decode_e5m6(jnp.asarray(every, jnp.int32)))
  assert_bitwise_equal(got[~np.isnan(want)], want[~np.isnan(want)])
  assert np.isnan(got[np.isnan(want)]).all()


def _inputs(key, m, k, dtype):
  """``randn`` rows, then upstream's constant rows (2^-20, (63/64)·2^-14, 2^-14, last column 65024) and a row of
  special values (signed zeros, rounding boundaries)."""
  x = randn(key, (m, k), jnp.float32)
  consts = [2.0**-20, (63 / 64) * 2.0**-14, 2.0**-14]
  for i, c in enumerate(consts[:m]):
    x = x.at[i].set(c).at[i, k - 1].set(65024.0)
  if m > 3:
    specials = np.resize(_special_values()[np.isfinite(_special_values())], k)
    x = x.at[3].set(jnp.asarray(specials))
  return x.astype(dtype)


CASES = [  # m, k, dtype, flags
    (5, 64, jnp.float32, "A"),  # fewer rows than a layout block (padded)
    (37, 576, jnp.bfloat16, "C"),  # ragged rows: the last CTA moved back
    (130, 192, jnp.float32, "B_round"),
    (16, 576, jnp.float32, "A_round"),
    (20, 128, jnp.bfloat16, "B"),
]


CASE_IDS = [f"{m}x{k}-{jnp.dtype(d).name}-{f}" for m, k, d, f in CASES]


@pytest.mark.parametrize("m, k, dtype, flags", CASES, ids=CASE_IDS)
def test_cast_and_cast_back_bit_exact(key, m, k, dtype, flags):
  x = _inputs(key, m, k, dtype)
  f = _flags(flags)
  got = quant.per_token_cast_to_e5m6(x, k, **f)
  assert got.data.dtype == jnp.uint8 and got.data.shape == (m, 3 * k // 2)
  assert_bitwise_equal(got, ref.per_token_cast_to_e5m6(x, k, **f))
  col = f["use_tma_aligned_col_major_sf"]
  for fmt in ("bf16", "fp32"):
    back = quant.cast_back_e5m6(got, fmt, (1, k), x_use_tma_aligned_col_major_sf=col)
    assert_bitwise_equal(back, ref.cast_back_e5m6(got, fmt, (1, k), x_use_tma_aligned_col_major_sf=col))


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 1e-4)])
def test_round_trip_and_dispatching_ops(key, dtype, tol):
  x = randn(key, (24, 256), dtype)
  q = quant.per_token_cast(x, "e5m6", 256, **_flags("C"))
  assert_bitwise_equal(q, quant.per_token_cast_to_e5m6(x, 256, **_flags("C")))
  back = quant.cast_back(q, "fp32", (1, 256), x_special_fmt="e5m6", x_use_tma_aligned_col_major_sf=True)
  assert_bitwise_equal(back, quant.per_token_cast_back(q, "fp32", 256, x_special_fmt="e5m6"))
  assert_bitwise_equal(back, ref.cast_back(q, "fp32", (1, 256), x_special_fmt="e5m6"))
  assert_diff_below(back, x.astype(jnp.float32), tol)
  assert_bitwise_equal(q, ref.per_token_cast(x, "e5m6", 256, **_flags("C")))


def test_all_zero_and_non_finite_rows(key):
  """A zero row (sf 2^-29 with round_sf, data ±0), and NaN / inf rows: same bits from kernel and reference."""
  x = randn(key, (20, 64), jnp.float32).at[0].set(0.0).at[1].set(-0.0).at[2, 5].set(jnp.nan).at[3, 7].set(-jnp.inf)
  for flags in ("A", "A_round"):
    got = quant.per_token_cast_to_e5m6(x, 64, **_flags(flags))
    assert_bitwise_equal(got, ref.per_token_cast_to_e5m6(x, 64, **_flags(flags)))
    for fmt in ("bf16", "fp32"):
      assert_bitwise_equal(quant.cast_back_e5m6(got, fmt, (1, 64)), ref.cast_back_e5m6(got, fmt, (1, 64)))
  data = np.asarray(ref.unpack_e5m6(got.data))
  assert float(got.sf[0, 0]) == 2.0**-29 and (data[0] == 0).all() and (data[1] == 0x800).all()


def test_other_blocks_run_xla(key):
  x = randn(key, (8, 64), jnp.float32)
  q = ref.per_token_cast_to_e5m6(x, 32)  # the reference's npc dividing K: two scales per row
  with pytest.raises(jaxkern.KernelUnavailableError, match="one sf per row"):
    quant.cast_back_e5m6(q, "fp32", (1, 32), implementation="interpret")
  assert_bitwise_equal(quant.cast_back_e5m6(q, "fp32", (1, 32), implementation="xla"),
                       ref.cast_back_e5m6(q, "fp32", (1, 32)))


def test_zero_rows():
  q = quant.per_token_cast_to_e5m6(jnp.zeros((0, 64), jnp.bfloat16), 64, **_flags("C"))
  assert q.data.shape == (0, 96) and q.sf.shape == (1, 0) and q.sf.dtype == jnp.int32
  assert quant.per_token_cast_to_e5m6(jnp.zeros((0, 64), jnp.float32), 64).sf.shape == (0, 1)
  assert quant.cast_back_e5m6(q, "bf16", (1, 64)).shape == (0, 64)
  (d,) = jaxkern.explain(lambda x: quant.per_token_cast_to_e5m6(x, 64, implementation="pallas"),
                         jax.ShapeDtypeStruct((0, 64), jnp.float32))
  assert d.path == "xla" and "zero-size" in d.reason


@pytest.mark.parametrize("args, match", [
    ((jnp.ones((8, 60), jnp.float32), 60), r"x.shape\[1\] must be a multiple of 8"),
    ((jnp.ones((8, 64), jnp.float32), 32), "num_per_channels must equal K=64"),
    ((jnp.ones((8, 64), jnp.float16), 64), "x must have dtype"),
    ((jnp.ones((64,), jnp.float32), 64), "x must have rank 2"),
])
def test_cast_bad_inputs(args, match):
  with pytest.raises(ValueError, match=match):
    quant.per_token_cast_to_e5m6(*args)


def test_cast_bad_flags_and_dispatch():
  x = jnp.ones((8, 64), jnp.float32)
  with pytest.raises(ValueError, match="use_packed_ue8m0 requires"):
    quant.per_token_cast_to_e5m6(x, 64, use_packed_ue8m0=True)
  with pytest.raises(ValueError, match="fmt='e5m6' needs a plain"):
    quant.per_token_cast(x, "e5m6", 64, x_block_size=(1, 64))


@pytest.mark.parametrize("x, fmt, block, match", [
    ((jnp.ones((8, 96), jnp.int8), jnp.ones((8, 1), jnp.float32)), "bf16", (1, 64), r"x\[0\] must have dtype"),
    ((jnp.ones((8, 90), jnp.uint8), jnp.ones((8, 1), jnp.float32)), "bf16", (1, 60), r"x\[0\].shape\[1\] must be"),
    ((jnp.ones((8, 96), jnp.uint8), jnp.ones((8, 2), jnp.float32)), "bf16", (1, 64), r"x\[1\] \(sf\) must have shape"),
    ((jnp.ones((8, 96), jnp.uint8), jnp.ones((8, 1), jnp.float16)), "bf16", (1, 64), r"x\[1\] must have dtype"),
    ((jnp.ones((8, 96), jnp.uint8), jnp.ones((8, 1), jnp.float32)), "fp16", (1, 64), "fmt"),
    ((jnp.ones((8, 96), jnp.uint8), jnp.ones((8, 1), jnp.float32)), "bf16", (0, 64), "x_block_size"),
    ([jnp.ones((8, 96), jnp.uint8), jnp.ones((8, 1), jnp.float32)], "bf16", (1, 64), "QuantTensor"),
])
def test_cast_back_bad_inputs(x, fmt, block, match):
  with pytest.raises(ValueError, match=match):
    quant.cast_back_e5m6(x, fmt, block)


def test_not_differentiable(key):
  x = randn(key, (8, 64), jnp.float32)
  with pytest.raises(jaxkern.NotDifferentiableError, match="per_token_cast_to_e5m6"):
    jax.grad(lambda x: quant.per_token_cast_to_e5m6(x, 64).sf.sum())(x)
  q = ref.per_token_cast_to_e5m6(x, 64)
  with pytest.raises(jaxkern.NotDifferentiableError, match="cast_back_e5m6"):
    jax.grad(lambda s: quant.cast_back_e5m6((q.data, s), "fp32", (1, 64)).sum())(q.sf)


@pytest.mark.parametrize("m, k", [(8001, 7168), (4001, 576)])
@pytest.mark.parametrize("flags", ["A", "C"])
def test_lowers_for_h100(m, k, flags):
  f = _flags(flags)
  for dtype in (jnp.float32, jnp.bfloat16):
    cast = lambda x: quant.per_token_cast_to_e5m6(x, k, **f, implementation="pallas")
    assert "mosaic_gpu" in lower_for_h100(cast, jax.ShapeDtypeStruct((m, k), dtype)).as_text()
  col, packed = f["use_tma_aligned_col_major_sf"], f["use_packed_ue8m0"]
  sf = jax.ShapeDtypeStruct(validate.sf_shape(m, 1, col_major=col, packed=packed), jnp.int32 if packed else jnp.float32)
  for fmt in ("bf16", "fp32"):
    back = lambda q, s: quant.cast_back_e5m6((q, s), fmt, (1, k), implementation="pallas")
    assert "mosaic_gpu" in lower_for_h100(back, jax.ShapeDtypeStruct((m, 3 * k // 2), jnp.uint8), sf).as_text()


@pytest.mark.parametrize("m, k, dtype, flags, exact", [
    (4001, 2048, jnp.bfloat16, "A_round", True), (4001, 2048, jnp.bfloat16, "C", True),
    (8001, 7168, jnp.bfloat16, "C", True),  # the prefetch grid
    (4001, 2048, jnp.bfloat16, "A", False), (4001, 2048, jnp.float32, "C", False)])
def test_exact_pair_code_lowers_for_h100(monkeypatch, m, k, dtype, flags, exact):
  """Where the encoder takes the exact pair code (:func:`_lane_pair_bits_exact`: bf16 with ``round_sf`` only),
  lowered for an H100: its rows' branch on ``sf_inv >= 1`` (the pattern 0x3F800000) and its bump mask 0x00100010
  in the Mosaic GPU module."""
  modules = capture_mosaic_modules(monkeypatch)
  cast = lambda x: quant.per_token_cast_to_e5m6(x, k, **_flags(flags), implementation="pallas")
  lower_for_h100(cast, jax.ShapeDtypeStruct((m, k), dtype))
  (text,) = modules
  assert ("arith.constant 1065353216 : i32" in text) == exact
  assert ("arith.constant 1048592 : i32" in text) == exact


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_every_exponent_gpu(dtype):
  """The kernels' codes for values spread over every exponent (edge and random mantissas, both signs, float32
  subnormals) and random patterns up to 65024: each row holds 65024 in its first column, so that with a
  power-of-two sf (1) the scaled values are the inputs; and every code decoded (layouts A and C, both outputs)."""
  rng = np.random.default_rng(3)
  mants = np.concatenate([np.array([0, 1, 0xFFFF, 0x10000, 0x10001, 0x1FFFF, 0x20000, 0x7FFFFF], np.uint32),
                          rng.integers(0, 1 << 23, 56, dtype=np.uint32)])
  u = ((np.arange(143, dtype=np.uint32)[:, None] << 23) | mants[None, :]).ravel()
  u = np.concatenate([u, u | 0x80000000, rng.integers(0, 0x477E0001, 1 << 16, dtype=np.uint32) | (
      rng.integers(0, 2, 1 << 16, dtype=np.uint32) << 31)])
  v = u.view(np.float32)
  v = v[np.abs(v) <= 65024.0]
  k = 1024
  rows = -(-len(v) // (k - 1))
  x = np.zeros((rows, k), np.float32)
  x[:, 0] = 65024.0
  x[:, 1:].flat[: len(v)] = v
  x = jnp.asarray(x).astype(dtype)
  f = _flags("A_round")
  got = jax.jit(lambda x: quant.per_token_cast_to_e5m6(x, k, **f))(x)
  assert_bitwise_equal(got, ref.per_token_cast_to_e5m6(x, k, **f))
  codes = np.resize(np.arange(4096, dtype=np.int32), (48, 768))
  q = ref.pack_e5m6(jnp.asarray(codes))
  scales = np.ldexp(1.0, rng.integers(-20, 20, 48)).astype(np.float32) * rng.uniform(1, 2, 48).astype(np.float32)
  packed = jnp.asarray(rng.integers(127 - 40, 127 + 20, (1, 48), dtype=np.int32))  # UE8M0 bytes, layout C
  for sf, col in ((jnp.asarray(scales).reshape(48, 1), False), (packed, True)):
    for fmt in ("bf16", "fp32"):
      back = jax.jit(lambda q, s: quant.cast_back_e5m6((q, s), fmt, (1, 768), x_use_tma_aligned_col_major_sf=col))
      assert_bitwise_equal(back(q, sf), ref.cast_back_e5m6((q, sf), fmt, (1, 768), x_use_tma_aligned_col_major_sf=col))


def _every_scale_rows(k):
  """bf16 rows of ``k`` columns: every finite bf16 value up to 65024 (both signs), with 65024 in each row's first
  column, scaled by 2^-e for e = 0..29 (with ``round_sf``: ``sf_inv = 2^e``, every power of two from 1 up to the
  amax clamp's); then the same rows led by 65280 (the bf16 value after 65024) and by 2^100 (amax above 65024)."""
  v = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
  v = v[np.abs(v) <= 65024.0]  # NaN and inf compare false
  block = np.zeros((-(-len(v) // (k - 1)), k), np.float32)
  block[:, 1:].flat[: len(v)] = v
  block[:, 0] = 65024.0
  over = [np.concatenate([np.full((len(block), 1), a, np.float32), block[:, 1:]], axis=1) for a in (65280.0, 2.0**100)]
  return jnp.asarray(np.concatenate([block * np.float32(2.0**-e) for e in range(30)] + over)).astype(jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("flags", ["A_round", "C"])
def test_exact_pair_code_every_scale_gpu(flags):
  """The compiled encoder on bf16 rows with ``round_sf`` at every ``sf_inv`` it takes the exact pair code for
  (:func:`_lane_pair_bits_exact`, ``2^0`` to ``2^29``, every finite bf16 value up to 65024 scaled) and on rows of
  amax above 65024 (the per-value codes), against the reference."""
  x = _every_scale_rows(2048)
  f = _flags(flags)
  got = jax.jit(lambda x: quant.per_token_cast_to_e5m6(x, 2048, **f))(x)
  assert_bitwise_equal(got, jax.jit(lambda x: ref.per_token_cast_to_e5m6(x, 2048, **f))(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("m, k, flags, non_finite", [
    (20, 64, "A", True), (20, 64, "A_round", True), (20, 64, "C", True),
    (5, 64, "A", False), (37, 576, "C", False), (130, 192, "C", False), (4001, 2048, "A", False),
    (300, 24, "A", False), (128, 4096, "C", False),
])
def test_non_finite_and_small_shapes_gpu(key, m, k, flags, non_finite, dtype):
  """The compiled kernels on NaN / inf / zero rows and on the CPU tests' shapes (every register layout the
  lane-level code maps: rows per thread, groups per thread, padded and ragged rows). One case per test, so that
  parallel workers split the compilations and the eager reference runs."""
  if non_finite:
    x = randn(key, (m, k), jnp.float32).at[0].set(0.0).at[1].set(-0.0).at[2, 5].set(jnp.nan).at[3, 7].set(-jnp.inf)
    x = x.at[4, 9].set(jnp.inf).astype(dtype)
  else:
    x = _inputs(key, m, k, dtype)
  got = quant.per_token_cast_to_e5m6(x, k, **_flags(flags))
  assert_bitwise_equal(got, ref.per_token_cast_to_e5m6(x, k, **_flags(flags)))
  col = _flags(flags)["use_tma_aligned_col_major_sf"]
  for fmt in ("bf16", "fp32"):
    assert_bitwise_equal(quant.cast_back_e5m6(got, fmt, (1, k), x_use_tma_aligned_col_major_sf=col),
                         ref.cast_back_e5m6(got, fmt, (1, k), x_use_tma_aligned_col_major_sf=col))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("flags", ["A", "C"])
@pytest.mark.parametrize("m, k", [(8001, 7168), (4001, 576)])
def test_spec_shapes_gpu(key, m, k, flags, dtype):
  x = _inputs(key, m, k, dtype)
  f = _flags(flags)
  got = jax.jit(lambda x: quant.per_token_cast_to_e5m6(x, k, **f))(x)
  assert_bitwise_equal(got, jax.jit(lambda x: ref.per_token_cast_to_e5m6(x, k, **f))(x))
  sf = np.asarray(ref.sf_to_float(got.sf, m, 1))
  values = np.asarray(ref.decode_e5m6(ref.unpack_e5m6(got.data)))
  for fmt, out_dtype in (("bf16", jnp.bfloat16), ("fp32", np.float32)):
    col_major = f["use_tma_aligned_col_major_sf"]
    back = jax.jit(lambda q: quant.cast_back_e5m6(q, fmt, (1, k), x_use_tma_aligned_col_major_sf=col_major))(got)
    assert_bitwise_equal(back, ref.cast_back_e5m6(got, fmt, (1, k), x_use_tma_aligned_col_major_sf=col_major))
    # NaN results are the canonical NaN (docstring); numpy's product keeps other NaN bits: compare values.
    np.testing.assert_array_equal(np.asarray(back, np.float32), (values * sf).astype(out_dtype).astype(np.float32))


# The encoder's register prefetch (bfloat16, ``_e5m6._PREFETCH_MIN_K <= K <= _PREFETCH_MAX_K``: a persistent grid,
# each CTA a run of consecutive row blocks, the next one loaded before the current one is coded).

def _non_finite_rows(key, m, k, dtype):
  """``randn`` rows with a zero, a negative-zero, a NaN, a -inf and an inf row at the top and a NaN, an inf and a
  zero row at the bottom (other blocks of other runs)."""
  x = randn(key, (m, k), jnp.float32).at[0].set(0.0).at[1].set(-0.0).at[2, 5].set(jnp.nan).at[3, 7].set(-jnp.inf)
  x = x.at[4, 9].set(jnp.inf).at[m - 1, k - 1].set(jnp.nan).at[m - 2, 0].set(jnp.inf).at[m - 3].set(0.0)
  return x.astype(dtype)


def test_prefetch_blocks_per_cta():
  """Where the prefetch grid runs and how many blocks each CTA takes (132 SMs when lowering off a GPU)."""
  from jaxkern.quant._e5m6 import _prefetch_blocks_per_cta
  assert _prefetch_blocks_per_cta(8001, jnp.bfloat16, 7168) == 21  # 381 CTAs of 21 blocks
  assert _prefetch_blocks_per_cta(999, jnp.bfloat16, 7168) == 3
  assert _prefetch_blocks_per_cta(396, jnp.bfloat16, 7168) is None  # one block per CTA anyway
  assert _prefetch_blocks_per_cta(8001, jnp.float32, 7168) is None
  assert _prefetch_blocks_per_cta(8001, jnp.bfloat16, 2048) is None
  assert _prefetch_blocks_per_cta(8001, jnp.bfloat16, 16384) is None  # wider rows: not measured


@pytest.fixture
def prefetch_everywhere(monkeypatch):
  """The prefetch grid for every bf16 width and sized for one SM, so that small CPU shapes give each CTA several
  blocks (the loop, the last run moved back over its neighbour's blocks)."""
  from jaxkern.quant import _e5m6
  monkeypatch.setattr(_e5m6, "_PREFETCH_MIN_K", 8)
  monkeypatch.setattr(_e5m6._config, "num_sms", lambda: 1)
  _e5m6._encode_kernel.clear_cache()
  yield
  _e5m6._encode_kernel.clear_cache()


PREFETCH_CASES = [  # m, k, flags, non-finite rows (bf16, one SM)
    (11, 7168, "C", True),  # 1-row blocks: 11 in 3 runs of 4, the last from block 7; sf padding
    (70, 576, "A_round", True),  # 16-row blocks: 5 in runs of 2, the last block and run moved back
    (70, 576, "B", False),
]


@pytest.mark.parametrize("m, k, flags, non_finite", PREFETCH_CASES,
                         ids=[f"{m}x{k}-{f}" for m, k, f, _ in PREFETCH_CASES])
def test_prefetch_encoder_bit_exact(key, prefetch_everywhere, m, k, flags, non_finite):
  x = _non_finite_rows(key, m, k, jnp.bfloat16) if non_finite else _inputs(key, m, k, jnp.bfloat16)
  got = quant.per_token_cast_to_e5m6(x, k, **_flags(flags), implementation="interpret")
  assert_bitwise_equal(got, ref.per_token_cast_to_e5m6(x, k, **_flags(flags)))


@pytest.mark.parametrize("flags", ["A_round", "B"])
def test_prefetch_encoder_lowers_for_h100(flags):
  cast = lambda x: quant.per_token_cast_to_e5m6(x, 7168, **_flags(flags), implementation="pallas")
  assert "mosaic_gpu" in lower_for_h100(cast, jax.ShapeDtypeStruct((8001, 7168), jnp.bfloat16)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("m, flags", [
    (8001, "A_round"), (8001, "C"), (999, "A_round"), (999, "B"), (999, "C"), (1000, "C")])
def test_prefetch_encoder_gpu(key, m, flags):
  """The compiled encoder on its prefetch grid (bf16, K=7168; 132 SMs: 8001 rows in 381 runs of 21 blocks, 999 in
  333 of 3, 1000 in 334 of 3, the last moved back) against the reference, with non-finite rows."""
  x = _non_finite_rows(key, m, 7168, jnp.bfloat16)
  f = _flags(flags)
  got = jax.jit(lambda x: quant.per_token_cast_to_e5m6(x, 7168, **f))(x)
  assert_bitwise_equal(got, jax.jit(lambda x: ref.per_token_cast_to_e5m6(x, 7168, **f))(x))

import functools

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
from jaxkern.testing import assert_bitwise_equal, assert_diff_below, lower_for_h100, randn
from jaxkern.types import QuantTensor

FLAGS = {"A": {}, "A-round": dict(round_sf=True), "B": dict(use_tma_aligned_col_major_sf=True),
         "C": dict(use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True)}


def assert_same(got, want):
  """Same pytree structure (QuantTensor vs QuantTensor) and bit-identical leaves."""
  chex.assert_trees_all_equal_structs(got, want)
  jax.tree.map(assert_bitwise_equal, got, want)


def _input(key, m, k, dtype):
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, (m, k)) * jnp.exp2(jax.random.randint(k2, (m, 1), -20, 20).astype(jnp.float32))
  return x.astype(dtype)


def _both(f, *args, **kw):
  """``f`` under the session's implementation (the kernel) and its reference in jaxkern.reference.quant."""
  return f(*args, **kw), getattr(ref, f.__name__)(*args, **kw)


@pytest.mark.parametrize("m, k, npc, dtype, flags", [
    (100, 576, 128, jnp.bfloat16, "A"),  # partial last group: one column segment per group
    (100, 576, 128, jnp.bfloat16, "C"),
    (72, 576, 576, jnp.float32, "A-round"),  # one sf per row
    (40, 320, 32, jnp.bfloat16, "C"),  # groups as view rows, shifted last block
    (130, 192, 192, jnp.bfloat16, "B"),  # one sf per row, 130 rows: the last block overlaps
    (9, 448, 16, jnp.float32, "A"),  # 252 view rows of 16: the last block overlaps
    (65, 576, 576, jnp.bfloat16, "C"),  # packed sf written by the kernel, 3 zero padding rows
    (130, 320, 64, jnp.float32, "C"),  # column segments, 2 packed words per row, 2 padding rows
    (65, 576, 128, jnp.float32, "B"),  # column segments, layout B written by the kernel
])
def test_per_token_cast_bit_exact(key, m, k, npc, dtype, flags):
  x = _input(key, m, k, dtype)
  got, want = _both(quant.per_token_cast, x, "e4m3", npc, **FLAGS[flags])
  assert isinstance(got, QuantTensor)
  assert_same(got, want)
  assert_bitwise_equal(quant.per_token_cast_with_sf_only(x, "e4m3", npc, **FLAGS[flags]), want.sf)


@pytest.mark.parametrize("m, k, npc, dtype, flags", [
    (1, 576, 32, jnp.bfloat16, "C"),  # one row
    (7, 576, 128, jnp.float32, "A"),  # partial last group: column segments
    (65, 320, 16, jnp.bfloat16, "A-round"),
    (130, 576, 576, jnp.float32, "B"),  # one sf per row
    (65, 192, 64, jnp.float32, "C"),
    (130, 320, 320, jnp.bfloat16, "A"),
    (65, 576, 128, jnp.bfloat16, "C"),  # packed sf written by the kernel
])
def test_per_token_cast_e2m1_bit_exact(key, m, k, npc, dtype, flags):
  x = _input(key, m, k, dtype)
  got, want = _both(quant.per_token_cast, x, "e2m1", npc, **FLAGS[flags])
  assert got.data.dtype == jnp.int8 and got.data.shape == (m, k // 2)
  assert_same(got, want)
  assert_bitwise_equal(quant.per_token_cast_with_sf_only(x, "e2m1", npc, **FLAGS[flags]), want.sf)


@pytest.mark.parametrize("m, k, npc, dtype, fmt, flags", [
    (37, 384, 128, jnp.bfloat16, "e4m3", "C"),  # 3 groups: one short chunk, 3 padding rows
    (100, 576, 64, jnp.float32, "e4m3", "C"),  # 9 groups: chunks of 4, 4 and 1
    (37, 576, 32, jnp.bfloat16, "e4m3", "B"),  # 18 groups, layout B
    (100, 384, 32, jnp.float32, "e2m1", "C"),
    (37, 384, 64, jnp.bfloat16, "e2m1", "B"),
])
def test_groups_dividing_k_sf_written_by_kernel(key, m, k, npc, dtype, fmt, flags):
  """Groups dividing K with a column-major sf: the rows' groups are column segments, chunks of
  them per CTA, and the kernel writes layout B / C (padding rows zeroed) itself."""
  x = _input(key, m, k, dtype)
  got, want = _both(quant.per_token_cast, x, fmt, npc, **FLAGS[flags])
  assert_same(got, want)
  assert_bitwise_equal(quant.per_token_cast_with_sf_only(x, fmt, npc, **FLAGS[flags]), want.sf)


def test_e2m1_precomputed_sf_bit_exact(key):
  x = _input(key, 65, 576, jnp.float32)
  sf = ref.per_token_cast(x, "e2m1", 128).sf * 0.37  # saturation at ±6 bites
  got, want = _both(quant.per_token_cast_with_precomputed_sf, x, "e2m1", 128, sf)
  assert_bitwise_equal(got, want)
  assert np.any(np.abs(np.asarray(quant.unpack_from_e2m1fn_x2(got))) == 6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_e2m1_special_values(dtype):
  """Ties to even, saturation, signed zeros and tiny values; with round_sf and amax 6 the sf is 1."""
  row = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, -0.1, 0.24, -5.5, 1e-30, -1e-30, 0.0, 2.0]
  want_nibbles = [7, 0, 2, 2, 4, 4, 6, 6, 8, 8, 0, 15, 0, 8, 0, 4]
  x = jnp.asarray(np.tile(np.asarray(row, np.float32), (4, 4)), dtype)
  got, want = _both(quant.per_token_cast, x, "e2m1", 16, round_sf=True)
  assert_same(got, want)
  assert np.all(np.asarray(got.sf) == 1.0)
  b = np.asarray(got.data).view(np.uint8)[0, :8]
  assert list(np.stack([b & 0xF, b >> 4], -1).reshape(-1)) == want_nibbles
  zeros = jnp.zeros((4, 64), dtype).at[1].set(-0.0)
  out, sf = quant.per_token_cast(zeros, "e2m1", 32, round_sf=True)
  assert np.all(np.asarray(out[0]) == 0) and np.all(np.asarray(out[1]).view(np.uint8) == 0x88)
  assert np.all(np.asarray(sf) == 2.0**-126)


@pytest.mark.parametrize("npc", [32, 576])
def test_precomputed_sf_bit_exact(key, npc):
  x = _input(key, 80, 576, jnp.bfloat16)
  sf = ref.per_token_cast(x, "e4m3", npc).sf * 0.37  # the ±448 clamp bites
  got, want = _both(quant.per_token_cast_with_precomputed_sf, x, "e4m3", npc, sf)
  assert_bitwise_equal(got, want)
  assert np.any(np.abs(np.asarray(got, np.float32)) == 448)


def test_sf_matches_numpy_division(key):
  """sf = RN(max(amax, 1e-4) / 448) computed by numpy (IEEE) on the host, independent of XLA."""
  x = _input(key, 64, 512, jnp.float32)
  _, sf = quant.per_token_cast(x, "e4m3", 128)
  a = np.abs(np.asarray(x)).reshape(64, 4, 128).max(-1)
  want = np.maximum(a, np.float32(1e-4)) / np.float32(448)
  assert_bitwise_equal(sf, want.astype(np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("round_sf", [False, True])
def test_round_trip_error(key, dtype, round_sf):
  x = _input(key, 64, 256, dtype)
  q = quant.per_token_cast(x, "e4m3", 128, round_sf=round_sf)
  back = np.asarray(quant.per_token_cast_back(q, "fp32", 128))
  xf = np.asarray(x, np.float32)
  # e4m3 has 3 mantissa bits: relative error at most 2^-4 for |q| >= 2^-6 of the group scale.
  amax = np.abs(xf).reshape(64, 2, 128).max(-1).repeat(128, 1)
  assert np.all(np.abs(back - xf) <= np.maximum(np.abs(xf) * 2.0**-4, amax * 2.0**-9 * 2))
  assert_diff_below(back, xf, 1e-3)


def test_special_values():
  """Zero rows (sf clamp), signed zeros, max finite, a row of ties; flag C decodes to the same sf."""
  rows = np.zeros((8, 64), np.float32)
  rows[1] = -0.0
  rows[2, :] = np.float32(3.4028235e38)
  rows[2, 1::2] *= -1
  rows[3, :] = 1e-30
  rows[3, 0] = 448 * 2.0**-9 * 3  # amax -> sf exactly 2^-9·3/... ties in the quantised values
  rows[4] = np.linspace(-448, 448, 64)
  rows[5] = 2.0**-10 * np.arange(64)  # e4m3 subnormal boundaries after scaling
  rows[5, -1] = 448.0
  x = jnp.asarray(rows)
  for flags in (FLAGS["A"], FLAGS["B"]):
    assert_same(*_both(quant.per_token_cast, x, "e4m3", 64, **flags))
  out, sf = quant.per_token_cast(x, "e4m3", 64)
  bits = np.asarray(out).view(np.uint8)
  assert np.all(bits[0] == 0) and np.all(bits[1] == 0x80)
  assert np.all(np.abs(np.asarray(out[2], np.float32)) == 448)
  assert float(sf[0, 0]) == np.float32(np.float32(1e-4) / np.float32(448))
  _, sf = quant.per_token_cast(x, "e4m3", 64, round_sf=True)
  assert float(sf[0, 0]) == 2.0**-22


def _non_finite_rows(m, k, dtype):
  """Rows with one NaN, -NaN, +inf, -inf (rows 0-3 in the first group, rows 4-7 in the last column),
  a row of a NaN and an inf, the rest random."""
  x = np.array(_input(jax.random.key(3), m, k, jnp.float32))
  for i, v in enumerate([np.nan, -np.float32(np.nan), np.inf, -np.inf]):
    x[i, 5] = x[4 + i, k - 1] = v
  x[8, 1], x[8, 9] = np.inf, np.nan
  return jnp.asarray(x).astype(dtype)


@pytest.mark.parametrize("fmt, flags, dtype, m, k, npc", [
    ("e4m3", "A", jnp.float32, 40, 192, 64),  # groups as view rows
    ("e4m3", "A-round", jnp.bfloat16, 40, 192, 192),  # one sf per row
    ("e4m3", "B", jnp.float32, 40, 192, 128),  # partial last group: column segments
    ("e4m3", "C", jnp.bfloat16, 40, 192, 64),  # column segments, packed sf written by the kernel
    ("e2m1", "A", jnp.bfloat16, 40, 192, 64),
    ("e2m1", "A-round", jnp.float32, 40, 192, 128),
    ("e2m1", "B", jnp.bfloat16, 40, 192, 192),
    ("e2m1", "C", jnp.float32, 40, 256, 128),
])
def test_non_finite_inputs_bit_exact(fmt, flags, dtype, m, k, npc):
  """NaN / ±inf rows: kernel and reference give the same bits (documented in per_token_cast's docstring)."""
  x = _non_finite_rows(m, k, dtype)
  got, want = _both(quant.per_token_cast, x, fmt, npc, **FLAGS[flags])
  assert_same(got, want)
  assert_bitwise_equal(quant.per_token_cast_with_sf_only(x, fmt, npc, **FLAGS[flags]), want.sf)
  sf = np.asarray(ref.sf_to_float(got.sf, m, -(-k // npc), use_tma_aligned_col_major_sf=flags in ("B", "C")))
  for row in (0, 1, 8):  # NaN groups: sf NaN, or -0.0 with round_sf (UE8M0 byte 0 decodes as +0.0)
    if FLAGS[flags].get("round_sf"):
      assert sf[row, 0] == 0 and (flags == "C" or np.signbit(sf[row, 0]))
    else:
      assert sf[row, 0].view(np.uint32) == ref.CANONICAL_NAN
  assert sf[2, 0] == np.inf and sf[3, 0] == np.inf and sf[6, -1] == np.inf
  data = np.asarray(got.data).view(np.uint8)
  if not FLAGS[flags].get("round_sf"):  # sf_inv NaN: the whole group is +NaN
    assert np.all(data[0, :8] == (0x7F if fmt == "e4m3" else 0x77))


def test_non_finite_precomputed_sf():
  x = _non_finite_rows(40, 192, jnp.float32)
  sf = jnp.full((40, 3), 0.01, jnp.float32)
  for fmt in ("e4m3", "e2m1"):
    assert_same(*_both(quant.per_token_cast_with_precomputed_sf, x, fmt, 64, sf))


def test_zero_tokens():
  x = jnp.zeros((0, 576), jnp.bfloat16)
  out, sf = quant.per_token_cast(x, "e4m3", 128)
  assert out.shape == (0, 576) and sf.shape == (0, 5)
  assert quant.per_token_cast(x, "e4m3", 128, **FLAGS["C"]).sf.shape == (2, 0)
  assert quant.per_token_cast(x, "e2m1", 32).data.shape == (0, 288)
  out, sf = quant.per_token_cast(x[:, :384], "e4m3", 64, **FLAGS["C"])
  assert out.shape == (0, 384) and sf.shape == (2, 0) and sf.dtype == jnp.int32
  assert quant.per_token_cast_with_sf_only(x, "e4m3", 128).shape == (0, 5)
  sf = jnp.zeros((0, 5), jnp.float32)
  assert quant.per_token_cast_with_precomputed_sf(x, "e2m1", 128, sf).shape == (0, 288)
  assert jaxkern.explain(quant.per_token_cast, x, "e4m3", 128, implementation="pallas")[0].path == "xla"


def test_unsupported_plain_input():
  """A partial last group with more than 16 groups per row: no kernel plan; 'pallas' / 'interpret' raise,
  'xla' / 'auto' run the reference."""
  x = _input(jax.random.key(1), 8, 280, jnp.float32)  # 18 groups of 16, the last one 8 wide
  sf = jnp.full((8, 18), 0.01, jnp.float32)
  calls = [(quant.per_token_cast, (x, "e4m3", 16)), (quant.per_token_cast_with_sf_only, (x, "e2m1", 16)),
           (quant.per_token_cast_with_precomputed_sf, (x, "e4m3", 16, sf))]
  for f, args in calls:
    with pytest.raises(jaxkern.KernelUnavailableError, match="more than 16 groups"):
      f(*args, implementation="interpret")
    want = getattr(ref, f.__name__)(*args)
    for impl in ("xla", "auto"):
      assert_same(f(*args, implementation=impl), want)
    assert jaxkern.explain(f, *args, implementation="auto")[0].path in ("xla", "reference")


def test_bool_and_list_inputs():
  with pytest.raises(ValueError, match="x must have dtype"):
    quant.per_token_cast(jnp.ones((8, 64), jnp.bool_), "e4m3", 32)
  rows = np.asarray(_input(jax.random.key(2), 16, 64, jnp.float32))
  assert_same(quant.per_token_cast(rows.tolist(), "e4m3", 32), ref.per_token_cast(jnp.asarray(rows), "e4m3", 32))
  with pytest.raises(ValueError, match="x must be an array"):
    quant.per_token_cast("x", "e4m3", 32)


def test_jit_does_not_retrace(key):
  x = _input(key, 64, 256, jnp.bfloat16)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(x):
    return quant.per_token_cast(x, "e4m3", 128, **FLAGS["C"])

  got = f(x)
  got = f(x + 1)
  assert_same(got, ref.per_token_cast(x + 1, "e4m3", 128, **FLAGS["C"]))


def test_jit_and_vmap(key):
  x = _input(key, 2 * 64, 256, jnp.bfloat16).reshape(2, 64, 256)
  f = jax.jit(jax.vmap(functools.partial(quant.per_token_cast, fmt="e4m3", num_per_channels=128)))
  got = f(x)
  for b in range(2):
    assert_same(jax.tree.map(lambda v: v[b], got), ref.per_token_cast(x[b], "e4m3", 128))


@settings(max_examples=2, deadline=None)
@given(m=st.integers(1, 70), kc=st.integers(1, 6), npc=st.sampled_from([16, 32, 64, 128, 0]))
def test_hypothesis_shapes(m, kc, npc):
  k = 64 * kc
  npc = npc or k
  x = _input(jax.random.key(m * 7 + kc), m, k, jnp.bfloat16)
  assert_same(*_both(quant.per_token_cast, x, "e4m3", npc, **FLAGS["C"]))


@pytest.mark.parametrize("kw, match", [
    (dict(x=jnp.ones((8, 64), jnp.float16)), "x must have dtype"),
    (dict(x=jnp.ones((64,), jnp.float32)), "x must have rank 2"),
    (dict(npc=48), "num_per_channels"),
    (dict(x=jnp.ones((8, 96), jnp.float32), npc=96), "num_per_channels"),
    (dict(fmt="e5m2"), "fmt"),
    (dict(flags=dict(round_sf=True, use_packed_ue8m0=True)), "use_packed_ue8m0"),
    (dict(flags=dict(use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)), "use_packed_ue8m0"),
    (dict(fmt="e2m1", x=jnp.ones((8, 65), jnp.float32), npc=16), r"x.shape\[1\] must be a multiple of 2"),
    (dict(flags=dict(x_block_size=(1, 32))), "x_block_size must be None"),
])
def test_bad_inputs(kw, match):
  x = kw.get("x", jnp.ones((8, 64), jnp.float32))
  with pytest.raises(ValueError, match=match):
    quant.per_token_cast(x, kw.get("fmt", "e4m3"), kw.get("npc", 32), **kw.get("flags", {}))


def test_keyword_only_options():
  x = jnp.ones((8, 64), jnp.float32)
  with pytest.raises(TypeError):
    quant.per_token_cast(x, "e4m3", 32, None, True)  # pylint: disable=too-many-function-args


def test_bad_precomputed_sf():
  x = jnp.ones((8, 64), jnp.float32)
  with pytest.raises(ValueError, match="sf must have shape"):
    quant.per_token_cast_with_precomputed_sf(x, "e4m3", 32, jnp.ones((8, 3), jnp.float32))
  with pytest.raises(ValueError, match="use_tma_aligned_col_major_sf"):
    quant.per_token_cast_with_precomputed_sf(x, "e4m3", 32, jnp.ones((8, 2), jnp.float32),
                                             use_tma_aligned_col_major_sf=True)
  with pytest.raises(ValueError, match="no QuantTensor"):
    quant.per_token_cast_with_sf_only((x, x), "e4m3", 32)


E4M3_LOWERING = [
    (4001, 576, 32, jnp.float32, "C"), (4001, 576, 128, jnp.bfloat16, "A"), (8001, 7168, 128, jnp.bfloat16, "C"),
    (8001, 7168, 7168, jnp.bfloat16, "C"), (8001, 7168, 7168, jnp.float32, "A"), (4096, 576, 576, jnp.float32, "B"),
    (4096, 2048, 16, jnp.bfloat16, "A"), (4001, 576, 128, jnp.bfloat16, "C"), (8001, 576, 128, jnp.float32, "B"),
    (4001, 7168, 64, jnp.float32, "B"), (8001, 7168, 32, jnp.bfloat16, "C"),
]
E2M1_LOWERING = [
    (4001, 576, 32, jnp.float32, "C"), (8001, 7168, 128, jnp.bfloat16, "C"), (4001, 576, 576, jnp.bfloat16, "A"),
    (8001, 7168, 16, jnp.float32, "A"), (4001, 576, 128, jnp.float32, "C"), (8001, 576, 576, jnp.bfloat16, "B"),
]


@pytest.mark.parametrize("fmt, m, k, npc, dtype, flags",
                         [("e4m3", *c) for c in E4M3_LOWERING] + [("e2m1", *c) for c in E2M1_LOWERING])
def test_lowers_for_h100(fmt, m, k, npc, dtype, flags):
  s = jax.ShapeDtypeStruct((m, k), dtype)
  f = functools.partial(quant.per_token_cast, fmt=fmt, num_per_channels=npc, **FLAGS[flags],
                        implementation="pallas")
  text = lower_for_h100(f, s).as_text()
  assert "mosaic_gpu" in text
  # Column-major sf: written by the kernel, no XLA reformatting or broadcast (e2m1 groups under 128
  # run as view rows and XLA reformats their sf: faster on the H200).
  if FLAGS[flags].get("use_tma_aligned_col_major_sf") and (fmt == "e4m3" or npc >= 128):
    assert "stablehlo.transpose" not in text and "stablehlo.broadcast" not in text
  if fmt == "e4m3":
    g = functools.partial(quant.per_token_cast_with_sf_only, fmt=fmt, num_per_channels=npc, implementation="pallas")
    assert "mosaic_gpu" in lower_for_h100(g, s).as_text()
  sf = jax.ShapeDtypeStruct((m, -(-k // npc)), jnp.float32)
  h = lambda x, sf: quant.per_token_cast_with_precomputed_sf(x, fmt, npc, sf, implementation="pallas")
  assert "mosaic_gpu" in lower_for_h100(h, s, sf).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("npc", [32, 128, 7168])
@pytest.mark.parametrize("flags", ["A", "C"])
def test_spec_shapes_gpu(key, npc, flags):
  """On the GPU the kernel's divisions must be IEEE: compare with numpy's float32 division."""
  x = randn(key, (8001, 7168), jnp.bfloat16)
  out, sf = jax.jit(functools.partial(quant.per_token_cast, fmt="e4m3", num_per_channels=npc, **FLAGS[flags]))(x)
  xf = np.asarray(x, np.float32).reshape(8001, -1, npc)
  a = np.maximum(np.abs(xf).max(-1), np.float32(1e-4))
  sf_np = a / np.float32(448)
  if flags == "C":
    u = sf_np.view(np.int32)
    e = ((u - 1) >> 23) + 1
    sf_np, inv = (e << 23).view(np.float32), ((254 - e) << 23).view(np.float32)
  else:
    inv = np.float32(448) / a
  q = np.clip(xf * inv[..., None], -448, 448).reshape(8001, 7168).astype(jnp.float8_e4m3fn)
  assert_bitwise_equal(out, q)
  assert_bitwise_equal(ref.sf_to_float(sf, 8001, 7168 // npc, use_tma_aligned_col_major_sf=flags == "C"), sf_np)


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, npc, dtype", [
    (4001, 576, 32, jnp.bfloat16), (8001, 7168, 128, jnp.float32), (8001, 7168, 7168, jnp.bfloat16),
])
def test_spec_shapes_e2m1_gpu(key, m, k, npc, dtype):
  """The GPU kernel against the reference run by XLA on the host CPU (IEEE divisions there)."""
  x = _input(key, m, k, dtype)
  cpu = jax.devices("cpu")[0]
  for flags in ("C", "A"):
    got = jax.jit(lambda x: quant.per_token_cast(x, "e2m1", npc, **FLAGS[flags]))(x)
    want = jax.jit(lambda x: ref.per_token_cast(x, "e2m1", npc, **FLAGS[flags]))(jax.device_put(x, cpu))
    assert_same(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("m, npc, flags", [(4001, 128, "C"), (8001, 576, "C"), (4001, 576, "B"), (8001, 128, "B")])
def test_small_spec_shapes_sf_written_by_kernel_gpu(key, m, npc, flags):
  """K=576: layouts B / C written by the kernel, against the reference run by XLA on the host CPU."""
  x = _input(key, m, 576, jnp.bfloat16)
  got = jax.jit(lambda x: quant.per_token_cast(x, "e4m3", npc, **FLAGS[flags]))(x)
  want = jax.jit(lambda x: ref.per_token_cast(x, "e4m3", npc, **FLAGS[flags]))(jax.device_put(x, jax.devices("cpu")[0]))
  assert_same(got, want)


def _poisoned_call(f, x):
  """``f(x)`` right after freeing all-ones buffers shaped like its outputs, so that on a GPU unwritten
  output elements (sf padding rows included) are likely to hold garbage."""
  for o in jax.tree.leaves(jax.eval_shape(f, x)):
    jnp.full(o.shape, -1, jnp.int8 if o.dtype.itemsize == 1 else o.dtype).block_until_ready()
  return f(x)


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, npc, dtype, fmt, flags", [
    (37, 384, 128, jnp.bfloat16, "e4m3", "C"), (100, 576, 32, jnp.float32, "e4m3", "C"),
    (4001, 7168, 64, jnp.float32, "e4m3", "B"), (8001, 7168, 128, jnp.bfloat16, "e4m3", "C"),
    (100, 576, 64, jnp.bfloat16, "e2m1", "C"), (4001, 7168, 128, jnp.float32, "e2m1", "C"),
])
def test_groups_dividing_k_sf_written_by_kernel_gpu(key, m, k, npc, dtype, fmt, flags):
  """Kernel-written layouts B / C on poisoned memory, against the reference run by XLA on the host CPU."""
  x = _input(key, m, k, dtype)
  got = _poisoned_call(jax.jit(lambda x: quant.per_token_cast(x, fmt, npc, **FLAGS[flags])), x)
  want = jax.jit(lambda x: ref.per_token_cast(x, fmt, npc, **FLAGS[flags]))(jax.device_put(x, jax.devices("cpu")[0]))
  assert_same(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("flags", sorted(FLAGS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda v: jnp.dtype(v).name)
@pytest.mark.parametrize("m, k, npc", [(4001, 576, 128), (4001, 512, 32), (4001, 576, 576)])
def test_non_finite_inputs_gpu(fmt, flags, dtype, m, k, npc):
  """NaN / ±inf rows: the compiled kernel against the reference on the GPU and on the host CPU (the
  definition, canonical NaN included, is the same on every backend)."""
  x = _non_finite_rows(m, k, dtype)
  f = lambda x: quant.per_token_cast(x, fmt, npc, **FLAGS[flags])
  got = jax.jit(f)(x)
  assert_same(got, jax.jit(lambda x: ref.per_token_cast(x, fmt, npc, **FLAGS[flags]))(x))
  assert_same(got, jax.jit(lambda x: ref.per_token_cast(x, fmt, npc, **FLAGS[flags]))(
      jax.device_put(x, jax.devices("cpu")[0])))
  sf = jnp.full((m, -(-k // npc)), 0.01, jnp.float32)
  assert_bitwise_equal(jax.jit(lambda x: quant.per_token_cast_with_precomputed_sf(x, fmt, npc, sf))(x),
                       ref.per_token_cast_with_precomputed_sf(x, fmt, npc, sf))

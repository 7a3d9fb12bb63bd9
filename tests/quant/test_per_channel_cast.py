"""Per-channel casts (kernel in interpret mode on CPU, or the implementation the run selects) against a
numpy oracle and the ``jnp`` reference."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jaxkern
from jaxkern import quant
from jaxkern.quant import _per_channel_cast as module
from jaxkern.reference import quant as ref
from jaxkern.testing import assert_bitwise_equal, randn
from jaxkern.types import QuantTensor


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


def _assert_quant_equal(got, want):
  assert isinstance(got, QuantTensor)
  chex.assert_trees_all_equal_shapes_and_dtypes(got, QuantTensor(*want))
  assert_bitwise_equal(got.data, want[0])
  assert_bitwise_equal(got.sf, want[1])


@pytest.mark.parametrize("round_sf", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_per_channel_cast(key, dtype, round_sf):
  x = randn(key, (256, 576), dtype)
  got = quant.per_channel_cast(x, "e4m3", 128, round_sf=round_sf)
  _assert_quant_equal(got, _oracle(np.asarray(x, np.float32), 128, round_sf))
  _assert_quant_equal(got, ref.per_channel_cast(x, "e4m3", 128, round_sf=round_sf))


@pytest.mark.parametrize("npt", [32, 128])
def test_per_channel_cast_and_transpose(key, npt):
  x = randn(key, (256, 128), jnp.bfloat16)
  got = quant.per_channel_cast_and_transpose(x, "e4m3", npt, round_sf=True)
  q, s = _oracle(np.asarray(x, np.float32), npt, True)
  _assert_quant_equal(got, (q.T, s))
  _assert_quant_equal(got, ref.per_channel_cast_and_transpose(x, "e4m3", npt, round_sf=True))


def _gathered(v, pos):
  p = np.asarray(pos)
  ok = (p >= 0) & (p < v.shape[0])
  return np.where(ok[:, None], v[np.clip(p, 0, v.shape[0] - 1)], 0.0).astype(np.float32), ok


def test_fused_gather_and_quant_tensor_input(key):
  x = randn(key, (40, 256), jnp.bfloat16)
  q_in, sf_in = quant.per_token_cast(x, "e4m3", 128, implementation="reference")
  # Mo = 144: partial last block; -1 padding and positions >= 40 (out of range) give zero rows.
  pos = jnp.asarray(np.random.default_rng(0).integers(-1, 43, 144), jnp.int32)
  got = quant.per_channel_cast_fused((q_in, sf_in), "e4m3", 128, num_per_channels=128, pos_to_token=pos)
  g, ok = _gathered(np.asarray(q_in, np.float32) * np.repeat(np.asarray(sf_in), 128, 1), pos)
  _assert_quant_equal(got, _oracle(g, 128))
  assert got.data.shape == (144, 256) and got.sf.shape == (2, 256)
  assert (~ok).any() and np.all(np.asarray(got.data).view(np.uint8)[~ok] == 0)


@pytest.mark.parametrize("dtype, round_sf", [(jnp.bfloat16, True), (jnp.float32, False)], ids=["bf16-round", "fp32"])
def test_fused_gather_plain_input(key, dtype, round_sf):
  x = randn(key, (37, 192), dtype) * 50
  pos = jnp.asarray(np.random.default_rng(1).integers(-1, 37, 272), jnp.int32)  # 2 full blocks + 16 rows
  got = quant.per_channel_cast_fused(x, "e4m3", 128, round_sf=round_sf, pos_to_token=pos)
  _assert_quant_equal(got, _oracle(_gathered(np.asarray(x, np.float32), pos)[0], 128, round_sf))


def test_fused_gather_ragged_columns_and_padding_block(key):
  """K = 576 (64-column programs), a block of padding rows only (sf at the clamp), Mo = 208."""
  x = randn(key, (50, 576), jnp.bfloat16)
  pos = jnp.asarray(np.concatenate([np.full(128, -1), np.random.default_rng(3).integers(-1, 50, 80)]), jnp.int32)
  got = quant.per_channel_cast_fused(x, "e4m3", 128, pos_to_token=pos)
  _assert_quant_equal(got, _oracle(_gathered(np.asarray(x, np.float32), pos)[0], 128))


BAD = [-2**31, -7, -2, -1, 37, 38, 1000, 2**31 - 1]  # M = 37: all but -1 are outside [-1, M)


@pytest.mark.parametrize("quant_input", [False, True], ids=["plain", "quant-tensor"])
def test_fused_gather_bad_indices_under_jit(key, quant_input):
  """Negative, -1, == M and huge entries: zero rows, kernel (Triton gather) and reference bitwise equal."""
  x = randn(key, (37, 256), jnp.bfloat16)
  npc = None
  if quant_input:
    x, npc = quant.per_token_cast(x, "e4m3", 128, implementation="reference"), 128
  rng = np.random.default_rng(4)
  pos = np.concatenate([np.array(BAD), rng.integers(0, 37, 24)]).astype(np.int32)
  pos = jnp.asarray(rng.permutation(pos))
  f = jax.jit(lambda x, p: quant.per_channel_cast_fused(x, "e4m3", 128, num_per_channels=npc, pos_to_token=p))
  got = f(x, pos)
  want = jax.jit(lambda x, p: ref.per_channel_cast_fused(x, "e4m3", 128, num_per_channels=npc, pos_to_token=p))(x, pos)
  _assert_quant_equal(got, want)
  bad = np.isin(np.asarray(pos), BAD)
  assert bad.sum() == len(BAD) and np.all(np.asarray(got.data).view(np.uint8)[bad] == 0)
  assert np.all(np.asarray(got.data).view(np.uint8)[~bad].any(axis=1))


def _checked(x, pos, implementation="xla"):
  f = lambda x, p: quant.per_channel_cast_fused(x, "e4m3", 128, pos_to_token=p, implementation=implementation)
  err, out = jax.jit(checkify.checkify(f, errors=checkify.user_checks))(x, pos)
  return err.get(), out


def test_fused_checkify_reports_the_first_bad_index(key):
  x = randn(key, (37, 128), jnp.bfloat16)
  ok = jnp.asarray(np.r_[np.arange(37), -np.ones(11)], jnp.int32)  # -1 padding is valid
  msg, out = _checked(x, ok)
  assert msg is None
  _assert_quant_equal(out, ref.per_channel_cast_fused(x, "e4m3", 128, pos_to_token=ok))
  for i, v in [(5, 37), (0, -2), (40, 2**31 - 1)]:
    msg, _ = _checked(x, ok.at[i].set(v).at[47].set(-5))  # two bad entries: the first is reported
    assert msg is not None and f"pos_to_token[{i}] = {v} is outside [-1, M=37)" in msg, msg
  bad = ok.at[9].set(-3)
  msg, out = _checked(x, bad, "interpret")  # the kernel path: the same report, zero rows as documented
  assert "pos_to_token[9] = -3" in msg and not np.asarray(out.data[9]).view(np.uint8).any()
  f = lambda x, p: quant.per_channel_cast_fused(x, "e4m3", 128, pos_to_token=p, implementation="xla")
  err, _ = checkify.checkify(jax.jit(f), errors=checkify.user_checks)(x, bad)
  assert "pos_to_token[9] = -3" in err.get()
  err, _ = checkify.checkify(f, errors=checkify.user_checks)(x, bad)  # eager, concrete: no check (documented)
  assert err.get() is None


def _compiled_hlo(f, *args):
  """The optimised HLO without metadata, source tables and the module's name."""
  text = jax.jit(f).lower(*args).compile().as_text()
  text = re.sub(r", metadata=\{[^}]*\}", "", text)
  return [line for line in text.splitlines() if "=" in line and not re.match(r"\s*\d+ \{", line)
          and not line.startswith("HloModule")]


def test_fused_check_adds_nothing_without_checkify(key, monkeypatch):
  x = randn(key, (37, 128), jnp.bfloat16)
  pos = jnp.zeros((48,), jnp.int32)
  f = lambda x, p: quant.per_channel_cast_fused(x, "e4m3", 128, pos_to_token=p, implementation="xla")
  with_check = _compiled_hlo(f, x, pos)
  monkeypatch.setattr(module, "_check_positions", lambda *a: None)
  assert _compiled_hlo(f, x, pos) == with_check
  assert any("gather" in line or "dynamic-slice" in line for line in with_check)  # the HLO is not empty


def test_fused_gather_lowers_for_h100():
  from jaxkern.testing import lower_for_h100

  pos = jax.ShapeDtypeStruct((48128,), jnp.int32)
  f = lambda x, p: quant.per_channel_cast_fused(x, "e4m3", 128, round_sf=True, pos_to_token=p, implementation="pallas")
  assert "triton" in lower_for_h100(f, jax.ShapeDtypeStruct((8001, 576), jnp.bfloat16), pos).as_text()
  qt = (jax.ShapeDtypeStruct((8001, 7168), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((8001, 56), jnp.float32))
  g = lambda x, p: quant.per_channel_cast_fused(x, "e4m3", 128, num_per_channels=128, pos_to_token=p,
                                                implementation="pallas")
  assert "triton" in lower_for_h100(g, qt, pos).as_text()


def test_fused_quant_tensor_without_gather(key):
  q_in, sf_in = quant.per_token_cast(randn(key, (128, 384), jnp.float32), "e4m3", 128, implementation="reference")
  got = quant.per_channel_cast_fused(QuantTensor(q_in, sf_in), "e4m3", 128, round_sf=True, num_per_channels=128)
  _assert_quant_equal(got, _oracle(np.asarray(q_in, np.float32) * np.repeat(np.asarray(sf_in), 128, 1), 128, True))


def _non_finite(key, shape, dtype):
  """Random values with NaN / +inf / -inf in some columns; column 5 has NaN and inf, column 6 both infs."""
  x = randn(key, shape, jnp.float32) * 10
  x = x.at[3, 0].set(jnp.nan).at[100, 1].set(jnp.inf).at[7, 2].set(-jnp.inf).at[0, 3].set(jnp.nan)
  x = x.at[9, 5].set(jnp.nan).at[10, 5].set(jnp.inf).at[1, 6].set(jnp.inf).at[2, 6].set(-jnp.inf)
  return x.at[:, 4].set(0.0).at[60, 4].set(jnp.nan).astype(dtype)  # column 4: zeros and a NaN


def _check_non_finite_semantics(out, round_sf, rows=slice(0, 128)):
  """The documented values (reference docstring) in the first block: NaN groups, inf groups."""
  sf, q = np.asarray(out.sf)[0], np.asarray(out.data.astype(jnp.float32))[rows]
  for c in (0, 3, 4, 5):  # a NaN in the group
    if round_sf:
      assert sf[c] == 0 and np.signbit(sf[c])
    else:
      assert np.isnan(sf[c]) and np.isnan(q[:, c]).all()
  for c in (1, 2, 6):  # an infinity, no NaN
    assert sf[c] == np.inf
    finite = np.isfinite(np.asarray(out.data.astype(jnp.float32)))[rows, c]
    if not round_sf:
      assert np.all(q[finite, c] == 0) and (~finite).sum() == (2 if c == 6 else 1)


@pytest.mark.parametrize("round_sf", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_non_finite_inputs_bit_exact(key, dtype, round_sf):
  x = _non_finite(key, (128, 128), dtype)
  got = quant.per_channel_cast(x, "e4m3", 128, round_sf=round_sf)
  _assert_quant_equal(got, ref.per_channel_cast(x, "e4m3", 128, round_sf=round_sf))
  _check_non_finite_semantics(got, round_sf)
  pos = jnp.asarray(np.r_[np.arange(128), -np.ones(16)], jnp.int32)  # the Triton gather kernel
  fused = quant.per_channel_cast_fused(x, "e4m3", 128, round_sf=round_sf, pos_to_token=pos)
  _assert_quant_equal(fused, ref.per_channel_cast_fused(x, "e4m3", 128, round_sf=round_sf, pos_to_token=pos))
  assert_bitwise_equal(fused.data[:128], got.data)
  assert_bitwise_equal(fused.sf[0], got.sf[0])
  if dtype == jnp.bfloat16:
    for npt in (32, 128):
      t = quant.per_channel_cast_and_transpose(x, "e4m3", npt, round_sf=round_sf)
      _assert_quant_equal(t, ref.per_channel_cast_and_transpose(x, "e4m3", npt, round_sf=round_sf))


@pytest.mark.parametrize("gather", [False, True])
def test_non_finite_quant_tensor_input_bit_exact(key, gather):
  q, sf = quant.per_token_cast(randn(key, (128, 256), jnp.float32), "e4m3", 128, implementation="reference")
  q = q.at[5, 3].set(jnp.nan)  # e4m3 NaN data
  sf = sf.at[7, 1].set(jnp.inf).at[9, 0].set(jnp.nan)  # an inf scale (its zeros -> NaN) and a NaN scale
  pos = jnp.asarray(np.r_[np.arange(128), [-1] * 16], jnp.int32) if gather else None
  got = quant.per_channel_cast_fused((q, sf), "e4m3", 128, num_per_channels=128, pos_to_token=pos)
  want = ref.per_channel_cast_fused((q, sf), "e4m3", 128, num_per_channels=128, pos_to_token=pos)
  _assert_quant_equal(got, want)
  s = np.asarray(got.sf)[0]
  assert np.isnan(s[:128]).all() and not np.isfinite(s[128:]).any()  # row 9's NaN scale; row 7's inf one


def test_zero_rows():
  for impl in ("interpret", "reference"):
    out = quant.per_channel_cast(jnp.zeros((0, 64), jnp.bfloat16), "e4m3", 128, implementation=impl)
    assert out.data.shape == (0, 64) and out.sf.shape == (0, 64)
    out = quant.per_channel_cast_and_transpose(jnp.zeros((0, 64), jnp.bfloat16), "e4m3", 32, implementation=impl)
    assert out.data.shape == (64, 0) and out.sf.shape == (0, 64)
  # M = 0 with a mapping: every row is out of range, zeros with the clamp scale (XLA, no kernel launch).
  pos = jnp.full((16,), 3, jnp.int32)
  out = quant.per_channel_cast_fused(jnp.zeros((0, 64), jnp.bfloat16), "e4m3", 128, pos_to_token=pos)
  _assert_quant_equal(out, ref.per_channel_cast_fused(jnp.zeros((0, 64), jnp.bfloat16), "e4m3", 128, pos_to_token=pos))
  assert not np.asarray(out.data).view(np.uint8).any()
  (d,) = jaxkern.explain(lambda x: quant.per_channel_cast(x, "e4m3", 128, implementation="pallas"),
                         jax.ShapeDtypeStruct((0, 64), jnp.float32))
  assert d.path == "xla" and "zero-size" in d.reason


def test_list_input_works_and_bool_input_raises():
  x = np.random.default_rng(5).standard_normal((128, 64)).astype(np.float32)
  _assert_quant_equal(quant.per_channel_cast(x.tolist(), "e4m3", 128),
                      ref.per_channel_cast(jnp.asarray(x), "e4m3", 128))
  with pytest.raises(ValueError, match="x must have dtype"):
    quant.per_channel_cast(jnp.ones((128, 64), jnp.bool_), "e4m3", 128)
  with pytest.raises(ValueError, match="x must be an array"):
    quant.per_channel_cast("x", "e4m3", 128)
  pos = list(range(16))
  got = quant.per_channel_cast_fused(jnp.asarray(x[:16]), "e4m3", 128, pos_to_token=pos)
  _assert_quant_equal(got, ref.per_channel_cast_fused(jnp.asarray(x[:16]), "e4m3", 128, pos_to_token=jnp.arange(16)))


def test_jit_does_not_retrace(key):
  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(x, p):
    return (quant.per_channel_cast(x, "e4m3", 128), quant.per_channel_cast_fused(x, "e4m3", 128, pos_to_token=p))

  x = randn(key, (128, 64), jnp.float32)
  p = jnp.arange(128, dtype=jnp.int32)
  # The first interpret-mode kernel run of a process changes jit's cache key once (any op, e.g.
  # transpose): warm up outside ``f``.
  quant.per_channel_cast(x, "e4m3", 128)
  f(x, p)
  f(x * 2, p[::-1])  # same shapes: no new trace (a second one raises)


@pytest.mark.parametrize("call, match", [
    (lambda: quant.per_channel_cast(jnp.ones((100, 64), jnp.bfloat16), "e4m3", 128), r"x.shape\[0\]"),
    (lambda: quant.per_channel_cast(jnp.ones((128, 96), jnp.bfloat16), "e4m3", 128), r"x.shape\[1\]"),
    (lambda: quant.per_channel_cast(jnp.ones((128, 64), jnp.bfloat16), "e4m3", 32), "num_per_tokens"),
    (lambda: quant.per_channel_cast(jnp.ones((128, 64), jnp.bfloat16), "e2m1", 128), "fmt"),
    (lambda: quant.per_channel_cast_and_transpose(jnp.ones((128, 64), jnp.float32), "e4m3", 32), "x must have dtype"),
    (lambda: quant.per_channel_cast_fused(jnp.ones((128, 64), jnp.bfloat16), "e4m3", 128, num_per_channels=128),
     "num_per_channels"),
    (lambda: quant.per_channel_cast_fused(jnp.ones((128, 64), jnp.bfloat16), "e4m3", 128,
                                          pos_to_token=jnp.zeros((20,), jnp.int32)), r"pos_to_token.shape\[0\]"),
    (lambda: quant.per_channel_cast_fused(jnp.ones((128, 64), jnp.bfloat16), "e4m3", 128,
                                          pos_to_token=jnp.zeros((16,), jnp.float32)), "pos_to_token must have dtype"),
    (lambda: quant.per_channel_cast_fused((jnp.ones((128, 64), jnp.float8_e4m3fn), jnp.ones((128, 1), jnp.float32)),
                                          "e4m3", 128, num_per_channels=128), r"x\[0\].shape\[1\]"),
    (lambda: quant.per_channel_cast_fused((jnp.ones((128, 128), jnp.float8_e4m3fn), jnp.ones((128, 1), jnp.float32)),
                                          "e4m3", 128), "num_per_channels"),
])
def test_bad_inputs(call, match):
  with pytest.raises(ValueError, match=match):
    call()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("k", [576, 7168])
def test_per_channel_cast_lowers_for_h100(k, dtype):
  from jaxkern.testing import lower_for_h100

  s = jax.ShapeDtypeStruct((8064, k), dtype)
  f = lambda x: quant.per_channel_cast(x, "e4m3", 128, round_sf=True, implementation="pallas")
  assert "mosaic_gpu" in lower_for_h100(f, s).as_text()
  if dtype == jnp.bfloat16:
    for npt in (32, 128):
      g = lambda x, npt=npt: quant.per_channel_cast_and_transpose(x, "e4m3", npt, implementation="pallas")
      assert "mosaic_gpu" in lower_for_h100(g, s).as_text()
  if k % 128 == 0:
    qt = (jax.ShapeDtypeStruct((8064, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((8064, k // 128), jnp.float32))
    f = lambda x: quant.per_channel_cast_fused(x, "e4m3", 128, round_sf=True, num_per_channels=128,
                                               implementation="pallas")
    assert "mosaic_gpu" in lower_for_h100(f, qt).as_text()


def test_kernel_vs_reference_ragged_columns(key):
  """K = 576: 64-column tiles (128 does not divide K)."""
  x = randn(key, (128, 576), jnp.float32) * 1000
  _assert_quant_equal(quant.per_channel_cast(x, "e4m3", 128),
                      quant.per_channel_cast(x, "e4m3", 128, implementation="reference"))


@pytest.mark.gpu
@pytest.mark.parametrize("npt", [32, 128])
def test_spec_shapes_gpu(key, npt):
  x = randn(key, (8064, 7168), jnp.bfloat16)
  got = jax.jit(lambda x: quant.per_channel_cast_and_transpose(x, "e4m3", npt))(x)
  q, s = _oracle(np.asarray(x, np.float32), npt)
  _assert_quant_equal(got, (q.T, s))


@pytest.mark.gpu
@pytest.mark.parametrize("quant_input", [False, True])
def test_fused_gather_spec_shape_gpu(key, quant_input):
  x = randn(key, (8001, 7168), jnp.bfloat16)
  if quant_input:
    x = quant.per_token_cast(x, "e4m3", 128)
  npc = 128 if quant_input else None
  pos = jnp.asarray(np.random.default_rng(2).integers(-1, 8001, 48128), jnp.int32)
  got = jax.jit(lambda x, p: quant.per_channel_cast_fused(x, "e4m3", 128, num_per_channels=npc, pos_to_token=p))(x, pos)
  _assert_quant_equal(got, quant.per_channel_cast_fused(x, "e4m3", 128, num_per_channels=npc, pos_to_token=pos,
                                                        implementation="reference"))


@pytest.mark.gpu
@pytest.mark.parametrize("round_sf", [False, True])
def test_non_finite_inputs_gpu(key, round_sf):
  """The GPU's max.NaN / maxnumf and satfinite conversions against the reference compiled by XLA."""
  x = _non_finite(key, (1024, 576), jnp.bfloat16)
  want = jax.jit(lambda x: ref.per_channel_cast(x, "e4m3", 128, round_sf=round_sf))(x)
  _assert_quant_equal(jax.jit(lambda x: quant.per_channel_cast(x, "e4m3", 128, round_sf=round_sf))(x), want)
  pos = jnp.arange(1024, dtype=jnp.int32)
  fused = jax.jit(lambda x, p: quant.per_channel_cast_fused(x, "e4m3", 128, round_sf=round_sf, pos_to_token=p))
  _assert_quant_equal(fused(x, pos), want)


def test_kernel_choice():
  """bf16: the two-warpgroup register kernel at every K; float32: the one-warpgroup TMA kernel."""
  from jaxkern.testing import lower_for_h100

  for m, k, dtype, kernel in ((256, 576, jnp.bfloat16, "_split_register_kernel"),
                              (256, 320, jnp.bfloat16, "_split_register_kernel"),
                              (8064, 576, jnp.bfloat16, "_split_register_kernel"),
                              (256, 2048, jnp.bfloat16, "_split_register_kernel"),
                              (256, 704, jnp.bfloat16, "_split_register_kernel"),
                              (4096, 3072, jnp.bfloat16, "_split_register_kernel"),
                              (8064, 7168, jnp.bfloat16, "_split_register_kernel"),
                              (256, 576, jnp.float32, "_kernel"), (256, 2048, jnp.float32, "_kernel"),
                              (8064, 7168, jnp.float32, "_kernel")):
    f = lambda x: quant.per_channel_cast(x, "e4m3", 128, implementation="pallas")
    text = lower_for_h100(f, jax.ShapeDtypeStruct((m, k), dtype)).as_text()
    assert set(re.findall(r"@(_\w*kernel)\b", text)) == {kernel}, (m, k, dtype)
    outside = "\n".join(line for line in text.splitlines() if "mosaic_gpu" not in line)
    assert "broadcast_in_dim" not in outside  # the kernels' constant operand: no XLA kernel before them
    # nor a uniform constant of more than one element, which XLA rewrites into a broadcast kernel
    assert re.findall(r"stablehlo\.constant dense<[^>]*> : tensor<([0-9x]+)x\w+>", outside) == ["1"], (m, k, dtype)


# The register kernel of bf16 per_channel_cast (two warpgroups of 64 rows): 128-column tiles where 128 divides K (K =
# 256 with two CTA rows, K = 640: five column tiles), 64-column tiles elsewhere (K = 576, and K = 64 x odd: 320, 192,
# an odd number of column tiles); M = 384 (an odd number of 128-row tiles); round_sf; non-finite values in both
# warpgroups' rows (rows 0-63 and 64-127 of the first block). Interpret mode takes about 0.4 s a CTA.
@pytest.mark.parametrize("m, k, round_sf", [(256, 576, True), (384, 320, False), (128, 192, True), (256, 256, False),
                                            (128, 640, True)], ids=str)
def test_split_register_kernel_bit_exact(key, m, k, round_sf):
  x = randn(key, (m, k), jnp.bfloat16) * jnp.exp2(jnp.arange(k, dtype=jnp.float32) % 17 - 8)
  got = quant.per_channel_cast(x, "e4m3", 128, round_sf=round_sf)
  _assert_quant_equal(got, _oracle(np.asarray(x, np.float32), 128, round_sf))
  x = _non_finite(key, (m, k), jnp.bfloat16)
  for rs in (False, True):
    got = quant.per_channel_cast(x, "e4m3", 128, round_sf=rs)
    _assert_quant_equal(got, ref.per_channel_cast(x, "e4m3", 128, round_sf=rs))
    _check_non_finite_semantics(got, rs)


@pytest.mark.parametrize("m, k", [(4096, 576), (8064, 576), (4096, 512), (4096, 320), (4096, 704), (4096, 2048),
                                  (8064, 7168)])
def test_split_register_kernel_lowers_for_h100(m, k):
  from jaxkern.testing import lower_for_h100
  for round_sf in (False, True):
    f = lambda x: quant.per_channel_cast(x, "e4m3", 128, round_sf=round_sf, implementation="pallas")
    assert "@_split_register_kernel" in lower_for_h100(f, jax.ShapeDtypeStruct((m, k), jnp.bfloat16)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("m, k", [(4096, 576), (8064, 576), (8064, 2560), (8064, 7168)])
def test_per_channel_cast_spec_shapes_gpu(key, m, k):
  """per_channel_cast's kernel at spec shapes (64-column tiles at K = 576, 128 above), compiled, against numpy;
  non-finite inputs: :func:`test_split_register_kernel_gpu`."""
  x = randn(key, (m, k), jnp.bfloat16)
  for round_sf in (False, True):
    got = jax.jit(lambda x: quant.per_channel_cast(x, "e4m3", 128, round_sf=round_sf))(x)
    _assert_quant_equal(got, _oracle(np.asarray(x, np.float32), 128, round_sf))


def _non_finite_ends(key, m, k):
  """:func:`_non_finite` (bf16) plus NaN / +inf / -inf in the last 128-row block and the last 3 columns (rows of
  both warpgroups): the first and the last tile."""
  x = _non_finite(key, (m, k), jnp.bfloat16)
  return x.at[m - 1, k - 1].set(jnp.nan).at[m - 100, k - 2].set(jnp.inf).at[m - 30, k - 3].set(-jnp.inf)


def _check_compiled_against_reference(x):
  """per_channel_cast of ``x``, compiled, against the reference compiled by XLA, with and without round_sf."""
  for round_sf in (False, True):
    want = jax.jit(lambda x: ref.per_channel_cast(x, "e4m3", 128, round_sf=round_sf))(x)
    got = jax.jit(lambda x: quant.per_channel_cast(x, "e4m3", 128, round_sf=round_sf))(x)
    _assert_quant_equal(got, want)
    _check_non_finite_semantics(got, round_sf)


@pytest.mark.gpu
@pytest.mark.parametrize("m, k", [(4096, 2048), (4096, 3072), (4096, 704), (4096, 576), (8064, 576), (384, 320),
                                  (8064, 2048), (8064, 7168), (8064, 2112), (8064, 3776)])
def test_split_register_kernel_gpu(key, m, k):
  """The two-warpgroup register kernel (128-column tiles; 64 at K = 704, 576, 320, 2112, 3776), compiled, against
  the reference compiled by XLA, with and without round_sf: random values with non-finite ones in the first and the
  last tile (:func:`_non_finite_ends`)."""
  _check_compiled_against_reference(_non_finite_ends(key, m, k))

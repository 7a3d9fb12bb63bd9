"""jaxkern.gemm.fp8_grouped_gemm: the kernel (interpret mode on CPU, compiled on a GPU) against the reference,
the reference against the float32 product of the dequantised inputs, H100 lowering, argument checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkern
from jaxkern import gemm
from jaxkern.gemm import _grouped
from jaxkern.reference import gemm as ref
from jaxkern.reference import quant as rq
from jaxkern.testing import lower_for_h100
from jaxkern.types import QuantTensor

S = jax.ShapeDtypeStruct
E4M3 = jnp.float8_e4m3fn
LAYOUTS = {"A": {}, "B": dict(use_tma_aligned_col_major_sf=True),
           "C": dict(use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True)}


def make_inputs(key, g, m, n, k, layout="A"):
  """Activations with per-row magnitudes spread over 2^±6 and weights over 2^±4 per block, quantised by the
  references of the jaxkern casts (per-token 1x128; 128x128 blocks)."""
  k1, k2, k3, k4 = jax.random.split(key, 4)
  xf = jax.random.normal(k1, (m, k)) * jnp.exp2(jax.random.randint(k2, (m, 1), -6, 7).astype(jnp.float32))
  ws = jnp.exp2(jax.random.randint(k4, (g, n // 128, k // 128), -4, 5).astype(jnp.float32))
  wf = jax.random.normal(k3, (g, n, k)) * ws.repeat(128, 1).repeat(128, 2)
  x = rq.per_token_cast(xf.astype(jnp.bfloat16), "e4m3", 128, **LAYOUTS[layout])
  w = jax.vmap(lambda v: tuple(rq.per_block_cast(v, "e4m3", (128, 128))))(wf)
  return QuantTensor(*x), QuantTensor(*w)


ON_GPU = jax.default_backend() == "gpu"


def tol(want, rtol=0.0):
  """Kernel vs reference. Interpret mode computes each 128-deep step in float32 (only the summation order differs);
  Hopper's FP8 wgmma accumulates a step with fewer mantissa bits (DeepGEMM's reason to promote every step), so on
  the GPU the bound is 1e-3 of the largest entry."""
  scale = float(np.max(np.abs(np.asarray(want, np.float64))))
  return dict(rtol=rtol + (0.0 if ON_GPU else 1e-5), atol=(1e-3 if ON_GPU else 1e-6) * scale)


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)


def run(x, w, be, **kw):
  return jax.jit(functools.partial(gemm.fp8_grouped_gemm, **kw))(x, w, be)


@pytest.fixture
def variant(request, monkeypatch):
  monkeypatch.setattr(_grouped, "VARIANT", request.param)
  return request.param


@pytest.mark.parametrize("variant, out_dtype, k", [
    ("simple", jnp.float32, 384), ("simple", jnp.bfloat16, 384),
    # deferred promotion: K/128 even (2 x 128 per step) and odd (falls back to 1 x 128)
    ("k2tma_gh", jnp.bfloat16, 512), ("k2tma_gh", jnp.float32, 384),
    # the scales through the pipeline's SMEM (bf16: the output staged in two column halves)
    ("k2tma_gh_ss", jnp.bfloat16, 512), ("k2tma_gh_ss", jnp.float32, 384),
    # the SMEM ring across items (_ring_kernel), one step
    ("ring_nodefer", jnp.float32, 384), ("ring_nodefer", jnp.bfloat16, 128),
    # 192 columns per tile (_wide_kernel): at N = 256 the second tile overlaps the first and starts inside a scale
    # block (column 64)
    ("wide192", jnp.bfloat16, 384), ("wide192", jnp.float32, 256),
    # DeepGEMM's schedule (_pair_mc_kernel): row-block pairs (2, 0) of different experts (no multicast) and (-1, 1)
    # (the skipped block's CTA loads its peer's weights and computes nothing)
    ("pair192", jnp.bfloat16, 384), ("pair192_r32", jnp.float32, 256)],
    indirect=["variant"])
def test_kernel_matches_reference(key, variant, out_dtype, k):
  g, m, n = 3, 512, 256
  x, w = make_inputs(key, g, m, n, k)
  be = jnp.array([2, 0, -1, 1], jnp.int32)
  got = run(x, w, be, out_dtype=out_dtype)
  want = ref.fp8_grouped_gemm(x, w, be, out_dtype=jnp.float32)
  assert got.shape == (m, n) and got.dtype == out_dtype
  assert np.all(np.asarray(got[256:384]) == 0)  # the skipped block
  assert np.any(np.asarray(got[:256]) != 0) and np.any(np.asarray(got[384:]) != 0)
  g64, w64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if out_dtype == jnp.float32:  # only the summation order inside a K step differs
    np.testing.assert_allclose(g64, w64, **tol(w64))
  else:  # one rounding to bf16 (half an ulp), plus the f32 difference
    np.testing.assert_allclose(g64, w64, **tol(w64, 2 ** -8))
  # each block used its own expert: the product with any other expert's weights is far off
  other = ref.fp8_grouped_gemm(x, w, jnp.array([1, 0, -1, 1], jnp.int32), out_dtype=jnp.float32)
  assert rel_err(got[:128], other[:128]) > 0.1


@pytest.mark.parametrize("layout, k", [("B", 256), ("C", 640)])
def test_kernel_scale_layouts(key, layout, k):
  """Layout B goes to the kernel as is; A is transposed and C (packed UE8M0, a partial last word for
  K/128 = 5) decoded by XLA."""
  g, m, n = 2, 256, 128
  x, w = make_inputs(key, g, m, n, k, layout)
  be = jnp.array([1, 0], jnp.int32)
  got = run(x, w, be, out_dtype=jnp.float32, x_use_tma_aligned_col_major_sf=True)
  want = ref.fp8_grouped_gemm(x, w, be, out_dtype=jnp.float32, x_use_tma_aligned_col_major_sf=True)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol(want))
  # the same product as the layout-A input
  xa = QuantTensor(x.data, ref.x_scales(x.sf, m, k // 128, x_use_tma_aligned_col_major_sf=True))
  want_a = ref.fp8_grouped_gemm(xa, w, be, out_dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(want), np.asarray(want_a))


def test_reference_is_the_dequantized_product(key):
  """The reference (promotion per K step) against the plain float32 product of the dequantised inputs."""
  g, m, n, k = 2, 256, 256, 512
  x, w = make_inputs(key, g, m, n, k)
  be = jnp.array([1, -1], jnp.int32)
  got = ref.fp8_grouped_gemm(x, w, be, out_dtype=jnp.float32)
  want = ref.dequantized_product(x, w, be)
  assert rel_err(got, want) < 1e-5
  np.testing.assert_array_equal(np.asarray(got[128:]), 0)
  # and against numpy in float64 for one row block
  xd = np.asarray(x.data, np.float64) * np.repeat(np.asarray(x.sf), 128, axis=1)
  wd = np.asarray(w.data[1], np.float64) * np.repeat(np.repeat(np.asarray(w.sf[1]), 128, 0), 128, 1)
  assert rel_err(got[:128], xd[:128] @ wd.T) < 1e-5


def test_traced_out_of_range_ids_are_skipped(key):
  g, m, n, k = 2, 256, 128, 128
  x, w = make_inputs(key, g, m, n, k)
  got = jax.jit(lambda be: gemm.fp8_grouped_gemm(x, w, be, out_dtype=jnp.float32))(jnp.array([5, 1], jnp.int32))
  want = ref.fp8_grouped_gemm(x, w, jnp.array([-1, 1], jnp.int32), out_dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(got[:128]), 0)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol(want))


def test_zero_rows():
  x = QuantTensor(jnp.zeros((0, 256), E4M3), jnp.zeros((0, 2), jnp.float32))
  w = QuantTensor(jnp.zeros((2, 128, 256), E4M3), jnp.ones((2, 1, 2), jnp.float32))
  for impl in ("interpret", "xla", "reference"):
    out = gemm.fp8_grouped_gemm(x, w, jnp.zeros((0,), jnp.int32), implementation=impl)
    assert out.shape == (0, 128) and out.dtype == jnp.bfloat16
  d = jaxkern.explain(lambda a, b, c: gemm.fp8_grouped_gemm(a, b, c, implementation="pallas"), x, w,
                      jnp.zeros((0,), jnp.int32))
  assert d[0].path == "xla"


def _args(g=2, m=256, n=128, k=256):
  return (QuantTensor(S((m, k), E4M3), S((m, k // 128), jnp.float32)),
          QuantTensor(S((g, n, k), E4M3), S((g, n // 128, k // 128), jnp.float32)), S((m // 128,), jnp.int32))


@pytest.mark.parametrize("mutate, match", [
    (lambda x, w, b: ((jnp.zeros((256, 200), E4M3), jnp.zeros((256, 2), jnp.float32)), w, b), "K = 200"),
    (lambda x, w, b: ((jnp.zeros((200, 256), E4M3), jnp.zeros((200, 2), jnp.float32)), w, b), "multiple of 128"),
    (lambda x, w, b: (x, (jnp.zeros((2, 100, 256), E4M3), jnp.ones((2, 1, 2), jnp.float32)), b), "multiple of 128"),
    (lambda x, w, b: (x, (jnp.zeros((2, 128, 384), E4M3), jnp.ones((2, 1, 3), jnp.float32)), b), "w.data"),
    (lambda x, w, b: ((x[0].astype(jnp.bfloat16), x[1]), w, b), "x.data must have dtype"),
    (lambda x, w, b: (x, (w[0].astype(jnp.float8_e5m2), w[1]), b), "w.data must have dtype"),
    (lambda x, w, b: ((x[0], x[1].T), w, b), "x.sf"),
    (lambda x, w, b: ((x[0], x[1][:, :1]), w, b), "x.sf"),
    (lambda x, w, b: (x, (w[0], w[1][:, :, :1]), b), "w.sf"),
    (lambda x, w, b: (x, (w[0], w[1].astype(jnp.bfloat16)), b), "w.sf"),
    (lambda x, w, b: (x, w, b[:1]), "block_expert"),
    (lambda x, w, b: (x, w, b.astype(jnp.int16)), "block_expert"),
    (lambda x, w, b: (x, w, jnp.array([0, 2], jnp.int32)), "block_expert entries"),
    (lambda x, w, b: (x, w, jnp.array([-2, 0], jnp.int32)), "block_expert entries"),
    (lambda x, w, b: (x[0], w, b), "x must be a QuantTensor"),
])
def test_bad_inputs(mutate, match):
  x = QuantTensor(jnp.zeros((256, 256), E4M3), jnp.ones((256, 2), jnp.float32))
  w = QuantTensor(jnp.zeros((2, 128, 256), E4M3), jnp.ones((2, 1, 2), jnp.float32))
  b = jnp.array([0, 1], jnp.int32)
  with pytest.raises(ValueError, match=match):
    gemm.fp8_grouped_gemm(*mutate(x, w, b), implementation="reference")


def test_bad_options():
  x = QuantTensor(jnp.zeros((256, 256), E4M3), jnp.ones((256, 2), jnp.float32))
  w = QuantTensor(jnp.zeros((2, 128, 256), E4M3), jnp.ones((2, 1, 2), jnp.float32))
  b = jnp.array([0, 1], jnp.int32)
  with pytest.raises(ValueError, match="out_dtype"):
    gemm.fp8_grouped_gemm(x, w, b, out_dtype=jnp.float16)
  with pytest.raises(ValueError, match="x.sf"):  # layout-A sf with the column-major flag
    gemm.fp8_grouped_gemm(x, w, b, x_use_tma_aligned_col_major_sf=True)
  with pytest.raises(ValueError, match="int32"):  # packed sf without the flag
    gemm.fp8_grouped_gemm((x[0], jnp.zeros((1, 256), jnp.int32)), w, b)


def test_not_differentiable(key):
  x, w = make_inputs(key, 2, 256, 128, 128)
  be = jnp.array([0, 1], jnp.int32)
  f = lambda s: jnp.sum(gemm.fp8_grouped_gemm(QuantTensor(x.data, s), w, be, implementation="reference"))
  with pytest.raises(jaxkern.NotDifferentiableError, match="fp8_grouped_gemm"):
    jax.grad(f)(x.sf)


@pytest.mark.parametrize("variant", list(_grouped.VARIANTS), indirect=True)
@pytest.mark.parametrize("out_dtype, shape", [(jnp.bfloat16, (8, 1024, 512, 896)), (jnp.float32, (2, 256, 128, 128))])
def test_lowers_for_h100(variant, out_dtype, shape):
  g, m, n, k = shape
  x, w, be = _args(g, m, n, k)
  lower_for_h100(lambda x, w, be: gemm.fp8_grouped_gemm(x, w, be, out_dtype=out_dtype, implementation="pallas"),
                 x, w, be)


@pytest.mark.parametrize("variant", ["pair192"], indirect=True)
def test_lowers_for_h100_staged_weight_scales(variant):
  """K/128 = 16: the pair kernel stages each tile's weight scales in SMEM (``W_SCALES_SMEM_UNIT``)."""
  assert (2048 // 128) % _grouped.W_SCALES_SMEM_UNIT == 0
  x, w, be = _args(4, 1024, 512, 2048)
  lower_for_h100(lambda x, w, be: gemm.fp8_grouped_gemm(x, w, be, implementation="pallas"), x, w, be)


@pytest.mark.parametrize("variant", ["pair192"], indirect=True)
def test_lowers_for_h100_one_warp_loads(variant):
  """K = 7168 (from ``ONE_WARP_LOADS_MIN_K``): the pair kernel's loads come from one warp of the memory warpgroup."""
  assert 7168 >= _grouped.ONE_WARP_LOADS_MIN_K > 4096
  x, w, be = _args(4, 1024, 4096, 7168)
  lower_for_h100(lambda x, w, be: gemm.fp8_grouped_gemm(x, w, be, implementation="pallas"), x, w, be)


@pytest.mark.parametrize("variant", ["k2tma_gh_ss"], indirect=True)
def test_lowers_for_h100_half_width_staging(variant):
  """K/128 even with bf16 out: the SMEM scales leave no room for the whole staging tile beside 3 stages, so each
  warpgroup stores its result in two 64-column halves."""
  x, w, be = _args(2, 256, 256, 1024)
  lower_for_h100(lambda x, w, be: gemm.fp8_grouped_gemm(x, w, be, implementation="pallas"), x, w, be)


def test_lowers_for_h100_packed_sf():
  g, m, n, k = 2, 256, 256, 640
  x = QuantTensor(S((m, k), E4M3), S((2, m), jnp.int32))
  _, w, be = _args(g, m, n, k)
  lower_for_h100(lambda x, w, be: gemm.fp8_grouped_gemm(x, w, be, x_use_tma_aligned_col_major_sf=True,
                                                        implementation="pallas"), x, w, be)


@pytest.mark.gpu
@pytest.mark.parametrize("g, rows, n, k", [(8, 512, 4096, 7168), (8, 512, 7168, 2048)])
def test_gpu_accuracy(key, g, rows, n, k):
  """Upstream's bound: ≤ 0.5% max-relative against the float32 product of the dequantised inputs."""
  m = g * rows
  x, w = make_inputs(key, g, m, n, k)
  be = jnp.repeat(jnp.arange(g, dtype=jnp.int32), rows // 128).at[-1].set(-1)
  got = gemm.fp8_grouped_gemm(x, w, be, out_dtype=jnp.float32, implementation="pallas")
  want = jax.jit(ref.dequantized_product)(x, w, be)
  assert rel_err(got, want) <= 5e-3


def _check_skipped_block_layout(key, k):
  """G = 3, M = 512 (row blocks of experts 1, -1, 0, 2), N = 256, contraction ``k``: the kernel against the reference,
  and the skipped block's rows zero."""
  g, m, n = 3, 512, 256
  x, w = make_inputs(key, g, m, n, k)
  be = jnp.array([1, -1, 0, 2], jnp.int32)
  got = run(x, w, be, out_dtype=jnp.float32)
  want = ref.fp8_grouped_gemm(x, w, be, out_dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol(want))
  np.testing.assert_array_equal(np.asarray(got[128:256]), 0)


@pytest.mark.parametrize("variant, k", [("k2tma_gh", 768), ("k2tma_gh_ss", 768), ("ring_nodefer", 768),
                                        ("wide192", 768), ("pair192", 768)],
                         indirect=["variant"])
def test_persistent_kernel_loops_over_items(key, variant, k, monkeypatch):
  """3 CTAs for 8 work items: each CTA runs several pipelines in turn (barrier phases carried over, a skipped
  block in between; with the TMA epilogue, each item's store still in flight while the next one runs), as every
  CTA does at the real shapes. k=768: 3 pipeline steps of 2 x 128. The ring kernels keep one ring of slots across
  a CTA's items: 6 steps of 128 per item over 5 slots, so slots are reused mid-item and across items; wide192: two
  column tiles of 192 per row block, the second starting inside a weight-scale block; pair192: one cluster of 2 CTAs
  (3 SMs) walks the row-block pairs (1, -1) and (0, 2)."""
  from jaxkern import _config
  monkeypatch.setattr(_config, "num_sms", lambda: 3)
  _check_skipped_block_layout(key, k)


def _skip_unaligned_scale_rows(k):
  """Call after forcing ``W_SCALES_SMEM_UNIT``: where that stages rows of K/128 float32 weight scales that are not
  whole 16-byte units, the test runs in interpret mode only: on the GPU Mosaic GPU refuses the TMA (GMEM strides must
  be 16-byte multiples), which is why the kernels stage them only where K/128 % 4 == 0."""
  ks = k // 128
  if ON_GPU and _grouped._w_scales_staged(ks) and ks % _grouped.W_SCALES_ROW_UNIT:
    pytest.skip(f"K/128 = {ks} scales a row: a TMA of them is refused on the GPU")


@pytest.mark.parametrize("variant, num_sms, w_scales_unit, k, out_dtype",
                         [("pair192", 3, 16, 384, jnp.float32), ("pair192", 4, 1, 384, jnp.float32),
                          ("pair192_r32", 2, 1, 384, jnp.float32), ("pair192", 4, 16, 512, jnp.bfloat16)],
                         indirect=["variant"])
def test_pair_clusters_share_weight_tiles(key, variant, num_sms, w_scales_unit, k, out_dtype, monkeypatch):
  """Row-block pairs of one expert (the weight tile multicast to both CTAs of a cluster), a pair of two skipped
  blocks (no loads: the ring's slot counter must stay in step in both CTAs), a pair of two experts and a pair with one
  skipped block, walked by one or two clusters (3 / 4 SMs) or with the grouped raster of 32 row blocks (2 SMs: one
  cluster); 192-column tiles over N = 256 (the second starts inside a weight-scale block). The weight scales by
  scalar loads (K/128 = 3 is no multiple of 4) or staged in SMEM per item (``W_SCALES_SMEM_UNIT`` 1: the loader's
  two buffers, a peer-only item's barrier phases, the final drain), or at K/128 = 4 staged by one TMA per column
  block into padded rows, with the K loop two steps per iteration (K = 7168's forms; bfloat16 output, so the ring
  keeps 4 slots: a float32 output tile leaves room for 3, and an odd ring runs one step per iteration)."""
  from jaxkern import _config
  monkeypatch.setattr(_config, "num_sms", lambda: num_sms)
  monkeypatch.setattr(_grouped, "W_SCALES_SMEM_UNIT", w_scales_unit)
  _skip_unaligned_scale_rows(k)
  _grouped._pair_mc_kernel.clear_cache()  # the unit is read at trace time
  g, m, n = 3, 1280, 256
  x, w = make_inputs(key, g, m, n, k)
  be = jnp.array([1, 1, -1, -1, 0, 0, 2, 0, 2, -1], jnp.int32)
  got = run(x, w, be, out_dtype=out_dtype)
  assert got.dtype == out_dtype
  want = np.asarray(ref.fp8_grouped_gemm(x, w, be, out_dtype=jnp.float32), np.float64)
  rounding = 0.0 if out_dtype == jnp.float32 else 2 ** -8  # bfloat16: half an ulp on top of the float32 difference
  np.testing.assert_allclose(np.asarray(got, np.float64), want, **tol(want, rounding))
  np.testing.assert_array_equal(np.asarray(got[256:512], np.float32), 0)
  np.testing.assert_array_equal(np.asarray(got[1152:], np.float32), 0)


def test_ring_slot():
  """The ring slot of step t is t mod stages, by an AND for a power-of-two ring and by the remainder otherwise."""
  t = jnp.arange(0, 4000, 7, dtype=jnp.int32)
  for stages in (2, 3, 4, 5, 8):
    np.testing.assert_array_equal(np.asarray(_grouped._ring_slot(t, stages)), np.asarray(t) % stages)


def test_row_unit_group():
  assert _grouped.row_unit_group(128, 16, 2) == 8 and _grouped.row_unit_group(256, 16, 1) == 16
  assert _grouped.row_unit_group(5, 16, 2) == 5 and _grouped.row_unit_group(12, 16, 2) == 6
  assert _grouped.row_unit_group(7, 4, 2) == 1


@pytest.mark.parametrize("w_scales_unit", [1, 16])
def test_pair_kernel_loads_from_one_warp(key, w_scales_unit, monkeypatch):
  """The one-warp memory warpgroup (``ONE_WARP_LOADS_MIN_K``, here forced at K = 768) on the layout of
  ``test_persistent_kernel_loops_over_items`` (a pair with a skipped block, then a pair of two experts; 6 steps over
  3 slots), with the weight scales staged per item from that warp (unit 1) or read by the compute warpgroups."""
  from jaxkern import _config
  monkeypatch.setattr(_config, "num_sms", lambda: 3)
  monkeypatch.setattr(_grouped, "VARIANT", "pair192")
  monkeypatch.setattr(_grouped, "ONE_WARP_LOADS_MIN_K", 0)
  monkeypatch.setattr(_grouped, "W_SCALES_SMEM_UNIT", w_scales_unit)
  _skip_unaligned_scale_rows(768)
  _grouped._pair_mc_kernel.clear_cache()  # both are read at trace time
  _check_skipped_block_layout(key, 768)


def test_pair_kernel_falls_back_for_odd_row_blocks(key, monkeypatch):
  """``"pair192"`` with 3 row blocks (no pairs) runs ``"wide192"``; with N = 128 (narrower than a tile) the ring of
  128-column tiles."""
  monkeypatch.setattr(_grouped, "VARIANT", "pair192")
  for g, m, n, be in [(2, 384, 256, [1, -1, 0]), (2, 256, 128, [0, 1])]:
    x, w = make_inputs(key, g, m, n, 256)
    be = jnp.array(be, jnp.int32)
    got = run(x, w, be, out_dtype=jnp.float32)
    want = ref.fp8_grouped_gemm(x, w, be, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol(want))


def test_default_variant_by_contraction():
  assert _grouped.VARIANT is None  # the shipped default picks per K and N
  # where the 192-column tile adds at most 1/32 of the columns: from K = 2048 the clustered kernel (weight tiles
  # multicast to row-block pairs; 32 row blocks per raster group up to K = 2048, 16 above), below it the 192-column
  # ring without clusters
  assert _grouped.PAIR_MIN_K == 2048 and _grouped.PAIR_R32_MAX_K == 2048
  assert _grouped.default_variant(7168, 4096) == "pair192" and _grouped.default_variant(2048, 7168) == "pair192_r32"
  assert _grouped.default_variant(4096, 7168) == "pair192" and _grouped.default_variant(7168, 2048) == "pair192"
  assert _grouped.default_variant(2176, 7168) == "pair192"  # just above the 32-row-block range
  assert _grouped.default_variant(1920, 7168) == "wide192"  # just below the threshold
  assert _grouped.default_variant(1024, 1536) == "wide192" and _grouped.default_variant(2048, 1536) == "pair192_r32"
  # elsewhere: the scales through SMEM up to K = 4096, GMEM above, the 128-column ring below
  assert _grouped.default_variant(5120, 1024) == "k2tma_gh" and _grouped.default_variant(4096, 1024) == "k2tma_gh_ss"
  assert _grouped.default_variant(2048, 1024) == "ring_nodefer"  # 6 tiles of 192: 1/8 extra
  assert _grouped.default_variant(128, 128) == "ring_nodefer"  # narrower than one wide tile
  assert _grouped.wide_tile_extra(7168) == 128 / 7168 and _grouped.wide_tile_extra(384) == 0
  assert {_grouped.default_variant(k, n) for k in (1024, 2048, 4096, 7168) for n in (128, 1024, 2048, 4096, 7168)} \
      | {"simple"} == set(_grouped.VARIANTS)  # and the independent check
  assert [_grouped.half_row_group(t) for t in (1, 8, 16, 32, 56, 57, 59)] == [1, 8, 16, 16, 28, 19, 59]


def test_wide_tile_widths():
  # 160 and 192 columns straddle at most two weight-scale blocks from any first column; 224 could reach a third
  for bn in (160, 192):
    _grouped._check_wide_tile(bn)
  for bn in (128, 176, 224, 256):
    with pytest.raises(ValueError, match="160 or 192"):
      _grouped._check_wide_tile(bn)

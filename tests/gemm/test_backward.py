"""jaxkern.gemm's backward GEMMs: input gradient (transposed weights) and weight gradient (ragged per-expert
contraction over 128-row blocks), kernels in interpret mode against the references, the references against
the float32 / float64 products of the dequantised inputs, lowering, argument checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkern
from jaxkern import gemm
from jaxkern.gemm import _backward
from jaxkern.reference import gemm as ref
from jaxkern.reference import quant as rq
from jaxkern.testing import lower_for_h100
from jaxkern.types import QuantTensor

from tests.gemm.test_fp8_grouped_gemm import ON_GPU, make_inputs, rel_err, tol

S = jax.ShapeDtypeStruct
E4M3 = jnp.float8_e4m3fn


def _tol(want):
  return tol(want)


def test_transpose_weights(key):
  _, w = make_inputs(key, 2, 128, 256, 384)
  wt = jax.jit(gemm.transpose_weights)(w)
  assert isinstance(wt, QuantTensor) and wt.data.shape == (2, 384, 256) and wt.sf.shape == (2, 3, 2)
  np.testing.assert_array_equal(np.asarray(wt.data, np.float32), np.swapaxes(np.asarray(w.data, np.float32), 1, 2))
  np.testing.assert_array_equal(np.asarray(wt.sf), np.swapaxes(np.asarray(w.sf), 1, 2))


def test_input_grad_matches_reference(key):
  g, m, n, k = 3, 384, 256, 384  # dy (M, N), w (G, N, K) -> dx (M, K)
  k1, k2 = jax.random.split(key)
  _, w = make_inputs(k1, g, 128, n, k)
  dy, _ = make_inputs(k2, 1, m, 128, n)
  be = jnp.array([2, -1, 0], jnp.int32)
  got = jax.jit(functools.partial(gemm.fp8_grouped_gemm_input_grad, out_dtype=jnp.float32))(dy, w, be)
  want = ref.fp8_grouped_gemm_input_grad(dy, w, be, out_dtype=jnp.float32)
  assert got.shape == (m, k)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **_tol(want))
  np.testing.assert_array_equal(np.asarray(got[128:256]), 0)
  # against float64: dx = dy_deq · w_deq[e]
  dyd = np.asarray(dy.data, np.float64) * np.repeat(np.asarray(dy.sf), 128, axis=1)
  wd = np.asarray(w.data[2], np.float64) * np.repeat(np.repeat(np.asarray(w.sf[2]), 128, 0), 128, 1)
  assert rel_err(got[:128], dyd[:128] @ wd) < (1e-3 if ON_GPU else 1e-5)


def _wgrad_inputs(key, m, n, k):
  """Token-major bf16 dy (M, N) and x (M, K), cast per channel and transposed (reference casts)."""
  k1, k2 = jax.random.split(key)
  dy = (jax.random.normal(k1, (m, n)) * jnp.exp2(jax.random.randint(k2, (m, 1), -5, 5).astype(jnp.float32)))
  x = jax.random.normal(k2, (m, k))
  dyt = rq.per_channel_cast_and_transpose(dy.astype(jnp.bfloat16), "e4m3", 128)
  xt = rq.per_channel_cast_and_transpose(x.astype(jnp.bfloat16), "e4m3", 128)
  return QuantTensor(*dyt), QuantTensor(*xt)


@pytest.fixture
def wgrad_variant(request, monkeypatch):
  monkeypatch.setattr(_backward, "WGRAD_VARIANT", request.param)
  return request.param


@pytest.mark.parametrize("wgrad_variant", ["simple", "xptma_g8b"], indirect=True)
def test_weight_grad_matches_reference(key, wgrad_variant):
  g, m, n, k = 4, 640, 128, 256
  dyt, xt = _wgrad_inputs(key, m, n, k)
  be = jnp.array([0, 0, 3, 3, -1], jnp.int32)  # expert 1, 2 without rows; a skipped block
  got = jax.jit(functools.partial(gemm.fp8_grouped_gemm_weight_grad, num_experts=g))(dyt, xt, be)
  want = ref.fp8_grouped_gemm_weight_grad(dyt, xt, be, num_experts=g)
  assert got.shape == (g, n, k) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **_tol(want))
  np.testing.assert_array_equal(np.asarray(got[1:3]), 0)
  # against float64 of the dequantised operands: dw[3] = dy[256:512]ᵀ x[256:512]
  dyd = np.asarray(dyt.data, np.float64) * np.repeat(np.asarray(dyt.sf), 128, axis=0).T
  xd = np.asarray(xt.data, np.float64) * np.repeat(np.asarray(xt.sf), 128, axis=0).T
  bound = 1e-3 if ON_GPU else 1e-5
  assert rel_err(got[3], dyd[:, 256:512] @ xd[:, 256:512].T) < bound
  assert rel_err(got[0], dyd[:, :256] @ xd[:, :256].T) < bound


@pytest.mark.parametrize("wgrad_variant", ["simple", "xptma_g8b"], indirect=True)
def test_weight_grad_bf16_output(key, wgrad_variant):
  """``out_dtype=bfloat16``: the float32 total rounded once, in the kernel (what the layer's bf16 weights take):
  against the reference's float32 result to half a bf16 ulp (the float32 totals differ in summation order only),
  zeros for experts without blocks."""
  g, m, n, k = 3, 384, 128, 256
  dyt, xt = _wgrad_inputs(key, m, n, k)
  be = jnp.array([2, 2, 2], jnp.int32)  # an odd count; experts 0, 1 empty
  got = jax.jit(functools.partial(gemm.fp8_grouped_gemm_weight_grad, num_experts=g, out_dtype=jnp.bfloat16))(
      dyt, xt, be)
  assert got.shape == (g, n, k) and got.dtype == jnp.bfloat16
  want = ref.fp8_grouped_gemm_weight_grad(dyt, xt, be, num_experts=g)
  np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=2 ** -8,
                             atol=_tol(want)["atol"])
  np.testing.assert_array_equal(np.asarray(got[:2], np.float32), 0)
  want16 = ref.fp8_grouped_gemm_weight_grad(dyt, xt, be, num_experts=g, out_dtype=jnp.bfloat16)
  assert want16.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(want16), np.asarray(want.astype(jnp.bfloat16)))


def test_weight_grad_zero_rows_and_traced_ids():
  out = gemm.fp8_grouped_gemm_weight_grad((jnp.zeros((128, 0), E4M3), jnp.zeros((0, 128), jnp.float32)),
                                          (jnp.zeros((256, 0), E4M3), jnp.zeros((0, 256), jnp.float32)),
                                          jnp.zeros((0,), jnp.int32), num_experts=2)
  assert out.shape == (2, 128, 256) and not np.any(np.asarray(out))


@pytest.mark.parametrize("kw, match", [
    (dict(num_experts=0), "num_experts"),
    (dict(num_experts=2.0), "num_experts"),
    (dict(block_expert=[0, 2, 2]), "entries"),
    (dict(x_t=(jnp.zeros((256, 256), E4M3), jnp.ones((2, 256), jnp.float32))), "same M"),
    (dict(x_t=(jnp.zeros((256, 384), E4M3), jnp.ones((3, 128), jnp.float32))), "x_t.sf"),
    (dict(dy_t=(jnp.zeros((128, 384), jnp.bfloat16), jnp.ones((3, 128), jnp.float32))), "dy_t.data"),
    (dict(out_dtype=jnp.float16), "out_dtype"),
])
def test_weight_grad_bad_inputs(kw, match):
  args = dict(dy_t=(jnp.zeros((128, 384), E4M3), jnp.ones((3, 128), jnp.float32)),
              x_t=(jnp.zeros((256, 384), E4M3), jnp.ones((3, 256), jnp.float32)), block_expert=[0, 1, 1], num_experts=2)
  args.update(kw)
  args["block_expert"] = jnp.asarray(args["block_expert"], jnp.int32)
  with pytest.raises(ValueError, match=match):
    gemm.fp8_grouped_gemm_weight_grad(args.pop("dy_t"), args.pop("x_t"), args.pop("block_expert"), **args,
                                      implementation="reference")


def test_not_differentiable(key):
  dyt, xt = _wgrad_inputs(key, 128, 128, 128)
  f = lambda s: jnp.sum(gemm.fp8_grouped_gemm_weight_grad(dyt, (xt.data, s), jnp.zeros((1,), jnp.int32),
                                                          num_experts=1, implementation="reference"))
  with pytest.raises(jaxkern.NotDifferentiableError):
    jax.grad(f)(xt.sf)


@pytest.mark.parametrize("wgrad_variant", list(_backward.WGRAD_VARIANTS), indirect=True)
def test_lowers_for_h100(wgrad_variant):
  g, m, n, k = 8, 1024, 512, 896
  for out_dtype in (jnp.float32, jnp.bfloat16):
    lower_for_h100(lambda a, b, be: gemm.fp8_grouped_gemm_weight_grad(a, b, be, num_experts=g, out_dtype=out_dtype,
                                                                      implementation="pallas"),
                   (S((n, m), E4M3), S((m // 128, n), jnp.float32)),
                   (S((k, m), E4M3), S((m // 128, k), jnp.float32)), S((m // 128,), jnp.int32))
  lower_for_h100(lambda a, b, be: gemm.fp8_grouped_gemm_input_grad(a, b, be, implementation="pallas"),
                 (S((m, n), E4M3), S((m, n // 128), jnp.float32)),
                 (S((g, n, k), E4M3), S((g, n // 128, k // 128), jnp.float32)), S((m // 128,), jnp.int32))


@pytest.mark.gpu
def test_gpu_weight_grad_accuracy(key):
  g, rows, n, k = 8, 1024, 2048, 1024
  m = g * rows
  dyt, xt = _wgrad_inputs(key, m, n, k)
  be = jnp.repeat(jnp.arange(g, dtype=jnp.int32), rows // 128)
  got = gemm.fp8_grouped_gemm_weight_grad(dyt, xt, be, num_experts=g, implementation="pallas")
  dyd = dyt.data.astype(jnp.float32) * jnp.repeat(dyt.sf, 128, axis=0).T
  xd = xt.data.astype(jnp.float32) * jnp.repeat(xt.sf, 128, axis=0).T
  want = jnp.stack([jnp.dot(dyd[:, e * rows:(e + 1) * rows], xd[:, e * rows:(e + 1) * rows].T,
                            precision=jax.lax.Precision.HIGHEST) for e in range(g)])
  assert rel_err(got, want) <= 5e-3


def test_persistent_weight_grad_loops_over_items(key, monkeypatch):
  """2 CTAs for 8 items (experts with 3, 0, 1 and 1 blocks): one pipeline across a CTA's items (an item without
  blocks in between); for the two-block steps an odd count (3: a repeated last block promoted with 0) and a single
  block."""
  from jaxkern import _config
  monkeypatch.setattr(_config, "num_sms", lambda: 2)
  g, m, n, k = 4, 768, 128, 256
  dyt, xt = _wgrad_inputs(key, m, n, k)
  be = jnp.array([0, 0, 0, 2, 3, -1], jnp.int32)
  got = jax.jit(functools.partial(gemm.fp8_grouped_gemm_weight_grad, num_experts=g))(dyt, xt, be)
  want = ref.fp8_grouped_gemm_weight_grad(dyt, xt, be, num_experts=g)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **_tol(want))
  np.testing.assert_array_equal(np.asarray(got[1]), 0)


@pytest.mark.parametrize("wgrad_variant", list(_backward.WGRAD_VARIANTS), indirect=True)
def test_weight_grad_any_block_layout(key, wgrad_variant, monkeypatch):
  """Experts whose blocks are not contiguous (0 and 1 interleaved, a -1 block between), traced under jit, 2 CTAs:
  the kernels walk each expert's blocks in block order (:func:`_backward.expert_block_order`), as the reference."""
  from jaxkern import _config
  monkeypatch.setattr(_config, "num_sms", lambda: 2)
  g, m, n, k = 3, 768, 128, 256
  dyt, xt = _wgrad_inputs(key, m, n, k)
  be = jnp.array([1, 0, 1, -1, 0, 1], jnp.int32)
  got = jax.jit(functools.partial(gemm.fp8_grouped_gemm_weight_grad, num_experts=g))(dyt, xt, be)
  want = ref.fp8_grouped_gemm_weight_grad(dyt, xt, be, num_experts=g)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **_tol(want))
  np.testing.assert_array_equal(np.asarray(got[2]), 0)
  blocks, starts, counts = _backward.expert_block_order(be, g)
  assert blocks.tolist() == [1, 4, 0, 2, 5, 3] and starts.tolist() == [0, 2, 5] and counts.tolist() == [2, 3, 0]


def test_wgrad_item_orders():
  """The item decode of :func:`_backward._wgrad_xp_kernel`: every (expert, N tile, K tile) exactly once, in the
  expert order given, K tiles grouped ``gk`` at a time."""
  g, n_iters, k_iters = 3, 2, 4
  order = np.array([2, 0, 1], np.int32)
  for gk in (1, 2, 4):
    seen = [tuple(int(v) for v in _backward._wgrad_item(lin, order, n_iters=n_iters, k_iters=k_iters, gk=gk))
            for lin in range(g * n_iters * k_iters)]
    assert sorted(seen) == [(e, i, j) for e in range(g) for i in range(n_iters) for j in range(k_iters)]
    assert [s[0] for s in seen[::n_iters * k_iters]] == [2, 0, 1]
    assert [s[2] for s in seen[:2 * gk]] == list(range(gk)) * 2  # gk K tiles of N tile 0, then of N tile 1
  assert seen[:4] == [(2, 0, 0), (2, 0, 1), (2, 0, 2), (2, 0, 3)]


def test_weight_grad_grouped_balanced(key, monkeypatch):
  """Grouped (2 K tiles per group) and balanced (experts by descending count: 3, 1, then 0 and 2 without blocks;
  two -1 blocks) order of the default kernel, 3 CTAs for 32 items."""
  from jaxkern import _config
  monkeypatch.setitem(_backward.WGRAD_VARIANTS, "test_g2b", functools.partial(_backward._wgrad_xp_kernel, group_k=2))
  monkeypatch.setattr(_backward, "WGRAD_VARIANT", "test_g2b")
  monkeypatch.setattr(_config, "num_sms", lambda: 3)
  g, m, n, k = 4, 768, 256, 512
  dyt, xt = _wgrad_inputs(key, m, n, k)
  be = jnp.array([1, 3, 3, 3, -1, -1], jnp.int32)  # experts 0 and 2 without rows
  got = jax.jit(functools.partial(gemm.fp8_grouped_gemm_weight_grad, num_experts=g))(dyt, xt, be)
  want = ref.fp8_grouped_gemm_weight_grad(dyt, xt, be, num_experts=g)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **_tol(want))
  np.testing.assert_array_equal(np.asarray(got[0::2]), 0)
  assert np.count_nonzero(np.asarray(want[1])) and np.count_nonzero(np.asarray(want[3]))


@pytest.mark.gpu
@pytest.mark.parametrize("wgrad_variant", [v for v in _backward.WGRAD_VARIANTS if v != "simple"],
                         indirect=True)
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_weight_grad_variants_ragged(key, wgrad_variant, out_dtype):
  """The weight-gradient default on the GPU: ragged experts with odd block counts (9, 3, 1), one without blocks, a -1
  block, against the float32 product of the dequantised operands (≤ 0.5%), zeros for the empty expert."""
  counts = [9, 0, 3, 1]
  g, n, k = len(counts), 512, 768
  be = jnp.asarray(np.concatenate([np.full(c, e, np.int32) for e, c in enumerate(counts)] + [[-1]]))
  m = 128 * be.shape[0]
  dyt, xt = _wgrad_inputs(key, m, n, k)
  got = gemm.fp8_grouped_gemm_weight_grad(dyt, xt, be, num_experts=g, out_dtype=out_dtype, implementation="pallas")
  assert got.dtype == out_dtype
  dyd = dyt.data.astype(jnp.float32) * jnp.repeat(dyt.sf, 128, axis=0).T
  xd = xt.data.astype(jnp.float32) * jnp.repeat(xt.sf, 128, axis=0).T
  starts = np.concatenate([[0], np.cumsum(counts)]) * 128
  for e in range(g):
    a, b = int(starts[e]), int(starts[e + 1])
    if a == b:
      np.testing.assert_array_equal(np.asarray(got[e], np.float32), 0)
      continue
    want = jnp.dot(dyd[:, a:b], xd[:, a:b].T, precision=jax.lax.Precision.HIGHEST)
    assert rel_err(got[e], want) <= 5e-3, e

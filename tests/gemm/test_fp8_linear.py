"""jaxkern.modeling.fp8_grouped_linear: forward and VJP against the composition of the references (tight: same
FP8 roundings), and against the float32 gradients of the unquantised product (loose: FP8 e4m3 operands)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern import _config, modeling
from jaxkern.reference import gemm as ref
from jaxkern.reference import quant as rq
from jaxkern.types import QuantTensor

ON_GPU = jax.default_backend() == "gpu"
G, M, N, K = 2, 384, 128, 256
BE = jnp.array([1, 1, -1], jnp.int32)  # blocks of expert 0: none; a skipped block


def _inputs(key):
  k1, k2, k3 = jax.random.split(key, 3)
  x = jax.random.normal(k1, (M, K)).astype(jnp.bfloat16)
  w = (jax.random.normal(k2, (G, N, K)) / 16).astype(jnp.float32)
  dy = jax.random.normal(k3, (M, N)).astype(jnp.bfloat16)
  return x, w, dy


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.max(np.abs(a - b)) / np.max(np.abs(b))


@pytest.fixture(scope="module")
def vjp_result():
  x, w, dy = _inputs(jax.random.key(7))
  y, dx, dw = jax.jit(lambda x, w, dy: (lambda r: (r[0], *r[1](dy)[:2]))(
      jax.vjp(lambda a, b: modeling.fp8_grouped_linear(a, b, BE), x, w)))(x, w, dy)
  return x, w, dy, y, dx, dw


def test_matches_reference_composition(vjp_result):
  x, w, dy, y, dx, dw = vjp_result
  assert y.dtype == jnp.bfloat16 and dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  xq = QuantTensor(*rq.per_token_cast(x, "e4m3", 128))
  wb = rq.per_block_cast(w.reshape(G * N, K), "e4m3", (128, 128))
  wq = QuantTensor(wb.data.reshape(G, N, K), wb.sf.reshape(G, N // 128, K // 128))
  y_ref = ref.fp8_grouped_gemm(xq, wq, BE, out_dtype=jnp.float32)
  dx_ref = ref.fp8_grouped_gemm_input_grad(QuantTensor(*rq.per_token_cast(dy, "e4m3", 128)), wq, BE,
                                           out_dtype=jnp.float32)
  dw_ref = ref.fp8_grouped_gemm_weight_grad(QuantTensor(*rq.per_channel_cast_and_transpose(dy, "e4m3", 128)),
                                            QuantTensor(*rq.per_channel_cast_and_transpose(x, "e4m3", 128)), BE,
                                            num_experts=G)
  for got, want, tol in ((y, y_ref, 2 ** -8), (dx, dx_ref, 2 ** -8), (dw, dw_ref, 1e-5)):  # bf16 outputs: 1/2 ulp
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=tol,
                               atol=(1e-3 if ON_GPU else 1e-5) * float(jnp.max(jnp.abs(want))))  # GPU: see tol()
  np.testing.assert_array_equal(np.asarray(y[256:], np.float32), 0)
  np.testing.assert_array_equal(np.asarray(dx[256:], np.float32), 0)
  np.testing.assert_array_equal(np.asarray(dw[0]), 0)


def test_close_to_float32_gradients(vjp_result):
  """Against the float32 VJP of the unquantised product. Loose (5% of the largest entry): every operand is
  rounded to e4m3 (3 mantissa bits: up to 2^-4 relative per element, ~2.5% RMS), which the straight-through
  gradients do not undo; a wrong layout or scale would be off by O(1)."""
  x, w, dy, y, dx, dw = vjp_result
  rows = jnp.repeat(BE, 128)

  def dense(a, b):
    prods = jnp.einsum("mk,gnk->mgn", a.astype(jnp.float32), b, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(rows[:, None] >= 0, jnp.take_along_axis(prods, jnp.maximum(rows, 0)[:, None, None], 1)[:, 0], 0)

  y32, vjp = jax.vjp(dense, x, w)
  dx32, dw32 = vjp(dy.astype(jnp.float32))
  assert _rel(y, y32) < 0.05 and _rel(dx, dx32) < 0.05 and _rel(dw, dw32) < 0.05
  assert _rel(dw[1], dw32[1]) < 0.05 and _rel(dx[:256], dx32[:256]) < 0.05


def test_bad_inputs():
  with pytest.raises(ValueError, match="x must have dtype"):
    modeling.fp8_grouped_linear(jnp.zeros((128, 128), jnp.float32), jnp.zeros((1, 128, 128)),
                                jnp.zeros((1,), jnp.int32))
  with pytest.raises(ValueError, match="w must have rank"):
    modeling.fp8_grouped_linear(jnp.zeros((128, 128), jnp.bfloat16), jnp.zeros((128, 128)), jnp.zeros((1,), jnp.int32))
  with pytest.raises(ValueError, match="weight_layout must be one of"):
    modeling.fp8_grouped_linear(jnp.zeros((128, 128), jnp.bfloat16), jnp.zeros((1, 128, 128)),
                                jnp.zeros((1,), jnp.int32), weight_layout="mk")


@pytest.mark.parametrize("implementation", ["reference", "interpret"])
def test_kn_layout_is_the_transposed_nk_layer(implementation, vjp_result):
  """``weight_layout="kn"`` with ``(G, K, N)`` weights is the ``"nk"`` layer on the transposed weights: the same
  forward (bit-exact: the 128x128 block cast commutes with the transpose), the same input gradient (the same GEMM
  on the same K-major operand) and the weight gradient transposed (the same products and scale products; the
  kernel's wgmma may sum them in another order)."""
  x, w, dy = vjp_result[:3]
  w_kn = jnp.swapaxes(w, 1, 2)  # (G, K, N)

  def vjp(w, layout):
    f = lambda a, b: modeling.fp8_grouped_linear(a, b, BE, weight_layout=layout, implementation=implementation)
    y, pullback = jax.vjp(f, x, w)
    return (y, *pullback(dy))

  if implementation == _config.get_implementation():  # the "nk" layer's VJP already ran (one compile fewer)
    y_nk, dx_nk, dw_nk = vjp_result[3:]
  else:
    y_nk, dx_nk, dw_nk = jax.jit(lambda w: vjp(w, "nk"))(w)
  y_kn, dx_kn, dw_kn = jax.jit(lambda w: vjp(w, "kn"))(w_kn)
  assert dw_kn.shape == w_kn.shape and dw_kn.dtype == w_kn.dtype
  np.testing.assert_array_equal(np.asarray(y_kn, np.float32), np.asarray(y_nk, np.float32))
  np.testing.assert_array_equal(np.asarray(dx_kn, np.float32), np.asarray(dx_nk, np.float32))
  np.testing.assert_allclose(np.asarray(dw_kn), np.asarray(jnp.swapaxes(dw_nk, 1, 2)), rtol=1e-5,
                             atol=1e-6 * float(jnp.max(jnp.abs(dw_nk))))
  assert float(jnp.max(jnp.abs(dw_kn[1]))) > 0  # a real gradient, not two zero arrays

"""jaxkern.modeling.swiglu: the trainable FP8 SwiGLU (custom_vjp over the fused forward and backward kernels), and
the MoE layer with it as the experts' activation.

Tolerance. The layer computes in FP8 e4m3: its output is the e4m3 activation (3 mantissa bits) and its gradient the
exact SwiGLU derivative at the e4m3 residual of ``x``. Rounding to e4m3 has a relative error of at most
``u = 2^-4`` per element (about ``u/√3`` in RMS over random mantissas), so against the float32 gradient of the plain
``silu(l) · r · w`` the gradients are compared in norm: ``‖g - g_f32‖ / ‖g_f32‖ < 2^-4`` (measured 0.027-0.039 for
the inputs below). Elementwise bounds would be meaningless (an element near a zero of the derivative has no
relative accuracy). The exactness of the plumbing is checked separately, bit for bit: the VJP equals the reference
backward applied to the reference per-token cast of ``x``.

``jax.test_util.check_grads`` does not apply: the forward is FP8 even with ``implementation="reference"`` (the
reference ops have the same quantised numerics), so finite differences of it measure e4m3 steps, not the
derivative; the reference path of this layer is not an unquantised SwiGLU by design (it must match the kernels).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern import modeling
from jaxkern.reference import quant as ref
from jaxkern.testing import assert_bitwise_equal

TOL = 2.0**-4


def _inputs(key, e=64, h=256, num_topk=2):
  kx, kc, kw = jax.random.split(key, 3)
  x = jax.random.normal(kx, (e, 2 * h), jnp.bfloat16)
  ct = jax.random.normal(kc, (e, h), jnp.bfloat16)
  w = jax.random.uniform(kw, (e // num_topk + 1, num_topk), jnp.float32)
  pos = jnp.where(jnp.arange(e) % 7 == 3, -1, jnp.arange(e)).astype(jnp.int32)  # some padding rows
  return x, ct, w, pos


def _plain(x, pos, w, clamp):
  """``silu(l) · r · w`` in float32 (weight 0 for padding rows, 1 without weights)."""
  v = x.astype(jnp.float32)
  h = v.shape[1] // 2
  left, right = v[:, :h], v[:, h:]
  if clamp is not None:
    left, right = jnp.minimum(left, clamp), jnp.clip(right, -clamp, clamp)
  out = jax.nn.silu(left) * right
  if w is None:
    return out
  return out * jnp.where(pos >= 0, w.reshape(-1)[jnp.maximum(pos, 0)], 0.0)[:, None]


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@functools.partial(jax.jit, static_argnames=("weighted", "npc", "clamp", "implementation"))
def _grads(x, ct, w, pos, *, weighted, npc, clamp, implementation):
  def loss(x, w):
    y = modeling.swiglu(x, *((pos, w) if weighted else ()), num_per_channels=npc, swiglu_clamp_value=clamp,
                        implementation=implementation)
    return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32))

  def plain_loss(x, w):
    return jnp.sum(_plain(x, pos, w if weighted else None, clamp) * ct.astype(jnp.float32))

  return jax.grad(loss, (0, 1))(x, w), jax.grad(plain_loss, (0, 1))(x, w)


def _same_clamp(x, npc, clamp):
  """``(E, h)``: where the e4m3 residual of ``x`` and ``x`` agree on both clamp flags (``l > C``, ``|r| > C``). The
  clamp makes the derivative jump (0 where clamped), so an element whose e4m3 rounding crosses ``±C`` (with
  ``C = 0.5`` about 3 % of ``randn`` inputs) has a gradient that differs from the float32 one by O(1): the FP8
  layer is the exact derivative at its residual, not at ``x``."""
  h = x.shape[1] // 2
  v8 = np.asarray(ref.swiglu_rows(ref.per_token_cast(x, "e4m3", npc), npc))
  v = np.asarray(x, np.float32)
  return ((v8[:, :h] > clamp) == (v[:, :h] > clamp)) & ((np.abs(v8[:, h:]) > clamp) == (np.abs(v[:, h:]) > clamp))


@pytest.mark.parametrize("weighted, npc, clamp, implementation", [
    (True, 128, None, "interpret"), (False, 32, 0.5, "interpret"), (True, 32, 10.0, "reference"),
    (False, 128, None, "reference"), (True, 128, 0.5, "reference")])
def test_gradients_match_float32_swiglu(key, weighted, npc, clamp, implementation):
  x, ct, w, pos = _inputs(key)
  (gx, gw), (rx, rw) = _grads(x, ct, w, pos, weighted=weighted, npc=npc, clamp=clamp, implementation=implementation)
  assert gx.dtype == x.dtype and gx.shape == x.shape
  if clamp is not None:  # compare where the FP8 residual and x take the same clamp decisions
    keep = np.tile(_same_clamp(x, npc, clamp), 2)
    assert keep.mean() > 0.9
    gx, rx = np.where(keep, np.asarray(gx, np.float32), 0), np.where(keep, np.asarray(rx, np.float32), 0)
  assert _rel(gx, rx) < TOL, _rel(gx, rx)
  if weighted:
    assert gw.shape == w.shape and gw.dtype == jnp.float32
    assert _rel(gw, rw) < TOL, _rel(gw, rw)
    pad = np.asarray(pos) < 0
    assert np.all(np.asarray(gx, np.float32)[pad] == 0)  # padding rows: weight 0, no gradient
  else:
    assert not np.any(gw)


def test_vjp_is_the_backward_kernel_on_the_fp8_residual(key):
  """Forward = the reference FP8 activation dequantised; VJP = the reference backward on the reference per-token
  cast of x (bit for bit; weight_grad to the op's tolerance)."""
  x, ct, w, pos = _inputs(key, e=48, h=128)
  npc, clamp = 32, 0.5

  @jax.jit
  def run(x, ct, w):
    y, vjp = jax.vjp(lambda x, w: modeling.swiglu(x, pos, w, num_per_channels=npc, swiglu_clamp_value=clamp,
                                                  implementation="interpret"), x, w)
    return y, vjp(ct)

  y, (dx, dw) = run(x, ct, w)
  act = ref.swiglu_forward_and_per_token_cast(x, "e4m3", 128, pos, w, swiglu_clamp_value=clamp)
  assert_bitwise_equal(y, ref.per_token_cast_back(act, "bf16", 128))
  want = ref.swiglu_backward_and_per_token_cast(ref.per_token_cast(x, "e4m3", npc), ct, w, pos,
                                                jnp.zeros(w.shape, jnp.int32), npc, swiglu_clamp_value=clamp)
  assert_bitwise_equal(dx, want.x_grad)
  np.testing.assert_allclose(np.asarray(dw), np.asarray(want.weight_grad), atol=1e-4, rtol=1e-4)
  assert _rel(y, _plain(x, pos, w, clamp)) < TOL  # the forward is the FP8 activation


def test_float32_input(key):
  x, ct, w, pos = _inputs(key, e=32, h=128)
  x = x.astype(jnp.float32)
  (gx, gw), (rx, rw) = _grads(x, ct, w, pos, weighted=True, npc=128, clamp=None, implementation="reference")
  assert gx.dtype == jnp.float32 and _rel(gx, rx) < TOL and _rel(gw, rw) < TOL
  assert modeling.swiglu(x, implementation="reference").dtype == jnp.float32


def test_vmap(key):
  """A batch of row blocks: the kernels take the batch as a grid axis."""
  x, ct, _, _ = _inputs(key, e=32, h=128)
  xs = jnp.stack([x, -x])
  f = lambda x: jnp.sum(modeling.swiglu(x, implementation="interpret").astype(jnp.float32) ** 2)
  batched = jax.jit(jax.vmap(jax.grad(f)))(xs)
  assert_bitwise_equal(batched[1], jax.jit(jax.grad(f))(xs[1]))


def test_zero_rows():
  x = jnp.zeros((0, 256), jnp.bfloat16)
  w = jnp.ones((3, 2), jnp.float32)
  pos = jnp.zeros((0,), jnp.int32)
  f = lambda x, w: jnp.sum(modeling.swiglu(x, pos, w).astype(jnp.float32))
  y = modeling.swiglu(x, pos, w)
  assert y.shape == (0, 128) and y.dtype == jnp.bfloat16
  gx, gw = jax.jit(jax.grad(f, (0, 1)))(x, w)
  assert gx.shape == (0, 256) and not np.any(gw)


@pytest.mark.parametrize("args, kw, match", [
    ((jnp.ones((8, 200), jnp.bfloat16),), {}, "h % 128"),
    ((jnp.ones((8, 256), jnp.float16),), {}, "x must have dtype"),
    ((jnp.ones((8, 4, 256), jnp.bfloat16),), {}, "x must have rank"),
    ((jnp.ones((8, 256)),), dict(num_per_channels=64), "num_per_channels"),
    ((jnp.ones((8, 256)), jnp.zeros((8,), jnp.int32)), {}, "given together"),
    ((jnp.ones((8, 256)), jnp.zeros((7,), jnp.int32), jnp.ones((4, 2))), {}, "pos_to_token_topk must have shape"),
    ((jnp.ones((8, 256)), jnp.zeros((8,), jnp.int32), jnp.ones((4, 2), jnp.bfloat16)), {}, "topk_weights must"),
])
def test_bad_inputs(args, kw, match):
  with pytest.raises(ValueError, match=match):
    modeling.swiglu(*args, **kw)


# The MoE layer with the FP8 activation (tests/modeling/test_moe_layer.py's setup).
H, I, T = 256, 128, 16
CONFIG = modeling.MoeConfig(num_experts=8, num_topk=2, num_shared_experts=1, routed_scaling_factor=1.5, alignment=8)


def _moe_grads(params, x, config, layer, implementation):
  def loss(params, x):
    return jnp.sum(jnp.sin(layer(params, x, config=config, implementation=implementation).astype(jnp.float32)))
  return jax.jit(jax.grad(loss, (0, 1)))(params, x)


@pytest.mark.parametrize("implementation", ["reference", "interpret"])
def test_moe_layer_with_fp8_swiglu_matches_dense(key, implementation):
  """Gradients of the layer with ``fp8_swiglu`` against the dense float32 layer (same routing), in norm."""
  k_params, k_x = jax.random.split(key)
  fp8 = dataclasses.replace(CONFIG, fp8_swiglu=True)
  params = modeling.init_moe_params(k_params, fp8, H, I, jnp.float32)
  x = jax.random.normal(k_x, (T, H), jnp.float32)
  with jax.default_matmul_precision("highest"):
    y = jax.jit(functools.partial(modeling.moe_layer, config=fp8, implementation=implementation))(params, x)
    y_dense = jax.jit(functools.partial(modeling.moe_layer_dense, config=CONFIG, implementation="reference"))(
        params, x)
    grads = _moe_grads(params, x, fp8, modeling.moe_layer, implementation)
    dense = _moe_grads(params, x, CONFIG, modeling.moe_layer_dense, "reference")
  assert 0 < _rel(y, y_dense) < TOL  # FP8: close, but not the float32 result
  for name, g, e in zip(["router", "router_bias", "w_gate", "w_up", "w_down", "x"], jax.tree.leaves(grads),
                        jax.tree.leaves(dense)):
    assert g.shape == e.shape and g.dtype == e.dtype, name
    if name != "router_bias":
      assert _rel(g, e) < TOL, (name, _rel(g, e))

"""jaxkern.modeling.engram_gate: the custom_vjp's gradients vs jax.grad of the jnp composite (float64 tight with
the references inside the custom_vjp; bf16 with the kernels in interpret mode at upstream's tolerance), with the
clamp active for part of the tokens; check_grads; leading dims, zero tokens, jit / grad / vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxkern
from jaxkern import modeling
from jaxkern.reference import engram as ref
from jaxkern.testing import assert_bitwise_equal, assert_diff_below
from tests.engram.test_reference import gate_inputs

def _loss(gate, go):
  return lambda *a: jnp.sum(gate(*a).astype(jnp.float32 if go.dtype != jnp.float64 else go.dtype) * go)


def _median_clamp(x, k, wh, we):
  """A clamp value at the median of |d|: the clamp is active for about half the (token, stream) pairs."""
  x, k, wh, we = (np.asarray(a, np.float64) for a in (x, k, wh, we))
  d = x.shape[-1]
  rx = 1 / np.sqrt((x * x).mean(-1) + 1e-20)
  rk = 1 / np.sqrt((k * k).mean(-1) + 1e-20)
  return float(np.median(np.abs((x * wh * k * we).sum(-1) * rx * rk / np.sqrt(d))))


def test_float64_gradients_reference_inside_custom_vjp(key):
  with jax.enable_x64(True):
    x, k, v, wh, we = gate_inputs(key, 6, 4, 64, jnp.float64)
    CLAMP = _median_clamp(x, k, wh, we)
    go = jax.random.normal(jax.random.fold_in(key, 3), x.shape, jnp.float64)
    ours = lambda *a: modeling.engram_gate(*a, clamp_value=CLAMP, eps=1e-20, implementation="reference")
    plain = lambda *a: ref.engram_gate(*a, clamp_value=CLAMP, eps=1e-20)
    got = jax.jit(jax.grad(_loss(ours, go), argnums=range(5)))(x, k, v, wh, we)
    want = jax.grad(_loss(plain, go), argnums=range(5))(x, k, v, wh, we)
    for a, b in zip(got, want):
      assert a.dtype == jnp.float64
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)
    check_grads(jax.jit(ours), (x, k, v, wh, we), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


def test_bf16_gradients_kernels_interpret(key):
  x, k, v, wh, we = gate_inputs(key, 5, 4, 512)
  CLAMP = _median_clamp(x, k, wh, we) * 1.0001  # away from exact ties
  go = jax.random.normal(jax.random.fold_in(key, 3), x.shape).astype(jnp.bfloat16)
  ours = lambda *a: modeling.engram_gate(*a, clamp_value=CLAMP, eps=1e-20, implementation="interpret")
  # upstream's bwd test: autograd through the reference with float32 leaf copies of the weights (float32
  # master weights here too, so that the weight gradients come back unrounded)
  wh32, we32 = wh.astype(jnp.float32), we.astype(jnp.float32)
  out, vjp = jax.vjp(jax.jit(ours), x, k, v, wh32, we32)
  got = jax.jit(vjp)(go)
  plain = lambda x, k, v, wh, we: ref.engram_gate(x, k, v, wh, we, clamp_value=CLAMP, eps=1e-20)
  want_out, want_vjp = jax.vjp(plain, x, k, v, wh32, we32)
  want = want_vjp(go)
  assert_diff_below(out, want_out, 2e-10)
  for a, b, w in zip(got, want, (x, k, v, wh32, we32)):
    assert a.dtype == w.dtype and a.shape == w.shape
    assert_diff_below(a, b, 1e-8)
  # bf16 weights: the same float32 sums rounded to bf16 (PyTorch's cast of the fp32 gradient buffer)
  got16 = jax.jit(jax.vjp(jax.jit(ours), x, k, v, wh, we)[1])(go)
  for a, b in zip(got16[3:], got[3:]):
    assert a.dtype == jnp.bfloat16
    assert_bitwise_equal(a, b.astype(jnp.bfloat16))


def test_float32_master_weights_get_float32_gradients(key):
  x, k, v, wh, we = gate_inputs(key, 3, 4, 256, weight_dtype=jnp.float32)
  f = lambda wh, we: modeling.engram_gate(x, k, v, wh, we, clamp_value=1e-6, eps=1e-20,
                                          implementation="reference").astype(jnp.float32).sum()
  gh, ge = jax.jit(jax.grad(f, argnums=(0, 1)))(wh, we)
  assert gh.dtype == ge.dtype == jnp.float32
  out = modeling.engram_gate(x, k, v, wh, we, clamp_value=1e-6, eps=1e-20, implementation="reference")
  assert_bitwise_equal(out, modeling.engram_gate(x, k, v, wh.astype(jnp.bfloat16), we.astype(jnp.bfloat16),
                                                 clamp_value=1e-6, eps=1e-20, implementation="reference"))


def test_leading_dims_vmap_and_zero_tokens(key):
  x, k, v, wh, we = gate_inputs(key, 6, 4, 256)
  f = lambda x, k, v: modeling.engram_gate(x, k, v, wh, we, clamp_value=1e-6, eps=1e-20, implementation="interpret")
  flat = jax.jit(f)(x, k, v)
  batched = jax.jit(f)(x.reshape(2, 3, 4, 256), k.reshape(2, 3, 4, 256), v.reshape(2, 3, 256))
  assert batched.shape == (2, 3, 4, 256)
  assert_bitwise_equal(batched.reshape(flat.shape), flat)
  mapped = jax.jit(jax.vmap(f))(x.reshape(2, 3, 4, 256), k.reshape(2, 3, 4, 256), v.reshape(2, 3, 256))
  assert_bitwise_equal(mapped.reshape(flat.shape), flat)
  # vmap of the gradient (grad inside vmap: per-example weight gradients)
  g = jax.jit(jax.vmap(jax.grad(lambda x, k, v, wh: modeling.engram_gate(
      x, k, v, wh, we, clamp_value=1e-6, eps=1e-20, implementation="reference").astype(jnp.float32).sum(),
      argnums=3), in_axes=(0, 0, 0, None)))(x.reshape(2, 3, 4, 256), k.reshape(2, 3, 4, 256),
                                            v.reshape(2, 3, 256), wh)
  assert g.shape == (2, 4, 256) and g.dtype == jnp.bfloat16
  z = jnp.zeros((2, 0, 4, 256), jnp.bfloat16)
  loss = lambda x, wh: modeling.engram_gate(x, x, jnp.zeros((2, 0, 256), jnp.bfloat16), wh, we, clamp_value=1e-6,
                                            eps=1e-20, implementation="pallas").astype(jnp.float32).sum()
  gx, gwh = jax.grad(loss, argnums=(0, 1))(z, wh)
  assert gx.shape == z.shape and gwh.shape == wh.shape and not np.any(np.asarray(gwh, np.float32))


def test_explain_lists_forward_and_backward(key):
  x, k, v, wh, we = gate_inputs(key, 2, 4, 256)
  loss = lambda x: modeling.engram_gate(x, k, v, wh, we, clamp_value=1e-6, eps=1e-20,
                                        implementation="interpret").astype(jnp.float32).sum()
  ops = [d.op for d in jaxkern.explain(jax.grad(loss), x)]
  assert ops == ["fused_weight", "engram_gate_fwd", "engram_gate_bwd", "grad_w_reduce"]


@pytest.mark.parametrize("kw, match", [
    (dict(v=jnp.zeros((3, 256), jnp.bfloat16)), "v must have shape"),
    (dict(k=jnp.zeros((2, 4, 128), jnp.bfloat16)), r"k must have shape .* \(the shape of hidden_states\)"),
    (dict(weight_hidden=jnp.zeros((2, 256), jnp.bfloat16), weight_embed=jnp.zeros((2, 256), jnp.bfloat16)),
     "weight_hidden must have shape"),
    (dict(weight_embed=jnp.zeros((2, 256), jnp.bfloat16)),
     r"weight_embed must have shape .* \(the shape of weight_hidden\)"),
    (dict(hidden_states=jnp.zeros((256,), jnp.bfloat16)), r"hidden_states must have shape \[\*, M, D\]"),
    (dict(hidden_states=jnp.zeros((2, 4, 256), jnp.int32)), "hidden_states must have dtype"),
])
def test_bad_inputs(kw, match):
  args = dict(hidden_states=jnp.zeros((2, 4, 256), jnp.bfloat16), k=jnp.zeros((2, 4, 256), jnp.bfloat16),
              v=jnp.zeros((2, 256), jnp.bfloat16), weight_hidden=jnp.ones((4, 256), jnp.bfloat16),
              weight_embed=jnp.ones((4, 256), jnp.bfloat16))
  args.update(kw)
  with pytest.raises(ValueError, match=match):
    modeling.engram_gate(**args, clamp_value=1e-6, eps=1e-6)

"""jaxkern.mhc.pre_split_mixes and head_compute_mix (docs/mhc.md): XLA code; values, custom_vjp
gradients vs autodiff of the reference at upstream's tolerances, float64 check_grads, zero tokens, checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxkern
from jaxkern import mhc
from jaxkern.reference import mhc as ref
from tests.mhc.helpers import close, vjp

M = 4


def _split(implementation=None):
  return lambda z, s, b: mhc.pre_split_mixes(z, s, b, mhc_mult=M, mhc_post_mult_value=2.0, mhc_pre_eps=1e-2,
                                             implementation=implementation)


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_pre_split_mixes(key, implementation):
  ks = jax.random.split(key, 4)
  z, s, b = jax.random.normal(ks[0], (2, 64, 24)), jax.random.normal(ks[1], (3,)), jax.random.normal(ks[2], (24,))
  outs = ref.pre_split_mixes(z, s, b, mhc_mult=M, mhc_post_mult_value=2.0, mhc_pre_eps=1e-2)
  cot = type(outs)(*(jax.random.normal(jax.random.fold_in(ks[3], i), o.shape) for i, o in enumerate(outs)))
  got, grads = jax.jit(lambda *a: vjp(_split(implementation), a, cot))(z, s, b)
  want, want_grads = vjp(_split("reference"), (z, s, b), cot)
  _, auto = vjp(lambda *a: ref.pre_split_mixes(*a, mhc_mult=M, mhc_post_mult_value=2.0, mhc_pre_eps=1e-2),
                (z, s, b), cot)
  for a, w in zip((*got, *grads), (*want, *auto)):
    close(a, w, rtol=1e-5, atol=2e-5)
  assert [o.shape for o in got] == [(2, 64, M, 1), (2, 64, M, 1), (2, 64, M, M)]


def test_head_compute_mix(key):
  ks = jax.random.split(key, 4)
  z, s, b = jax.random.normal(ks[0], (2, 64, M)), jax.random.normal(ks[1], (1,)), jax.random.normal(ks[2], (M,))
  go = jax.random.normal(ks[3], z.shape)
  f = lambda *a: mhc.head_compute_mix(*a, mhc_pre_eps=1e-2, implementation="xla")
  got, grads = jax.jit(lambda *a: vjp(f, a, go))(z, s, b)
  want, auto = vjp(lambda *a: ref.head_compute_mix(*a, mhc_pre_eps=1e-2), (z, s, b), go)
  for a, w in zip((got, *grads), (want, *auto)):
    close(a, w, rtol=1e-4, atol=1e-5)


def test_float64_check_grads(key):
  with jax.enable_x64(True):
    z, s, b = (jax.random.normal(k, shape, jnp.float64) for k, shape in
               zip(jax.random.split(key, 3), ((3, 24), (3,), (24,))))
    check_grads(jax.jit(_split("reference")), (z, s, b), order=1, modes=["rev"])
    check_grads(jax.jit(lambda *a: mhc.head_compute_mix(*a, implementation="reference")), (z[:, :M], s[:1], b[:M]),
                order=1, modes=["rev"])


def test_zero_tokens():
  z = jnp.zeros((0, 24))
  out = mhc.pre_split_mixes(z, jnp.ones(3), jnp.ones(24), mhc_mult=M, implementation="pallas")
  assert out.comb_res_mix.shape == (0, M, M)
  g = jax.grad(lambda s: _split("xla")(z, s, jnp.ones(24)).pre_layer_mix.sum())(jnp.ones(3))
  assert g.shape == (3,) and not np.any(g)
  assert mhc.head_compute_mix(jnp.zeros((0, M)), jnp.ones(1), jnp.ones(M)).shape == (0, M)


@pytest.mark.parametrize("call, match", [
    (lambda: mhc.pre_split_mixes(jnp.zeros((2, 23)), jnp.ones(3), jnp.ones(24), mhc_mult=4), "input_mixes must have 24"),
    (lambda: mhc.pre_split_mixes(jnp.zeros((2, 24)), jnp.ones(2), jnp.ones(24), mhc_mult=4), "mhc_scale must have shape"),
    (lambda: mhc.pre_split_mixes(jnp.zeros((2, 24)), jnp.ones(3), jnp.ones(23), mhc_mult=4), "mhc_base must have shape"),
    (lambda: mhc.pre_split_mixes(jnp.zeros((2, 24)), jnp.ones(3), jnp.ones(24), mhc_mult=0), "mhc_mult"),
    (lambda: mhc.pre_split_mixes(jnp.zeros((2, 24)), jnp.ones(3), jnp.ones(24), mhc_mult=4, mhc_post_mult_value=0.0),
     "mhc_post_mult_value"),
    (lambda: mhc.head_compute_mix(jnp.zeros((2, 4)), jnp.ones(2), jnp.ones(4)), "mhc_scale must have shape"),
    (lambda: mhc.head_compute_mix(jnp.zeros((2, 4)), jnp.ones(1), jnp.ones(3)), "mhc_base must have shape"),
])
def test_bad_inputs(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_backward_ops_are_not_differentiable():
  with pytest.raises(jaxkern.NotDifferentiableError, match="head_compute_mix_bwd"):
    jax.grad(lambda z: mhc.head_compute_mix_bwd(z, z, jnp.ones(1), jnp.ones(M)).mhc_scale_grad.sum())(jnp.ones((2, M)))

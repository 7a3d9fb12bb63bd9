"""jaxkern.mhc.expand_to_mhc (docs/mhc.md): bitwise forward, float32-summed backward, lowering, checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkern
from jaxkern import mhc
from jaxkern.reference import mhc as ref
from jaxkern.testing import assert_bitwise_equal, lower_for_h100
from tests.mhc.helpers import BF16, close, interpret, sds, vjp


@pytest.mark.parametrize("lead, m, h", [((3,), 4, 1280), ((2, 1), 2, 1024)])
def test_expand_kernel(key, lead, m, h):
  x = jax.random.normal(key, (*lead, h)).astype(jnp.bfloat16)
  g = jax.random.normal(jax.random.fold_in(key, 1), (*lead, m, h)).astype(jnp.bfloat16)
  out, (dx,) = interpret(lambda x: vjp(functools.partial(mhc.expand_to_mhc, mhc_mult=m), (x,), g))(x)
  assert_bitwise_equal(out, ref.expand_to_mhc(x, mhc_mult=m))
  want = ref.expand_to_mhc_bwd(g)
  close(dx, want, **BF16)
  assert_bitwise_equal(dx, want)  # m-ordered float32 sums of bf16 values, one rounding: exact here


def test_zero_tokens_and_checks():
  x = jnp.zeros((0, 1024), jnp.bfloat16)
  assert mhc.expand_to_mhc(x, mhc_mult=4, implementation="pallas").shape == (0, 4, 1024)
  assert mhc.expand_to_mhc_bwd(jnp.zeros((0, 4, 1024), jnp.bfloat16), implementation="pallas").shape == (0, 1024)
  for bad in (0, 2.0, True):
    with pytest.raises(ValueError, match="mhc_mult"):
      mhc.expand_to_mhc(x, mhc_mult=bad)
  with pytest.raises(ValueError, match="hidden must have dtype"):
    mhc.expand_to_mhc(x.astype(jnp.int32), mhc_mult=4)
  with pytest.raises(ValueError, match="out_grad must have rank"):
    mhc.expand_to_mhc_bwd(jnp.zeros((1024,), jnp.bfloat16))
  with pytest.raises(jaxkern.KernelUnavailableError, match="bfloat16"):
    mhc.expand_to_mhc(jnp.zeros((2, 1024)), mhc_mult=4, implementation="pallas")
  with pytest.raises(jaxkern.NotDifferentiableError):
    jax.grad(lambda g: mhc.expand_to_mhc_bwd(g).sum())(jnp.zeros((2, 4, 8)))


def test_float64_gradient_through_reference():
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8)))
    from jax.test_util import check_grads
    check_grads(jax.jit(lambda x: mhc.expand_to_mhc(x, mhc_mult=3, implementation="reference")), (x,), order=1,
                modes=["rev"])


def test_lowers_for_h100():
  for f, a in [(functools.partial(mhc.expand_to_mhc, mhc_mult=4, implementation="pallas"), sds((4001, 7168), jnp.bfloat16)),
               (functools.partial(mhc.expand_to_mhc_bwd, implementation="pallas"), sds((4001, 8, 2560), jnp.bfloat16))]:
    assert "mosaic_gpu" in lower_for_h100(f, a).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 4, 8])
@pytest.mark.parametrize("h", [1280, 2560, 7168])
def test_spec_grid(key, m, h):
  x = jax.random.normal(key, (2, 4096, h)).astype(jnp.bfloat16)
  g = jax.random.normal(jax.random.fold_in(key, 1), (2, 4096, m, h)).astype(jnp.bfloat16)
  out, (dx,) = jax.jit(lambda x: vjp(functools.partial(mhc.expand_to_mhc, mhc_mult=m), (x,), g))(x)
  assert_bitwise_equal(out, ref.expand_to_mhc(x, mhc_mult=m))
  close(dx, jax.jit(ref.expand_to_mhc_bwd)(g), **BF16)

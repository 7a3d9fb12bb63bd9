"""jaxkern.mhc.sinkhorn_normalize (docs/mhc.md): kernel (interpret) vs the reference, column sums,
backward kernel vs autodiff, lowering, checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxkern
from jaxkern import mhc
from jaxkern.reference import mhc as ref
from jaxkern.testing import lower_for_h100
from tests.mhc.helpers import FP32, close, interpret, sds, vjp


def _check_sums(out):
  cols = np.asarray(out, np.float64).sum(-2)
  np.testing.assert_allclose(cols, 1.0, atol=1e-5)  # the last normalisation is a column one
  np.testing.assert_allclose(np.asarray(out, np.float64).sum(-1), 1.0, atol=0.1)  # rows only approximately (10 iterations)


def test_forward_and_backward(key):
  """T < 128 (padded to one CTA), the default repeat = 10, forward and backward kernels."""
  x = jax.random.normal(key, (2, 3, 4, 4)) * 2
  g = jax.random.normal(jax.random.fold_in(key, 1), x.shape)
  out, (dx,) = interpret(lambda x: vjp(mhc.sinkhorn_normalize, (x,), g))(x)
  want, (want_dx,) = vjp(ref.sinkhorn_normalize, (x,), g)
  close(out, want, **FP32)
  close(dx, want_dx, **FP32)
  _check_sums(out)


def test_forward_clamped_last_cta(key):
  """T = 130: a clamped last CTA that overlaps its neighbour (the backward kernels on the same tokens:
  test_linear_backward_equals_recompute; the repeat = 10 backward takes a minute or more to compile in interpret
  mode, once is enough: test_forward_and_backward)."""
  x = jax.random.normal(key, (130, 4, 4)) * 2
  out = interpret(mhc.sinkhorn_normalize)(x)
  close(out, ref.sinkhorn_normalize(x), **FP32)
  _check_sums(out)


def test_repeat_one_and_eps(key):
  x = jax.random.normal(key, (3, 4, 4))
  f = lambda x: mhc.sinkhorn_normalize(x, repeat=1, eps=1e-3)
  close(interpret(f)(x), ref.sinkhorn_normalize(x, repeat=1, eps=1e-3), **FP32)


def test_float64_gradients_via_reference(key):
  with jax.enable_x64(True):
    x = jax.random.normal(key, (2, 4, 4), jnp.float64)
    check_grads(jax.jit(functools.partial(mhc.sinkhorn_normalize, repeat=4, implementation="reference")), (x,),
                order=1, modes=["rev"])


def test_zero_tokens_checks_and_lowering():
  assert mhc.sinkhorn_normalize(jnp.zeros((0, 4, 4)), implementation="pallas").shape == (0, 4, 4)
  assert mhc.sinkhorn_normalize_bwd(jnp.zeros((0, 4, 4)), jnp.zeros((0, 4, 4)), implementation="pallas").shape == (0, 4, 4)
  with pytest.raises(ValueError, match="x must have shape"):
    mhc.sinkhorn_normalize(jnp.zeros((2, 4, 3)))
  with pytest.raises(ValueError, match="repeat"):
    mhc.sinkhorn_normalize(jnp.zeros((2, 4, 4)), repeat=0)
  with pytest.raises(ValueError, match="eps"):
    mhc.sinkhorn_normalize(jnp.zeros((2, 4, 4)), eps=-1.0)
  with pytest.raises(ValueError, match="grad_output must have shape"):
    mhc.sinkhorn_normalize_bwd(jnp.zeros((3, 4, 4)), jnp.zeros((2, 4, 4)))
  with pytest.raises(jaxkern.KernelUnavailableError, match="float32"):
    mhc.sinkhorn_normalize(jnp.zeros((2, 4, 4), jnp.bfloat16), implementation="pallas")
  with pytest.raises(jaxkern.NotDifferentiableError):
    jax.grad(lambda x: mhc.sinkhorn_normalize_bwd(x, x).sum())(jnp.ones((2, 4, 4)))
  a = sds((8192, 4, 4), jnp.float32)
  assert "mosaic_gpu" in lower_for_h100(functools.partial(mhc.sinkhorn_normalize, implementation="pallas"), a).as_text()
  assert "mosaic_gpu" in lower_for_h100(functools.partial(mhc.sinkhorn_normalize_bwd, implementation="pallas"),
                                        a, a).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("n0", [1, 2])
@pytest.mark.parametrize("n1", [1, 1024, 4096])
def test_spec_grid(key, n0, n1):
  x = jax.random.normal(key, (n0, n1, 4, 4))
  g = jax.random.normal(jax.random.fold_in(key, 1), x.shape)
  out, (dx,) = jax.jit(lambda x: vjp(mhc.sinkhorn_normalize, (x,), g))(x)
  want, (want_dx,) = jax.jit(lambda x: vjp(ref.sinkhorn_normalize, (x,), g))(x)
  close(out, want, **FP32)
  close(dx, want_dx, **FP32)


@pytest.mark.parametrize("repeat", [3])  # repeat = 10 against the reference: test_forward_and_backward
def test_linear_backward_equals_recompute(key, repeat):
  # The saved-iterate backward (reciprocal multiplies) and the O(repeat²) form (upstream's divisions) agree to a
  # few ulps, and both meet upstream's tolerance against the reference.
  from jaxkern import _config
  from jaxkern.mhc import _sinkhorn_kernel as kern
  x = jax.random.normal(key, (130, 4, 4)) * 2
  g = jax.random.normal(jax.random.fold_in(key, 1), x.shape)
  run = lambda recompute: jax.jit(functools.partial(kern.sinkhorn_kernel, repeat=repeat, eps=1e-6, backward_pass=True,
                                                    recompute=recompute, interpret=_config.mosaic_interpret(True)))(x, g)
  fast, slow = run(False), run(True)
  np.testing.assert_allclose(np.asarray(fast), np.asarray(slow), rtol=1e-5, atol=1e-6)
  want = ref.sinkhorn_normalize_bwd(g, x, repeat=repeat, eps=1e-6)
  close(fast, want, **FP32)
  close(slow, want, **FP32)

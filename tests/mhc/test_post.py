"""jaxkern.mhc.post and pre_apply_mix (docs/mhc.md): kernels in interpret mode vs the references at
upstream's tolerances, backward kernels (custom_vjp) vs autodiff of the reference, accumulation into a residual
gradient, H100 lowering, argument checks, zero tokens, leading dims."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxkern
from jaxkern import mhc
from jaxkern.mhc import _stream_kernels
from jaxkern.reference import mhc as ref
from jaxkern.testing import lower_for_h100
from tests.mhc.helpers import BF16, close, interpret, sds, vjp

M = 4


def post_inputs(key, lead, h, m=M):
  ks = jax.random.split(key, 5)
  x = jax.random.normal(ks[0], (*lead, h)).astype(jnp.bfloat16)
  res = jax.random.normal(ks[1], (*lead, m, h)).astype(jnp.bfloat16)
  post = jax.random.normal(ks[2], (*lead, m, 1))
  comb = jax.random.normal(ks[3], (*lead, m, m))
  do = jax.random.normal(ks[4], (*lead, m, h)).astype(jnp.bfloat16)
  return x, res, post, comb, do


def test_tiles_cover_the_row_once():
  for h in (1024, 1280, 2560, 7168, 7680):
    covered = np.zeros(h // 128, int)
    for r0, overlap in _stream_kernels.tiles(h):
      covered[r0 + overlap:r0 + 8] += 1
    assert np.all(covered == 1), h


@pytest.mark.parametrize("lead, h", [((3,), 1280), ((2, 2), 1024)])  # overlapping last tile / leading dims
def test_post_forward_and_backward(key, lead, h):
  x, res, post, comb, do = post_inputs(key, lead, h)
  out, grads = interpret(lambda *a: vjp(mhc.post, a, do))(x, res, post, comb)
  want, want_grads = vjp(ref.post, (x, res, post, comb), do)
  close(out, want, **BF16)
  assert np.mean(np.asarray(out, np.float32) == np.asarray(want, np.float32)) > 0.99
  close(grads[0], want_grads[0], **BF16)
  close(grads[1], want_grads[1], **BF16)
  close(grads[2], want_grads[2], rtol=1e-4, atol=1e-4)
  close(grads[3], want_grads[3], rtol=1e-4, atol=1e-4)
  bwd = interpret(mhc.post_bwd)(do, x, res, post, comb)
  for a, b in zip(bwd, grads):
    close(a, b, rtol=0, atol=0)  # the custom_vjp runs the same backward kernel


@pytest.mark.parametrize("acc", [False, True])
def test_pre_apply_mix_forward_and_backward(key, acc):
  x, res, mix, _, do = post_inputs(key, (3,), 1280)
  mix = jax.nn.softmax(mix, axis=-2)
  og = x
  out, grads = interpret(lambda *a: vjp(mhc.pre_apply_mix, a, og))(res, mix)
  want, want_grads = vjp(ref.pre_apply_mix, (res, mix), og)
  tol = dict(atol=1e-2, rtol=1e-3)
  close(out, want, **tol)
  close(grads[0], want_grads[0], **tol)
  close(grads[1], want_grads[1], **tol)
  if acc:  # accumulate onto an existing residual gradient (the fused grad_from_mhc_post path)
    got = interpret(lambda *a: mhc.pre_apply_mix_bwd(*a))(og, res, mix, do)
    want = ref.pre_apply_mix_bwd(og, res, mix, do)
    close(got.x_grad, want.x_grad, **BF16)
    assert np.mean(np.asarray(got.x_grad, np.float32) == np.asarray(want.x_grad, np.float32)) > 0.99
    close(got.mix_grad, want.mix_grad, **tol)


def test_reference_gradients_float64(key):
  """The custom_vjp under "reference" in float64 equals autodiff of the reference composite."""
  with jax.enable_x64(True):
    x, res, post, comb, do = (a.astype(jnp.float64) for a in post_inputs(key, (2,), 16))
    f = jax.jit(lambda *a: vjp(functools.partial(mhc.post, implementation="reference"), a, do))
    _, got = f(x, res, post, comb)
    _, want = vjp(ref.post, (x, res, post, comb), do)
    for a, b in zip(got, want):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)
    check_grads(jax.jit(functools.partial(mhc.post, implementation="reference")),
                              (x, res, post, comb), order=1, modes=["rev"])
    check_grads(jax.jit(functools.partial(mhc.pre_apply_mix, implementation="reference")),
                              (res, post), order=1, modes=["rev"])


def test_zero_tokens():
  x, res = jnp.zeros((0, 1024), jnp.bfloat16), jnp.zeros((0, M, 1024), jnp.bfloat16)
  p, c = jnp.zeros((0, M, 1)), jnp.zeros((0, M, M))
  assert mhc.post(x, res, p, c, implementation="pallas").shape == (0, M, 1024)
  g = mhc.post_bwd(res, x, res, p, c, implementation="pallas")
  assert g.d_comb_res_mix.shape == (0, M, M) and g.d_x.shape == (0, 1024)
  assert mhc.pre_apply_mix(res, p, implementation="pallas").shape == (0, 1024)
  assert mhc.pre_apply_mix_bwd(x, res, p, implementation="pallas").mix_grad.shape == (0, M, 1)


@pytest.mark.parametrize("h", [2560, 7168])
def test_kernels_lower_for_h100(h):
  t = 4001
  x, r = sds((t, h), jnp.bfloat16), sds((t, M, h), jnp.bfloat16)
  p, c = sds((t, M, 1), jnp.float32), sds((t, M, M), jnp.float32)
  pallas = dict(implementation="pallas")
  for f, args in [(functools.partial(mhc.post, **pallas), (x, r, p, c)),
                  (functools.partial(mhc.post_bwd, **pallas), (r, x, r, p, c)),
                  (functools.partial(mhc.pre_apply_mix, **pallas), (r, p)),
                  (functools.partial(mhc.pre_apply_mix_bwd, **pallas), (x, r, p)),
                  (functools.partial(mhc.pre_apply_mix_bwd, **pallas), (x, r, p, r))]:
    assert "mosaic_gpu" in lower_for_h100(f, *args).as_text()


def test_unsupported_runs_xla():
  x, r = jnp.zeros((2, 640), jnp.bfloat16), jnp.zeros((2, 5, 640), jnp.bfloat16)
  p, c = jnp.zeros((2, 5, 1)), jnp.zeros((2, 5, 5))
  with pytest.raises(jaxkern.KernelUnavailableError, match=r"residual.shape\[-2\] \(M\) = 5; the kernels take M <= 4"):
    mhc.post(x, r, p, c, implementation="interpret")
  with pytest.raises(jaxkern.KernelUnavailableError, match="x has dtype float32; the kernels take bfloat16"):
    mhc.pre_apply_mix(jnp.zeros((2, M, 1024), jnp.float32), p[:, :M], implementation="interpret")


X, R = jnp.zeros((2, 1024), jnp.bfloat16), jnp.zeros((2, M, 1024), jnp.bfloat16)
P, C = jnp.zeros((2, M, 1)), jnp.zeros((2, M, M))


@pytest.mark.parametrize("args, match", [
    ((X[:1], R, P, C), "x must have shape"),
    ((X, R, P[..., 0], C), "post_layer_mix must have shape"),
    ((X, R, P, C[:, :3]), "comb_res_mix must have shape"),
    ((X, R.astype(jnp.int32), P, C), "residual must have dtype"),
    ((X, R[0, 0], P, C), "residual must have rank"),
])
def test_post_bad_inputs(args, match):
  with pytest.raises(ValueError, match=match):
    mhc.post(*args)


def test_bad_inputs_other_ops():
  with pytest.raises(ValueError, match="mix must have shape"):
    mhc.pre_apply_mix(R, P[..., 0])
  with pytest.raises(ValueError, match="o_grad must have shape"):
    mhc.pre_apply_mix_bwd(R, R, P)
  with pytest.raises(ValueError, match="x_grad_acc must have shape"):
    mhc.pre_apply_mix_bwd(X, R, P, X)
  with pytest.raises(ValueError, match="d_o must have shape"):
    mhc.post_bwd(X, X, R, P, C)


def test_backward_ops_are_not_differentiable():
  with pytest.raises(jaxkern.NotDifferentiableError, match="post_bwd"):
    jax.grad(lambda d: mhc.post_bwd(d, X, R, P, C).d_comb_res_mix.sum())(R.astype(jnp.float32))
  with pytest.raises(jaxkern.NotDifferentiableError, match="pre_apply_mix_bwd"):
    jax.grad(lambda m: mhc.pre_apply_mix_bwd(X, R, m).mix_grad.sum())(P)


@pytest.mark.gpu
@pytest.mark.parametrize("n0", [1, 2])
@pytest.mark.parametrize("h", [1280, 2560, 7168])
def test_post_spec_grid(key, n0, h):
  x, res, post, comb, do = post_inputs(key, (n0, 4096), h)
  out, grads = jax.jit(lambda *a: vjp(mhc.post, a, do))(x, res, post, comb)
  want, want_grads = jax.jit(lambda *a: vjp(ref.post, a, do))(x, res, post, comb)
  close(out, want, **BF16)
  for a, b, tol in zip(grads, want_grads, (BF16, BF16, dict(atol=1e-4, rtol=1e-4), dict(atol=1e-4, rtol=1e-4))):
    close(a, b, **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("n0", [1, 2])
@pytest.mark.parametrize("h", [1280, 2560, 7680])
def test_pre_apply_mix_spec_grid(key, n0, h):
  ks = jax.random.split(key, 3)
  x = jax.nn.sigmoid(jax.random.normal(ks[0], (n0, 4096, M, h))).astype(jnp.bfloat16)
  mix = jax.nn.softmax(jax.random.normal(ks[1], (n0, 4096, M, 1)), axis=-2)
  og = jax.random.normal(ks[2], (n0, 4096, h)).astype(jnp.bfloat16)
  got = jax.jit(lambda *a: vjp(mhc.pre_apply_mix, a, og))(x, mix)
  want = jax.jit(lambda *a: vjp(ref.pre_apply_mix, a, og))(x, mix)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    close(a, b, atol=1e-2, rtol=1e-3)

"""The mHC stream ops (expand_to_mhc, pre_apply_mix, post, forward and backward) at hidden sizes the (8, 128)-tile
kernels do not take (upstream's kernels take any H): the row kernels' tiling, the ops against the references in
interpret mode (fewer tokens than one tile, a clamped last tile, chunked rows, H not a multiple of 8), the row
kernels against the tile kernels where both run, H100 lowering, the rejection messages, and the same on a GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkern
from jaxkern import _config, mhc
from jaxkern.mhc import _stream_kernels as sk
from jaxkern.reference import mhc as ref
from jaxkern.testing import assert_bitwise_equal, lower_for_h100
from tests.mhc.helpers import BF16, close, interpret, sds, vjp

M = 4
IP = _config.mosaic_interpret(True)
MIX_TOL = dict(atol=1e-4, rtol=1e-4)  # float32 reductions in another order


def bits(a):
  return np.asarray(a).view(np.uint16)


def inputs(key, lead, h, m=M):
  ks = jax.random.split(key, 6)
  return dict(
      x=jax.random.normal(ks[0], (*lead, h)).astype(jnp.bfloat16),
      res=jax.random.normal(ks[1], (*lead, m, h)).astype(jnp.bfloat16),
      post=jax.random.normal(ks[2], (*lead, m, 1)),
      comb=jax.random.normal(ks[3], (*lead, m, m)),
      do=jax.random.normal(ks[4], (*lead, m, h)).astype(jnp.bfloat16),
      pre=jax.nn.softmax(jax.random.normal(ks[5], (*lead, m, 1)), axis=-2))


def test_row_plan():
  got = {h: (sk.row_plan(h).rows, sk.row_plan(h).chunk) for h in (1, 64, 100, 128, 192, 256, 320, 576, 1000, 1280,
                                                                     7168, 7680)}
  assert got == {1: (128, 1), 64: (16, 64), 100: (128, 20), 128: (8, 128), 192: (16, 192), 256: (4, 256),
                 320: (16, 320), 576: (16, 192), 1000: (128, 40), 1280: (4, 1280), 7168: (1, 7168),
                 7680: (2, 2560)}
  assert (sk.row_plan(320, sk.POST_BWD_MAX_REGS).rows, sk.row_plan(320, sk.POST_BWD_MAX_REGS).chunk) == (16, 64)
  # every hidden size: a divisor of H, at most max_regs vectors per thread and stream row
  for h in range(1, 300):
    for regs in (2, 8):
      plan = sk.row_plan(h, regs)
      assert h % plan.chunk == 0 and plan.chunk // np.gcd(8, plan.chunk) // (128 // plan.rows) <= regs
  assert sk.use_rows(576, 1) and sk.use_rows(7680, 1) is False and not sk.tiles_fit(576) and sk.tiles_fit(7680)


def check_ops(d):
  """Every stream op with the implementation in force against the reference (the checks of test_expand.py /
  test_post.py). Off a GPU the reference also contracts pre_apply_mix's sums as the kernel does, so they are
  bit-identical there; XLA on a GPU does not (one-ulp differences, within upstream's tolerance)."""
  exact = jax.default_backend() != "gpu"
  x, res, post, comb, do, pre = (d[k] for k in ("x", "res", "post", "comb", "do", "pre"))
  g = do
  out, (dx,) = jax.jit(lambda x: vjp(functools.partial(mhc.expand_to_mhc, mhc_mult=M), (x,), g))(x)
  assert_bitwise_equal(out, ref.expand_to_mhc(x, mhc_mult=M))
  assert_bitwise_equal(dx, jax.jit(ref.expand_to_mhc_bwd)(g))  # stream-ordered float32 adds on every backend

  out, grads = jax.jit(lambda *a: vjp(mhc.post, a, do))(x, res, post, comb)
  want, want_grads = jax.jit(lambda *a: vjp(ref.post, a, do))(x, res, post, comb)
  close(out, want, **BF16)
  assert np.mean(bits(out) == bits(want)) > 0.99
  for a, b, tol in zip(grads, want_grads, (BF16, BF16, MIX_TOL, MIX_TOL)):
    close(a, b, **tol)
  for a, b in zip(grads[:2], want_grads[:2]):
    assert np.mean(bits(a) == bits(b)) > 0.99

  og = x
  out, grads = jax.jit(lambda *a: vjp(mhc.pre_apply_mix, a, og))(res, pre)
  want, want_grads = jax.jit(lambda *a: vjp(ref.pre_apply_mix, a, og))(res, pre)
  tol = dict(atol=1e-2, rtol=1e-3)  # upstream's tolerance (XLA on a GPU rounds the products separately)
  for a, b in ((out, want), (grads[0], want_grads[0]), (grads[1], want_grads[1])):
    close(a, b, **tol)
  if exact:
    assert_bitwise_equal(out, want)
  got = jax.jit(mhc.pre_apply_mix_bwd)(og, res, pre, do)
  want = jax.jit(ref.pre_apply_mix_bwd)(og, res, pre, do)
  close(got.x_grad, want.x_grad, **BF16)
  assert np.mean(bits(got.x_grad) == bits(want.x_grad)) > 0.99
  close(got.mix_grad, want.mix_grad, **tol)


# (tokens, H): fewer tokens than one tile (padded), a clamped last tile, chunked rows (576: 3 x 192), 4-byte
# vectors (H = 100), chunks in a loop (H = 1000: 25 chunks of 40). H = 192 would repeat H = 320's plans (16-row
# tiles of whole rows, post's backward in chunks of 64) and its clamped last tile.
@pytest.mark.parametrize("t, h", [(5, 64), (6, 256), (17, 320), (3, 576), (130, 100), (7, 1000)])
def test_ops_interpret(key, t, h):
  check_ops(inputs(key, (t,), h))


def test_leading_dims_and_explain(key):
  d = inputs(key, (2, 3), 320)
  out = mhc.post(d["x"], d["res"], d["post"], d["comb"])
  assert out.shape == (2, 3, M, 320)
  assert [d.path for d in jaxkern.explain(mhc.post, d["x"], d["res"], d["post"], d["comb"])] == ["interpret"]
  assert_bitwise_equal(mhc.expand_to_mhc(d["x"], mhc_mult=2), ref.expand_to_mhc(d["x"], mhc_mult=2))


@pytest.mark.parametrize("t, h", [(3, 1280), (5, 1152)])  # padded to one tile; 1152 = 9 x 128: chunks of 384
def test_row_kernels_equal_tile_kernels(key, t, h):
  d = inputs(key, (t,), h)
  x, res, post, comb, do = d["x"], d["res"], d["post"][..., 0], d["comb"], d["do"]
  run = lambda f, *a, **k: jax.jit(functools.partial(f, interpret=IP, **k))(*a)
  np.testing.assert_array_equal(bits(run(sk.expand_fwd_rows_kernel, x, mhc_mult=3)),
                                bits(run(sk.expand_fwd_kernel, x, mhc_mult=3)))
  np.testing.assert_array_equal(bits(run(sk.expand_bwd_rows_kernel, res)), bits(run(sk.expand_bwd_kernel, res)))
  np.testing.assert_array_equal(bits(run(sk.apply_mix_fwd_rows_kernel, res, post)),
                                bits(run(sk.apply_mix_fwd_kernel, res, post)))
  xg, mg = run(sk.apply_mix_bwd_rows_kernel, x, res, post, do)
  xg1, mg1 = run(sk.apply_mix_bwd_kernel, x, res, post, do)
  np.testing.assert_array_equal(bits(xg), bits(xg1))
  np.testing.assert_allclose(np.asarray(mg), np.asarray(mg1), **MIX_TOL)
  np.testing.assert_array_equal(bits(run(sk.post_fwd_rows_kernel, x, res, post, comb)),
                                bits(run(sk.post_fwd_kernel, x, res, post, comb)))
  for cot in (do, do.astype(jnp.float32) * 1.001):  # the float32 cotangent, rounded in registers
    got = run(sk.post_bwd_rows_kernel, cot, x, res, post, comb)
    want = run(sk.post_bwd_kernel, cot, x, res, post, comb)
    for a, b in zip(got[:2], want[:2]):
      np.testing.assert_array_equal(bits(a), bits(b))
    for a, b in zip(got[2:], want[2:]):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), **MIX_TOL)


@pytest.mark.parametrize("t, h", [(4001, 64), (4001, 320), (4001, 576), (5, 100), (5, 1000)])
def test_ops_lower_for_h100(t, h):
  x, r = sds((t, h), jnp.bfloat16), sds((t, M, h), jnp.bfloat16)
  p, c, r32 = sds((t, M, 1), jnp.float32), sds((t, M, M), jnp.float32), sds((t, M, h), jnp.float32)
  pallas = dict(implementation="pallas")
  post_f32_cot = jax.grad(lambda x, r, p, c, w: jnp.sum(mhc.post(x, r, p, c, **pallas).astype(jnp.float32) * w),
                          argnums=(0, 1))
  for f, args in [(functools.partial(mhc.expand_to_mhc, mhc_mult=M, **pallas), (x,)),
                  (functools.partial(mhc.expand_to_mhc_bwd, **pallas), (r,)),
                  (functools.partial(mhc.pre_apply_mix, **pallas), (r, p)),
                  (functools.partial(mhc.pre_apply_mix_bwd, **pallas), (x, r, p)),
                  (functools.partial(mhc.pre_apply_mix_bwd, **pallas), (x, r, p, r)),
                  (functools.partial(mhc.post, **pallas), (x, r, p, c)),
                  (functools.partial(mhc.post_bwd, **pallas), (r, x, r, p, c)),
                  (post_f32_cot, (x, r, p, c, r32))]:
    assert "mosaic_gpu" in lower_for_h100(f, *args).as_text()


def test_rejections_name_the_argument():
  x, r, p, c = jnp.zeros((2, 128), jnp.bfloat16), jnp.zeros((2, M, 128), jnp.bfloat16), jnp.zeros((2, M, 1)), \
      jnp.zeros((2, M, M))
  ip = dict(implementation="interpret")
  cases = [
      (lambda: mhc.expand_to_mhc(x.astype(jnp.float32), mhc_mult=4, **ip), "hidden has dtype float32; the kernel takes bfloat16"),
      (lambda: mhc.expand_to_mhc(x, mhc_mult=9, **ip), "mhc_mult = 9; the kernel takes mhc_mult <= 8"),
      (lambda: mhc.expand_to_mhc_bwd(jnp.zeros((2, 9, 128), jnp.bfloat16), **ip), r"out_grad.shape\[-2\] \(M\) = 9"),
      (lambda: mhc.pre_apply_mix(r, p.astype(jnp.bfloat16), **ip), "mix has dtype bfloat16; the kernels take float32"),
      (lambda: mhc.pre_apply_mix_bwd(x.astype(jnp.float32), r, p, **ip), "o_grad has dtype float32"),
      (lambda: mhc.post(x, jnp.zeros((2, 5, 128), jnp.bfloat16), jnp.zeros((2, 5, 1)), jnp.zeros((2, 5, 5)), **ip),
       r"residual.shape\[-2\] \(M\) = 5; the kernels take M <= 4"),
      (lambda: mhc.post(x, r, p, c.astype(jnp.bfloat16), **ip), "comb_res_mix has dtype bfloat16"),
      (lambda: mhc.multilayer_recompute(jnp.zeros((2, M, 576), jnp.bfloat16), [p], [jnp.zeros((2, 576), jnp.bfloat16)],
                                        [p], [c], **ip), r"initial_residual.shape\[-1\] \(H\) = 576; the fused kernel takes H a multiple of 128"),
  ]
  for f, match in cases:
    with pytest.raises(jaxkern.KernelUnavailableError, match=match):
      f()


# ---------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("t, h", [(4096, 256), (4096, 576), (13, 320), (4096, 64), (4001, 100)])
def test_gpu_ops(key, t, h):
  check_ops(inputs(key, (1, t), h))


@pytest.mark.gpu
@pytest.mark.parametrize("t, h", [(4001, 1152)])
def test_gpu_row_kernels_equal_tile_kernels(key, t, h):
  d = inputs(key, (t,), h)
  x, res, post, comb, do = d["x"], d["res"], d["post"][..., 0], d["comb"], d["do"]
  run = lambda f, *a, **k: jax.jit(functools.partial(f, **k))(*a)
  np.testing.assert_array_equal(bits(run(sk.post_fwd_rows_kernel, x, res, post, comb)),
                                bits(run(sk.post_fwd_kernel, x, res, post, comb)))
  got = run(sk.post_bwd_rows_kernel, do, x, res, post, comb)
  want = run(sk.post_bwd_kernel, do, x, res, post, comb)
  for a, b in zip(got[:2], want[:2]):
    np.testing.assert_array_equal(bits(a), bits(b))
  for a, b in zip(got[2:], want[2:]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **MIX_TOL)
  np.testing.assert_array_equal(bits(run(sk.expand_fwd_rows_kernel, x, mhc_mult=M)),
                                bits(run(sk.expand_fwd_kernel, x, mhc_mult=M)))

"""The whole-row stream kernels (second version of pre_apply_mix, its backward and
expand_to_mhc_bwd) against the first-version kernels and the references in interpret mode, their H100 lowering,
which kernel the ops pick, and the private timing override of the "auto" XLA choice."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern import _config, mhc
from jaxkern.mhc import _common, _stream_kernels as sk
from jaxkern.reference import mhc as ref
from jaxkern.testing import lower_for_h100
from tests.mhc.helpers import BF16, close, interpret, sds

M = 4
IP = _config.mosaic_interpret(True)


def bits(a):
  return np.asarray(a).view(np.uint16)


def test_whole_rows_and_selection(monkeypatch):
  plans = [sk.row_plan(h) for h in (1024, 1280, 2560, 4096, 7168)]
  assert [(p.rows, p.chunk) for p in plans] == [(1, 1024), (4, 1280), (2, 2560), (1, 4096), (1, 7168)]
  # 129 vectors of 8 (a thread per row whatever the chunk): 128 tokens x 24 columns; 4-byte vectors for 1028
  assert [(sk.row_plan(h).rows, sk.row_plan(h).chunk) for h in (1032, 1028)] == [(128, 24), (128, 4)]
  assert sk.use_rows(1280, 4) and not sk.use_rows(1280, 3)  # fewer tokens than one tile: first version
  assert not sk.use_rows(7680, 4096)  # whole rows do not fit one tile: first version
  assert sk.use_rows(1032, 1)  # the (8, 128) tiles do not fit: the row kernels, always
  monkeypatch.setenv(sk.STREAM_V1_ENV, "1")
  assert not sk.use_rows(1280, 4096)


@pytest.mark.parametrize("t, h", [(6, 1280), (3, 2560)])  # the last tile clamped (overlapping its neighbour)
def test_rows_kernels_equal_first_version(key, t, h):
  ks = jax.random.split(key, 4)
  x = jax.nn.sigmoid(jax.random.normal(ks[0], (t, M, h))).astype(jnp.bfloat16)
  mix = jax.nn.softmax(jax.random.normal(ks[1], (t, M)), axis=-1)
  og = jax.random.normal(ks[2], (t, h)).astype(jnp.bfloat16)
  acc = jax.random.normal(ks[3], (t, M, h)).astype(jnp.bfloat16)
  run = lambda f, *a: jax.jit(functools.partial(f, interpret=IP))(*a)
  fwd = run(sk.apply_mix_fwd_rows_kernel, x, mix)
  np.testing.assert_array_equal(bits(fwd), bits(run(sk.apply_mix_fwd_kernel, x, mix)))
  close(fwd, ref.pre_apply_mix(x, mix[..., None]), atol=1e-2, rtol=1e-3)
  exp = run(sk.expand_bwd_rows_kernel, x)
  np.testing.assert_array_equal(bits(exp), bits(run(sk.expand_bwd_kernel, x)))
  close(exp, ref.expand_to_mhc_bwd(x), **BF16)
  for a in (None, acc):
    xg, mg = run(sk.apply_mix_bwd_rows_kernel, og, x, mix, a)
    xg1, mg1 = run(sk.apply_mix_bwd_kernel, og, x, mix, a)
    np.testing.assert_array_equal(bits(xg), bits(xg1))
    np.testing.assert_allclose(np.asarray(mg), np.asarray(mg1), rtol=1e-5, atol=1e-4)  # another summation tree
    want = ref.pre_apply_mix_bwd(og, x, mix[..., None], a)
    close(xg, want.x_grad, **BF16)
    close(mg, want.mix_grad[..., 0], atol=1e-2, rtol=1e-3)


def test_ops_run_the_rows_kernels(key):
  t, h = 5, 1024
  x = jax.nn.sigmoid(jax.random.normal(key, (t, M, h))).astype(jnp.bfloat16)
  mix = jax.nn.softmax(jax.random.normal(jax.random.fold_in(key, 1), (t, M, 1)), axis=-2)
  og = jax.random.normal(jax.random.fold_in(key, 2), (t, h)).astype(jnp.bfloat16)
  out = interpret(mhc.pre_apply_mix)(x, mix)
  close(out, ref.pre_apply_mix(x, mix), atol=1e-2, rtol=1e-3)
  got = interpret(mhc.pre_apply_mix_bwd)(og, x, mix)
  want = ref.pre_apply_mix_bwd(og, x, mix)
  close(got.x_grad, want.x_grad, **BF16)
  close(got.mix_grad, want.mix_grad, atol=1e-2, rtol=1e-3)
  close(interpret(mhc.expand_to_mhc_bwd)(x), ref.expand_to_mhc_bwd(x), **BF16)


@pytest.mark.parametrize("h", [1280, 2560, 4096, 7168])
def test_rows_kernels_lower_for_h100(h):
  t = 4001
  x, og, mix = sds((t, M, h), jnp.bfloat16), sds((t, h), jnp.bfloat16), sds((t, M), jnp.float32)
  for f, args in [(sk.apply_mix_fwd_rows_kernel, (x, mix)), (sk.expand_bwd_rows_kernel, (x,)),
                  (lambda a, b, c: sk.apply_mix_bwd_rows_kernel(a, b, c, None), (og, x, mix)),
                  (sk.apply_mix_bwd_rows_kernel, (og, x, mix, x))]:
    assert "mosaic_gpu" in lower_for_h100(f, *args).as_text()


def test_private_force_kernel_override(monkeypatch):
  monkeypatch.delenv(_common.FORCE_KERNEL_ENV, raising=False)
  assert _common.xla_faster("pre_apply_mix", "slower") == "slower"
  monkeypatch.setenv(_common.FORCE_KERNEL_ENV, "expand_to_mhc_bwd, sinkhorn_normalize_bwd")
  assert _common.xla_faster("sinkhorn_normalize_bwd", "slower") is None
  assert _common.xla_faster("pre_apply_mix", "slower") == "slower"
  monkeypatch.setenv(_common.FORCE_KERNEL_ENV, "all")
  assert _common.xla_faster("pre_apply_mix_bwd", "slower") is None


def _post_args(key, t, h):
  ks = jax.random.split(key, 5)
  return (jax.random.normal(ks[0], (t, h)).astype(jnp.bfloat16), jax.random.normal(ks[1], (t, M, h)).astype(jnp.bfloat16),
          jax.random.normal(ks[2], (t, M, 1)), jax.random.normal(ks[3], (t, M, M)), jax.random.normal(ks[4], (t, M, h)))


def test_post_float32_cotangent_rounded_in_kernel(key):
  # A loss that upcasts the output gives a float32 cotangent: the kernel rounds it to bf16 itself; the gradients
  # are the bits of post_bwd on the bf16-cast cotangent.
  x, r, p, c, w = _post_args(key, 3, 1024)
  loss = lambda x, r, p, c: jnp.sum(mhc.post(x, r, p, c).astype(jnp.float32) * w)
  got = interpret(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, r, p, c)
  want = interpret(lambda *a: mhc.post_bwd(w.astype(jnp.bfloat16), *a))(x, r, p, c)
  for a, b in zip(got, want):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  ref_g = jax.jit(jax.grad(lambda *a: jnp.sum(ref.post(*a).astype(jnp.float32) * w), argnums=(0, 1, 2, 3)))(x, r, p, c)
  close(got[0], ref_g[0], **BF16)
  close(got[1], ref_g[1], **BF16)


def test_post_float32_cotangent_lowers_for_h100():
  t, h = 4001, 2560
  args = (sds((t, h), jnp.bfloat16), sds((t, M, h), jnp.bfloat16), sds((t, M, 1), jnp.float32),
          sds((t, M, M), jnp.float32), sds((t, M, h), jnp.float32))
  f = jax.grad(lambda x, r, p, c, w: jnp.sum(mhc.post(x, r, p, c, implementation="pallas").astype(jnp.float32) * w),
               argnums=(0, 1))
  text = lower_for_h100(f, *args).as_text()
  assert text.count("mosaic_gpu") >= 2

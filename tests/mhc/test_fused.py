"""jaxkern.mhc.pre_big_fuse and multilayer_recompute (docs/mhc.md, "`pre_big_fuse`: the inference path",
"`multilayer_recompute`: rebuilding activations"): bit-exact against the unfused chain of jaxkern's own ops (as
upstream's exact-equality tests), against the references at upstream's tolerances, zero tokens, argument checks,
H100 lowering, not differentiable; upstream's shapes on a GPU.

Bit-exactness is checked with both sides under jax.jit (as the ops run in practice): on XLA:CPU an op-by-op
(eager) run of the same XLA code can differ in the last bit of the Sinkhorn divisions from a jitted one."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkern
from jaxkern import mhc
from jaxkern.reference import mhc as ref
from jaxkern.testing import lower_for_h100
from tests.mhc.helpers import BF16, close, sds

M = 4
OPTS = dict(rms_eps=1e-6, mhc_pre_eps=1e-2, mhc_sinkhorn_eps=1e-6, mhc_post_mult_value=2.0, sinkhorn_repeat=10)


def fuse_inputs(key, lead, h, normw=False):
  """Upstream's generator: residual randn·(1 + 0.01 m) -> bf16, fn randn·1e-4·(1 + 0.01 m), scale, base randn·0.1
  (fn scaled up to 1e-2 here so the mixes are not all ~0 at these small H)."""
  ks = jax.random.split(key, 5)
  j, k = M * (M + 2), M * h
  r = (jax.random.normal(ks[0], (*lead, M, h)) * (1 + 0.01 * jnp.arange(M))[:, None]).astype(jnp.bfloat16)
  fn = jax.random.normal(ks[1], (j, k)) * 1e-2 * (1 + 0.01 * jnp.repeat(jnp.arange(M), h))[None, :]
  scale = jax.random.normal(ks[2], (3,)) * 0.1
  base = jax.random.normal(ks[3], (j,)) * 0.1
  w = jax.random.normal(ks[4], (k,)) * 0.1 + 1 if normw else None
  return r, fn, scale, base, w


def unfused(r, fn, scale, base, w, *, rms_eps, mhc_pre_eps, mhc_sinkhorn_eps, mhc_post_mult_value, sinkhorn_repeat,
            implementation):
  """Upstream's ``big_fuse_reference``: the unfused chain of the (jaxkern) ops."""
  impl = dict(implementation=implementation)
  mixes = mhc.pre_norm_fn(r, fn, w, norm_eps=rms_eps, **impl)
  pre, post, comb = mhc.pre_split_mixes(mixes, scale, base, mhc_mult=M, mhc_post_mult_value=mhc_post_mult_value,
                                        mhc_pre_eps=mhc_pre_eps, **impl)
  comb = mhc.sinkhorn_normalize(comb, repeat=sinkhorn_repeat, eps=mhc_sinkhorn_eps, **impl)
  return post, comb, mhc.pre_apply_mix(r, pre, **impl)


def exact(a, b):
  assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
  np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


# ---------------------------------------------------------------------------------------------- pre_big_fuse

@pytest.mark.parametrize("implementation, lead, h, normw", [
    ("xla", (3, 5), 64, False), ("xla", (70,), 128, True), ("reference", (7,), 64, True),
    ("interpret", (5,), 1024, False), ("interpret", (3,), 192, True)])
def test_pre_big_fuse_bit_exact_vs_unfused_ops(key, implementation, lead, h, normw):
  r, fn, scale, base, w = fuse_inputs(key, lead, h, normw)
  got = jax.jit(lambda *a: mhc.pre_big_fuse(*a, **OPTS, implementation=implementation))(r, fn, scale, base, w)
  want = jax.jit(lambda *a: unfused(*a, **OPTS, implementation=implementation))(r, fn, scale, base, w)
  assert isinstance(got, jaxkern.types.PreBigFuse)
  for a, b in zip(got, want):
    exact(a, b)
  assert got.post_mix.shape == (*lead, M, 1) and got.comb_mix.shape == (*lead, M, M)
  assert got.layer_input.shape == (*lead, h) and got.layer_input.dtype == jnp.bfloat16
  # the test can fail: another eps gives other bits
  other = jax.jit(lambda *a: unfused(*a, **{**OPTS, "mhc_pre_eps": 1e-3}, implementation=implementation))(
      r, fn, scale, base, w)
  assert not np.array_equal(np.asarray(got.layer_input, np.float32), np.asarray(other[2], np.float32))
  if implementation == "interpret":  # the kernel against the reference on the inputs it already ran on
    check_against_reference(got, r, fn, scale, base, w)


def test_pre_big_fuse_vs_reference(key):
  """XLA's path (the kernel's: test_pre_big_fuse_bit_exact_vs_unfused_ops)."""
  r, fn, scale, base, w = fuse_inputs(key, (9,), 64, normw=True)
  got = jax.jit(lambda *a: mhc.pre_big_fuse(*a, **OPTS, implementation="xla"))(r, fn, scale, base, w)
  check_against_reference(got, r, fn, scale, base, w)


def check_against_reference(got, r, fn, scale, base, w):
  want = jax.jit(lambda *a: ref.pre_big_fuse(*a, **OPTS))(r, fn, scale, base, w)
  close(got.post_mix, want.post_mix, atol=1e-3, rtol=1e-3)  # pre_norm_fn's tolerance carried through
  close(got.comb_mix, want.comb_mix, atol=1e-3, rtol=1e-3)
  close(got.layer_input, want.layer_input, **BF16)
  # columns of the Sinkhorn output sum to ~1 (the last normalisation is over columns)
  np.testing.assert_allclose(np.asarray(got.comb_mix).sum(-2), 1, atol=1e-4)


def test_pre_big_fuse_reference_is_the_composition_of_references(key):
  r, fn, scale, base, w = fuse_inputs(key, (4,), 64, normw=True)
  got = jax.jit(lambda *a: ref.pre_big_fuse(*a, **OPTS))(r, fn, scale, base, w)
  want = jax.jit(lambda *a: unfused(*a, **OPTS, implementation="reference"))(r, fn, scale, base, w)
  for a, b in zip(got, want):
    exact(a, b)


@pytest.mark.parametrize("implementation", ["xla", "interpret", "reference"])
def test_pre_big_fuse_zero_tokens(key, implementation):
  _, fn, scale, base, _ = fuse_inputs(key, (1,), 1024)
  r = jnp.zeros((0, 3, M, 1024), jnp.bfloat16)
  out = jax.jit(lambda *a: mhc.pre_big_fuse(*a, implementation=implementation))(r, fn, scale, base)
  assert [a.shape for a in out] == [(0, 3, M, 1), (0, 3, M, M), (0, 3, 1024)]


def test_pre_big_fuse_argument_checks(key):
  r, fn, scale, base, w = fuse_inputs(key, (2,), 64, normw=True)
  f = functools.partial(mhc.pre_big_fuse, implementation="xla")
  with pytest.raises(ValueError, match="residual"):
    f(r[..., :3, :], fn, scale, base)
  with pytest.raises(ValueError, match="fn"):
    f(r, fn[:, :128], scale, base)
  with pytest.raises(ValueError, match="mhc_scale"):
    f(r, fn, scale[:2], base)
  with pytest.raises(ValueError, match="mhc_base"):
    f(r, fn, scale, base[:20])
  with pytest.raises(ValueError, match="norm_weight"):
    f(r, fn, scale, base, w[:10])
  with pytest.raises(ValueError, match="mhc_post_mult_value"):
    f(r, fn, scale, base, mhc_post_mult_value=0.0)
  with pytest.raises(ValueError, match="repeat"):
    f(r, fn, scale, base, sinkhorn_repeat=0)
  with pytest.raises(ValueError, match="mhc_sinkhorn_eps"):
    f(r, fn, scale, base, mhc_sinkhorn_eps=-1.0)
  with pytest.raises(ValueError, match="rms_eps"):
    f(r, fn, scale, base, rms_eps=float("nan"))
  r, fn, scale, base, _ = fuse_inputs(key, (2,), 32)
  with pytest.raises(jaxkern.KernelUnavailableError, match="pre_norm_fn"):  # H = 32: M·H not a multiple of 256
    jax.jit(lambda *a: mhc.pre_big_fuse(*a, implementation="interpret"))(r, fn, scale, base)


def test_pre_big_fuse_is_not_differentiable(key):
  r, fn, scale, base, _ = fuse_inputs(key, (2,), 64)
  with pytest.raises(jaxkern.NotDifferentiableError, match="pre_big_fuse"):
    jax.grad(lambda f: jnp.sum(mhc.pre_big_fuse(r, f, scale, base, implementation="xla").comb_mix))(fn)


# ---------------------------------------------------------------------------------------------- multilayer_recompute

def recompute_inputs(key, lead, h, num_layers, num_post):
  """Upstream's generator: everything randn (the mixes are not activations)."""
  ks = iter(jax.random.split(key, 1 + num_layers + 3 * num_post))
  r = jax.random.normal(next(ks), (*lead, M, h)).astype(jnp.bfloat16)
  pre = [jax.random.normal(next(ks), (*lead, M, 1)) for _ in range(num_layers)]
  outs = [jax.random.normal(next(ks), (*lead, h)).astype(jnp.bfloat16) for _ in range(num_post)]
  posts = [jax.random.normal(next(ks), (*lead, M, 1)) for _ in range(num_post)]
  combs = [jax.random.normal(next(ks), (*lead, M, M)) for _ in range(num_post)]
  return r, pre, outs, posts, combs


def layer_by_layer(r, pre, outs, posts, combs, implementation):
  inputs, residuals = [], []
  for i in range(len(pre)):
    inputs.append(mhc.pre_apply_mix(r, pre[i], implementation=implementation))
    if i < len(outs):
      r = mhc.post(outs[i], r, posts[i], combs[i], implementation=implementation)
      residuals.append(r)
  return inputs, residuals


@pytest.mark.parametrize("implementation, lead, h, num_layers, num_post", [
    ("xla", (1, 33), 256, 1, 1), ("xla", (17,), 128, 3, 2), ("xla", (2, 5), 64, 3, 3),
    ("reference", (9,), 64, 4, 3), ("interpret", (3,), 1024, 2, 1), ("interpret", (5,), 256, 2, 1),
    ("xla", (3,), 576, 2, 2)])  # interpret mode with num_post = num_layers: tests/mhc/test_recompute_kernel.py
def test_multilayer_recompute_bit_exact_vs_layer_by_layer(key, implementation, lead, h, num_layers, num_post):
  args = recompute_inputs(key, lead, h, num_layers, num_post)
  got = jax.jit(lambda *a: mhc.multilayer_recompute(*a, implementation=implementation))(*args)
  want = jax.jit(lambda *a: layer_by_layer(*a, implementation))(*args)
  assert isinstance(got, jaxkern.types.MultilayerRecompute)
  assert len(got.layer_input_list) == num_layers and len(got.residual_list) == num_post
  for a, b in zip(got.layer_input_list + got.residual_list, want[0] + want[1]):
    exact(a, b)
  ref_out = jax.jit(ref.multilayer_recompute)(*args)
  for a, b in zip(got.layer_input_list + got.residual_list, ref_out.layer_input_list + ref_out.residual_list):
    close(a, b, **BF16)
  # each layer reads the previous residual: the residuals change from layer to layer
  if num_post >= 2:
    assert not np.array_equal(np.asarray(got.residual_list[0]), np.asarray(got.residual_list[1]))


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_multilayer_recompute_zero_tokens(key, implementation):
  args = recompute_inputs(key, (0,), 1024, 2, 1)
  got = jax.jit(lambda *a: mhc.multilayer_recompute(*a, implementation=implementation))(*args)
  assert [a.shape for a in got.layer_input_list] == [(0, 1024)] * 2
  assert [a.shape for a in got.residual_list] == [(0, M, 1024)]


def test_multilayer_recompute_argument_checks(key):
  r, pre, outs, posts, combs = recompute_inputs(key, (3,), 64, 3, 2)
  f = functools.partial(mhc.multilayer_recompute, implementation="xla")
  with pytest.raises(ValueError, match="pre_mix_list"):
    f(r, [], [], [], [])
  with pytest.raises(ValueError, match="layer_output_list"):
    f(r, pre, outs[:1], posts[:1], combs[:1])
  with pytest.raises(ValueError, match="post_mix_list"):
    f(r, pre, outs, posts[:1], combs)
  with pytest.raises(ValueError, match=r"comb_mix_list\[1\]"):
    f(r, pre, outs, posts, [combs[0], combs[1][..., :2]])
  with pytest.raises(ValueError, match=r"pre_mix_list\[2\]"):
    f(r, pre[:2] + [pre[2][:2]], outs, posts, combs)
  with pytest.raises(ValueError, match=r"layer_output_list\[0\]"):
    f(r, pre, [outs[0].astype(jnp.int32), outs[1]], posts, combs)
  with pytest.raises(ValueError, match="pre_mix_list must be a list"):
    f(r, jnp.stack(pre), outs, posts, combs)
  with pytest.raises(ValueError, match="initial_residual"):
    f(r[0, 0], pre, outs, posts, combs)


def test_multilayer_recompute_is_not_differentiable(key):
  r, pre, outs, posts, combs = recompute_inputs(key, (3,), 64, 2, 1)
  with pytest.raises(jaxkern.NotDifferentiableError, match="multilayer_recompute"):
    jax.grad(lambda x: jnp.sum(mhc.multilayer_recompute(x, pre, outs, posts, combs)[0][1].astype(jnp.float32)))(r)


# ---------------------------------------------------------------------------------------------- H100

def test_kernels_lower_for_h100():
  t, h = 4001, 2560
  r = sds((t, M, h), jnp.bfloat16)
  fn, s, b = sds((24, M * h), jnp.float32), sds((3,), jnp.float32), sds((24,), jnp.float32)
  text = lower_for_h100(functools.partial(mhc.pre_big_fuse, implementation="pallas"), r, fn, s, b).as_text()
  assert text.count("mosaic_gpu") >= 3  # pre_norm_fn's GEMM, Sinkhorn, pre_apply_mix
  x, p, c = sds((t, h), jnp.bfloat16), sds((t, M, 1), jnp.float32), sds((t, M, M), jnp.float32)
  f = functools.partial(mhc.multilayer_recompute, implementation="pallas")
  assert "mosaic_gpu" in lower_for_h100(f, r, [p, p], [x], [p], [c]).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("t", [512, 8192])
@pytest.mark.parametrize("h", [1280, 4096])
def test_gpu_pre_big_fuse_bit_exact(key, t, h):
  r, fn, scale, base, _ = fuse_inputs(key, (1, t), h)
  fn = fn * 1e-2  # upstream's 1e-4
  opts = dict(OPTS, mhc_pre_eps=1e-6, mhc_post_mult_value=1.0)
  for impl in ("pallas", "auto"):
    got = jax.jit(lambda *a: mhc.pre_big_fuse(*a, **opts, implementation=impl))(r, fn, scale, base, None)
    want = jax.jit(lambda *a: unfused(*a, **opts, implementation=impl))(r, fn, scale, base, None)
    for a, b in zip(got, want):
      exact(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("num_layers, num_post, h", [(1, 1, 2560), (3, 2, 2560), (10, 9, 7168), (10, 10, 4096)])
def test_gpu_multilayer_recompute_bit_exact(key, num_layers, num_post, h):
  args = recompute_inputs(key, (1, 8192), h, num_layers, num_post)
  for impl in ("pallas", "auto"):
    got = jax.jit(lambda *a: mhc.multilayer_recompute(*a, implementation=impl))(*args)
    want = jax.jit(lambda *a: layer_by_layer(*a, impl))(*args)
    for a, b in zip(got.layer_input_list + got.residual_list, want[0] + want[1]):
      exact(a, b)

"""jaxkern.reference.mhc checked independently: forwards against a numpy float64 transcription of upstream's
formulas (docs/mhc.md), the hand-written backward formulas against jax.vjp of the forward
references in float64, and check_grads of the references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxkern.reference import mhc as ref

M = 4


def sig(z):
  return 1 / (1 + np.exp(-z))


def np_split(z, scale, base, m, pmv, pre_eps):
  j = m * (m + 2)
  grp = np.minimum(2, np.arange(j) // m)
  a = z * scale[grp] + base
  return (sig(a[..., :m]) + pre_eps)[..., None], (sig(a[..., m:2 * m]) * pmv)[..., None], \
      a[..., 2 * m:].reshape(*z.shape[:-1], m, m)


def np_sinkhorn(x, repeat, eps):
  out = np.empty_like(x)
  for idx in np.ndindex(x.shape[:-2]):
    c = x[idx]
    p = np.exp(c - c.max(1, keepdims=True))
    p = p / p.sum(1, keepdims=True) + eps
    p = p / (p.sum(0, keepdims=True) + eps)
    for _ in range(repeat - 1):
      p = p / (p.sum(1, keepdims=True) + eps)
      p = p / (p.sum(0, keepdims=True) + eps)
    out[idx] = p
  return out


def np_apply(x, mix):
  return sum(mix[..., m, 0, None] * x[..., m, :] for m in range(x.shape[-2]))


def np_post(x, res, post, comb):
  t, m = res.shape[:-2], res.shape[-2]
  out = np.zeros(res.shape)
  for n in range(m):
    out[..., n, :] = post[..., n, 0, None] * x + sum(comb[..., k, n, None] * res[..., k, :] for k in range(m))
  return out


def np_head(z, scale, base, pre_eps):
  return sig(z * scale[0] + base) + pre_eps


@pytest.fixture
def rng(request):
  import zlib
  return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def test_forwards_against_numpy(rng):
  t, h = (2, 3), 40
  with jax.enable_x64(True):
    z = rng.standard_normal((*t, M * (M + 2)))
    scale, base = rng.standard_normal(3), rng.standard_normal(M * (M + 2))
    for got, want in zip(ref.pre_split_mixes(z, scale, base, mhc_mult=M, mhc_post_mult_value=2.0, mhc_pre_eps=1e-2),
                         np_split(z, scale, base, M, 2.0, 1e-2)):
      np.testing.assert_allclose(np.asarray(got), want, rtol=1e-13, atol=1e-15)
    c = rng.standard_normal((*t, M, M)) * 3
    for repeat in (1, 10):
      np.testing.assert_allclose(np.asarray(ref.sinkhorn_normalize(c, repeat=repeat, eps=1e-6)),
                                 np_sinkhorn(c, repeat, 1e-6), rtol=1e-12, atol=1e-15)
    x, res = rng.standard_normal((*t, h)), rng.standard_normal((*t, M, h))
    mix, comb = rng.standard_normal((*t, M, 1)), rng.standard_normal((*t, M, M))
    np.testing.assert_allclose(np.asarray(ref.pre_apply_mix(res, mix)), np_apply(res, mix), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(np.asarray(ref.post(x, res, mix, comb)), np_post(x, res, mix, comb), rtol=1e-13,
                               atol=1e-14)
    zh, sh, bh = rng.standard_normal((*t, M)), rng.standard_normal(1), rng.standard_normal(M)
    np.testing.assert_allclose(np.asarray(ref.head_compute_mix(zh, sh, bh, mhc_pre_eps=1e-2)),
                               np_head(zh, sh, bh, 1e-2), rtol=1e-13)
    e = np.asarray(ref.expand_to_mhc(x, mhc_mult=3))
    assert e.shape == (*t, 3, h) and all(np.array_equal(e[..., k, :], x) for k in range(3))
    np.testing.assert_allclose(np.asarray(ref.expand_to_mhc_bwd(res)), res.sum(-2), rtol=1e-14)


def test_bf16_rounding_and_dtypes(rng):
  res = jnp.asarray(rng.standard_normal((3, M, 256)), jnp.bfloat16)
  x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
  mix, comb = jnp.asarray(rng.random((3, M, 1)), jnp.float32), jnp.asarray(rng.random((3, M, M)), jnp.float32)
  out = ref.post(x, res, mix, comb)
  assert out.dtype == jnp.bfloat16
  want = np_post(np.asarray(x, np.float64), np.asarray(res, np.float64), np.asarray(mix, np.float64),
                 np.asarray(comb, np.float64))
  np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2 ** -8, atol=1e-6)  # one bf16 rounding
  assert ref.pre_apply_mix(res, mix).dtype == jnp.bfloat16
  assert ref.sinkhorn_normalize(comb).dtype == jnp.float32


def _vjp(f, primals, cot):
  _, vjp = jax.vjp(f, *primals)
  return vjp(cot)


def test_backward_formulas_match_autodiff(rng):
  with jax.enable_x64(True):
    t, h = (2, 3), 24
    z, scale, base = rng.standard_normal((*t, 24)), rng.standard_normal(3), rng.standard_normal(24)
    fwd = lambda z, s, b: ref.pre_split_mixes(z, s, b, mhc_mult=M, mhc_post_mult_value=2.0, mhc_pre_eps=1e-2)
    outs = fwd(z, scale, base)
    cots = type(outs)(*(rng.standard_normal(o.shape) for o in outs))
    want = _vjp(fwd, (z, scale, base), cots)
    got = ref.pre_split_mixes_bwd(*cots, z, outs.post_layer_mix, scale, base, mhc_mult=M, mhc_post_mult_value=2.0)
    for a, b in zip(got, want):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-11, atol=1e-12)

    c, g = rng.standard_normal((*t, M, M)) * 2, rng.standard_normal((*t, M, M))
    for repeat in (1, 2, 10):
      (want,) = _vjp(lambda c: ref.sinkhorn_normalize(c, repeat=repeat, eps=1e-6), (c,), g)
      np.testing.assert_allclose(np.asarray(ref.sinkhorn_normalize_bwd(g, c, repeat=repeat, eps=1e-6)),
                                 np.asarray(want), rtol=1e-9, atol=1e-12)

    x, res = rng.standard_normal((*t, h)), rng.standard_normal((*t, M, h))
    mix, comb = rng.standard_normal((*t, M, 1)), rng.standard_normal((*t, M, M))
    og, acc = rng.standard_normal((*t, h)), rng.standard_normal((*t, M, h))
    want = _vjp(ref.pre_apply_mix, (res, mix), og)
    got = ref.pre_apply_mix_bwd(og, res, mix)
    for a, b in zip(got, want):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(ref.pre_apply_mix_bwd(og, res, mix, acc).x_grad),
                               acc + np.asarray(want[0]), rtol=1e-12)

    do = rng.standard_normal((*t, M, h))
    want = _vjp(ref.post, (x, res, mix, comb), do)
    for a, b in zip(ref.post_bwd(do, x, res, mix, comb), want):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)

    zh, sh, bh, gh = rng.standard_normal((*t, M)), rng.standard_normal(1), rng.standard_normal(M), \
        rng.standard_normal((*t, M))
    want = _vjp(lambda *a: ref.head_compute_mix(*a, mhc_pre_eps=1e-2), (zh, sh, bh), gh)
    for a, b in zip(ref.head_compute_mix_bwd(gh, zh, sh, bh), want):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)

    (want,) = _vjp(lambda a: ref.expand_to_mhc(a, mhc_mult=M), (x,), do)
    np.testing.assert_allclose(np.asarray(ref.expand_to_mhc_bwd(do)), np.asarray(want), rtol=1e-13)


def test_check_grads_of_references(rng):
  with jax.enable_x64(True):
    c = rng.standard_normal((2, M, M))
    check_grads(jax.jit(lambda c: ref.sinkhorn_normalize(c, repeat=3)), (c,), order=1, modes=["rev"])
    x, res = rng.standard_normal((2, 8)), rng.standard_normal((2, M, 8))
    mix, comb = rng.random((2, M, 1)), rng.random((2, M, M))
    check_grads(jax.jit(ref.post), (x, res, mix, comb), order=1, modes=["rev"])
    check_grads(jax.jit(ref.pre_apply_mix), (res, mix), order=1, modes=["rev"])
    z, s, b = rng.standard_normal((2, 24)), rng.standard_normal(3), rng.standard_normal(24)
    check_grads(jax.jit(lambda *a: ref.pre_split_mixes(*a, mhc_mult=M, mhc_post_mult_value=2.0)), (z, s, b),
                order=1, modes=["rev"])

"""jaxkern.modeling mHC layers (docs/modeling.md): mhc_pre's two forwards agree bit for bit, backward
passes vs jax.grad of the reference composition (float64 through implementation="reference") and
jax.test_util.check_grads, the fused block gradient, mhc_head's backward, and a 4-layer stack
that trains with optax.

Implementations: the float64 gradient checks run "reference" (the custom_vjps with the jnp references inside);
the bfloat16 checks run "xla" and, where the kernels allow the shape (H >= 1024), "interpret"; the training
test runs "xla" (interpret mode would take minutes per step)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

import jaxkern
from jaxkern import mhc
from jaxkern.modeling import expand_from_embedding, mhc_block, mhc_head, mhc_post, mhc_pre
from jaxkern.reference import mhc as ref, mhc_norm

M = 4
OPTS = dict(norm_eps=1e-6, post_mult_value=2.0, pre_eps=1e-2, sinkhorn_eps=1e-6, sinkhorn_repeat=3)


def params(key, lead, h, dtype=jnp.float32, normw=True):
  ks = jax.random.split(key, 6)
  j, k = M * (M + 2), M * h
  r = jax.random.normal(ks[0], (*lead, M, h))
  r = r.astype(jnp.bfloat16) if dtype == jnp.float32 else r.astype(dtype)
  fn = (jax.random.normal(ks[1], (j, k)) * 0.05).astype(dtype)
  scale = (jax.random.normal(ks[2], (3,)) * 0.5 + 1).astype(dtype)
  base = (jax.random.normal(ks[3], (j,)) * 0.3).astype(dtype)
  w = (jax.random.normal(ks[4], (k,)) * 0.1 + 1).astype(dtype) if normw else None
  return r, fn, scale, base, w


def ref_pre(r, fn, scale, base, w, *, norm_eps, post_mult_value, pre_eps, sinkhorn_eps, sinkhorn_repeat):
  """The reference composition (plain autodiff)."""
  mixes = mhc_norm.pre_norm_fn(r, fn, w, norm_eps=norm_eps)
  pre, post, comb = ref.pre_split_mixes(mixes, scale, base, mhc_mult=M, mhc_post_mult_value=post_mult_value,
                                        mhc_pre_eps=pre_eps)
  return ref.pre_apply_mix(r, pre), (post, ref.sinkhorn_normalize(comb, repeat=sinkhorn_repeat, eps=sinkhorn_eps))


def ref_head(r, fn, scale, base, w, *, norm_eps, pre_eps):
  j = M * (M + 2)
  mixes = mhc_norm.pre_norm_fn(r, jnp.pad(fn, ((0, j - M), (0, 0))), w, norm_eps=norm_eps)
  return ref.pre_apply_mix(r, ref.head_compute_mix(mixes[..., :M], scale, base, mhc_pre_eps=pre_eps)[..., None])


def exact(a, b):
  assert a.shape == b.shape and a.dtype == b.dtype
  np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def total(out, weights):
  return sum(jnp.sum(o.astype(jnp.float32 if o.dtype == jnp.bfloat16 else o.dtype) * w)
             for o, w in zip(jax.tree.leaves(out), jax.tree.leaves(weights)))


def random_like(key, tree):
  leaves, treedef = jax.tree.flatten(tree)
  ks = jax.random.split(key, len(leaves))
  return treedef.unflatten([jax.random.normal(k, l.shape).astype(
      jnp.float32 if l.dtype == jnp.bfloat16 else l.dtype) for k, l in zip(ks, leaves)])


# ---------------------------------------------------------------------------------------------- forward

@pytest.mark.parametrize("implementation, h", [("xla", 64), ("reference", 64), ("interpret", 1024)])
def test_mhc_pre_same_forward_with_and_without_gradients(key, implementation, h):
  r, fn, scale, base, w = params(key, (2, 3), h)
  f = functools.partial(mhc_pre, **OPTS, implementation=implementation)
  plain = jax.jit(lambda *a: f(*a[:4], norm_weight=a[4]))(r, fn, scale, base, w)
  traced = jax.jit(lambda *a: jax.vjp(lambda *b: f(*b[:4], norm_weight=b[4]), *a)[0])(r, fn, scale, base, w)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(traced)):
    exact(a, b)
  fused = jax.jit(lambda *a: mhc.pre_big_fuse(*a, rms_eps=1e-6, mhc_pre_eps=1e-2, mhc_sinkhorn_eps=1e-6,
                                              mhc_post_mult_value=2.0, sinkhorn_repeat=3,
                                              implementation=implementation))(r, fn, scale, base, w)
  for a, b in zip((plain[0], *plain[1]), (fused.layer_input, fused.post_mix, fused.comb_mix)):
    exact(a, b)
  assert plain[0].shape == (2, 3, h) and plain[0].dtype == jnp.bfloat16
  # the norm weight is used on the no-gradient path (docs/mhc.md, "`pre_big_fuse`: the inference path")
  no_w = jax.jit(lambda *a: f(*a))(r, fn, scale, base)
  assert not np.array_equal(np.asarray(no_w[1][1]), np.asarray(plain[1][1]))


def test_expand_and_post_are_the_ops(key):
  x = jax.random.normal(key, (3, 64)).astype(jnp.bfloat16)
  r = expand_from_embedding(x, implementation="xla")
  exact(r, jnp.broadcast_to(x[:, None], (3, M, 64)))
  p, c = jnp.full((3, M, 1), 0.5), jnp.eye(M)[None].repeat(3, 0)
  exact(mhc_post(x, r, p, c, implementation="xla"), mhc.post(x, r, p, c, implementation="xla"))


# ---------------------------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("normw", [False, True])
def test_mhc_pre_backward_vs_reference_autodiff_float64(key, normw):
  with jax.enable_x64(True):
    args = params(key, (2, 3), 8, jnp.float64, normw)
    out_w = random_like(jax.random.fold_in(key, 1), ref_pre(*args, **OPTS))
    nums = (0, 1, 2, 3, 4) if normw else (0, 1, 2, 3)

    def loss(fun, *a):
      return total(fun(*a), out_w)

    ours = functools.partial(lambda *a: mhc_pre(*a[:4], norm_weight=a[4], **OPTS, implementation="reference"))
    got = jax.jit(jax.grad(functools.partial(loss, ours), argnums=nums))(*args)
    want = jax.jit(jax.grad(functools.partial(loss, functools.partial(ref_pre, **OPTS)), argnums=nums))(*args)
    for a, b in zip(got, want):
      assert a.dtype == jnp.float64
      np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    check_grads(jax.jit(lambda *a: ours(*a[:4], a[4] if normw else None)), args[:len(nums)], order=1,
                modes=("rev",))


def test_mhc_head_backward_vs_reference_autodiff_float64(key):
  with jax.enable_x64(True):
    r, fn, _, _, w = params(key, (5,), 8, jnp.float64)
    fn = fn[:M]
    scale = jnp.array([1.3], jnp.float64)
    base = jnp.linspace(-0.5, 0.5, M, dtype=jnp.float64)
    ow = jax.random.normal(jax.random.fold_in(key, 1), (5, 8), jnp.float64)
    ours = lambda *a: mhc_head(*a[:4], norm_weight=a[4], pre_eps=1e-2, implementation="reference")
    got = jax.jit(jax.grad(lambda *a: jnp.sum(ours(*a) * ow), argnums=(0, 1, 2, 3, 4)))(r, fn, scale, base, w)
    want = jax.jit(jax.grad(lambda *a: jnp.sum(ref_head(*a[:4], a[4], norm_eps=1e-6, pre_eps=1e-2) * ow),
                            argnums=(0, 1, 2, 3, 4)))(r, fn, scale, base, w)
    for a, b in zip(got, want):
      np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    check_grads(jax.jit(ours), (r, fn, scale, base, w), order=1, modes=("rev",))


def sublayer(p, x):
  return jnp.tanh(x.astype(p.dtype) @ p).astype(x.dtype)


def test_mhc_block_gradient_float64_equals_the_composition(key):
  with jax.enable_x64(True):
    r, fn, scale, base, w = params(key, (2, 3), 8, jnp.float64)
    p = jax.random.normal(jax.random.fold_in(key, 2), (8, 8), jnp.float64) * 0.3
    ow = jax.random.normal(jax.random.fold_in(key, 3), r.shape, jnp.float64)
    impl = dict(**OPTS, implementation="reference")

    def block(r, fn, scale, base, w, p):
      return jnp.sum(mhc_block(r, fn, scale, base, sublayer, p, norm_weight=w, **impl) * ow)

    def composed(r, fn, scale, base, w, p):
      x, (po, co) = mhc_pre(r, fn, scale, base, norm_weight=w, **impl)
      return jnp.sum(mhc_post(sublayer(p, x), r, po, co, implementation="reference") * ow)

    args = (r, fn, scale, base, w, p)
    assert np.allclose(jax.jit(block)(*args), jax.jit(composed)(*args), rtol=1e-13)
    got = jax.jit(jax.grad(block, argnums=tuple(range(6))))(*args)
    want = jax.jit(jax.grad(composed, argnums=tuple(range(6))))(*args)
    for a, b in zip(got, want):
      np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    check_grads(jax.jit(lambda *a: mhc_block(*a[:4], sublayer, a[5], norm_weight=a[4], **impl)), args, order=1,
                modes=("rev",))


@pytest.mark.parametrize("implementation, h", [("xla", 128), ("interpret", 1024)])
def test_bf16_gradients_vs_reference(key, implementation, h):
  """bfloat16 streams: mhc_pre + mhc_post and mhc_block gradients vs float32 autodiff of the reference composition
  at bf16 / pre_norm_fn tolerances (relative to each gradient's largest entry)."""
  r, fn, scale, base, w = params(key, (3,), h)
  p = (jax.random.normal(jax.random.fold_in(key, 2), (h, h)) / h ** 0.5).astype(jnp.float32)
  ow = jax.random.normal(jax.random.fold_in(key, 3), r.shape)
  impl = dict(**OPTS, implementation=implementation)

  def composed(r, fn, scale, base, w, p):
    x, (po, co) = mhc_pre(r, fn, scale, base, norm_weight=w, **impl)
    return jnp.sum(mhc_post(sublayer(p, x), r, po, co, implementation=implementation).astype(jnp.float32) * ow)

  def block(r, fn, scale, base, w, p):
    return jnp.sum(mhc_block(r, fn, scale, base, sublayer, p, norm_weight=w, **impl).astype(jnp.float32) * ow)

  def reference(r, fn, scale, base, w, p):
    x, (po, co) = ref_pre(r, fn, scale, base, w, **OPTS)
    return jnp.sum(ref.post(sublayer(p, x), r, po, co).astype(jnp.float32) * ow)

  args = (r, fn, scale, base, w, p)
  with jaxkern.use_implementation(implementation):
    want = jax.jit(jax.grad(reference, argnums=tuple(range(6))))(*args)
    for f in (composed, block):
      got = jax.jit(jax.grad(f, argnums=tuple(range(6))))(*args)
      for name, a, b in zip(("residual", "fn", "scale", "base", "norm_weight", "params"), got, want):
        assert a.dtype == b.dtype, name
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(a, b, atol=3e-2 * np.abs(b).max(), err_msg=f"{f.__name__}: {name}")


def test_argument_checks(key):
  r, fn, scale, base, w = params(key, (2,), 64)
  f = functools.partial(mhc_pre, implementation="xla")
  with pytest.raises(ValueError, match="mhc_mult"):
    f(r, fn, scale, base, mhc_mult=2)
  with pytest.raises(ValueError, match="scale"):
    f(r, fn, scale[:1], base)
  with pytest.raises(ValueError, match="base"):
    f(r, fn, scale, base[:4])
  with pytest.raises(ValueError, match="norm_weight"):
    f(r, fn, scale, base, norm_weight=w[:5])
  with pytest.raises(ValueError, match="post_mult_value"):
    f(r, fn, scale, base, post_mult_value=0)
  with pytest.raises(ValueError, match="fn"):
    mhc_head(r, fn, scale[:1], base[:4], implementation="xla")
  with pytest.raises(ValueError, match="scale"):
    mhc_head(r, fn[:4], scale, base[:4], implementation="xla")
  with pytest.raises(ValueError, match="base"):
    mhc_head(r, fn[:4], scale[:1], base, implementation="xla")


def test_zero_tokens(key):
  _, fn, scale, base, w = params(key, (1,), 64)
  r = jnp.zeros((0, M, 64), jnp.bfloat16)
  f = lambda r, fn, s, b, w: jnp.sum(mhc_pre(r, fn, s, b, norm_weight=w, implementation="xla")[1][1])
  g = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(r, fn, scale, base, w)
  assert g[0].shape == r.shape and all(not np.any(np.asarray(a)) for a in g[1:])
  assert mhc_head(r, fn[:4], scale[:1], base[:4], implementation="xla").shape == (0, 64)


# ---------------------------------------------------------------------------------------------- training

H, T, LAYERS = 64, 32, 4


def init_stack(key):
  ks = jax.random.split(key, 3 + 2 * LAYERS)
  j, k = M * (M + 2), M * H
  layers = [dict(fn=jax.random.normal(ks[2 * i], (j, k)) * 0.01, scale=jnp.ones(3), base=jnp.zeros(j),
                 norm_weight=jnp.ones(k),
                 w1=jax.random.normal(ks[2 * i + 1], (H, 2 * H)) / H ** 0.5,
                 w2=jax.random.normal(jax.random.fold_in(ks[2 * i + 1], 1), (2 * H, H)) / (2 * H) ** 0.5)
            for i in range(LAYERS)]
  head = dict(fn=jax.random.normal(ks[-3], (M, k)) * 0.01, scale=jnp.ones(1), base=jnp.zeros(M))
  return dict(layers=layers, head=head, out=jax.random.normal(ks[-2], (H, H)) / H ** 0.5)


def stack_forward(p, x, implementation="xla"):
  """expand -> [mhc_pre -> MLP -> mhc_post] x 4 -> mhc_head -> a linear read-out (float32)."""
  r = expand_from_embedding(x, M, implementation=implementation)
  for lp in p["layers"]:
    y, (post_mix, comb_mix) = mhc_pre(r, lp["fn"], lp["scale"], lp["base"], norm_weight=lp["norm_weight"],
                                      implementation=implementation)
    hdn = jax.nn.gelu(y.astype(jnp.float32) @ lp["w1"])
    r = mhc_post((hdn @ lp["w2"]).astype(jnp.bfloat16), r, post_mix, comb_mix, implementation=implementation)
  h = mhc_head(r, p["head"]["fn"], p["head"]["scale"], p["head"]["base"], implementation=implementation)
  return h.astype(jnp.float32) @ p["out"]


def test_four_layer_stack_trains_with_optax(key):
  kp, kx, kt = jax.random.split(key, 3)
  p = init_stack(kp)
  x = jax.random.normal(kx, (T, H)).astype(jnp.bfloat16)
  target = jnp.sin(2 * jax.random.normal(kt, (T, H)))
  opt = optax.adam(1e-2)

  def loss(p):
    return jnp.mean((stack_forward(p, x) - target) ** 2)

  @jax.jit
  def step(p, state):
    value, grads = jax.value_and_grad(loss)(p)
    updates, state = opt.update(grads, state, p)
    return optax.apply_updates(p, updates), state, value, grads

  state = opt.init(p)
  losses = []
  for i in range(20):
    p, state, value, grads = step(p, state)
    losses.append(float(value))
    if i == 0:  # every mHC parameter gets a non-zero gradient
      for g in jax.tree.leaves(grads):
        assert np.all(np.isfinite(np.asarray(g))) and np.any(np.asarray(g))
  assert losses[-1] < 0.7 * losses[0], losses
  assert all(np.isfinite(losses))

"""Gradients of the routing weights: ``top2_sum_gate``'s ``topk_weights`` w.r.t. the logits and
``routed_scaling_factor``, and ``normalize_weight``; against finite differences and ``jax.grad`` of the references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxkern.moe import normalize_weight, top2_sum_gate
from jaxkern.reference import moe as ref

FUNCS = ["sigmoid", "sqrtsoftplus", "softmax"]
IMPLEMENTATIONS = ["reference", "interpret"]
STEP = 0.05  # logits are a permutation of the experts in steps of STEP, plus noise
EPS = 1e-4  # check_grads' finite-difference step: it moves a logit by at most ~5 EPS
MIN_GAP = 2e-3  # every ranking gap that decides the selection or the slot order exceeds this
TOL = 5e-3  # finite differences of float32 weights


def _gate(logits, bias, rsf=1.5, *, k=4, g=0, ntg=0, s=0, func="sigmoid", ep=1, tp=1, tp_rank=0, mask=None,
          fix=None, pmap=None, count=None, unmapped=None, implementation=None):
  return top2_sum_gate(logits, bias, k, scoring_func=func, num_topk_groups=ntg, num_groups=g,
                       use_shared_as_routed=s > 0, num_shared_experts=s, routed_scaling_factor=rsf, num_ep_ranks=ep,
                       tp_rank=tp_rank, num_tp_ranks=tp, mask=mask, fix_routing_mask=fix, to_physical_map=pmap,
                       logical_count=count, unmapped_topk_idx=unmapped, implementation=implementation)


def _reference(logits, bias, rsf=1.5, *, k=4, g=0, ntg=0, s=0, func="sigmoid", ep=1, tp=1, tp_rank=0, mask=None,
               fix=None, pmap=None, count=None, unmapped=None):
  return ref.top2_sum_gate(logits, bias, k, scoring_func=func, num_topk_groups=ntg, num_groups=g,
                           use_shared_as_routed=s > 0, num_shared_experts=s, routed_scaling_factor=rsf,
                           num_ep_ranks=ep, tp_rank=tp_rank, num_tp_ranks=tp, mask=mask, fix_routing_mask=fix,
                           to_physical_map=pmap, logical_count=count, unmapped_topk_idx=unmapped)


def _ranking_gaps(logits, bias, func, k, g, ntg):
  """Per row, the smallest gap between the ranking values that decide the selection and its slot order."""
  t, e = logits.shape
  b = ref.ranking_scores(logits, ref.gate_scores(logits, func), bias, func)
  gaps = jnp.full((t,), jnp.inf)
  if g != ntg:
    sums = ref.group_scores(b.reshape(t, g, e // g), 2)
    ordered = -jnp.sort(-sums, axis=1)
    gaps = ordered[:, ntg - 1] - ordered[:, ntg]
    kept = sums >= ordered[:, ntg - 1:ntg]
    b = jnp.where(jnp.repeat(kept, e // g, axis=1), b, -jnp.inf)
  top = -jnp.sort(-b, axis=1)[:, :k + 1]
  return jnp.minimum(gaps, jnp.min(top[:, :-1] - top[:, 1:], axis=1))


def _logits(key, t, e, bias, func, k, g=0, ntg=0):
  """``(t, e)`` logits without near-ties, so check_grads' steps keep the selection: rows of a random permutation
  of the experts in steps of STEP plus noise, kept where every ranking gap exceeds MIN_GAP."""
  k1, k2 = jax.random.split(key)
  n = 16 * t
  perm = jax.vmap(lambda r: jax.random.permutation(r, e))(jax.random.split(k1, n))
  x = (perm - e / 2) * STEP + 0.01 * jax.random.normal(k2, (n, e))
  rows = np.flatnonzero(np.asarray(_ranking_gaps(x, bias, func, k, g, ntg)) > MIN_GAP)[:t]
  assert len(rows) == t
  return x[rows].astype(jnp.float32)


def _bias(key, e):
  return 0.02 * jax.random.normal(key, (e,), jnp.float32)  # of the size of the score gaps: it moves the selection


def _check_weight_grads(weights, reference_weights, logits, rsf):
  """``weights(logits, rsf)`` against finite differences and the VJP of ``reference_weights``."""
  check_grads(jax.jit(weights), (logits, rsf), order=1, modes=("rev",), eps=EPS, atol=TOL, rtol=TOL)
  out, vjp = jax.vjp(weights, logits, rsf)
  want_out, want_vjp = jax.vjp(reference_weights, logits, rsf)
  np.testing.assert_allclose(out, want_out, rtol=1e-6, atol=0)
  ct = jax.random.normal(jax.random.key(7), out.shape, jnp.float32)
  (got_dx, got_drsf), (want_dx, want_drsf) = vjp(ct), want_vjp(ct)
  assert np.isfinite(got_dx).all() and np.isfinite(want_dx).all()
  np.testing.assert_allclose(got_dx, want_dx, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got_drsf, want_drsf, rtol=1e-5)
  return got_dx


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("func", FUNCS)
def test_grouped_shared_masked_tp(key, func, implementation):
  """Groups, shared experts through a replica map, masked rows holding NaN, EP/TP masking."""
  t, e, s, k, x = 24, 32, 2, 4, 4
  keys = jax.random.split(key, 4)
  bias = _bias(keys[0], e)
  logits = _logits(keys[1], t, e, bias, func, k, g=8, ntg=4).at[-3:].set(jnp.nan)
  kw = dict(k=k, g=8, ntg=4, s=s, func=func, ep=2, tp=2, tp_rank=1, mask=jnp.arange(t) < t - 3,
            pmap=jax.random.randint(keys[2], (e + s, x + 1), 0, e + x, jnp.int32),
            count=jax.random.randint(keys[3], (e + s,), 1, x + 2, jnp.int32))
  idx = np.asarray(_gate(logits, bias, implementation=implementation, **kw).topk_idx)
  assert (idx[:t - 3, :k] == -1).any() and (idx[:t - 3, :k] >= 0).any()  # slots on both TP ranks
  dx = _check_weight_grads(lambda x, r: _gate(x, bias, r, implementation=implementation, **kw).topk_weights,
                           lambda x, r: _reference(x, bias, r, **kw).topk_weights, logits, jnp.float32(1.5))
  assert (dx[t - 3:] == 0).all()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("func", FUNCS)
def test_fixed_routing_rows(key, func, implementation):
  """Given ids on every other row: a repeated id adds up, ids outside [0, E) drop their slot (weight 0)."""
  t, e, k = 16, 16, 4
  keys = jax.random.split(key, 3)
  bias = _bias(keys[0], e)
  logits = _logits(keys[1], t, e, bias, func, k)
  unmapped = jax.random.randint(keys[2], (t, k), 0, e, jnp.int32)
  unmapped = unmapped.at[0].set(jnp.array([3, 3, 7, 3])).at[2].set(jnp.array([5, -1, 9, e]))
  kw = dict(k=k, func=func, fix=jnp.arange(t) % 2 == 0, unmapped=unmapped)
  _check_weight_grads(lambda x, r: _gate(x, bias, r, implementation=implementation, **kw).topk_weights,
                      lambda x, r: _reference(x, bias, r, **kw).topk_weights, logits, jnp.float32(0.7))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bias_and_python_float_rsf(key, implementation):
  """bias only moves the selection: zero gradient. A Python float rsf is a constant: same logits gradient."""
  t, e = 16, 32
  bias = _bias(key, e)
  logits = _logits(key, t, e, bias, "sigmoid", 4)
  ct = jax.random.normal(key, (t, 4), jnp.float32)
  loss = lambda x, b, r: jnp.vdot(_gate(x, b, r, implementation=implementation).topk_weights, ct)
  dx, db = jax.grad(loss, argnums=(0, 1))(logits, bias, 2.5)
  assert db.shape == (e,) and (db == 0).all()
  assert (jax.grad(lambda b: jnp.vdot(_reference(logits, b, 2.5).topk_weights, ct))(bias) == 0).all()
  np.testing.assert_array_equal(dx, jax.grad(loss)(logits, bias, jnp.float32(2.5)))
  drsf = jax.grad(loss, argnums=2)  # differentiating w.r.t. a float argument traces it: an array
  np.testing.assert_array_equal(drsf(logits, bias, 2.5), drsf(logits, bias, jnp.float32(2.5)))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_zero_tokens(implementation):
  bias = jnp.zeros((16,), jnp.float32)
  dx, drsf = jax.grad(lambda x, r: jnp.sum(_gate(x, bias, r, implementation=implementation).topk_weights),
                      argnums=(0, 1))(jnp.zeros((0, 16), jnp.float32), jnp.float32(1.5))
  assert dx.shape == (0, 16) and float(drsf) == 0.0


def test_extreme_logits_have_finite_gradients():
  """Logits where exp overflows or the scores underflow (sigmoid below -88, softplus above 88 or below -104)."""
  row = jnp.array([-200.0, -100.0, -90.0, 0.5, 1.0, 2.0, 95.0, 200.0], jnp.float32)
  logits, bias = jnp.stack([row, row[::-1]]), jnp.zeros((8,), jnp.float32)
  for func in FUNCS:
    for impl in IMPLEMENTATIONS:
      dx = jax.grad(lambda x: jnp.sum(_gate(x, bias, k=2, func=func, implementation=impl).topk_weights[:, 1]))(logits)
      assert np.isfinite(dx).all(), (func, impl)
    dx = jax.grad(lambda x: jnp.sum(_reference(x, bias, k=2, func=func).topk_weights[:, 1]))(logits)
    assert np.isfinite(dx).all(), func


def test_jit_and_vmap_of_the_gradient(key):
  t, e = 16, 32
  keys = jax.random.split(key, 3)
  bias = _bias(keys[0], e)
  logits = jnp.stack([_logits(keys[i], t, e, bias, "softmax", 4, g=4, ntg=2) for i in (1, 2)])
  ct = jax.random.normal(key, (t, 4), jnp.float32)
  grad = jax.grad(lambda x: jnp.vdot(_gate(x, bias, k=4, g=4, ntg=2, func="softmax",
                                           implementation="interpret").topk_weights, ct))
  eager = [grad(x) for x in logits]
  np.testing.assert_allclose(jax.jit(grad)(logits[0]), eager[0], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(jax.jit(jax.vmap(grad))(logits), jnp.stack(eager), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS + ["xla"])
@pytest.mark.parametrize("num_topk", [2, 6])
def test_normalize_weight(key, implementation, num_topk):
  """Both outputs, rows read directly (K = 2) and through SMEM (K = 6); signed weights."""
  w = jax.random.uniform(key, (20, num_topk), jnp.float32, 0.1, 1.0).at[3, 0].multiply(-1.0)
  f = functools.partial(normalize_weight, implementation=implementation)
  check_grads(jax.jit(f), (w,), order=1, modes=("rev",), eps=EPS, atol=TOL, rtol=TOL)
  out, vjp = jax.vjp(f, w)
  _, want_vjp = jax.vjp(ref.normalize_weight, w)
  ct = jax.tree.map(lambda o: jax.random.normal(jax.random.key(3), o.shape, jnp.float32), out)
  np.testing.assert_allclose(vjp(ct)[0], want_vjp(ct)[0], rtol=1e-5, atol=1e-6)


def test_normalize_weight_jit_and_zero_size(key):
  def loss(w):
    d, n = normalize_weight(w)
    return jnp.sum(jnp.sin(n)) + jnp.sum(d)

  w = jax.random.uniform(key, (20, 6), jnp.float32)
  np.testing.assert_allclose(jax.jit(jax.grad(loss))(w), jax.grad(loss)(w), rtol=1e-6)
  for shape in ((0, 6), (4, 0)):
    assert jax.grad(loss)(jnp.zeros(shape, jnp.float32)).shape == shape

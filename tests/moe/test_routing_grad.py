"""Backward passes of expand_to_fused(_with_sf) and reduce_fused.

The kernels run in interpret mode on CPU (conftest), compiled on a GPU. Gradients are checked
numerically (``check_grads``) and against ``jax.grad`` of the ``jnp`` references.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxkern
from jaxkern import moe
from jaxkern.moe import _fused_grad
from jaxkern.reference import moe as ref
from jaxkern.testing import assert_bitwise_equal, lower_for_h100, moe_topk_idx, randn

IMPLEMENTATIONS = [None, "reference"]  # None: the conftest's kernel (interpret on CPU, compiled on a GPU)


def _mapping(key, tokens, num_topk, experts, ranks, alignment=8):
  idx = jnp.asarray(moe_topk_idx(key, tokens, num_topk, experts, ranks))
  return ref.get_fused_mapping(idx, experts, 0, alignment)


def _awkward_pos():
  """-1 slots, a token without slots, fused rows no slot names (13-19)."""
  return jnp.array([[0, 3, -1], [1, -1, 7], [2, 4, 5], [6, 8, 9], [-1, -1, -1], [10, 11, 12]], jnp.int32)


def _vjp(f, primals, cotangent):
  """``f``'s VJP, jitted: eager interpret-mode kernels mixed with eager XLA ops can deadlock XLA:CPU's
  executable semaphore (a kernel's host callbacks wait for executions queued behind it)."""
  out, vjp = jax.vjp(jax.jit(f), *primals)
  return vjp(cotangent)


def _assert_close(actual, expected, rtol=1e-5):
  for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * max(1.0, float(np.abs(b).max(initial=0))))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_reduce_fused_grads_numerically(key, implementation):
  k1, k2, k3 = jax.random.split(key, 3)
  pos = _awkward_pos()
  x, w, x_sf = randn(k1, (20, 256), jnp.float32), jax.random.uniform(k2, pos.shape), randn(k3, (20,), jnp.float32)
  f = lambda x, w, x_sf: moe.reduce_fused((x, x_sf), w, pos, implementation=implementation)
  check_grads(jax.jit(f), (x, w, x_sf), order=1, modes=("rev",))  # jitted: see _vjp


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reduce_fused_grads_match_the_reference(key, implementation, dtype):
  k1, k2, k3, k4 = jax.random.split(key, 4)
  pos = _awkward_pos()
  x, w, x_sf = randn(k1, (20, 512), dtype), jax.random.uniform(k2, pos.shape), randn(k3, (20,), jnp.float32)
  dy = randn(k4, (pos.shape[0], 512), dtype)
  ours = _vjp(lambda x, w, s: moe.reduce_fused((x, s), w, pos, implementation=implementation), (x, w, x_sf), dy)
  theirs = _vjp(lambda x, w, s: ref.reduce_fused((x, s), w, pos), (x, w, x_sf), dy)
  _assert_close(ours, theirs, 1e-5 if dtype == jnp.float32 else 1e-2)
  unused_rows = np.setdiff1d(np.arange(20), np.asarray(pos))
  assert not np.asarray(ours[0], np.float32)[unused_rows].any()  # rows no slot names get a zero cotangent


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_reduce_fused_e4m3_output_grads(key, implementation):
  """Through the saturating cast (zero beyond ±448) and the global scale ``sf``."""
  k1, k2, k3, k4 = jax.random.split(key, 4)
  pos = _awkward_pos()
  x, w, x_sf = 40 * randn(k1, (20, 256), jnp.float32), jax.random.uniform(k2, pos.shape), randn(k3, (20,), jnp.float32)
  sf, dy = jnp.array([0.75], jnp.float32), randn(k4, (pos.shape[0], 256), jnp.float32)

  def loss(reduce_fused, x, w, x_sf, sf):
    return jnp.sum(reduce_fused((x, x_sf), w, pos, fp8_format="e4m3", sf=sf).astype(jnp.float32) * dy)

  ours = jax.grad(functools.partial(loss, functools.partial(moe.reduce_fused, implementation=implementation)),
                  argnums=(0, 1, 2, 3))(x, w, x_sf, sf)
  theirs = jax.grad(functools.partial(loss, ref.reduce_fused), argnums=(0, 1, 2, 3))(x, w, x_sf, sf)
  _assert_close(ours, theirs, 1e-4)
  assert np.asarray(ours[0] == 0).any() and np.asarray(ours[0] != 0).any()  # some rows saturate, some do not


def test_reduce_fused_grad_of_one_argument(key):
  """Only the perturbed arguments' cotangents are formed; each alone is right."""
  k1, k2, k3 = jax.random.split(key, 3)
  pos = _awkward_pos()
  x, w, dy = randn(k1, (20, 256), jnp.float32), jax.random.uniform(k2, pos.shape), randn(k3, (6, 256), jnp.float32)
  loss = lambda reduce_fused, x, w: jnp.sum(reduce_fused(x, w, pos) * dy)
  for argnum in (0, 1):
    ours = jax.grad(functools.partial(loss, moe.reduce_fused), argnums=argnum)(x, w)
    _assert_close(ours, jax.grad(functools.partial(loss, ref.reduce_fused), argnums=argnum)(x, w))


def test_reduce_fused_grads_with_zero_tokens(key):
  x = randn(key, (8, 256), jnp.float32)
  pos, w = jnp.zeros((0, 2), jnp.int32), jnp.zeros((0, 2), jnp.float32)
  dx, dw = jax.grad(lambda x, w: jnp.sum(moe.reduce_fused(x, w, pos)), argnums=(0, 1))(x, w)
  assert dx.shape == x.shape and not dx.any() and dw.shape == (0, 2)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_expand_to_fused_grads(key, implementation):
  m = _mapping(key, 6, 3, 4, 2)
  x = randn(key, (m.token_topk_to_pos.shape[0], 256), jnp.float32)
  f = lambda x: moe.expand_to_fused(x, m.token_topk_to_pos, m.pos_to_expert, implementation=implementation)
  check_grads(jax.jit(f), (x,), order=1, modes=("rev",))


@pytest.mark.parametrize("dtype, hidden", [(jnp.bfloat16, 256), (jnp.bfloat16, 192), (jnp.float32, 512)])
def test_expand_to_fused_grad_sums_the_slots_in_float32(key, dtype, hidden):
  """``dx[t] = sum_k dy[pos[t, k]]`` summed in float32, rounded once; H = 192 takes the XLA path."""
  m = _mapping(key, 8, 4, 4, 2)
  pos = m.token_topk_to_pos
  x = randn(key, (pos.shape[0], hidden), dtype)
  dy = randn(jax.random.fold_in(key, 1), (m.pos_to_expert.shape[0], hidden), dtype)
  implementation = "auto" if hidden % 256 else None
  (dx,) = _vjp(lambda x: moe.expand_to_fused(x, pos, m.pos_to_expert, implementation=implementation), (x,), dy)
  rows = jnp.where((pos >= 0)[..., None], dy[jnp.maximum(pos, 0)].astype(jnp.float32), 0)
  expected = functools.reduce(lambda a, k: a + rows[:, k], range(1, pos.shape[1]), rows[:, 0]).astype(dtype)
  assert_bitwise_equal(dx, expected)


def test_expand_to_fused_grad_needs_the_kernel_shape_for_pallas(key):
  x = randn(key, (4, 192), jnp.bfloat16)
  pos, pte = jnp.array([[0], [1], [2], [3]], jnp.int32), jnp.zeros((4,), jnp.int32)
  with pytest.raises(jaxkern.KernelUnavailableError, match="expand_to_fused.bwd.*multiple of 256"):
    jax.grad(lambda x: jnp.sum(moe.expand_to_fused(x, pos, pte, implementation="interpret").astype(jnp.float32)))(x)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("col_major", [False, True])
def test_expand_to_fused_with_sf_grads(key, implementation, col_major):
  m = _mapping(key, 6, 2, 4, 2)
  t = m.token_topk_to_pos.shape[0]
  data, sf = randn(key, (t, 256), jnp.float32), jax.random.uniform(key, (t, 2))
  expand = lambda fn, **kw: lambda d, s: fn((d, s), 128, m.token_topk_to_pos, m.pos_to_expert,
                                            use_tma_aligned_col_major_sf=col_major, **kw)
  f = expand(moe.expand_to_fused_with_sf, implementation=implementation)
  check_grads(jax.jit(f), (data, sf), order=1, modes=("rev",), rtol=1e-2)  # float32 finite differences of long sums
  out = jax.jit(f)(data, sf)
  cotangent = jax.tree.map(lambda o: randn(jax.random.fold_in(key, 1), o.shape, o.dtype), out)
  _assert_close(_vjp(f, (data, sf), cotangent), _vjp(expand(ref.expand_to_fused_with_sf), (data, sf), cotangent))


def test_expand_to_fused_with_sf_packed_scales_have_no_derivative(key):
  m = _mapping(key, 6, 2, 4, 2)
  t = m.token_topk_to_pos.shape[0]
  data, packed = randn(key, (t, 256), jnp.float32), jnp.ones((t, 1), jnp.int32)
  loss = lambda d: jnp.sum(moe.expand_to_fused_with_sf((d, packed), 128, m.token_topk_to_pos, m.pos_to_expert,
                                                       use_tma_aligned_col_major_sf=True).data)
  counts = jnp.sum(m.token_topk_to_pos >= 0, axis=1).astype(jnp.float32)
  np.testing.assert_array_equal(jax.grad(loss)(data), jnp.broadcast_to(counts[:, None], data.shape))


def test_routing_path_trains_under_jit_and_vmap(key):
  """expand -> scale -> reduce: gradients under jit and vmap equal those of the references."""
  m = _mapping(key, 6, 3, 4, 2)
  pos, pte = m.token_topk_to_pos, m.pos_to_expert
  x, w = randn(key, (pos.shape[0], 256), jnp.float32), jax.random.uniform(key, pos.shape)

  def path(expand, reduce, x, w):
    return jnp.sum(reduce(2.0 * expand(x, pos, pte), w, pos) ** 2)

  ours = jax.jit(jax.vmap(jax.grad(functools.partial(path, moe.expand_to_fused, moe.reduce_fused), argnums=(0, 1))))
  theirs = jax.grad(functools.partial(path, ref.expand_to_fused, ref.reduce_fused), argnums=(0, 1))
  _assert_close([a[0] for a in ours(x[None], w[None])], theirs(x, w))


def test_backward_paths_are_explained(key):
  m = _mapping(key, 6, 3, 4, 2)
  x, w = randn(key, (m.token_topk_to_pos.shape[0], 256), jnp.float32), jax.random.uniform(key, m.token_topk_to_pos.shape)
  loss = lambda x, w: jnp.sum(moe.reduce_fused(moe.expand_to_fused(x, m.token_topk_to_pos, m.pos_to_expert), w,
                                               m.token_topk_to_pos))
  ops = [(d.op, d.path) for d in jaxkern.explain(jax.grad(loss, argnums=(0, 1)), x, w)]
  kernel = "pallas" if jax.default_backend() == "gpu" else "interpret"
  assert ops == [("expand_to_fused", kernel), ("reduce_fused", kernel), ("reduce_fused.bwd", kernel),
                 ("expand_to_fused.bwd", kernel)]


@pytest.mark.parametrize("dtype, hidden", [(jnp.bfloat16, 7168), (jnp.float32, 8448)])
def test_backward_kernels_lower_for_h100(dtype, hidden):
  t, k, n = 64, 6, 512
  pos = jax.ShapeDtypeStruct((t, k), jnp.int32)

  def grads(x, w, pos, pte):
    loss = lambda x, w: jnp.sum(moe.reduce_fused(moe.expand_to_fused(x, pos, pte, implementation="pallas"), w, pos,
                                                 implementation="pallas").astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1))(x, w)

  lower_for_h100(grads, jax.ShapeDtypeStruct((t, hidden), dtype), jax.ShapeDtypeStruct((t, k), jnp.float32), pos,
                 jax.ShapeDtypeStruct((n,), jnp.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, hidden", [(jnp.bfloat16, 7168), (jnp.float32, 2048), (jnp.float32, 12288)])
@pytest.mark.parametrize("experts, ranks, num_topk", [(9, 8, 6), (32, 8, 8)])
def test_scatter_grad_kernel_matches_xla_at_spec_size(key, dtype, hidden, experts, ranks, num_topk):
  m = _mapping(key, 4001, num_topk, experts, ranks, 128)
  pos = m.token_topk_to_pos
  t, n = pos.shape[0], m.pos_to_expert.shape[0]
  k1, k2, k3 = jax.random.split(key, 3)
  g, x, c = randn(k1, (t, hidden), dtype), randn(k2, (n, hidden), dtype), jax.random.uniform(k3, pos.shape)
  grad = jax.jit(functools.partial(_fused_grad.scatter_grad, "test", n=n, out_dtype=dtype), static_argnames="implementation")
  dx, dots = grad(g, x, pos, c, implementation="pallas")
  dx_xla, dots_xla = grad(g, x, pos, c, implementation="xla")
  assert_bitwise_equal(dx, dx_xla)  # one rounded product per element on both paths
  _assert_close(dots, dots_xla, 1e-4)

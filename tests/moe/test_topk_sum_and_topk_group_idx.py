import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import jaxkern
from jaxkern.moe import topk_sum_and_topk_group_idx
from jaxkern.reference import moe as ref
from jaxkern.testing import assert_bitwise_equal, lower_for_h100, num_tokens
from tests.moe.gating import tricky_rows

# (E, G) of upstream's test.
SPEC_EG = [(72, 4), (72, 8), (72, 12), (256, 4), (256, 8), (256, 16)]


def _scores(key, t, g, epg):
  return jax.random.normal(key, (t, g, epg), jnp.float32)


@pytest.mark.parametrize("t, g, epg, s, n", [(100, 4, 18, 2, 2), (70, 8, 9, 1, 4), (130, 12, 6, 2, 4),
                                              (64, 8, 32, 2, 4), (5, 16, 16, 1, 2), (66, 3, 2, 2, 3)])
def test_matches_reference(key, t, g, epg, s, n):
  x = _scores(key, t, g, epg)
  assert_bitwise_equal(topk_sum_and_topk_group_idx(x, s, n), ref.topk_sum_and_topk_group_idx(x, s, n))


@settings(max_examples=8, deadline=None)
@given(tricky_rows((70, 6, 4)))
def test_tricky_values(x):
  x = jnp.asarray(np.where(x == np.inf, np.float32(1e30), x))  # +inf with -inf in a group sums to NaN
  for s in (1, 2):
    y = np.asarray(topk_sum_and_topk_group_idx(x, s, 4))
    assert_bitwise_equal(y, ref.topk_sum_and_topk_group_idx(x, s, 4))
    assert all(len(set(r)) == 4 for r in y)


def test_repeated_maximum_counts_twice():
  x = jnp.array([[[5.0, 5.0, 0.0], [9.0, 0.0, 0.0], [1.0, 1.0, 1.0]]] * 64, jnp.float32)
  np.testing.assert_array_equal(topk_sum_and_topk_group_idx(x, 2, 3)[0], [0, 1, 2])
  np.testing.assert_array_equal(topk_sum_and_topk_group_idx(x, 1, 3)[0], [1, 0, 2])


def test_zero_tokens():
  x = jnp.zeros((0, 8, 9), jnp.float32)
  y = topk_sum_and_topk_group_idx(x, 2, 4)
  assert y.shape == (0, 4) and y.dtype == jnp.int32
  (d,) = jaxkern.explain(lambda x: topk_sum_and_topk_group_idx(x, 2, 4, implementation="interpret"), x)
  assert d.path == "xla"


def test_list_input_and_xla_path(key):
  x = _scores(key, 70, 4, 6)
  want = ref.topk_sum_and_topk_group_idx(x, 2, 3)
  assert_bitwise_equal(topk_sum_and_topk_group_idx(x.tolist(), 2, 3), want)
  assert_bitwise_equal(topk_sum_and_topk_group_idx(x, 2, 3, implementation="xla"), want)


def test_no_retrace(key):
  # JAX imports its Mosaic GPU interpreter on the first interpreted kernel, adding a config value to
  # jit's trace context (one retrace per process): warm up first.
  jax.block_until_ready(topk_sum_and_topk_group_idx(_scores(key, 64, 4, 8), 2, 2))
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(x):
    return topk_sum_and_topk_group_idx(x, 2, 2)

  for i in range(3):
    f(_scores(jax.random.fold_in(key, i), 64, 4, 8))


def test_jit_and_vmap(key):
  x = _scores(key, 2 * 64, 4, 8).reshape(2, 64, 4, 8)
  f = functools.partial(topk_sum_and_topk_group_idx, num_topk_sum=2, num_topk_groups=2)
  want = ref.topk_sum_and_topk_group_idx(x.reshape(-1, 4, 8), 2, 2).reshape(2, 64, 2)
  assert_bitwise_equal(jax.jit(jax.vmap(f))(x), want)


@pytest.mark.parametrize("shape, s, n, match", [
    ((4, 8), 2, 2, "scores must have rank 3"),
    ((4, 8, 1), 2, 2, "num_topk_sum"),
    ((4, 8, 4), 3, 2, "num_topk_sum"),
    ((4, 8, 4), 2, 9, "num_topk_groups"),
    ((4, 8, 4), 2, 0, "num_topk_groups"),
])
def test_bad_input(shape, s, n, match):
  with pytest.raises(ValueError, match=match):
    topk_sum_and_topk_group_idx(jnp.ones(shape, jnp.float32), s, n)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.bool_])
def test_bad_dtype(dtype):
  with pytest.raises(ValueError, match="scores must have dtype"):
    topk_sum_and_topk_group_idx(jnp.ones((4, 8, 4), dtype), 2, 2)


@pytest.mark.parametrize("e, g", SPEC_EG)
@pytest.mark.parametrize("s", [1, 2])
def test_lowers_for_h100(e, g, s):
  f = functools.partial(topk_sum_and_topk_group_idx, num_topk_sum=s, num_topk_groups=4, implementation="pallas")
  assert "mosaic_gpu" in lower_for_h100(f, jax.ShapeDtypeStruct((8001, g, e // g), jnp.float32)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("e, g", SPEC_EG)
@pytest.mark.parametrize("s, n", [(1, 2), (1, 4), (2, 2), (2, 4)])
@pytest.mark.parametrize("t", num_tokens())
def test_spec_shapes_gpu(key, t, e, g, s, n):
  x = _scores(key, t, g, e // g)
  f = jax.jit(topk_sum_and_topk_group_idx, static_argnums=(1, 2))
  assert_bitwise_equal(f(x, s, n), ref.topk_sum_and_topk_group_idx(x, s, n))


@pytest.mark.parametrize("epg, s", [(3, 1), (8, 2)])
def test_one_group_runs_xla(key, epg, s):
  """One group (the fuzz harness's T=130, G=1, Epg=3 crashed the kernel's lowering on an H200, 2026-11-29: a
  splat rank cannot be stored): every index is 0 through XLA; the kernel declines it."""
  x = _scores(key, 130, 1, epg)
  assert_bitwise_equal(topk_sum_and_topk_group_idx(x, s, 1, implementation="auto"), jnp.zeros((130, 1), jnp.int32))
  with pytest.raises(jaxkern.KernelUnavailableError, match="one group"):
    topk_sum_and_topk_group_idx(x, s, 1, implementation="pallas")


@pytest.mark.parametrize("g", [2, 3])
def test_two_and_three_groups_lower_for_h100(g):
  f = functools.partial(topk_sum_and_topk_group_idx, num_topk_sum=1, num_topk_groups=1, implementation="pallas")
  assert "mosaic_gpu" in lower_for_h100(f, jax.ShapeDtypeStruct((130, g, 3), jnp.float32)).as_text()

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkern
from jaxkern import moe
from jaxkern.reference import moe as ref
from jaxkern.testing import assert_bitwise_equal, moe_topk_idx


@pytest.mark.parametrize("num_topk, experts, ranks", [(1, 1, 1), (2, 9, 8), (6, 32, 8), (9, 4, 64), (7, 384, 1)])
def test_counts_and_aux_fi(key, num_topk, experts, ranks):
  idx = moe_topk_idx(key, 8, num_topk, experts, ranks)
  counts = np.array([(idx == e).sum() for e in range(experts)], np.int32)
  assert_bitwise_equal(jax.jit(moe.group_count, static_argnums=1)(jnp.asarray(idx), experts), counts)
  for aux_topk in {1, num_topk}:
    fi = moe.aux_fi(jnp.asarray(idx), experts, aux_topk)
    want = (counts.astype(np.float32) * np.float32(experts)) / np.float32(idx.shape[0] * aux_topk)
    assert_bitwise_equal(fi, want)


def test_zero_tokens_and_padding_only():
  assert_bitwise_equal(moe.group_count(jnp.zeros((0, 2), jnp.int32), 3), np.zeros(3, np.int32))
  assert_bitwise_equal(moe.aux_fi(jnp.zeros((0, 2), jnp.int32), 3, 2), np.zeros(3, np.float32))
  assert_bitwise_equal(moe.group_count(jnp.full((4, 2), -1, jnp.int32), 3), np.zeros(3, np.int32))


@pytest.mark.parametrize("f", [moe.group_count, lambda i, e: moe.aux_fi(i, e, 1)])
@pytest.mark.parametrize("idx, match", [
    (np.array([[0, 3]], np.int32), "must hold -1 or values in"),
    (np.array([[0, -2]], np.int32), "must hold -1 or values in"),
    (np.zeros((4,), np.int32), "must have rank 2"),
    (np.zeros((4, 2), np.float32), "must have dtype"),
    (np.zeros((4, 2), bool), "must have dtype"),
])
def test_bad_inputs(f, idx, match):
  with pytest.raises(ValueError, match=match):
    f(jnp.asarray(idx), 3)


@pytest.mark.parametrize("num_experts", [5, 72])  # compare-and-sum histogram / scatter-add
def test_out_of_range_ids_under_jit_are_ignored(num_experts):
  idx = np.array([[0, num_experts], [-3, 1], [4, 2], [1, 99]], np.int32)
  counts = np.bincount(idx[(idx >= 0) & (idx < num_experts)], minlength=num_experts).astype(np.int32)
  fi = ((counts.astype(np.float32) * np.float32(num_experts)) / np.float32(4 * 2)).astype(np.float32)
  for impl in ("xla", "reference"):
    g = jax.jit(lambda i: moe.group_count(i, num_experts, implementation=impl))
    a = jax.jit(lambda i: moe.aux_fi(i, num_experts, 2, implementation=impl))
    assert_bitwise_equal(g(jnp.asarray(idx)), counts)
    assert_bitwise_equal(a(jnp.asarray(idx)), fi)


def test_list_input_and_every_implementation():
  """Lists work; "pallas" and "interpret" run the XLA code too (the ops have no kernel)."""
  idx = [[0, 2], [1, 0], [-1, 2]]
  for impl in ("auto", "pallas", "interpret", "xla", "reference"):
    assert_bitwise_equal(moe.group_count(idx, 3, implementation=impl), np.array([2, 1, 2], np.int32))
    assert_bitwise_equal(moe.aux_fi(idx, 3, 2, implementation=impl), ref.aux_fi(jnp.asarray(idx, jnp.int32), 3, 2))
  paths = [d.path for d in jaxkern.explain(lambda i: (moe.group_count(i, 3, implementation="pallas"),
                                                      moe.aux_fi(i, 3, 2, implementation="interpret")),
                                           jnp.zeros((3, 2), jnp.int32))]
  assert paths == ["xla", "xla"]


def test_no_retrace():
  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(idx):
    return moe.group_count(idx, 9), moe.aux_fi(idx, 9, 2)

  for seed in range(3):
    f(jax.random.randint(jax.random.key(seed), (14, 2), -1, 9))

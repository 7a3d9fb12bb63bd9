import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern import moe
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
])
def test_bad_inputs(f, idx, match):
  with pytest.raises(ValueError, match=match):
    f(jnp.asarray(idx), 3)

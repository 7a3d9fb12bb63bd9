import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern import moe
from jaxkern.testing import assert_bitwise_equal


def _expected(idx, n, ep, tp_rank, tp):
  r = n // ep
  out = np.full_like(idx, -1)
  for pos, p in np.ndenumerate(idx):
    if p >= 0 and (p // r) % tp == tp_rank:
      out[pos] = (p // r // tp) * r + p % r
  return out


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("experts, ranks", [(9, 8), (32, 8), (4, 64), (72, 1)])
def test_bit_exact(key, experts, ranks, tp):
  """Ids spread over all EP ranks (upstream's test only sees rank 0)."""
  n = experts * ranks
  idx = np.asarray(jax.random.randint(key, (37, 6), -1, n), np.int32)
  f = jax.jit(moe.mask_indices_by_tp, static_argnums=(1, 2, 4))
  for tp_rank in range(tp):
    assert_bitwise_equal(f(jnp.asarray(idx), n, ranks, jnp.int32(tp_rank), tp), _expected(idx, n, ranks, tp_rank, tp))


def test_negatives_and_empty():
  idx = jnp.array([[-1, -5, 3]], jnp.int32)
  assert_bitwise_equal(moe.mask_indices_by_tp(idx, 8, 4, 1, 2), np.array([[-1, -1, 1]], np.int32))
  assert moe.mask_indices_by_tp(jnp.zeros((0, 3), jnp.int32), 8, 4, 0, 2).shape == (0, 3)


@pytest.mark.parametrize("args, match", [
    ((jnp.zeros((4,), jnp.int32), 8, 4, 0, 2), "indices must have rank 2"),
    ((jnp.zeros((4, 2), jnp.float32), 8, 4, 0, 2), "indices must have dtype"),
    ((jnp.zeros((4, 2), jnp.int32), 8, 0, 0, 2), "num_ep_ranks"),
    ((jnp.zeros((4, 2), jnp.int32), 8, 4, 2, 2), "tp_rank"),
])
def test_bad_inputs(args, match):
  with pytest.raises(ValueError, match=match):
    moe.mask_indices_by_tp(*args)

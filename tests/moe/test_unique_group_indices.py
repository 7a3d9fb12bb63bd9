import chex
import hypothesis
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

import jaxkern
from jaxkern import moe
from jaxkern.moe._unique_group_indices import _kernel
from jaxkern.reference import moe as ref
from jaxkern.testing import assert_bitwise_equal, lower_for_h100, moe_topk_idx


def _expected(g):
  out = g.copy()
  for row in out:
    seen = set()
    for j, v in enumerate(row):
      if v >= 0 and v in seen:
        row[j] = -1
      seen.add(v)
  return out


@pytest.mark.parametrize("num_groups", [8, 16, 72])
@pytest.mark.parametrize("num_topk, experts, ranks", [(2, 9, 8), (6, 32, 8), (9, 4, 64), (8, 72, 1)])
def test_spec_grid(key, num_topk, experts, ranks, num_groups):
  if (experts * ranks) % num_groups:
    pytest.skip("total experts not a multiple of num_groups")
  idx = moe_topk_idx(key, 8, num_topk, experts, ranks)
  g = np.where(idx >= 0, idx // (experts * ranks // num_groups), -1).astype(np.int32)
  assert_bitwise_equal(jax.jit(moe.unique_group_indices, static_argnums=1)(jnp.asarray(g), num_groups), _expected(g))


@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(g=hnp.arrays(np.int32, st.tuples(st.integers(0, 6), st.integers(1, 9)),
                               elements=st.integers(-3, 5)))
def test_random_rows(g):
  """Negative values, repeated -3 included, stay as they are (the upstream kernel's behaviour)."""
  assert_bitwise_equal(moe.unique_group_indices(jnp.asarray(g), 8), _expected(g))


@pytest.mark.parametrize("shape", [(5, 3), (130, 9), (257, 6), (257, 2), (131, 8)])
def test_kernel_any_topk(key, shape):
  """The kernel (also for K the op leaves to XLA), ragged T, repeated values and negatives; the staged
  block moves in 4-, 8- and 16-byte vectors (K = 3 and 9, 6, 8)."""
  g = np.asarray(jax.random.randint(key, shape, -3, 6), np.int32)
  got = _kernel(jnp.asarray(g), interpret=jaxkern._config.mosaic_interpret(jaxkern.get_implementation() == "interpret"))
  assert_bitwise_equal(got, _expected(g))


@pytest.mark.parametrize("num_topk", [2, 6, 8, 9])
def test_lowers_for_h100(num_topk):
  """The kernel itself, also for the K that the op leaves to XLA."""
  spec = jax.ShapeDtypeStruct((22062, num_topk), jnp.int32)
  assert "mosaic_gpu" in lower_for_h100(lambda g: _kernel(g), spec).as_text()


@pytest.mark.parametrize("t, k, kernel", [(21845, 6, False), (21846, 6, True), (100, 2, True), (100, 8, True)])
def test_auto_on_gpu_takes_the_kernel_for_k6_from_2_17_entries(monkeypatch, t, k, kernel):
  """"auto" on a GPU leaves K = 6 below XLA_BELOW_ENTRIES[6] = 2^17 entries to XLA (measured faster);
  "pallas" runs the kernel there too."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  spec = jax.ShapeDtypeStruct((t, k), jnp.int32)
  [d] = jaxkern.explain(lambda g: moe.unique_group_indices(g, 8, implementation="auto"), spec)
  assert d.path == ("pallas" if kernel else "xla")
  if not kernel:
    assert "XLA_BELOW_ENTRIES[6]" in d.reason
  f = lambda g: moe.unique_group_indices(g, 8, implementation="pallas")
  assert "mosaic_gpu" in lower_for_h100(f, spec).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("num_groups", [8, 72])
@pytest.mark.parametrize("num_topk, experts, ranks", [(2, 9, 8), (6, 9, 8), (6, 4, 64), (9, 32, 8), (9, 4, 64)])
def test_spec_shapes_gpu(key, num_topk, experts, ranks, num_groups):
  if (experts * ranks) % num_groups:
    pytest.skip("total experts not a multiple of num_groups")
  idx = moe_topk_idx(key, 4001, num_topk, experts, ranks)
  g = jnp.asarray(np.where(idx >= 0, idx // (experts * ranks // num_groups), -1).astype(np.int32))
  f = jax.jit(moe.unique_group_indices, static_argnums=1)
  jax.block_until_ready(f(g, num_groups))
  jnp.full(g.shape, -7, jnp.int32).block_until_ready()  # poison the allocator
  assert_bitwise_equal(f(g, num_groups), ref.unique_group_indices(g, num_groups))


def test_bad_inputs():
  with pytest.raises(ValueError, match="group_indices must have rank 2"):
    moe.unique_group_indices(jnp.zeros((4,), jnp.int32), 8)
  with pytest.raises(ValueError, match="num_groups"):
    moe.unique_group_indices(jnp.zeros((4, 2), jnp.int32), 200)
  with pytest.raises(ValueError, match="group_indices must have dtype"):
    moe.unique_group_indices(jnp.zeros((4, 2), bool), 8)


def test_int64_has_no_kernel():
  with jax.enable_x64(True):
    g = jnp.asarray(np.array([[0, 0, -1, -1], [3, 2, 3, 2]], np.int64))
    with pytest.raises(jaxkern.KernelUnavailableError, match="int64 indices"):
      moe.unique_group_indices(g, 8, implementation="interpret")
    want = ref.unique_group_indices(g, 8)
    assert want.dtype == jnp.int64
    for impl in ("xla", "auto"):
      assert_bitwise_equal(moe.unique_group_indices(g, 8, implementation=impl), want)


def test_list_input():
  assert_bitwise_equal(moe.unique_group_indices([[1, 1, -1, -1, 2]], 8), np.array([[1, -1, -1, -1, 2]], np.int32))


def test_no_retrace():
  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(g):
    return moe.unique_group_indices(g, 8)

  for seed in range(3):
    f(jax.random.randint(jax.random.key(seed), (20, 6), -1, 8))

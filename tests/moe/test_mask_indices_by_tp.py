import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkern
from jaxkern import moe
from jaxkern.moe._mask_indices_by_tp import STATIC_VEC, _kernel
from jaxkern.reference import moe as ref
from jaxkern.testing import assert_bitwise_equal, lower_for_h100, moe_topk_idx


def _expected(idx, n, ep, tp_rank, tp):
  r = n // ep
  out = np.full_like(idx, -1)
  for pos, p in np.ndenumerate(idx):
    if p >= 0 and (p // r) % tp == tp_rank:
      out[pos] = (p // r // tp) * r + p % r
  return out


@pytest.mark.parametrize("static_rank", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("experts, ranks", [(9, 8), (32, 8), (4, 64), (72, 1)])
def test_bit_exact(key, experts, ranks, tp, static_rank):
  """Ids spread over all EP ranks (upstream's test only sees rank 0); a traced and a static tp_rank."""
  n = experts * ranks
  idx = np.asarray(jax.random.randint(key, (37, 9), -1, n), np.int32)
  f = jax.jit(moe.mask_indices_by_tp, static_argnums=(1, 2, 3, 4) if static_rank else (1, 2, 4))
  for tp_rank in range(tp):
    rank = tp_rank if static_rank else jnp.int32(tp_rank)
    assert_bitwise_equal(f(jnp.asarray(idx), n, ranks, rank, tp), _expected(idx, n, ranks, tp_rank, tp))


@pytest.mark.parametrize("shape", [(1, 3), (130, 9), (257, 2), (43, 3)])
@pytest.mark.parametrize("static_rank", [False, True])
def test_ragged_sizes(key, shape, static_rank):
  """The kernel (for any K, also K = 6) on sizes below one CTA (padded) and with entries past the last
  whole vector (scalar tail), with the rank read from GMEM (4-entry vectors) or static (2-entry)."""
  idx = np.asarray(jax.random.randint(key, shape, -2, 72), np.int32)
  interpret = jaxkern._config.mosaic_interpret(jaxkern.get_implementation() == "interpret")
  if static_rank:
    got = _kernel(jnp.asarray(idx), r=9, tp=4, rank=3, vec=STATIC_VEC, interpret=interpret)
  else:
    got = _kernel(jnp.asarray(idx), 3, r=9, tp=4, interpret=interpret)
  assert_bitwise_equal(got, _expected(idx, 72, 8, 3, 4))


def test_static_rank_takes_the_kernel_for_every_topk():
  """A Python-int rank runs the kernel even for the K that a traced rank leaves to XLA."""
  f = lambda x: moe.mask_indices_by_tp(x, 72, 8, 1, 2, implementation="pallas")
  assert "mosaic_gpu" in lower_for_h100(f, jax.ShapeDtypeStruct((18506, 6), jnp.int32)).as_text()


def test_lowers_for_h100():
  f = lambda x, r: moe.mask_indices_by_tp(x, 72, 8, r, 2, implementation="pallas")
  spec = jax.ShapeDtypeStruct
  assert "mosaic_gpu" in lower_for_h100(f, spec((23505, 9), jnp.int32), spec((), jnp.int32)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [2, 8])
@pytest.mark.parametrize("num_topk, experts, ranks", [(2, 9, 8), (6, 32, 8), (9, 9, 8), (9, 4, 64)])
def test_spec_shapes_gpu(key, num_topk, experts, ranks, tp):
  t = moe_topk_idx(key, 4001, num_topk, experts, ranks).shape[0]
  n = experts * ranks
  idx = jax.random.randint(key, (t, num_topk), -1, n)
  f = jax.jit(moe.mask_indices_by_tp, static_argnums=(1, 2, 4))
  jax.block_until_ready(f(idx, n, ranks, 1, tp))
  g = jax.jit(moe.mask_indices_by_tp, static_argnums=(1, 2, 3, 4))
  for rank in range(tp):
    want = ref.mask_indices_by_tp(idx, n, ranks, rank, tp)
    jnp.full(idx.shape, -7, jnp.int32).block_until_ready()  # poison the allocator
    assert_bitwise_equal(f(idx, n, ranks, jnp.int32(rank), tp), want)
    jnp.full(idx.shape, -7, jnp.int32).block_until_ready()
    assert_bitwise_equal(g(idx, n, ranks, rank, tp), want)


def test_negatives_and_empty():
  idx = jnp.array([[-1, -5, 3]], jnp.int32)
  assert_bitwise_equal(moe.mask_indices_by_tp(idx, 8, 4, 1, 2), np.array([[-1, -1, 1]], np.int32))
  assert moe.mask_indices_by_tp(jnp.zeros((0, 3), jnp.int32), 8, 4, 0, 2).shape == (0, 3)


@pytest.mark.parametrize("args, match", [
    ((jnp.zeros((4,), jnp.int32), 8, 4, 0, 2), "indices must have rank 2"),
    ((jnp.zeros((4, 2), jnp.float32), 8, 4, 0, 2), "indices must have dtype"),
    ((jnp.zeros((4, 2), bool), 8, 4, 0, 2), "indices must have dtype"),
    ((jnp.zeros((4, 2), jnp.int32), 8, 0, 0, 2), "num_ep_ranks"),
    ((jnp.zeros((4, 2), jnp.int32), 8, 4, 2, 2), "tp_rank"),
])
def test_bad_inputs(args, match):
  with pytest.raises(ValueError, match=match):
    moe.mask_indices_by_tp(*args)


def test_int64_has_no_kernel():
  with jax.enable_x64(True):
    idx = jnp.asarray(np.array([[0, 7, -1], [5, 3, 2]], np.int64))
    with pytest.raises(jaxkern.KernelUnavailableError, match="int64 indices"):
      moe.mask_indices_by_tp(idx, 8, 4, 1, 2, implementation="interpret")
    want = ref.mask_indices_by_tp(idx, 8, 4, 1, 2)
    assert want.dtype == jnp.int64
    for impl in ("xla", "auto"):
      assert_bitwise_equal(moe.mask_indices_by_tp(idx, 8, 4, 1, 2, implementation=impl), want)


@pytest.mark.parametrize("shape, static_rank, path, reason", [
    ((18506, 6), False, "xla", "XLA_TOPK"), ((18506, 6), True, "pallas", ""),
    ((1 << 15, 8), False, "xla", "XLA_MIN_ENTRIES[8]"), ((1 << 15, 8), True, "xla", "XLA_MIN_ENTRIES[8]"),
    (((1 << 15) - 1, 8), False, "pallas", ""), ((23505, 9), False, "pallas", "")])
def test_auto_on_gpu_keeps_the_measured_thresholds(monkeypatch, shape, static_rank, path, reason):
  """"auto" on a GPU takes XLA exactly where the module docstring's measurements say."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  spec = jax.ShapeDtypeStruct(shape, jnp.int32)
  if static_rank:
    [d] = jaxkern.explain(lambda i: moe.mask_indices_by_tp(i, 72, 8, 1, 2, implementation="auto"), spec)
  else:
    [d] = jaxkern.explain(lambda i, r: moe.mask_indices_by_tp(i, 72, 8, r, 2, implementation="auto"), spec,
                          jax.ShapeDtypeStruct((), jnp.int32))
  assert d.path == path and reason in d.reason


def test_list_input():
  assert_bitwise_equal(moe.mask_indices_by_tp([[-1, -5, 3]], 8, 4, 1, 2), np.array([[-1, -1, 1]], np.int32))


def test_no_retrace(key):
  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(idx, rank):
    return moe.mask_indices_by_tp(idx, 72, 8, rank, 2), moe.mask_indices_by_tp(idx, 72, 8, 1, 2)

  for seed in range(3):
    f(jax.random.randint(jax.random.key(seed), (37, 9), -1, 72), jnp.int32(seed % 2))

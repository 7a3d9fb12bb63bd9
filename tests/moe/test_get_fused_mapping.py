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
from jaxkern.reference import moe as ref
from jaxkern.testing import align, assert_bitwise_equal, moe_topk_idx
from jaxkern.types import FusedMapping

# (local experts, EP ranks): upstream's 72/256/288/384 experts split over ranks, scaled for CPU.
EXPERT_SPLITS = [(9, 8), (32, 8), (4, 64), (72, 1), (256, 1), (288, 1), (384, 1), (1, 1)]


def _expected(idx: np.ndarray, num_experts: int, alignment: int, n: int):
  """The canonical layout, built with plain Python loops."""
  t, k = idx.shape
  counts = [int((idx == e).sum()) for e in range(num_experts)]
  aligned = [align(c, alignment) for c in counts]
  start = np.cumsum([0] + aligned)[:-1]
  pos_to_expert, pos_to_token_topk = np.full(n, -1), np.full(n, -1)
  token_topk_to_pos = np.full((t, k), -1)
  fill = list(start)
  for f, e in enumerate(idx.ravel()):
    if e >= 0:
      p = fill[e]
      fill[e] += 1
      pos_to_expert[p], pos_to_token_topk[p] = e, f
      token_topk_to_pos[f // k, f % k] = p
  pos_to_token = np.where(pos_to_token_topk >= 0, pos_to_token_topk // k, -1)
  return [np.asarray(a, np.int32) for a in (pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos,
                                            start, start + np.asarray(aligned, int), aligned)]


def _check_properties(idx, outs, alignment):
  """Upstream's test's checks."""
  assert isinstance(outs, FusedMapping)
  pte, ptt, pttk, ttp, start, end, n_e, counts = [np.asarray(o) for o in outs[:7]] + [outs.num_tokens_per_expert_list]
  k = idx.shape[1]
  assert counts == n_e.tolist()
  assert (start == np.cumsum(n_e) - n_e).all() and (end == np.cumsum(n_e)).all()
  assert (n_e % alignment == 0).all()
  for e in range(len(n_e)):
    seg = pte[start[e]:end[e]]
    assert (seg == e).sum() == (idx == e).sum() and ((seg == e) | (seg == -1)).all()
  occ = np.nonzero(pttk >= 0)[0]
  assert (ttp[pttk[occ] // k, pttk[occ] % k] == occ).all()
  assert (idx[pttk[occ] // k, pttk[occ] % k] == pte[occ]).all()
  assert (ptt[occ] == pttk[occ] // k).all()
  assert ((pte < 0) == (ptt < 0)).all() and ((pte < 0) == (pttk < 0)).all()


@pytest.mark.parametrize("num_topk", [1, 6, 9])
@pytest.mark.parametrize("experts, ranks", EXPERT_SPLITS)
def test_spec_grid(key, experts, ranks, num_topk):
  if num_topk > experts * ranks:
    pytest.skip("K > total experts")
  idx = moe_topk_idx(key, 24, num_topk, experts, ranks)
  for alignment in (1, 16, 128) if num_topk == 9 else (64,):
    outs = moe.get_fused_mapping(jnp.asarray(idx), experts, 0, alignment)
    _check_properties(idx, outs, alignment)
    want = _expected(idx, experts, alignment, sum(outs.num_tokens_per_expert_list))
    for got, w in zip(outs[:7], want):
      assert_bitwise_equal(got, w)
    chex.assert_trees_all_equal(outs, ref.get_fused_mapping(jnp.asarray(idx), experts, 0, alignment))


@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(data=st.data(), experts=st.integers(1, 40), num_topk=st.integers(1, 9),
                  alignment=st.sampled_from([1, 3, 16, 64]), extra=st.integers(1, 20))
def test_random_routings(data, experts, num_topk, alignment, extra):
  """Any routing, rows entirely -1 included, with a static N larger than needed, under jit."""
  tokens = data.draw(st.integers(0, 40))
  idx = data.draw(hnp.arrays(np.int32, (tokens, num_topk), elements=st.integers(-1, experts - 1)))
  used = sum(align(int((idx == e).sum()), alignment) for e in range(experts))
  f = jax.jit(moe.get_fused_mapping, static_argnums=(1, 2, 3))
  outs = f(jnp.asarray(idx), experts, used + extra, alignment)
  assert outs.num_tokens_per_expert_list == []
  want = _expected(idx, experts, alignment, used + extra)
  for got, w in zip(outs[:7], want):
    assert_bitwise_equal(got, w)


def test_zero_tokens():
  outs = moe.get_fused_mapping(jnp.zeros((0, 1), jnp.int32), 1, 0, 1)
  assert [o.shape for o in outs[:7]] == [(0,), (0,), (0,), (0, 1), (1,), (1,), (1,)]
  assert outs.num_tokens_per_expert_list == [0] and int(outs.expert_start[0]) == int(outs.expert_end[0]) == 0


def test_all_padding_rows_and_unused_experts():
  idx = np.array([[-1, -1], [3, -1], [-1, -1], [3, 0]], np.int32)
  pte, ptt, pttk, ttp, start, end, n_e, counts = moe.get_fused_mapping(jnp.asarray(idx), 5, 0, 4)
  assert counts == [4, 0, 0, 4, 0]
  assert np.asarray(start).tolist() == [0, 4, 4, 4, 8] and np.asarray(end).tolist() == [4, 4, 4, 8, 8]
  assert np.asarray(pte).tolist() == [0, -1, -1, -1, 3, 3, -1, -1]
  assert np.asarray(ttp).tolist() == [[-1, -1], [4, -1], [-1, -1], [5, 0]]


def test_force_no_sync_allocates_upper_bound(key):
  idx = moe_topk_idx(key, 8, 6, 9, 8)
  t, k = idx.shape
  outs = jax.jit(lambda i: moe.get_fused_mapping(i, 9, 0, 64, force_no_sync=True))(jnp.asarray(idx))
  assert outs.pos_to_expert.shape == ((t * k + 63 * 9) // 64 * 64,) and outs.num_tokens_per_expert_list == []
  chex.assert_trees_all_equal(outs, ref.get_fused_mapping(jnp.asarray(idx), 9, 0, 64, force_no_sync=True))
  synced = moe.get_fused_mapping(jnp.asarray(idx), 9, 0, 64)
  n = len(synced.pos_to_expert)
  for a, b in zip(outs[:3], synced[:3]):
    assert_bitwise_equal(a[:n], b)
    assert (np.asarray(a[n:]) == -1).all()


def test_int64_input_and_reference_agree(key):
  idx = moe_topk_idx(key, 16, 2, 32, 8)
  outs = moe.get_fused_mapping(idx.astype(np.int64), 32, 0, 16)
  want = ref.fused_mapping(jnp.asarray(idx), 32, len(outs.pos_to_expert), 16)
  for a, b in zip(outs[:7], want):
    assert a.dtype == jnp.int32
    assert_bitwise_equal(a, b)


def test_sync_under_jit_raises():
  with pytest.raises(ValueError, match="num_expanded_tokens"):
    jax.jit(lambda i: moe.get_fused_mapping(i, 4, 0, 16))(jnp.zeros((4, 2), jnp.int32))


@pytest.mark.parametrize("idx, kwargs, match", [
    (np.array([[0, 4]], np.int32), {}, "topk_idx must hold"),
    (np.array([[0, -2]], np.int32), {}, "topk_idx must hold"),
    (np.zeros((4,), np.int32), {}, "topk_idx must have rank 2"),
    (np.zeros((4, 2), np.float32), {}, "topk_idx must have dtype"),
    (np.zeros((4, 2), np.int32), dict(num_experts=0), "num_experts"),
    (np.zeros((4, 2), np.int32), dict(alignment=0), "alignment"),
    (np.zeros((4, 2), bool), {}, "topk_idx must have dtype"),
    (np.array([[0, 1], [1, 1]], np.int32), dict(num_expanded_tokens=31), "below the 32 rows"),
])
def test_bad_inputs(idx, kwargs, match):
  args = dict(num_experts=4, num_expanded_tokens=0, alignment=16) | kwargs  # [[0, 1], [1, 1]] needs 16 + 16 rows
  with pytest.raises(ValueError, match=match):
    moe.get_fused_mapping(jnp.asarray(idx) if idx.dtype != np.int64 else idx, **args)


@pytest.mark.gpu
@pytest.mark.parametrize("num_topk", [2, 6, 8, 9])
@pytest.mark.parametrize("experts, ranks", [(9, 8), (32, 8), (4, 64)])
def test_spec_grid_gpu(key, experts, ranks, num_topk):
  idx = moe_topk_idx(key, 4001, num_topk, experts, ranks)
  for alignment in (64, 128):
    outs = moe.get_fused_mapping(jnp.asarray(idx), experts, 0, alignment)
    _check_properties(idx, outs, alignment)
    chex.assert_trees_all_equal(outs, ref.get_fused_mapping(jnp.asarray(idx), experts, 0, alignment))



@pytest.mark.parametrize("experts, ranks, num_topk", [(9, 8, 6), (64, 4, 8), (65, 1, 2)])
def test_sort_free_matches_reference_sort(key, experts, ranks, num_topk):
  """Many rank blocks (several thousand entries), up to and past the sort-free expert limit."""
  idx = jnp.asarray(moe_topk_idx(key, 500, num_topk, experts, ranks))
  n = ref.upper_bound_rows(*idx.shape, experts, 16) + 5
  got = moe.get_fused_mapping(idx, experts, n, 16)
  chex.assert_trees_all_equal(got, ref.get_fused_mapping(idx, experts, n, 16))


def test_too_few_rows_under_jit_drops_rows():
  """Under jit a too small N cannot be checked: the rows past N are dropped, and their slots keep
  positions >= N, which expand_to_fused / reduce_fused skip as unused slots."""
  idx = jnp.array([[0, 1], [1, 1], [2, -1]], jnp.int32)
  m = jax.jit(moe.get_fused_mapping, static_argnums=(1, 2, 3))(idx, 3, 10, 4)  # needs 12 rows
  assert_bitwise_equal(m.pos_to_expert, np.array([0, -1, -1, -1, 1, 1, 1, -1, 2, -1], np.int32))
  assert_bitwise_equal(m.token_topk_to_pos, np.array([[0, 4], [5, 6], [8, -1]], np.int32))
  chex.assert_trees_all_equal(m, ref.get_fused_mapping(idx, 3, 10, 4))
  m = jax.jit(moe.get_fused_mapping, static_argnums=(1, 2, 3))(idx, 3, 5, 4)
  assert_bitwise_equal(m.token_topk_to_pos, np.array([[0, 4], [5, 6], [8, -1]], np.int32))
  assert_bitwise_equal(m.pos_to_token_topk, np.array([0, -1, -1, -1, 1], np.int32))


def test_out_of_range_ids_under_jit_are_unused_slots():
  """Traced ids outside [0, E) (below -1 included) are treated as -1, also by the reference."""
  idx = np.array([[0, 7], [-3, 1], [3, 2], [1, 4]], np.int32)
  clean = np.where((idx >= 0) & (idx < 3), idx, -1)
  f = jax.jit(moe.get_fused_mapping, static_argnums=(1, 2, 3), static_argnames=("implementation",))
  for impl in ("xla", "reference"):
    chex.assert_trees_all_equal(f(jnp.asarray(idx), 3, 16, 4, implementation=impl),
                                f(jnp.asarray(clean), 3, 16, 4, implementation=impl))


def test_list_input_and_every_implementation():
  """A nested list works; every implementation gives the reference's mapping ("pallas" and
  "interpret" too: the op has no kernel, its XLA code is the implementation)."""
  idx = [[0, 2], [1, 0], [-1, 2]]
  want = ref.get_fused_mapping(jnp.asarray(idx, jnp.int32), 3, 0, 4)
  for impl in ("auto", "pallas", "interpret", "xla", "reference"):
    chex.assert_trees_all_equal(moe.get_fused_mapping(idx, 3, 0, 4, implementation=impl), want)
  assert [d.path for d in jaxkern.explain(lambda i: moe.get_fused_mapping(i, 3, 8, 4, implementation="pallas"),
                                          jnp.asarray(idx, jnp.int32))] == ["xla"]


def test_force_no_sync_is_keyword_only():
  with pytest.raises(TypeError):
    moe.get_fused_mapping(jnp.zeros((2, 2), jnp.int32), 4, 0, 16, True)


def test_no_retrace():
  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(idx):
    return moe.get_fused_mapping(idx, 9, 0, 16, force_no_sync=True)

  for seed in range(3):
    f(jax.random.randint(jax.random.key(seed), (14, 2), -1, 9))

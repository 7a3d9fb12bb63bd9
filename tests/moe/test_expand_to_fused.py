import functools

import chex
import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from jax.experimental import checkify

import jaxkern
from jaxkern import moe
from jaxkern.reference import moe as ref
from jaxkern.testing import assert_bitwise_equal, lower_for_h100, moe_topk_idx, randn, random_bits
from jaxkern.types import QuantTensor
from tests.moe.routing_checks import assert_checks_compile_away, checkify_error


def _mapping(key, tokens, num_topk, experts, ranks, alignment=4):
  idx = moe_topk_idx(key, tokens, num_topk, experts, ranks)
  return idx, moe.get_fused_mapping(jnp.asarray(idx), experts, 0, alignment)


@pytest.mark.parametrize("num_topk, experts, ranks, hidden, dtype", [
    (2, 9, 8, 576, jnp.bfloat16), (6, 9, 8, 2048, jnp.float8_e4m3fn), (9, 72, 1, 320, jnp.float32)])
def test_bit_exact(key, num_topk, experts, ranks, hidden, dtype):
  k1, k2 = jax.random.split(key)
  _, m = _mapping(k1, 2 if ranks > 1 else 8, num_topk, experts, ranks)
  pos, pte = m.token_topk_to_pos, m.pos_to_expert
  x = random_bits(k2, (pos.shape[0], hidden), dtype)  # NaN payloads and -0 must survive
  out = moe.expand_to_fused(x, pos, pte)
  assert out.shape == (pte.shape[0], hidden) and out.dtype == x.dtype
  assert_bitwise_equal(out, ref.expand_to_fused(x, pos, pte))


def test_ragged_tokens_padding_and_empty_rows(key):
  """17 tokens (not a multiple of the token block), rows entirely -1, extra padding rows."""
  idx = np.array(jax.random.randint(key, (17, 3), -1, 5), np.int32)
  idx[[0, 7, 16]] = -1
  m = moe.get_fused_mapping(jnp.asarray(idx), 5, 64, 4)
  x = randn(key, (17, 576), jnp.bfloat16)
  out = moe.expand_to_fused(x, m.token_topk_to_pos, m.pos_to_expert)
  want = np.zeros((64, 576), np.float32)
  for t, k in zip(*np.nonzero(idx >= 0)):
    want[int(m.token_topk_to_pos[t, k])] = np.asarray(x[t], np.float32)
  assert_bitwise_equal(out, want.astype(jnp.bfloat16))


def test_token_block_tail():
  """T not a multiple of the token block of a wide row (block 4 at H = 7168 bf16)."""
  from jaxkern.moe._expand_to_fused import _expand_kernel
  import jaxkern

  t, k = 6, 2
  pos = jnp.asarray(np.random.default_rng(0).permutation(t * k).reshape(t, k).astype(np.int32))
  x = randn(jax.random.key(1), (t, 7168), jnp.bfloat16)
  got = _expand_kernel(x, None, pos, jnp.zeros((t * k,), jnp.int32), interpret=jaxkern._config.mosaic_interpret(True))
  assert_bitwise_equal(got, ref.expand_to_fused(x, pos, jnp.zeros((t * k,), jnp.int32)))


@pytest.mark.parametrize("max_slots, row_block", [(27, 32), (16, 128), (None, 8)])
def test_token_and_row_blocks(key, monkeypatch, max_slots, row_block):
  """Smaller token blocks (at most ``max_slots`` slots: 3 tokens of K = 9, 1 of K = 9 with 16) and other
  padding-row blocks, forced: 17 ragged tokens (the last block moved back), padding rows, unused slots."""
  from jaxkern.moe import _expand_to_fused as etf
  monkeypatch.setattr(etf, "_MAX_SLOTS", max_slots)
  monkeypatch.setattr(etf, "_ROW_BLOCK", row_block)
  idx = np.array(jax.random.randint(key, (17, 9), -1, 5), np.int32)
  idx[[0, 7, 16]] = -1
  m = moe.get_fused_mapping(jnp.asarray(idx), 5, 0, 16)
  x = randn(key, (17, 576), jnp.bfloat16)
  got = moe.expand_to_fused(x, m.token_topk_to_pos, m.pos_to_expert)
  assert_bitwise_equal(got, ref.expand_to_fused(x, m.token_topk_to_pos, m.pos_to_expert))


def test_token_block_choice():
  from jaxkern.moe._expand_to_fused import _token_block
  assert _token_block(4001, 9, 1152, None) == 16
  assert _token_block(4001, 9, 1152, 32) == 3
  assert _token_block(4001, 9, 14336, None) == 4
  assert _token_block(4001, 9, 1152, 4) == 1  # at least one token
  assert _token_block(4001, 2, 1000, None) == 1  # rows that break the TMA alignment


def test_zero_tokens():
  out = moe.expand_to_fused(jnp.ones((0, 576), jnp.bfloat16), jnp.zeros((0, 2), jnp.int32), jnp.full((16,), -1))
  assert_bitwise_equal(out, jnp.zeros((16, 576), jnp.bfloat16))


def test_jit_and_vmap(key):
  _, m = _mapping(key, 2, 2, 9, 8)
  pos, pte = m.token_topk_to_pos, m.pos_to_expert
  x = randn(key, (2, pos.shape[0], 256), jnp.bfloat16)
  f = jax.jit(jax.vmap(moe.expand_to_fused, in_axes=(0, None, None)))
  want = jnp.stack([ref.expand_to_fused(xi, pos, pte) for xi in x])
  assert_bitwise_equal(f(x, pos, pte), want)


def _sf_inputs(key, tokens, hidden, npc, sf_dtype):
  blocks = -(-hidden // npc)
  hs = -(-blocks // 4) if sf_dtype == jnp.int32 else blocks
  k1, k2 = jax.random.split(key)
  return random_bits(k1, (tokens, hidden), jnp.float8_e4m3fn), random_bits(k2, (tokens, hs), sf_dtype)


def _check_with_sf(x, npc, pos, pte, col_major, got):
  assert isinstance(got, QuantTensor)
  out, out_sf = got.data, got.sf
  n, hs = pte.shape[0], x[1].shape[1]
  assert out_sf.shape == ((hs, -(-n // 4) * 4) if col_major else (n, hs)) and out_sf.dtype == x[1].dtype
  assert_bitwise_equal(got, ref.expand_to_fused_with_sf(x, npc, pos, pte, use_tma_aligned_col_major_sf=col_major))
  bits = np.asarray(jax.lax.bitcast_convert_type(out_sf, jnp.int32))
  logical = bits[:, :n].T if col_major else bits
  tokens, slots = np.nonzero(np.asarray(pos) >= 0)
  np.testing.assert_array_equal(logical[np.asarray(pos)[tokens, slots]],
                                np.asarray(jax.lax.bitcast_convert_type(x[1], jnp.int32))[tokens])
  assert not logical[np.asarray(pte) < 0].any()  # padding rows are zero
  if col_major:
    assert not bits[:, n:].any()  # padding columns of the column-major buffer


# Row-major scale rows of 20 words (moved by the kernel), of 5 words (not TMA-copyable: moved by XLA),
# column-major packed int32 and float32 (column-major kernel), column-major rows of 2 words (XLA).
@pytest.mark.parametrize("sf_dtype, col_major, npc, hidden", [
    (jnp.float32, False, 128, 2560), (jnp.float32, False, 128, 576), (jnp.int32, True, 128, 2560),
    (jnp.float32, True, 32, 576), (jnp.int32, True, 128, 576)])
def test_with_sf(key, sf_dtype, col_major, npc, hidden):
  k1, k2 = jax.random.split(key)
  _, m = _mapping(k1, 2, 6, 9, 8)
  pos, pte = m.token_topk_to_pos, m.pos_to_expert
  x = QuantTensor(*_sf_inputs(k2, pos.shape[0], hidden, npc, sf_dtype))  # NaN payloads and -0 must survive
  _check_with_sf(x, npc, pos, pte, col_major,
                 moe.expand_to_fused_with_sf(x, npc, pos, pte, use_tma_aligned_col_major_sf=col_major))


@pytest.mark.parametrize("col_major, sf_dtype, npc", [(False, jnp.float32, 32), (True, jnp.int32, 32)])
def test_with_sf_ragged_padding_and_empty_rows(key, col_major, sf_dtype, npc):
  """17 tokens, rows entirely -1, N = 61 (not a multiple of 4: padding columns), extra padding rows;
  row-major scale rows of 32 words move in the kernel, like the data."""
  idx = np.array(jax.random.randint(key, (17, 3), -1, 5), np.int32)
  idx[[0, 7, 16]] = -1
  m = moe.get_fused_mapping(jnp.asarray(idx), 5, 61, 4)
  pos, pte = m.token_topk_to_pos, m.pos_to_expert
  x = _sf_inputs(key, 17, 1024, npc, sf_dtype)
  _check_with_sf(x, npc, pos, pte, col_major,
                 moe.expand_to_fused_with_sf(x, npc, pos, pte, use_tma_aligned_col_major_sf=col_major))


def test_with_sf_zero_tokens():
  x = (jnp.ones((0, 576), jnp.float8_e4m3fn), jnp.ones((0, 5), jnp.int32))
  out, out_sf = moe.expand_to_fused_with_sf(x, 32, jnp.zeros((0, 2), jnp.int32), jnp.full((6,), -1),
                                            use_tma_aligned_col_major_sf=True)
  assert_bitwise_equal(out, jnp.zeros((6, 576), jnp.float8_e4m3fn))
  assert_bitwise_equal(out_sf, jnp.zeros((5, 8), jnp.int32))


@hypothesis.settings(max_examples=6, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**30), tokens=st.integers(1, 6), num_topk=st.integers(1, 9),
                  extra_experts=st.integers(0, 12), alignment=st.sampled_from([1, 4, 16]), col_major=st.booleans())
def test_random_routings(seed, tokens, num_topk, extra_experts, alignment, col_major):
  """Hypothesis routings (distinct experts per row, any entry -1) through get_fused_mapping, then
  expand_to_fused and expand_to_fused_with_sf (row-major float32 / column-major packed scales)."""
  rng = np.random.default_rng(seed)
  experts = num_topk + extra_experts
  idx = np.stack([rng.permutation(experts)[:num_topk] for _ in range(tokens)]).astype(np.int32)
  idx[rng.random(idx.shape) < 0.3] = -1
  m = moe.get_fused_mapping(jnp.asarray(idx), experts, 0, alignment)
  pos, pte = m.token_topk_to_pos, m.pos_to_expert
  key = jax.random.key(seed)
  x = random_bits(key, (tokens, 64), jnp.bfloat16)
  assert_bitwise_equal(moe.expand_to_fused(x, pos, pte), ref.expand_to_fused(x, pos, pte))
  xq = _sf_inputs(key, tokens, 256, 32, jnp.int32 if col_major else jnp.float32)
  _check_with_sf(xq, 32, pos, pte, col_major,
                 moe.expand_to_fused_with_sf(xq, 32, pos, pte, use_tma_aligned_col_major_sf=col_major))


@pytest.mark.parametrize("args, match", [
    ((jnp.ones((4,), jnp.bfloat16), jnp.zeros((4, 2), jnp.int32), jnp.zeros((8,), jnp.int32)), "x must have rank 2"),
    ((jnp.ones((4, 64), jnp.bfloat16), jnp.zeros((3, 2), jnp.int32), jnp.zeros((8,), jnp.int32)),
     "token_topk_to_pos must have 4 rows"),
    ((jnp.ones((4, 64), jnp.bfloat16), jnp.zeros((4, 2), jnp.float32), jnp.zeros((8,), jnp.int32)),
     "token_topk_to_pos must have dtype"),
    ((jnp.ones((4, 64), jnp.bfloat16), jnp.zeros((4, 2), jnp.int32), jnp.zeros((8, 1), jnp.int32)),
     "pos_to_expert must have rank 1"),
    ((jnp.ones((4, 60), jnp.bfloat16), jnp.zeros((4, 2), jnp.int32), jnp.zeros((8,), jnp.int32)),
     r"x.shape\[1\] = 60 must be a multiple of 8"),
    ((jnp.ones((4, 64), jnp.bfloat16), jnp.full((4, 2), 8, jnp.int32), jnp.zeros((8,), jnp.int32)),
     "token_topk_to_pos must hold"),
])
def test_bad_inputs(args, match):
  with pytest.raises(ValueError, match=match):
    moe.expand_to_fused(*args)


def test_with_sf_bad_inputs():
  x = jnp.ones((4, 256), jnp.float8_e4m3fn)
  pos, pte = jnp.zeros((4, 1), jnp.int32), jnp.zeros((4,), jnp.int32)
  with pytest.raises(ValueError, match="x.sf must have shape"):
    moe.expand_to_fused_with_sf((x, jnp.ones((4, 3), jnp.float32)), 128, pos, pte)
  with pytest.raises(ValueError, match="use_tma_aligned_col_major_sf"):
    moe.expand_to_fused_with_sf((x, jnp.ones((4, 1), jnp.int32)), 128, pos, pte)
  with pytest.raises(ValueError, match="x.sf must have dtype"):
    moe.expand_to_fused_with_sf((x, jnp.ones((4, 2), jnp.bfloat16)), 128, pos, pte)
  with pytest.raises(ValueError, match="x must be a QuantTensor"):
    moe.expand_to_fused_with_sf(x, 128, pos, pte)
  with pytest.raises(TypeError):
    moe.expand_to_fused_with_sf((x, jnp.ones((4, 1), jnp.int32)), 128, pos, pte, True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("hidden", [576, 2560, 7168])
def test_lowers_for_h100(hidden, dtype):
  """Spec-sized shapes: 4001 x 9 = 36k fused rows (K = 6, 9 local experts)."""
  t, k, n = 4001, 6, 24064
  f = functools.partial(moe.expand_to_fused, implementation="pallas")
  args = (jax.ShapeDtypeStruct((t, hidden), dtype), jax.ShapeDtypeStruct((t, k), jnp.int32),
          jax.ShapeDtypeStruct((n,), jnp.int32))
  assert "mosaic_gpu" in lower_for_h100(f, *args).as_text()


@pytest.mark.parametrize("max_slots, row_block", [(32, 32), (16, 128)])
def test_smaller_token_blocks_lower_for_h100(monkeypatch, max_slots, row_block):
  from jaxkern.moe import _expand_to_fused as etf
  monkeypatch.setattr(etf, "_MAX_SLOTS", max_slots)
  monkeypatch.setattr(etf, "_ROW_BLOCK", row_block)
  t, k, n = 37699, 9, 38144
  f = functools.partial(moe.expand_to_fused, implementation="pallas")
  args = (jax.ShapeDtypeStruct((t, 576), jnp.bfloat16), jax.ShapeDtypeStruct((t, k), jnp.int32),
          jax.ShapeDtypeStruct((n,), jnp.int32))
  assert "mosaic_gpu" in lower_for_h100(f, *args).as_text()


@pytest.mark.parametrize("sf_dtype, col_major, npc", [(jnp.float32, False, 32), (jnp.float32, False, 128),
                                                      (jnp.int32, True, 32), (jnp.float32, True, 128)])
@pytest.mark.parametrize("hidden", [576, 7168])
def test_with_sf_lowers_for_h100(hidden, sf_dtype, col_major, npc):
  t, k, n = 4001, 6, 24064
  blocks = -(-hidden // npc)
  hs = -(-blocks // 4) if sf_dtype == jnp.int32 else blocks
  f = functools.partial(moe.expand_to_fused_with_sf, num_per_channels=npc, use_tma_aligned_col_major_sf=col_major,
                        implementation="pallas")
  args = ((jax.ShapeDtypeStruct((t, hidden), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((t, hs), sf_dtype)),
          jax.ShapeDtypeStruct((t, k), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.int32))
  assert "mosaic_gpu" in lower_for_h100(lambda x, pos, pte: f(x, token_topk_to_pos=pos, pos_to_expert=pte),
                                        *args).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("max_slots, row_block", [(32, 32), (16, 128), (64, 32)])
@pytest.mark.parametrize("num_topk, experts, ranks", [(9, 4, 64), (8, 9, 8), (2, 9, 8)])
def test_token_and_row_blocks_gpu(key, monkeypatch, max_slots, row_block, num_topk, experts, ranks):
  """Smaller token / padding-row blocks, compiled, on spec-sized routings at H = 576."""
  from jaxkern.moe import _expand_to_fused as etf
  monkeypatch.setattr(etf, "_MAX_SLOTS", max_slots)
  monkeypatch.setattr(etf, "_ROW_BLOCK", row_block)
  k1, k2 = jax.random.split(key)
  _, m = _mapping(k1, 4001, num_topk, experts, ranks, alignment=16)
  pos, pte = m.token_topk_to_pos, m.pos_to_expert
  x = randn(k2, (pos.shape[0], 576), jnp.bfloat16)
  got = jax.jit(lambda *a: moe.expand_to_fused(*a))(x, pos, pte)  # a fresh function: traced with these blocks
  assert_bitwise_equal(got, ref.expand_to_fused(x, pos, pte))


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [576, 2048, 7168])
@pytest.mark.parametrize("num_topk, experts, ranks", [(2, 9, 8), (6, 9, 8), (9, 32, 8), (8, 4, 64)])
def test_spec_shapes_gpu(key, num_topk, experts, ranks, hidden):
  _, m = _mapping(key, 4001, num_topk, experts, ranks)
  pos, pte = m.token_topk_to_pos, m.pos_to_expert
  x = random_bits(key, (pos.shape[0], hidden), jnp.bfloat16)
  jnp.full((pte.shape[0], hidden), -1, jnp.int16).block_until_ready()  # poison the allocator
  assert_bitwise_equal(jax.jit(moe.expand_to_fused)(x, pos, pte), ref.expand_to_fused(x, pos, pte))


@pytest.mark.gpu
@pytest.mark.parametrize("sf_dtype, col_major, npc", [(jnp.float32, False, 32), (jnp.float32, False, 128),
                                                      (jnp.int32, True, 32), (jnp.int32, True, 128),
                                                      (jnp.float32, True, 32)])
@pytest.mark.parametrize("hidden", [2560, 7168])
@pytest.mark.parametrize("num_topk, experts, ranks", [(6, 9, 8)])
def test_with_sf_spec_shapes_gpu(key, num_topk, experts, ranks, hidden, sf_dtype, col_major, npc):
  _, m = _mapping(key, 4001, num_topk, experts, ranks, alignment=16)
  pos, pte = m.token_topk_to_pos, m.pos_to_expert
  x = _sf_inputs(key, pos.shape[0], hidden, npc, sf_dtype)
  n = pte.shape[0]
  jnp.full((n, hidden + 4 * x[1].shape[1] + 16), -1, jnp.int8).block_until_ready()  # poison the allocator
  f = jax.jit(functools.partial(moe.expand_to_fused_with_sf, num_per_channels=npc,
                                use_tma_aligned_col_major_sf=col_major))
  _check_with_sf(x, npc, pos, pte, col_major, f(x, token_topk_to_pos=pos, pos_to_expert=pte))


# Bad mappings. T = 5 tokens, K = 2, N = 12 fused rows (6 used, 6 padding); slots
# (1, 1) -> 12 and (3, 0) -> 99 are past N, (2, 1) -> -7 below -1: all unused slots, like -1.
_BAD_POS = np.array([[0, 5], [1, 12], [2, -7], [99, 3], [-1, 4]], np.int32)
_BAD_PTE = np.array([0, 0, 0, 1, 1, 1, -1, -1, -1, -1, -1, -1], np.int32)


def _unused_as_minus_one(pos, n):
  return np.where((pos >= 0) & (pos < n), pos, -1).astype(np.int32)


@pytest.mark.parametrize("impl", ["interpret", "xla", "reference"])
def test_out_of_range_positions_are_unused_slots(key, impl):
  """Under jit, kernel (interpret mode), XLA path and reference all skip positions outside [0, N)."""
  x = random_bits(key, (5, 64), jnp.bfloat16)
  pte = jnp.asarray(_BAD_PTE)
  f = jax.jit(functools.partial(moe.expand_to_fused, implementation=impl))
  want = ref.expand_to_fused(x, jnp.asarray(_unused_as_minus_one(_BAD_POS, 12)), pte)
  assert_bitwise_equal(f(x, jnp.asarray(_BAD_POS), pte), want)


@pytest.mark.parametrize("impl", ["interpret", "xla"])
@pytest.mark.parametrize("sf_dtype, col_major, npc, hidden", [
    (jnp.float32, False, 16, 64),  # 4-word row-major scale rows: moved by the expand kernel
    (jnp.float32, False, 32, 96),  # 3 words: XLA scatter next to the kernel
    (jnp.int32, True, 8, 128),  # 4 packed words, column-major: Pallas-Triton kernel
    (jnp.int32, True, 32, 128)])  # 1 word, column-major: XLA
def test_with_sf_out_of_range_positions_are_unused_slots(key, impl, sf_dtype, col_major, npc, hidden):
  x = QuantTensor(*_sf_inputs(key, 5, hidden, npc, sf_dtype))
  pte = jnp.asarray(_BAD_PTE[:10])  # N = 10: slot (1, 1) -> 10 names a padding column of the col-major buffer
  pos = _BAD_POS.copy()
  pos[1, 1] = 10
  f = jax.jit(functools.partial(moe.expand_to_fused_with_sf, num_per_channels=npc,
                                use_tma_aligned_col_major_sf=col_major, implementation=impl))
  got = f(x, token_topk_to_pos=jnp.asarray(pos), pos_to_expert=pte)
  want = ref.expand_to_fused_with_sf(x, npc, jnp.asarray(_unused_as_minus_one(pos, 10)), pte,
                                     use_tma_aligned_col_major_sf=col_major)
  assert_bitwise_equal(got, want)


@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_duplicate_positions_hold_one_candidate_row(key, impl):
  """Fused row 1 is named by tokens 0, 2 and 4, row 6 by tokens 1 and 3: each holds the row of one
  of its candidates (which one is unspecified; on a GPU the row may mix them, see the docstring)."""
  x = randn(key, (5, 64), jnp.float32)
  pos = jnp.array([[1, 0], [6, -1], [1, 2], [6, 3], [4, 1]], jnp.int32)
  pte = jnp.zeros((8,), jnp.int32)
  out = np.asarray(jax.jit(functools.partial(moe.expand_to_fused, implementation=impl))(x, pos, pte))
  xs = np.asarray(x)
  assert any((out[1] == xs[t]).all() for t in (0, 2, 4))
  assert any((out[6] == xs[t]).all() for t in (1, 3))
  for row, t in ((0, 0), (2, 2), (3, 3), (4, 4)):
    assert (out[row] == xs[t]).all()


@pytest.mark.parametrize("op", ["expand_to_fused", "expand_to_fused_with_sf"])
def test_checkify_reports_the_first_bad_slot(key, op):
  x = randn(key, (5, 64), jnp.bfloat16)
  if op == "expand_to_fused":
    f = functools.partial(moe.expand_to_fused, implementation="interpret")
  else:
    sf = jnp.ones((5, 4), jnp.float32)
    f = lambda x, pos, pte: moe.expand_to_fused_with_sf((x, sf), 16, pos, pte, implementation="interpret")
  pte = jnp.asarray(_BAD_PTE)
  msg = checkify_error(f, x, jnp.asarray(_BAD_POS), pte)
  assert f"{op}: token_topk_to_pos[1, 1] = 12 is outside {{-1}} ∪ [0, 12)" in msg
  dup = np.array([[0, 5], [1, 2], [3, 4], [6, 2], [-1, 1]], np.int32)  # row 2 at slots [1, 1] and [3, 1]
  msg = checkify_error(f, x, jnp.asarray(dup), pte)
  assert f"{op}: token_topk_to_pos[3, 1] = 2 names the fused row of the earlier slot [1, 1]" in msg
  dup[4, 0] = -5  # an out-of-range entry after the first repeat: the repeat is still the first bad slot
  assert "token_topk_to_pos[3, 1] = 2 names" in checkify_error(f, x, jnp.asarray(dup), pte)
  good = np.array([[0, 5], [1, 2], [3, 4], [6, 7], [-1, 8]], np.int32)
  assert "token_topk_to_pos[3, 0] = 6 is not -1 or a fused row" in checkify_error(f, x, jnp.asarray(good), pte)
  assert checkify_error(f, x, jnp.asarray(good), jnp.zeros_like(pte)) is None  # rows 6-8 not padding


@pytest.mark.parametrize("impl", ["interpret", "xla"])
def test_checks_add_nothing_without_checkify(impl):
  """Without checkify the check's predicate is dead code: the compiled program is the one without it."""
  args = (jax.ShapeDtypeStruct((5, 64), jnp.bfloat16), jax.ShapeDtypeStruct((5, 2), jnp.int32),
          jax.ShapeDtypeStruct((12,), jnp.int32))
  sf = jax.ShapeDtypeStruct((5, 4), jnp.float32)
  f = functools.partial(moe.expand_to_fused, implementation=impl)
  g = lambda x, sf, pos, pte: moe.expand_to_fused_with_sf((x, sf), 16, pos, pte, implementation=impl)
  assert_checks_compile_away(f, *args)
  assert_checks_compile_away(g, args[0], sf, *args[1:])


@pytest.mark.gpu
def test_checks_add_nothing_without_checkify_gpu():
  args = (jax.ShapeDtypeStruct((4001, 7168), jnp.bfloat16), jax.ShapeDtypeStruct((4001, 6), jnp.int32),
          jax.ShapeDtypeStruct((24064,), jnp.int32))
  f = functools.partial(moe.expand_to_fused, implementation="pallas")
  assert_checks_compile_away(f, *args)


@pytest.mark.gpu
def test_out_of_range_positions_gpu(key):
  """The TMA stores of slots past N are skipped on the GPU too (spec-sized rows)."""
  x = random_bits(key, (5, 7168), jnp.bfloat16)
  pte = jnp.asarray(_BAD_PTE)
  want = ref.expand_to_fused(x, jnp.asarray(_unused_as_minus_one(_BAD_POS, 12)), pte)
  assert_bitwise_equal(jax.jit(moe.expand_to_fused)(x, jnp.asarray(_BAD_POS), pte), want)


def test_bool_data_has_no_kernel():
  x = jnp.asarray(np.random.default_rng(0).random((4, 64)) < 0.5)
  pos, pte = jnp.array([[0, 3], [1, -1], [2, 4], [-1, 5]], jnp.int32), jnp.full((8,), 1, jnp.int32)
  with pytest.raises(jaxkern.KernelUnavailableError, match="bool data"):
    moe.expand_to_fused(x, pos, pte, implementation="interpret")
  want = ref.expand_to_fused(x, pos, pte)
  for impl in ("xla", "auto"):
    assert_bitwise_equal(moe.expand_to_fused(x, pos, pte, implementation=impl), want)
  with pytest.raises(jaxkern.KernelUnavailableError, match="bool data"):
    moe.expand_to_fused_with_sf((x, jnp.ones((4, 2), jnp.float32)), 32, pos, pte, implementation="pallas")


def test_list_inputs():
  x = [[float(i + j) for j in range(8)] for i in range(3)]  # float32 rows of 32 bytes
  pos, pte = [[0, 2], [1, -1], [3, 4]], [0, 0, 1, 1, 1, -1]
  want = ref.expand_to_fused(jnp.asarray(x), jnp.asarray(pos, jnp.int32), jnp.asarray(pte, jnp.int32))
  assert_bitwise_equal(moe.expand_to_fused(x, pos, pte), want)
  with pytest.raises(ValueError, match="x must be an array"):
    moe.expand_to_fused("x", pos, pte)


def test_no_retrace(key):
  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(x, sf, pos, pte):
    return moe.expand_to_fused(x, pos, pte), moe.expand_to_fused_with_sf((x, sf), 16, pos, pte)

  pte = jnp.asarray(_BAD_PTE)
  for seed in range(3):
    x = randn(jax.random.key(seed), (5, 64), jnp.bfloat16)
    pos = jnp.asarray(np.random.default_rng(seed).permutation(12)[:10].reshape(5, 2).astype(np.int32))
    f(x, jnp.ones((5, 4), jnp.float32), pos, pte)


def test_checked_mode_lowers_for_h100():
  """checkify around the kernel path (Mosaic GPU and the Pallas-Triton scale kernel) lowers for the GPU."""
  spec = jax.ShapeDtypeStruct
  pos, pte = spec((4001, 6), jnp.int32), spec((24064,), jnp.int32)
  f = lambda x, p, e: moe.expand_to_fused(x, p, e, implementation="pallas")
  g = lambda x, s, p, e: moe.expand_to_fused_with_sf((x, s), 32, p, e, use_tma_aligned_col_major_sf=True,
                                                     implementation="pallas")
  checked = lambda fn: checkify.checkify(fn, errors=checkify.user_checks)
  assert "mosaic_gpu" in lower_for_h100(checked(f), spec((4001, 576), jnp.bfloat16), pos, pte).as_text()
  text = lower_for_h100(checked(g), spec((4001, 7168), jnp.float8_e4m3fn), spec((4001, 56), jnp.int32), pos,
                        pte).as_text()
  assert "mosaic_gpu" in text and "triton" in text

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern import moe
from jaxkern.reference import moe_routing as ref
from jaxkern.testing import assert_bitwise_equal, lower_for_h100, moe_topk_idx, randn, random_bits


def _mapping(key, tokens, num_topk, experts, ranks, alignment=4):
  idx = moe_topk_idx(key, tokens, num_topk, experts, ranks)
  return idx, moe.get_fused_mapping(jnp.asarray(idx), experts, 0, alignment)


@pytest.mark.parametrize("num_topk, experts, ranks, hidden, dtype", [
    (2, 9, 8, 576, jnp.bfloat16), (6, 9, 8, 2048, jnp.float8_e4m3fn), (9, 72, 1, 320, jnp.float32)])
def test_bit_exact(key, num_topk, experts, ranks, hidden, dtype):
  k1, k2 = jax.random.split(key)
  _, m = _mapping(k1, 2 if ranks > 1 else 8, num_topk, experts, ranks)
  x = random_bits(k2, (m[3].shape[0], hidden), dtype)  # NaN payloads and -0 must survive
  out = moe.expand_to_fused(x, m[3], m[0])
  assert out.shape == (m[0].shape[0], hidden) and out.dtype == x.dtype
  assert_bitwise_equal(out, ref.expand_to_fused(x, m[3], m[0]))


def test_ragged_tokens_padding_and_empty_rows(key):
  """17 tokens (not a multiple of the token block), rows entirely -1, extra padding rows."""
  idx = np.array(jax.random.randint(key, (17, 3), -1, 5), np.int32)
  idx[[0, 7, 16]] = -1
  m = moe.get_fused_mapping(jnp.asarray(idx), 5, 64, 4)
  x = randn(key, (17, 576), jnp.bfloat16)
  out = moe.expand_to_fused(x, m[3], m[0])
  want = np.zeros((64, 576), np.float32)
  for t, k in zip(*np.nonzero(idx >= 0)):
    want[int(m[3][t, k])] = np.asarray(x[t], np.float32)
  assert_bitwise_equal(out, want.astype(jnp.bfloat16))


def test_token_block_tail():
  """T not a multiple of the token block of a wide row (block 4 at H = 7168 bf16)."""
  from jaxkern.moe.expand_to_fused import _expand_kernel
  import jaxkern

  t, k = 6, 2
  pos = jnp.asarray(np.random.default_rng(0).permutation(t * k).reshape(t, k).astype(np.int32))
  x = randn(jax.random.key(1), (t, 7168), jnp.bfloat16)
  got = _expand_kernel(x, pos, jnp.zeros((t * k,), jnp.int32), interpret=jaxkern._config.mosaic_interpret("interpret"))
  assert_bitwise_equal(got, ref.expand_to_fused(x, pos, jnp.zeros((t * k,), jnp.int32)))


def test_zero_tokens():
  out = moe.expand_to_fused(jnp.ones((0, 576), jnp.bfloat16), jnp.zeros((0, 2), jnp.int32), jnp.full((16,), -1))
  assert_bitwise_equal(out, jnp.zeros((16, 576), jnp.bfloat16))


def test_jit_and_vmap(key):
  _, m = _mapping(key, 2, 2, 9, 8)
  x = randn(key, (2, m[3].shape[0], 256), jnp.bfloat16)
  f = jax.jit(jax.vmap(moe.expand_to_fused, in_axes=(0, None, None)))
  want = jnp.stack([ref.expand_to_fused(xi, m[3], m[0]) for xi in x])
  assert_bitwise_equal(f(x, m[3], m[0]), want)


@pytest.mark.parametrize("sf_dtype, col_major, npc", [(jnp.float32, False, 128), (jnp.int32, True, 32),
                                                      (jnp.float32, True, 32)])
def test_with_sf(key, sf_dtype, col_major, npc):
  k1, k2, k3 = jax.random.split(key, 3)
  _, m = _mapping(k1, 2, 6, 9, 8)
  t, h = m[3].shape[0], 576
  blocks = -(-h // npc)
  hs = -(-blocks // 4) if sf_dtype == jnp.int32 else blocks
  x = (randn(k2, (t, h), jnp.float8_e4m3fn), random_bits(k3, (t, hs), sf_dtype))
  out, out_sf = moe.expand_to_fused_with_sf(x, npc, m[3], m[0], col_major)
  n = m[0].shape[0]
  assert out_sf.shape == ((hs, -(-n // 4) * 4) if col_major else (n, hs)) and out_sf.dtype == sf_dtype
  want = ref.expand_to_fused_with_sf(x, npc, m[3], m[0], col_major)
  assert_bitwise_equal(out, want[0])
  assert_bitwise_equal(out_sf, want[1])
  logical = out_sf[:, :n].T if col_major else out_sf
  for t_, k_ in zip(*np.nonzero(np.asarray(m[3]) >= 0)):
    assert_bitwise_equal(logical[int(m[3][t_, k_])], x[1][t_])


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
  with pytest.raises(ValueError, match="x_sf must have shape"):
    moe.expand_to_fused_with_sf((x, jnp.ones((4, 3), jnp.float32)), 128, pos, pte)
  with pytest.raises(ValueError, match="use_tma_aligned_col_major_sf"):
    moe.expand_to_fused_with_sf((x, jnp.ones((4, 1), jnp.int32)), 128, pos, pte)
  with pytest.raises(ValueError, match="x_sf must have dtype"):
    moe.expand_to_fused_with_sf((x, jnp.ones((4, 2), jnp.bfloat16)), 128, pos, pte)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("hidden", [576, 2560, 7168])
def test_lowers_for_h100(hidden, dtype):
  """Spec-sized shapes: 4001 x 9 = 36k fused rows (K = 6, 9 local experts)."""
  t, k, n = 4001, 6, 24064
  f = functools.partial(moe.expand_to_fused, implementation="pallas")
  args = (jax.ShapeDtypeStruct((t, hidden), dtype), jax.ShapeDtypeStruct((t, k), jnp.int32),
          jax.ShapeDtypeStruct((n,), jnp.int32))
  assert "mosaic_gpu" in lower_for_h100(f, *args).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [576, 2048, 7168])
@pytest.mark.parametrize("num_topk, experts, ranks", [(2, 9, 8), (6, 9, 8), (9, 32, 8), (8, 4, 64)])
def test_spec_shapes_gpu(key, num_topk, experts, ranks, hidden):
  _, m = _mapping(key, 4001, num_topk, experts, ranks)
  x = random_bits(key, (m[3].shape[0], hidden), jnp.bfloat16)
  jnp.full((m[0].shape[0], hidden), -1, jnp.int16).block_until_ready()  # poison the allocator
  assert_bitwise_equal(jax.jit(moe.expand_to_fused)(x, m[3], m[0]), ref.expand_to_fused(x, m[3], m[0]))

"""Random inputs and the shape grids of the upstream tests."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

NUM_TOKENS = (4001, 8001)
HIDDEN_SIZES = (576, 2048, 2560, 3072, 4096, 6144, 7168)


def align(n: int, alignment: int) -> int:
  """``n`` rounded up to a multiple of ``alignment``."""
  return -(-n // alignment) * alignment


def num_tokens(alignment: int = 1) -> tuple[int, ...]:
  """Upstream's token counts, rounded up to ``alignment`` (64 gives 4032 and 8064)."""
  return tuple(align(t, alignment) for t in NUM_TOKENS)


def hidden_sizes(alignment: int = 64) -> tuple[int, ...]:
  """The hidden sizes divisible by ``alignment``."""
  return tuple(h for h in HIDDEN_SIZES if h % alignment == 0)


def randn(key: jax.Array, shape: Sequence[int], dtype: jax.typing.DTypeLike = jnp.bfloat16) -> jax.Array:
  """Standard-normal values drawn in float32 and converted to ``dtype``.

  Float8 / float4 targets are clipped to their finite range first, so the
  conversion never produces NaN.
  """
  x = jax.random.normal(key, shape, jnp.float32)
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1:
    fmax = float(jnp.finfo(dtype).max)
    x = jnp.clip(x, -fmax, fmax)
  return x.astype(dtype)


def random_bits(key: jax.Array, shape: Sequence[int], dtype: jax.typing.DTypeLike) -> jax.Array:
  """Uniformly random bit patterns of ``dtype`` (NaN payloads, infinities and -0 included)."""
  dtype = jnp.dtype(dtype)
  udtype = jnp.dtype(f"uint{8 * dtype.itemsize}")
  bits = jax.random.bits(key, shape, udtype)
  return jax.lax.bitcast_convert_type(bits, dtype)


def moe_topk_idx(key: jax.Array, num_send_tokens: int, num_topk: int, num_experts: int,
                 num_ep_ranks: int) -> np.ndarray:
  """Upstream's ``generate_topk_idx``: the ``(T, K)`` int32 routing EP rank 0 receives.

  Top-``K`` of uniform bf16 scores over all ``num_experts * num_ep_ranks`` experts for
  ``num_send_tokens * num_ep_ranks`` tokens; ids of other ranks become -1 and rows left
  all -1 are dropped, so ``T`` is random. Returns a NumPy array.
  """
  scores = jax.random.uniform(key, (num_send_tokens * num_ep_ranks, num_experts * num_ep_ranks), jnp.bfloat16)
  idx = np.asarray(jax.lax.top_k(scores, num_topk)[1]).astype(np.int32)
  idx[idx >= num_experts] = -1
  return idx[(idx >= 0).any(axis=1)]

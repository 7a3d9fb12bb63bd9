"""per_token_cast of a QuantTensor with infinite and NaN input sf (docs/quant.md, "Non-finite inputs and edge
cases"): the amax is ``max|data| · sf_in`` per input block within a group, in kernel and reference alike. The
differential fuzz harness found the reference's former ``max|data · sf_in|`` giving NaN where the kernel gives
+inf (a group with a zero datum under an infinite sf; H200, 2026-11-29)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern import quant
from jaxkern.reference import quant as ref
from jaxkern.testing import assert_bitwise_equal
from jaxkern.types import QuantTensor


def _input(in_fmt, m, k, block, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.integers(0, 256, size=(m, k // 2 if in_fmt == "e2m1" else k), dtype=np.uint8)
  if in_fmt == "e4m3":
    q = np.where((q & 0x7F) == 0x7F, 0, q).astype(np.uint8).view(np.dtype(jnp.float8_e4m3fn))
  else:
    q = q.view(np.int8)
  sf = np.exp2(rng.integers(-5, 5, size=(m // block[0], k // block[1]))).astype(np.float32)
  sf.flat[::3] = np.inf
  sf.flat[1::7] = np.nan
  return QuantTensor(jnp.asarray(q), jnp.asarray(sf))


@pytest.mark.parametrize("in_fmt, block, npc", [("e2m1", (128, 128), 32), ("e4m3", (1, 32), 128),
                                                ("e2m1", (32, 32), 64)])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_kernel_matches_reference(in_fmt, block, npc, fmt):
  x = _input(in_fmt, 128, 256, block)
  got = quant.per_token_cast(x, fmt, npc, x_block_size=block)
  want = quant.per_token_cast(x, fmt, npc, x_block_size=block, implementation="reference")
  assert_bitwise_equal(got, want)


def test_infinite_sf_gives_inf_unless_the_part_is_all_zero():
  v = jnp.asarray([[0.0, 3.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], jnp.float32)
  s = jnp.full((2, 4), jnp.inf, jnp.float32)
  amax = np.asarray(ref.scaled_abs_max(v, s, (1, 4), (1, 2)))
  assert amax[0, 0] != amax[0, 0]  # the part [0, 0] of row 0 is all zero: 0 · inf = NaN, NaN-propagating
  assert np.isnan(amax[1, 0])
  amax = np.asarray(ref.scaled_abs_max(v, s, (1, 2), (1, 2)))
  assert amax[0, 0] == np.inf and np.isnan(amax[0, 1])

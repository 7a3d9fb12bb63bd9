"""The clustered FP8 grouped GEMM (``_pair_mc_kernel``, variants ``"pair192_r32"``, the default at K = 2048, and
``"pair192"``, the default above it): the pair protocol on the fused layout's skipped (-1) row blocks on the CPU (what each CTA of a
pair loads, the ring slots both CTAs walk), and on a GPU the same bits run after run on the training step's fused
layout.

Interpret mode cannot show a race; the CPU tests check the schedule the kernel computes (its own functions), the
GPU test runs the compiled kernels many times (tests/gemm/test_fp8_grouped_gemm.py checks their values in interpret
mode)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern import gemm
from jaxkern.gemm import _grouped
from jaxkern.reference import gemm as ref
from jaxkern.types import QuantTensor

# The fused layout of the v3 model's first training step (benchmarks/train_step.py v3_config: T 8192, top-4 of 8
# routed experts + the shared expert, alignment 128, force_no_sync; seed 0, as in the determinism probe of 2026-11-29,
# routed on a CPU): row blocks per expert segment, then the skipped blocks up to the upper bound of 328 blocks
# (M = 41984).
# Its pairs mix two experts five times, the last pair holds expert 8's last block and a skipped one, the one after
# two skipped blocks. The clustered kernel raced on it (H200, 2026-11-29) in tiles of row blocks 314-315 (and 322-323
# at N = 7168, K = 2048) while a slot's release to the pair came from the first warp of a warpgroup alone.
V3_SEGMENT_BLOCKS = (30, 35, 33, 35, 33, 31, 38, 26, 64)
V3_BLOCKS = 328


def fused_block_experts(segment_blocks, total_blocks):
  """Expert ``e`` on ``segment_blocks[e]`` consecutive row blocks, then -1 up to ``total_blocks``."""
  be = np.concatenate([np.full(c, e, np.int32) for e, c in enumerate(segment_blocks)])
  return np.concatenate([be, np.full(total_blocks - be.size, -1, np.int32)])


# Layouts for the CPU checks: the v3 step's; one skipped block beside an expert at either position of a pair; two
# skipped pairs inside; a skip at the end after an odd expert; no skip.
LAYOUTS = {
    "v3_step": fused_block_experts(V3_SEGMENT_BLOCKS, V3_BLOCKS),
    "skip_second": np.array([0, 0, 1, -1, 2, 2], np.int32),
    "skip_first": np.array([0, 0, -1, 1, 2, 2], np.int32),
    "both_skipped_inside": np.array([0, 1, -1, -1, 1, 1, -1, -1, 2, 2], np.int32),
    "skip_at_end": np.array([0, 0, 0, 1, 1, -1, -1, -1], np.int32),
    "all_skipped": np.full(6, -1, np.int32),
    "uniform": np.repeat(np.arange(4, dtype=np.int32), 4),
}


def pair_codes(be, g):
  """Per pair p (row blocks 2p, 2p + 1): the load codes of its two CTAs, as the kernel computes them."""
  own, peer = be.reshape(-1, 2), be.reshape(-1, 2)[:, ::-1]
  return np.asarray(_grouped.pair_load_code(jnp.asarray(own), jnp.asarray(peer), g))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pair_load_codes_agree(layout):
  """Both CTAs of a pair load or both skip (so their ring slot counters stay equal), multicast together and only on
  one expert's weights, and each loads its own expert's tile, or its peer's where its own block is skipped."""
  be = LAYOUTS[layout]
  g = max(int(be.max()) + 1, 1)
  codes = pair_codes(be, g)
  own = be.reshape(-1, 2)
  np.testing.assert_array_equal(codes[:, 0] < 0, codes[:, 1] < 0)
  np.testing.assert_array_equal(codes[:, 0] >= g, codes[:, 1] >= g)
  np.testing.assert_array_equal(codes[:, 0] < 0, (own < 0).all(axis=1))
  shared = codes[:, 0] >= g
  np.testing.assert_array_equal(shared, (own[:, 0] == own[:, 1]) & (own[:, 0] >= 0))
  loaded = np.where(codes >= 0, codes % g, -1)
  np.testing.assert_array_equal(loaded, np.where(own >= 0, own, own[:, ::-1]))


def test_pair_load_code_exhaustive():
  g = 3
  for own in range(-1, g):
    for peer in range(-1, g):
      a, b = (int(_grouped.pair_load_code(jnp.int32(x), jnp.int32(y), g)) for x, y in ((own, peer), (peer, own)))
      assert (a < 0) == (b < 0) == (own < 0 and peer < 0)
      assert (a >= g) == (b >= g) == (own == peer >= 0)


def ring_walk(be, g, n_tiles, units_per_group, clusters):
  """Per cluster and CTA: the (row block, column tile, slot of the first K step, loaded expert) of every unit that
  loads, in the order the kernel walks them (each unit of ``ks`` steps advances the slot counter by ``ks``)."""
  codes = pair_codes(be, g)
  units = codes.shape[0] * n_tiles
  ks = 3
  walks = {}
  for c in range(clusters):
    for cta in range(2):
      t, walk = 0, []
      for u in range(c, units, clusters):
        pair, j = (int(v) for v in _grouped.pair_unit(u, units_per_group, n_tiles))
        code = codes[pair, cta]
        if code >= 0:
          walk.append((2 * pair + cta, j, t, int(code) >= g))
          t += ks
      walks[c, cta] = walk
  return walks


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("clusters, row_group", [(1, 16), (3, 4), (66, 16), (66, 32)])
def test_pair_rings_stay_in_step(layout, clusters, row_group):
  """The two CTAs of a cluster fill the same ring slots at the same step counts, unit by unit, and multicast the
  same units (a multicast half lands in the peer's slot of the same index), and every (row block, column tile) is
  walked once."""
  be = LAYOUTS[layout]
  g = max(int(be.max()) + 1, 1)
  n_tiles = 5
  gp = _grouped.row_unit_group(be.size // 2, row_group, 2)
  walks = ring_walk(be, g, n_tiles, gp, clusters)
  for c in range(clusters):
    a, b = walks[c, 0], walks[c, 1]
    assert [(j, t, mc) for _, j, t, mc in a] == [(j, t, mc) for _, j, t, mc in b]
    assert all(mb == ma + 1 for (ma, *_), (mb, *_) in zip(a, b))
  seen = sorted((mi, j) for w in walks.values() for mi, j, *_ in w)
  want = sorted((mi, j) for mi in range(be.size) for j in range(n_tiles)
                if be[mi] >= 0 or be[mi ^ 1] >= 0)  # a block loads where it or its peer computes
  assert seen == want


def test_pair_unit_covers_every_tile_once():
  for pairs, gp, n_tiles in [(164, 4, 22), (164, 4, 38), (128, 8, 22), (3, 3, 2)]:
    got = sorted(tuple(int(v) for v in _grouped.pair_unit(u, gp, n_tiles)) for u in range(pairs * n_tiles))
    assert got == [(p, j) for p in range(pairs) for j in range(n_tiles)]


def random_fp8_inputs(key, g, m, n, k):
  """Random e4m3 data with per-token and per-block scales (generated on the device: the GPU-sized case)."""
  k1, k2, k3, k4 = jax.random.split(key, 4)
  xq = jnp.clip(jax.random.normal(k1, (m, k)) * 100, -448, 448).astype(jnp.float8_e4m3fn)
  xs = jax.random.uniform(k2, (m, k // 128), minval=2 ** -8, maxval=2 ** -6)
  wq = jnp.clip(jax.random.normal(k3, (g, n, k)) * 100, -448, 448).astype(jnp.float8_e4m3fn)
  ws = jax.random.uniform(k4, (g, n // 128, k // 128), minval=2 ** -8, maxval=2 ** -6)
  return QuantTensor(xq, xs), QuantTensor(wq, ws)


def compiled_variant(variant, x, w, be):
  """``fp8_grouped_gemm`` with ``variant`` forced, compiled once."""
  old = _grouped.VARIANT
  _grouped.VARIANT = variant
  try:
    return jax.jit(functools.partial(gemm.fp8_grouped_gemm, implementation="pallas")).lower(x, w, be).compile()
  finally:
    _grouped.VARIANT = old


@jax.jit
def differing(a, b):
  return jnp.sum(jax.lax.bitcast_convert_type(a, jnp.uint16) != jax.lax.bitcast_convert_type(b, jnp.uint16))


RUNS = 24


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["pair192", "pair192_r32"])
@pytest.mark.parametrize("n, k", [(4096, 7168), (7168, 2048)])
def test_pair_kernels_deterministic_on_fused_layout(key, variant, n, k):
  """The v3 step's fused layout (skipped blocks at the end, one pair of an expert and a skipped block, pairs of two
  experts) at its gate-up and down GEMM shapes: one executable run RUNS times gives the same bits every run, the same
  bits as ``"wide192"`` (no clusters; same numerics), and the reference's values on the last 16 row blocks."""
  g = len(V3_SEGMENT_BLOCKS)
  be = jnp.asarray(fused_block_experts(V3_SEGMENT_BLOCKS, V3_BLOCKS))
  m = V3_BLOCKS * 128
  x, w = random_fp8_inputs(key, g, m, n, k)
  run = compiled_variant(variant, x, w, be)
  first = run(x, w, be)
  counts = [int(differing(run(x, w, be), first)) for _ in range(RUNS - 1)]
  assert counts == [0] * len(counts), f"elements differing from the first run, per run: {counts}"
  wide = compiled_variant("wide192", x, w, be)(x, w, be)
  assert int(differing(first, wide)) == 0
  tail = slice(m - 16 * 128, m)
  want = ref.fp8_grouped_gemm(QuantTensor(x.data[tail], x.sf[tail]), w, be[-16:], out_dtype=jnp.float32)
  got = np.asarray(first[tail], np.float64)
  want = np.asarray(want, np.float64)
  scale = np.max(np.abs(want))
  np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=1e-3 * scale)
  np.testing.assert_array_equal(got[-3 * 128:], 0)  # the skipped blocks

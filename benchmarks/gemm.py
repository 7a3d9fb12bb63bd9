"""fp8_grouped_gemm at the DeepSeek-V3 expert shapes of issue 24 (../shared/notes/fp8_grouped_gemm.md).

A: 8 experts x 4096 rows, K=7168 N=4096 (gate+up); B: the same rows, K=2048 N=7168 (down); C / D: 32 experts,
65,536 routed rows skewed 384-7168 per expert (each segment padded to 128 rows), gate+up / down.
FLOPs = 2·M·N·K over all padded rows (``Case.flops``: the runner reports TF/s). Bytes: x, its float32 sf,
w, its sf, block_expert read once, the bf16 output written once.

The timed XLA baseline (``reference``) is ``jax.lax.ragged_dot`` in bf16 on the dequantised inputs (what a JAX
user has today; the jnp oracle loops over row blocks in float32 and is far slower); the check is a relative
bound against it (1%: bf16 rounding of the dequantised inputs and of the output), the GPU test bounds the kernel
against the float32 product of the dequantised inputs (≤ 0.5%).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.registry import BenchOp, Case, register
from jaxkern import gemm
from jaxkern.types import QuantTensor


def skewed_counts(num_experts=32, total=65536, lo=384, hi=7168, seed=6):
  """Deterministic per-expert routed row counts in [lo, hi] summing to ``total`` (seed 6: 384-6471 rows, padded
  to 128 per expert M = 67,584 as in the notes)."""
  rng = np.random.default_rng(seed)
  w = rng.lognormal(0.0, 1.0, num_experts)
  c = np.clip(np.round(w / w.sum() * total), lo, hi).astype(np.int64)
  while c.sum() != total:  # move the rounding difference onto experts that stay in range
    i = rng.integers(num_experts)
    step = np.sign(total - c.sum())
    if lo <= c[i] + step <= hi:
      c[i] += step
  return c


SHAPES = {  # name: (segment rows per expert (padded to 128), N, K)
    "A": ([4096] * 8, 4096, 7168),
    "B": ([4096] * 8, 7168, 2048),
    "C": ([-(-int(c) // 128) * 128 for c in skewed_counts()], 4096, 7168),
    "D": ([-(-int(c) // 128) * 128 for c in skewed_counts()], 7168, 2048),
}


def make_inputs(key, rows, n, k, skip_blocks=0):
  """Random e4m3 data with scales in [2^-8, 2^-6): ``(x, w, block_expert, group_sizes)``; ``skip_blocks``
  trailing -1 blocks (zero rows, the upper bound of ``get_fused_mapping(force_no_sync)``)."""
  g, m = len(rows), sum(rows) + 128 * skip_blocks
  k1, k2, k3, k4 = jax.random.split(key, 4)
  xq = jnp.clip(jax.random.normal(k1, (m, k)) * 100, -448, 448).astype(jnp.float8_e4m3fn)
  xs = jax.random.uniform(k2, (m, k // 128), minval=2 ** -8, maxval=2 ** -6)
  wq = jnp.clip(jax.random.normal(k3, (g, n, k)) * 100, -448, 448).astype(jnp.float8_e4m3fn)
  ws = jax.random.uniform(k4, (g, n // 128, k // 128), minval=2 ** -8, maxval=2 ** -6)
  be = np.concatenate([np.full(r // 128, e, np.int32) for e, r in enumerate(rows)]
                      + [np.full(skip_blocks, -1, np.int32)])
  sizes = np.asarray(rows, np.int32)
  sizes[-1] += 128 * skip_blocks  # ragged_dot needs every row in a group: the skipped rows join the last one
  return QuantTensor(xq, xs), QuantTensor(wq, ws), jnp.asarray(be), jnp.asarray(sizes)


def dequantize_bf16(x, w):
  xd = (x.data.astype(jnp.float32) * jnp.repeat(x.sf, 128, axis=1)).astype(jnp.bfloat16)
  wd = (w.data.astype(jnp.float32) * jnp.repeat(jnp.repeat(w.sf, 128, axis=1), 128, axis=2)).astype(jnp.bfloat16)
  return xd, wd


@jax.jit
def ragged_dot_bf16(xd, wd, group_sizes):
  """``jax.lax.ragged_dot`` in bf16 (``wd`` ``(G, N, K)`` transposed to ``(G, K, N)``), bf16 out."""
  return jax.lax.ragged_dot(xd, jnp.swapaxes(wd, 1, 2), group_sizes=group_sizes,
                            preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def _case(name, rows, n, k):
  g, m = len(rows), sum(rows)
  nbytes = m * k + m * (k // 128) * 4 + g * n * k + g * (n // 128) * (k // 128) * 4 + (m // 128) * 4 + m * n * 2
  return Case(f"{name} G={g} M={m} N={n} K={k}", lambda key: make_inputs(key, rows, n, k), nbytes,
              flops=2 * m * n * k)


def _fn(x, w, be, sizes, implementation=None):
  del sizes
  return gemm.fp8_grouped_gemm(x, w, be, implementation=implementation)


def _reference(x, w, be, sizes, implementation=None):
  del be, implementation
  return ragged_dot_bf16(*dequantize_bf16(x, w), sizes)


def _check(out, expected):
  out, expected = np.asarray(out, np.float32), np.asarray(expected, np.float32)
  err = np.max(np.abs(out - expected)) / max(np.max(np.abs(expected)), 1e-30)
  assert err <= 1e-2, f"max relative difference to bf16 ragged_dot {err:.3g} > 1%"


register(BenchOp(
    "fp8_grouped_gemm", _fn, _reference,
    lambda: [_case(name, *SHAPES[name]) for name in "ABCD"],
    lambda: [_case("small", [128, 128], 128, 256)], check=_check))

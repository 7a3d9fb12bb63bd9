"""fp8_grouped_gemm and its two backward GEMMs at the DeepSeek-V3 expert shapes
(docs/gemm.md, "Kernels and performance").

A: 8 experts x 4096 rows, K=7168 N=4096 (gate+up); B: the same rows, K=2048 N=7168 (down); C / D: 32 experts,
65,536 routed rows skewed 384-7168 per expert (each segment padded to 128 rows), gate+up / down.
FLOPs = 2·M·N·K over all padded rows (``Case.flops``: the runner reports TF/s). Bytes: x, its float32 sf,
w, its sf, block_expert read once, the bf16 output written once.

The backward GEMMs of each shape (same FLOPs): ``fp8_grouped_gemm_input_grad`` ``dx = dy · w[e]`` (the op transposes
the e4m3 weights to ``(G, K, N)`` before the forward kernel), ``fp8_grouped_gemm_input_grad:kn`` the same product
from weights stored ``(G, K, N)`` (``fp8_grouped_gemm`` on them: what ``fp8_grouped_linear(weight_layout="kn")``, the
MoE layer's, runs; no transpose), and ``fp8_grouped_gemm_weight_grad`` ``dw[e] = dy_eᵀ · x_e`` (bf16 out, as for bf16 weights).

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


def _shape_case(name, rows, n, k, make, nbytes):
  """The Case of shape ``name`` (FLOPs ``2·M·N·K``) whose inputs are ``make(key, rows, n, k)``."""
  g, m = len(rows), sum(rows)
  return Case(f"{name} G={g} M={m} N={n} K={k}", lambda key: make(key, rows, n, k), nbytes, flops=2 * m * n * k)


def _weight_bytes(g, n, k):
  return g * n * k + g * (n // 128) * (k // 128) * 4


def _case(name, rows, n, k):
  g, m = len(rows), sum(rows)
  nbytes = m * k + m * (k // 128) * 4 + _weight_bytes(g, n, k) + (m // 128) * 4 + m * n * 2
  return _shape_case(name, rows, n, k, make_inputs, nbytes)


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


def make_grad_inputs(key, rows, n, k):
  """The input gradient's ``(dy, w, block_expert, group_sizes)``: ``dy`` ``(M, N)`` e4m3 with per-token 1x128 scales
  along N, ``w`` as :func:`make_inputs`."""
  _, w, be, sizes = make_inputs(key, rows, n, k)
  k1, k2 = jax.random.split(jax.random.fold_in(key, 1))
  m = sum(rows)
  dyq = jnp.clip(jax.random.normal(k1, (m, n)) * 100, -448, 448).astype(jnp.float8_e4m3fn)
  dys = jax.random.uniform(k2, (m, n // 128), minval=2 ** -8, maxval=2 ** -6)
  return QuantTensor(dyq, dys), w, be, sizes


def make_wgrad_inputs(key, rows, n, k):
  """The weight gradient's ``(dy_t, x_t, block_expert, group_sizes)``: ``dy_t`` ``(N, M)`` and ``x_t`` ``(K, M)`` e4m3
  with one scale per column and 128-row block (``(M/128, N)`` / ``(M/128, K)``)."""
  m = sum(rows)
  k1, k2, k3, k4 = jax.random.split(key, 4)
  dyt = jnp.clip(jax.random.normal(k1, (n, m)) * 100, -448, 448).astype(jnp.float8_e4m3fn)
  xt = jnp.clip(jax.random.normal(k2, (k, m)) * 100, -448, 448).astype(jnp.float8_e4m3fn)
  sdy = jax.random.uniform(k3, (m // 128, n), minval=2 ** -8, maxval=2 ** -6)
  sx = jax.random.uniform(k4, (m // 128, k), minval=2 ** -8, maxval=2 ** -6)
  be = np.concatenate([np.full(r // 128, e, np.int32) for e, r in enumerate(rows)])
  return QuantTensor(dyt, sdy), QuantTensor(xt, sx), jnp.asarray(be), jnp.asarray(rows, jnp.int32)


def _input_grad_nbytes(rows, n, k):
  g, m = len(rows), sum(rows)
  return m * n + m * (n // 128) * 4 + _weight_bytes(g, n, k) + (m // 128) * 4 + m * k * 2


def _input_grad_case(name, rows, n, k, make=None):
  return _shape_case(name, rows, n, k, make or make_grad_inputs, _input_grad_nbytes(rows, n, k))


def _input_grad(dy, w, be, sizes, implementation=None):
  del sizes
  return gemm.fp8_grouped_gemm_input_grad(dy, w, be, implementation=implementation)


def _input_grad_reference(dy, w, be, sizes, implementation=None):
  """``ragged_dot`` bf16 of the dequantised ``dy (M, N)`` and ``w (G, N, K)`` (the contraction runs over N)."""
  del be, implementation
  dyd, wd = dequantize_bf16(dy, w)
  return jax.lax.ragged_dot(dyd, wd, group_sizes=sizes, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def _swap_nk(w):
  """``(G, N, K)`` weights with ``(G, N/128, K/128)`` sf <-> ``(G, K, N)`` with ``(G, K/128, N/128)``."""
  return QuantTensor(jnp.swapaxes(w.data, 1, 2), jnp.swapaxes(w.sf, 1, 2))


def make_kn_grad_inputs(key, rows, n, k):
  """:func:`make_grad_inputs` with the weights stored ``(G, K, N)``."""
  dy, w, be, sizes = make_grad_inputs(key, rows, n, k)
  return dy, _swap_nk(w), be, sizes


def _kn_input_grad_reference(dy, w_kn, be, sizes, implementation=None):
  return _input_grad_reference(dy, _swap_nk(w_kn), be, sizes, implementation)


def _wgrad_case(name, rows, n, k):
  g, m = len(rows), sum(rows)
  nbytes = n * m + m * k + (m // 128) * (n + k) * 4 + (m // 128) * 4 + g * n * k * 2
  return _shape_case(name, rows, n, k, make_wgrad_inputs, nbytes)


def _wgrad(dy_t, x_t, be, sizes, implementation=None):
  return gemm.fp8_grouped_gemm_weight_grad(dy_t, x_t, be, num_experts=sizes.shape[0], out_dtype=jnp.bfloat16,
                                           implementation=implementation)


_WGRAD_DIMS = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
                                                rhs_group_dimensions=[])


def _wgrad_reference(dy_t, x_t, be, sizes, implementation=None):
  """``ragged_dot_general`` bf16 over each expert's rows (the ragged contraction) of the dequantised ``dy`` and ``x``."""
  del be, implementation

  def dequant(q):  # (C, M) e4m3, sf (M/128, C) -> (M, C) bf16
    return (q.data.astype(jnp.float32).T * jnp.repeat(q.sf, 128, axis=0)).astype(jnp.bfloat16)

  out = jax.lax.ragged_dot_general(dequant(dy_t), dequant(x_t), sizes, _WGRAD_DIMS,
                                   preferred_element_type=jnp.float32)
  return out.astype(jnp.bfloat16)


register(BenchOp(
    "fp8_grouped_gemm_input_grad", _input_grad, _input_grad_reference,
    lambda: [_input_grad_case(name, *SHAPES[name]) for name in "ABCD"],
    lambda: [_input_grad_case("small", [128, 128], 256, 128)], check=_check))

register(BenchOp(
    "fp8_grouped_gemm_input_grad:kn", _fn, _kn_input_grad_reference,  # the forward op on (G, K, N) weights
    lambda: [_input_grad_case(name, *SHAPES[name], make=make_kn_grad_inputs) for name in "ABCD"],
    lambda: [_input_grad_case("small", [128, 128], 256, 128, make=make_kn_grad_inputs)], check=_check))

register(BenchOp(
    "fp8_grouped_gemm_weight_grad", _wgrad, _wgrad_reference,
    lambda: [_wgrad_case(name, *SHAPES[name]) for name in "ABCD"],
    lambda: [_wgrad_case("small", [128, 256], 128, 256)], check=_check))

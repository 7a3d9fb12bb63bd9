"""transpose / batched_transpose on upstream's benchmark shapes."""

import itertools

import jax.numpy as jnp

from benchmarks.registry import BenchOp, Case, register
from jaxkern import reference, transpose
from jaxkern.testing import hidden_sizes, num_tokens, randn

_DTYPES = {"e4m3": jnp.float8_e4m3fn, "bf16": jnp.bfloat16, "fp32": jnp.float32}


def _case(shape, dtype_name):
  dtype = _DTYPES[dtype_name]
  nbytes = 2 * jnp.dtype(dtype).itemsize
  for d in shape:
    nbytes *= d
  label = " ".join(f"{a}={d}" for a, d in zip("BMN"[3 - len(shape):], shape)) + f" {dtype_name}"
  return Case(label, lambda key: (randn(key, shape, dtype),), nbytes)


def _transpose_cases():
  return [_case((m, n), d) for d, m, n in itertools.product(("e4m3", "bf16"), num_tokens(64), hidden_sizes(64))]


def _batched_cases():
  return [_case((b, m, n), d)
          for d, b, m, n in itertools.product(("e4m3", "bf16", "fp32"), (8, 32), num_tokens(64), hidden_sizes(64))]


register(BenchOp(
    "transpose", transpose.transpose, reference.transpose.transpose, _transpose_cases,
    lambda: [_case((192, 320), "bf16"), _case((128, 64), "e4m3")]))
register(BenchOp(
    "batched_transpose", transpose.batched_transpose, reference.transpose.batched_transpose, _batched_cases,
    lambda: [_case((2, 64, 192), "fp32")]))

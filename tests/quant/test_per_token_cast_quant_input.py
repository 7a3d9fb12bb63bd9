"""per_token_cast of a QuantTensor (already quantised data and its sf, re-cast; quant.md §4.3, §5.1)."""

import functools

import jax
import jax.numpy as jnp
import pytest

from jaxkern import quant
from jaxkern.quant._per_token_cast import _quant_plan
from jaxkern.reference import quant as ref
from jaxkern.testing import assert_bitwise_equal, lower_for_h100

FLAGS = {"A": (False, False, False), "A-round": (False, True, False), "B": (True, False, False),
         "C": (True, True, True)}


def _quant_input(key, m, k, in_fmt, x_block, x_flags):
  """The reference cast of a bf16 input whose rows spread over 2^±8, and the input sf flag."""
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, (m, k)) * jnp.exp2(jax.random.randint(k2, (m, 1), -8, 8).astype(jnp.float32))
  col, round_sf, packed = FLAGS[x_flags]
  q = ref.cast(x.astype(jnp.bfloat16), in_fmt, x_block, round_sf=round_sf, use_tma_aligned_col_major_sf=col,
               use_packed_ue8m0=packed)
  return q, col and not packed


@pytest.mark.parametrize("m, k, in_fmt, x_block, x_flags, npc, fmt, flags", [
    (100, 576, "e4m3", (128, 128), "C", 128, "e4m3", "C"),  # partial groups, input and output blocks
    (70, 256, "e2m1", (32, 32), "A-round", 32, "e2m1", "A"),  # block rows cross tiles (two sf rows)
    (70, 256, "e4m3", (32, 32), "B", 128, "e2m1", "B"),  # a group spans 4 input blocks; e4m3 pairs
    (130, 384, "e2m1", (1, 32), "A-round", 64, "e4m3", "A-round"),  # per-row input sf; e4m3 pairs out
    (130, 576, "e2m1", (32, 32), "C", 128, "e4m3", "C"),
    (160, 320, "e4m3", (128, 128), "A", 16, "e4m3", "B"),  # non-power-of-two input sf
])
def test_bit_exact(key, m, k, in_fmt, x_block, x_flags, npc, fmt, flags):
  q, x_col = _quant_input(key, m, k, in_fmt, x_block, x_flags)
  assert _quant_plan(q[0], x_block, npc, fmt) is not None  # the kernel runs
  f = functools.partial(quant.per_token_cast, q, fmt, npc, x_block, *FLAGS[flags], x_use_tma_aligned_col_major_sf=x_col)
  (out, sf), (want, want_sf) = f(), f(implementation="reference")
  assert_bitwise_equal(out, want)
  assert_bitwise_equal(sf, want_sf)


def test_few_rows_and_zero_tokens(key):
  """Fewer rows than one register layout block run the reference; 0 rows give empty outputs."""
  q, _ = _quant_input(key, 5, 256, "e2m1", (32, 32), "C")
  assert _quant_plan(q[0], (32, 32), 32, "e4m3") is None
  got = quant.per_token_cast(q, "e4m3", 32, (32, 32), True, True, True)
  want = quant.per_token_cast(q, "e4m3", 32, (32, 32), True, True, True, implementation="reference")
  for a, b in zip(got, want):
    assert_bitwise_equal(a, b)
  q0 = (jnp.zeros((0, 576), jnp.float8_e4m3fn), jnp.zeros((0, 5), jnp.float32))
  out, sf = quant.per_token_cast(q0, "e2m1", 128, (128, 128))
  assert out.shape == (0, 288) and out.dtype == jnp.int8 and sf.shape == (0, 5)


@pytest.mark.parametrize("m, k", [(4001, 576), (8001, 7168)])
@pytest.mark.parametrize("in_fmt, x_block, npc, fmt", [
    ("e4m3", (128, 128), 128, "e4m3"), ("e4m3", (32, 32), 32, "e2m1"), ("e2m1", (32, 32), 128, "e4m3"),
    ("e2m1", (128, 128), 32, "e2m1"),
])
def test_lowers_for_h100(m, k, in_fmt, x_block, npc, fmt):
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  q = jax.eval_shape(lambda x: ref.cast(x, in_fmt, x_block, round_sf=True, use_tma_aligned_col_major_sf=True,
                                        use_packed_ue8m0=True), x)
  f = lambda d, s: quant.per_token_cast((d, s), fmt, npc, x_block, True, True, True, implementation="pallas")
  text = lower_for_h100(f, *q).as_text()
  assert "mosaic_gpu" in text and "stablehlo.transpose" not in text


@pytest.mark.gpu
@pytest.mark.parametrize("m, k", [(4001, 7168), (8001, 576)])
@pytest.mark.parametrize("in_fmt, x_block, npc, fmt", [
    ("e4m3", (128, 128), 128, "e4m3"), ("e4m3", (32, 32), 32, "e2m1"), ("e2m1", (32, 32), 128, "e4m3"),
    ("e2m1", (128, 128), 32, "e2m1"),
])
def test_spec_shapes_gpu(key, m, k, in_fmt, x_block, npc, fmt):
  """The GPU kernel against the reference run by XLA on the GPU, layout C and layout A outputs.

  Same backend on purpose: rows spread over 2^±8 leave all-zero e2m1 groups inside input blocks with
  sf >= 4, where ``sfv_in · sf_inv`` overflows (e2m1 output: sf_inv = 2^126) and ``0 · inf`` is NaN,
  encoded by its sign (+6, as upstream's kernel writes); x86 makes that NaN negative (-6)."""
  q, _ = _quant_input(key, m, k, in_fmt, x_block, "C")
  for flags in ("C", "A-round"):
    f = lambda d, s, **kw: quant.per_token_cast((d, s), fmt, npc, x_block, *FLAGS[flags], **kw)
    got = jax.jit(f)(*q)
    want = jax.jit(functools.partial(f, implementation="reference"))(*q)
    for a, b in zip(got, want):
      assert_bitwise_equal(a, b)

"""per_token_cast of a QuantTensor (already quantised data and its sf, re-cast; docs/quant.md, Casts)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkern
from jaxkern import quant
from jaxkern.quant._per_token_cast import _quant_plan
from jaxkern.reference import quant as ref
from jaxkern.testing import assert_bitwise_equal, lower_for_h100
from jaxkern.types import QuantTensor

FLAGS = {"A": {}, "A-round": dict(round_sf=True), "B": dict(use_tma_aligned_col_major_sf=True),
         "C": dict(use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True)}


def assert_same(got, want):
  chex.assert_trees_all_equal_structs(got, want)
  jax.tree.map(assert_bitwise_equal, got, want)


def _quant_input(key, m, k, in_fmt, x_block, x_flags):
  """The reference cast of a bf16 input whose rows spread over 2^±8, and the input sf flag."""
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, (m, k)) * jnp.exp2(jax.random.randint(k2, (m, 1), -8, 8).astype(jnp.float32))
  q = ref.cast(x.astype(jnp.bfloat16), in_fmt, x_block, **FLAGS[x_flags])
  return QuantTensor(*q), x_flags == "B"


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
  assert not isinstance(_quant_plan(q.data, x_block, npc, fmt), str)  # the kernel runs
  kw = dict(x_block_size=x_block, **FLAGS[flags], x_use_tma_aligned_col_major_sf=x_col)
  assert_same(quant.per_token_cast(q, fmt, npc, **kw), ref.per_token_cast(q, fmt, npc, **kw))


def test_few_rows_and_zero_tokens(key):
  """Fewer rows than one register layout block: no kernel plan ('interpret' raises, 'xla' / 'auto' run
  the reference); 0 rows give empty outputs."""
  q, _ = _quant_input(key, 5, 256, "e2m1", (32, 32), "C")
  assert "fewer than one register layout block" in _quant_plan(q.data, (32, 32), 32, "e4m3")
  kw = dict(x_block_size=(32, 32), **FLAGS["C"])
  with pytest.raises(jaxkern.KernelUnavailableError, match="5 rows, fewer than one register layout block"):
    quant.per_token_cast(q, "e4m3", 32, **kw, implementation="interpret")
  want = ref.per_token_cast(q, "e4m3", 32, **kw)
  for impl in ("xla", "auto"):
    assert_same(quant.per_token_cast(q, "e4m3", 32, **kw, implementation=impl), want)
  q0 = (jnp.zeros((0, 576), jnp.float8_e4m3fn), jnp.zeros((0, 5), jnp.float32))
  out, sf = quant.per_token_cast(q0, "e2m1", 128, x_block_size=(128, 128))
  assert out.shape == (0, 288) and out.dtype == jnp.int8 and sf.shape == (0, 5)


def test_groups_straddling_input_blocks_unsupported(key):
  """Groups of 64 columns over input blocks 96 wide: no kernel plan."""
  q, _ = _quant_input(key, 64, 192, "e4m3", (1, 96), "A")
  with pytest.raises(jaxkern.KernelUnavailableError, match="straddle input blocks"):
    quant.per_token_cast(q, "e4m3", 64, x_block_size=(1, 96), implementation="interpret")
  for impl in ("xla", "auto"):
    assert_same(quant.per_token_cast(q, "e4m3", 64, x_block_size=(1, 96), implementation=impl),
                ref.per_token_cast(q, "e4m3", 64, x_block_size=(1, 96)))


@pytest.mark.parametrize("fmt, flags", [("e4m3", "A"), ("e2m1", "C")])
def test_nan_data_bit_exact(key, fmt, flags):
  """e4m3 NaN bytes (0x7F, 0xFF) in the input data: the groups holding them get sf NaN (-0.0 with
  round_sf) and +NaN data, the same bits from kernel and reference."""
  q, _ = _quant_input(key, 64, 256, "e4m3", (32, 32), "A-round")
  b = np.array(q.data).view(np.uint8)
  b[0, 3], b[1, 200], b[2, 0] = 0x7F, 0xFF, 0x00
  q = QuantTensor(jnp.asarray(b.view(jnp.float8_e4m3fn)), q.sf)
  kw = dict(x_block_size=(32, 32), **FLAGS[flags])
  got = quant.per_token_cast(q, fmt, 32, **kw)
  assert_same(got, ref.per_token_cast(q, fmt, 32, **kw))
  if flags == "A":
    assert np.asarray(got.sf)[0, 0].view(np.uint32) == ref.CANONICAL_NAN


def test_bad_quant_inputs(key):
  q, _ = _quant_input(key, 64, 256, "e4m3", (32, 32), "A")
  with pytest.raises(ValueError, match="x_block_size must be a pair"):
    quant.per_token_cast(q, "e4m3", 32)
  with pytest.raises(ValueError, match="QuantTensor input"):
    quant.per_token_cast(q, "e4m3", 256, x_block_size=(32, 32))
  with pytest.raises(ValueError, match="even logical width"):
    quant.per_token_cast((q.data[:, :255], q.sf), "e2m1", 32, x_block_size=(32, 32))
  with pytest.raises(ValueError, match=r"x\[1\] must have dtype"):
    quant.per_token_cast((q.data, q.sf.astype(jnp.bool_)), "e4m3", 32, x_block_size=(32, 32))
  with pytest.raises(ValueError, match="tuple of 3"):
    quant.per_token_cast((q.data, q.sf, q.sf), "e4m3", 32, x_block_size=(32, 32))


@pytest.mark.parametrize("m, k", [(4001, 576), (8001, 7168)])
@pytest.mark.parametrize("in_fmt, x_block, npc, fmt", [
    ("e4m3", (128, 128), 128, "e4m3"), ("e4m3", (32, 32), 32, "e2m1"), ("e2m1", (32, 32), 128, "e4m3"),
    ("e2m1", (128, 128), 32, "e2m1"),
])
def test_lowers_for_h100(m, k, in_fmt, x_block, npc, fmt):
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  q = jax.eval_shape(lambda x: ref.cast(x, in_fmt, x_block, round_sf=True, use_tma_aligned_col_major_sf=True,
                                        use_packed_ue8m0=True), x)
  f = lambda d, s: quant.per_token_cast((d, s), fmt, npc, x_block_size=x_block, **FLAGS["C"], implementation="pallas")
  text = lower_for_h100(f, *q).as_text()
  assert "mosaic_gpu" in text and "stablehlo.transpose" not in text


@pytest.mark.gpu
@pytest.mark.parametrize("m, k", [(4001, 7168), (8001, 576)])
@pytest.mark.parametrize("in_fmt, x_block, npc, fmt", [
    ("e4m3", (128, 128), 128, "e4m3"), ("e4m3", (32, 32), 32, "e2m1"), ("e2m1", (32, 32), 128, "e4m3"),
    ("e2m1", (128, 128), 32, "e2m1"),
])
def test_spec_shapes_gpu(key, m, k, in_fmt, x_block, npc, fmt):
  """The GPU kernel against the reference run by XLA on the GPU and on the host CPU, layout C and layout A
  outputs.

  Rows spread over 2^±8 leave all-zero e2m1 groups inside input blocks with sf >= 4, where
  ``sfv_in · sf_inv`` overflows (e2m1 output: sf_inv = 2^126) and ``0 · inf`` is NaN, encoded as +6 (the
  GPU's canonical NaN, as upstream's kernel writes); the reference makes x86's negative NaN canonical too."""
  q, _ = _quant_input(key, m, k, in_fmt, x_block, "C")
  for flags in ("C", "A-round"):
    got = jax.jit(lambda q: quant.per_token_cast(q, fmt, npc, x_block_size=x_block, **FLAGS[flags]))(q)
    assert_same(got, jax.jit(lambda q: ref.per_token_cast(q, fmt, npc, x_block_size=x_block, **FLAGS[flags]))(q))
    cpu = jax.devices("cpu")[0]
    assert_same(got, jax.jit(lambda q: ref.per_token_cast(q, fmt, npc, x_block_size=x_block, **FLAGS[flags]))(
        jax.device_put(q, cpu)))

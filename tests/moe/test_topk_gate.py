import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import jaxkern
from jaxkern.moe import topk_gate
from jaxkern.reference import moe as ref
from jaxkern.testing import assert_bitwise_equal, lower_for_h100, num_tokens
from tests.moe.gating import tricky_rows

# (E, K) of upstream's test.
SPEC_EK = [(72, 6), (32, 6), (64, 6), (96, 6), (16, 6), (36, 6), (108, 6), (128, 6), (144, 6), (256, 8)]


def _scores(key, t, e):
  return jax.random.normal(key, (t, e), jnp.float32)


@pytest.mark.parametrize("t, e, k", [(200, 72, 6), (64, 36, 6), (10, 16, 6), (130, 256, 8), (70, 384, 9),
                                     (65, 288, 1), (3, 8, 8)])
def test_matches_reference(key, t, e, k):
  x = _scores(key, t, e)
  assert_bitwise_equal(topk_gate(x, k), ref.topk_gate(x, k))


def test_ties_go_to_the_smaller_index(key):
  x = jnp.round(_scores(key, 100, 40) * 2) / 2  # few distinct values
  x = x.at[:7].set(1.0).at[7, ::3].set(-jnp.inf)
  y = topk_gate(x, 40)
  assert_bitwise_equal(y, ref.topk_gate(x, 40))
  np.testing.assert_array_equal(y[0], np.arange(40))


@settings(max_examples=8, deadline=None)
@given(tricky_rows((70, 40)))
def test_tricky_values(x):
  x = jnp.asarray(x)
  y = np.asarray(topk_gate(x, 5))
  assert_bitwise_equal(y, ref.topk_gate(x, 5))
  assert all(len(set(r)) == 5 for r in y)  # never a repeated expert (docs/moe.md, "`topk_gate`")


def test_all_minus_inf_rows_give_distinct_indices():
  y = topk_gate(jnp.full((64, 16), -jnp.inf, jnp.float32), 6)
  np.testing.assert_array_equal(y, np.tile(np.arange(6), (64, 1)))


def test_zero_tokens():
  x = jnp.zeros((0, 72), jnp.float32)
  y = topk_gate(x, 6)
  assert y.shape == (0, 6) and y.dtype == jnp.int32
  (d,) = jaxkern.explain(lambda x: topk_gate(x, 6, implementation="interpret"), x)
  assert d.path == "xla"


def test_list_input_and_xla_path(key):
  x = _scores(key, 70, 16)
  assert_bitwise_equal(topk_gate(x.tolist(), 5), ref.topk_gate(x, 5))
  assert_bitwise_equal(topk_gate(x, 5, implementation="xla"), ref.topk_gate(x, 5))


def test_no_retrace(key):
  # JAX imports its Mosaic GPU interpreter on the first interpreted kernel, adding a config value to
  # jit's trace context (one retrace per process): warm up first.
  jax.block_until_ready(topk_gate(_scores(key, 64, 32), 4))
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(x):
    return topk_gate(x, 4)

  for i in range(3):
    f(_scores(jax.random.fold_in(key, i), 64, 32))


def test_jit_and_vmap(key):
  x = _scores(key, 3 * 64, 32).reshape(3, 64, 32)
  want = ref.topk_gate(x.reshape(-1, 32), 4).reshape(3, 64, 4)
  assert_bitwise_equal(jax.jit(jax.vmap(functools.partial(topk_gate, num_topk=4)))(x), want)
  assert_bitwise_equal(jax.jit(topk_gate, static_argnums=1)(x[0], 4), want[0])


@pytest.mark.parametrize("bad, k, match", [
    (jnp.ones((4, 8), jnp.bfloat16), 2, "scores must have dtype"),
    (jnp.ones((8,), jnp.float32), 2, "scores must have rank 2"),
    (jnp.ones((4, 8), jnp.float32), 9, "num_topk"),
    (jnp.ones((4, 8), jnp.float32), 0, "num_topk"),
    (jnp.ones((4, 8), bool), 2, "scores must have dtype"),
    ((1.0, 2.0), 1, "scores must be an array"),
])
def test_bad_input(bad, k, match):
  with pytest.raises(ValueError, match=match):
    topk_gate(bad, k)


@pytest.mark.parametrize("e, k", SPEC_EK + [(288, 8), (384, 8)])
def test_lowers_for_h100(e, k):
  f = functools.partial(topk_gate, num_topk=k, implementation="pallas")
  assert "mosaic_gpu" in lower_for_h100(f, jax.ShapeDtypeStruct((8001, e), jnp.float32)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("e, k", SPEC_EK)
@pytest.mark.parametrize("t", num_tokens())
def test_spec_shapes_gpu(key, t, e, k):
  x = _scores(key, t, e)
  assert_bitwise_equal(jax.jit(topk_gate, static_argnums=1)(x, k), ref.topk_gate(x, k))


@pytest.mark.parametrize("variant", [("narrow", 4), ("narrow", 8), ("narrow", 16), ("wgmma", None)], ids=str)
@pytest.mark.parametrize("t, e, k", [(37, 96, 6), (9, 112, 6), (20, 108, 6), (130, 256, 8)])
def test_kernel_variants_match_reference(key, monkeypatch, variant, t, e, k):
  """Both kernels for many experts, forced: fewer rows than one CTA (padded), the last CTA moved back
  (37 = 2x16 + 5 rows at 8 lanes per row), padded columns (108), ties."""
  from jaxkern.moe import _topk_gate as tg
  monkeypatch.setattr(tg, "_VARIANT_OVERRIDE", variant)
  x = _scores(key, t, e)
  x = x.at[:, 3].set(x[:, e - 1])  # a tie per row: the smaller index first
  assert_bitwise_equal(topk_gate(x, k), ref.topk_gate(x, k))


def test_variant_choice():
  from jaxkern.moe import _topk_gate as tg
  assert tg._variant(32) == ("wgmma", None) and tg._variant(72) == ("narrow", tg.LANES_PER_ROW)
  assert tg._variant(tg.NARROW_MIN_EXPERTS) == ("narrow", tg.LANES_PER_ROW)


@pytest.mark.parametrize("lanes", [4, 8, 16])
@pytest.mark.parametrize("e, k", [(36, 6), (72, 6), (96, 6), (108, 6), (144, 6), (256, 8)])
def test_narrow_kernel_lowers_for_h100(monkeypatch, lanes, e, k):
  from jaxkern.moe import _topk_gate as tg
  monkeypatch.setattr(tg, "_VARIANT_OVERRIDE", ("narrow", lanes))
  f = functools.partial(topk_gate, num_topk=k, implementation="pallas")
  assert "mosaic_gpu" in lower_for_h100(f, jax.ShapeDtypeStruct((4001, e), jnp.float32)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [("narrow", 4), ("narrow", 8), ("narrow", 16), ("wgmma", None)], ids=str)
@pytest.mark.parametrize("t, e, k", [(4001, 96, 6), (8001, 108, 6), (4001, 144, 6), (8001, 256, 8), (5, 128, 6)])
def test_kernel_variants_gpu(key, monkeypatch, variant, t, e, k):
  from jaxkern.moe import _topk_gate as tg
  monkeypatch.setattr(tg, "_VARIANT_OVERRIDE", variant)
  x = _scores(key, t, e)
  x = x.at[::3, 7].set(x[::3, 1])  # ties
  assert_bitwise_equal(jax.jit(lambda x: topk_gate(x, k))(x), ref.topk_gate(x, k))

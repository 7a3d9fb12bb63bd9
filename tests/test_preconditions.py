"""Preconditions on argument values (docs/usage.md, "Bad values under jit"): a concrete array that breaks one
raises ValueError naming the argument; a traced one is reported under checkify's user checks, naming the op, the
argument and the first bad entry, and the check adds nothing to a program that is not checkified.

Small shapes and the reference / XLA paths: the checks sit in the wrappers, before any kernel."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from jaxkern import _checks, engram, gemm, modeling, moe, quant
from jaxkern.modeling.moe import MoeParams
from jaxkern.moe import _routing
from jaxkern.reference import quant as ref_quant
from tests.moe.routing_checks import compiled_program

REF = "reference"


def checkify_error(f, *args) -> str | None:
  """The message of the first failed user check of ``jax.jit(checkify(f))(*args)``, or None."""
  err, _ = jax.jit(checkify.checkify(f, errors=checkify.user_checks))(*args)
  return err.get()


def assert_reported(f, bad, good, expected: str) -> None:
  """``f`` traced: ``bad`` is reported with ``expected`` in the message, ``good`` is not."""
  msg = checkify_error(f, *bad)
  assert msg is not None and expected in msg, msg
  assert checkify_error(f, *good) is None


# --- fp8 grouped GEMMs: block_expert in {-1} ∪ [0, G) ---------------------------------------------------------

def _fp8(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).uniform(-2, 2, shape), jnp.float8_e4m3fn)


def _gemm_args():
  x = (_fp8((256, 128)), jnp.ones((256, 1), jnp.float32))
  w = (_fp8((2, 128, 128), 1), jnp.ones((2, 1, 1), jnp.float32))
  return x, w


def test_fp8_grouped_gemm_block_expert():
  x, w = _gemm_args()
  with pytest.raises(ValueError, match=r"block_expert entries must be -1 \(skip\) or expert ids in \[0, 2\)"):
    gemm.fp8_grouped_gemm(x, w, jnp.array([0, 2], jnp.int32), implementation=REF)
  f = lambda be: gemm.fp8_grouped_gemm(x, w, be, implementation=REF)
  assert_reported(f, (jnp.array([0, 2], jnp.int32),), (jnp.array([1, -1], jnp.int32),),
                  "fp8_grouped_gemm: block_expert[1] = 2 is not -1 (skip) or an expert id in [0, 2)")
  g = lambda be: gemm.fp8_grouped_gemm_input_grad(x, w, be, implementation=REF)
  assert "block_expert[0] = -3" in checkify_error(g, jnp.array([-3, 0], jnp.int32))
  # without checkify the bad block is skipped, as -1
  out = jax.jit(f)(jnp.array([0, 2], jnp.int32))
  assert (out == jax.jit(f)(jnp.array([0, -1], jnp.int32))).all() and not out[128:].any()


def test_fp8_grouped_gemm_weight_grad_block_expert():
  t = (_fp8((128, 256)), jnp.ones((2, 128), jnp.float32))
  f = lambda be: gemm.fp8_grouped_gemm_weight_grad(t, t, be, num_experts=2, implementation=REF)
  with pytest.raises(ValueError, match=r"block_expert entries must be -1 \(skip\) or expert ids in \[0, 2\)"):
    f(jnp.array([5, 0], jnp.int32))
  assert_reported(f, (jnp.array([5, 0], jnp.int32),), (jnp.array([1, 0], jnp.int32),),
                  "fp8_grouped_gemm_weight_grad: block_expert[0] = 5 is not -1 (skip) or an expert id in [0, 2)")


def test_fp8_grouped_linear_block_expert_through_its_custom_vjp():
  x = jnp.ones((256, 128), jnp.bfloat16)
  w = jnp.ones((2, 128, 128), jnp.bfloat16)
  f = lambda be: modeling.fp8_grouped_linear(x, w, be, implementation=REF)
  with pytest.raises(ValueError, match="block_expert"):
    f(jnp.array([0, 9], jnp.int32))
  assert_reported(f, (jnp.array([0, 9], jnp.int32),), (jnp.array([0, 1], jnp.int32),), "block_expert[1] = 9")


# --- routing helpers: ids in {-1} ∪ [0, E) ---------------------------------------------------------------------

_BAD_IDS = np.array([[0, 1], [2, 9], [1, -1]], np.int32)
_GOOD_IDS = np.array([[0, 1], [2, 3], [1, -1]], np.int32)


@pytest.mark.parametrize("op, name, call", [
    ("get_fused_mapping", "topk_idx", lambda i: moe.get_fused_mapping(i, 4, 32, 4, implementation="xla")),
    ("aux_fi", "topk_idx", lambda i: moe.aux_fi(i, 4, 2)),
    ("group_count", "group_idx", lambda i: moe.group_count(i, 4)),
])
def test_routing_ids(op, name, call):
  with pytest.raises(ValueError, match=rf"{name} must hold -1 or values in \[0, 4\)"):
    call(jnp.asarray(_BAD_IDS))
  assert_reported(call, (jnp.asarray(_BAD_IDS),), (jnp.asarray(_GOOD_IDS),),
                  f"{op}: {name}[1, 1] = 9 is not -1 or ")


def test_get_fused_mapping_rows():
  f = lambda i: moe.get_fused_mapping(i, 4, 8, 4, implementation="xla")
  with pytest.raises(ValueError, match="num_expanded_tokens=8 is below the 16 rows"):
    f(jnp.asarray(_GOOD_IDS))
  msg = checkify_error(f, jnp.asarray(_GOOD_IDS))
  assert "get_fused_mapping: num_expanded_tokens = 8 is below the 16 rows" in msg, msg
  assert checkify_error(f, jnp.asarray([[0, 1], [-1, -1], [1, -1]], jnp.int32)) is None


def test_mask_indices_by_tp():
  f = lambda i: moe.mask_indices_by_tp(i, 8, 4, 1, 2, implementation="xla")
  with pytest.raises(ValueError, match=r"indices must hold a negative value \(unused\) or an expert id in \[0, 8\)"):
    f(jnp.array([[0, 8]], jnp.int32))
  assert_reported(f, (jnp.array([[-5, 3], [7, 8]], jnp.int32),), (jnp.array([[-5, 3], [7, 0]], jnp.int32),),
                  "mask_indices_by_tp: indices[1, 1] = 8 is not a negative value (unused) or an expert id in [0, 8)")


def test_traced_tp_rank():
  f = lambda r: moe.mask_indices_by_tp(jnp.array([[0, 5]], jnp.int32), 8, 4, r, 2, implementation="xla")
  assert_reported(f, (jnp.int32(2),), (jnp.int32(1),), "mask_indices_by_tp: tp_rank = 2 is not a TP rank in [0, 2)")
  logits = jnp.zeros((4, 8), jnp.float32)
  g = lambda r: moe.top2_sum_gate(logits, jnp.zeros((8,), jnp.float32), 2, scoring_func="sigmoid", tp_rank=r,
                                  num_tp_ranks=2, implementation=REF)
  assert_reported(g, (jnp.int32(-1),), (jnp.int32(0),), "top2_sum_gate: tp_rank = -1 is not a TP rank in [0, 2)")


def test_expand_to_fused_names_each_row_once():
  x = jnp.ones((3, 64), jnp.float32)
  pte = jnp.zeros((8,), jnp.int32)
  pos = jnp.array([[0, 5], [1, 2], [3, 2]], jnp.int32)
  with pytest.raises(ValueError, match=r"token_topk_to_pos\[2, 1\] = 2 repeats the row of slot \[1, 1\]"):
    moe.expand_to_fused(x, pos, pte, implementation=REF)
  with pytest.raises(ValueError, match="token_topk_to_pos must name each fused row at most once"):
    moe.expand_to_fused_with_sf((x, jnp.ones((3, 1), jnp.float32)), 64, pos, pte, implementation=REF)
  moe.reduce_fused(jnp.ones((8, 256), jnp.float32), None, pos, implementation=REF)  # a sum: repeats allowed
  f = lambda p: moe.expand_to_fused(x, p, pte, implementation=REF)
  assert "names the fused row of the earlier slot [1, 1]" in checkify_error(f, pos)


_PADDED_PTE = np.array([0, 0, 0, 1, 1, -1, -1, -1], np.int32)  # rows 5, 6, 7: padding
_NAMES_PADDING = np.array([[0, 1], [2, 6], [3, -1]], np.int32)  # slot [1, 1] names padding row 6
_NAMES_NO_PADDING = np.array([[0, 1], [2, 4], [3, -1]], np.int32)


@pytest.mark.parametrize("op", ["expand_to_fused", "expand_to_fused_with_sf"])
def test_expand_to_fused_named_padding_row(op):
  """A slot naming a row that pos_to_expert marks as padding: the kernel stores zeros and the token's row there."""
  x = jnp.ones((3, 64), jnp.float32)
  if op == "expand_to_fused":
    call = lambda pos, pte: moe.expand_to_fused(x, pos, pte, implementation=REF)
  else:
    call = lambda pos, pte: moe.expand_to_fused_with_sf((x, jnp.ones((3, 1), jnp.float32)), 64, pos, pte,
                                                        implementation=REF)
  pte = jnp.asarray(_PADDED_PTE)
  with pytest.raises(ValueError, match=r"token_topk_to_pos must hold -1 or a fused row that pos_to_expert does not "
                                       r"mark as padding .*; token_topk_to_pos\[1, 1\] = 6 is not"):
    call(jnp.asarray(_NAMES_PADDING), pte)
  call(jnp.asarray(_NAMES_NO_PADDING), pte)
  assert_reported(call, (jnp.asarray(_NAMES_PADDING), pte), (jnp.asarray(_NAMES_NO_PADDING), pte),
                  f"{op}: token_topk_to_pos[1, 1] = 6 is not -1 or a fused row that pos_to_expert does not mark")
  assert_reported(lambda pos: call(pos, pte), (jnp.asarray(_NAMES_PADDING),), (jnp.asarray(_NAMES_NO_PADDING),),
                  f"{op}: token_topk_to_pos[1, 1] = 6 is not")
  # a concrete mapping with a traced pos_to_expert: the named padding row is reported
  names_padding = jnp.asarray(_NAMES_PADDING)  # made outside the trace: concrete inside it
  assert_reported(lambda p: call(names_padding, p), (pte,), (jnp.asarray(_PADDED_PTE).at[6].set(1),),
                  f"{op}: pos_to_expert[6] = -1 is not an expert id (>= 0) for a fused row that token_topk_to_pos names")


# --- top2_sum_gate's replica table, router NaNs -----------------------------------------------------------------

def _gate(logits, count, table):
  return moe.top2_sum_gate(logits, jnp.zeros((8,), jnp.float32), 2, scoring_func="sigmoid",
                           to_physical_map=table, logical_count=count, implementation=REF)


def test_top2_sum_gate_logical_count():
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.float32)
  table = jnp.asarray(np.arange(16).reshape(8, 2) % 9, jnp.int32)
  good, bad = np.ones(8, np.int32), np.ones(8, np.int32)
  good[3], bad[3] = 2, 3
  with pytest.raises(ValueError,
                     match=r"logical_count must hold a replica count in \[1, 2\] .*; logical_count\[3\] = 3"):
    _gate(logits, jnp.asarray(bad), table)
  with pytest.raises(ValueError, match=r"logical_count\[0\] = 0"):
    _gate(logits, jnp.zeros((8,), jnp.int32), table)
  f = lambda c: _gate(logits, c, table)
  assert_reported(f, (jnp.asarray(bad),), (jnp.asarray(good),),
                  "top2_sum_gate: logical_count[3] = 3 is not a replica count in [1, 2]")


@pytest.mark.parametrize("op", ["topk_gate", "topk_sum_and_topk_group_idx"])
def test_nan_scores(op):
  scores = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
  scores[0, 0] = -np.inf  # ±inf rank as values: not reported
  good = scores.copy()
  scores[2, 5] = np.nan
  if op == "topk_gate":
    f = lambda s: moe.topk_gate(s, 2, implementation=REF)
    where = "scores[2, 5]"
  else:
    f = lambda s: moe.topk_sum_and_topk_group_idx(s.reshape(4, 4, 2), 2, 2, implementation=REF)
    where = "scores[2, 2, 1]"
  assert_reported(f, (jnp.asarray(scores),), (jnp.asarray(good),), f"{op}: {where} = nan is not a number")
  f(jnp.asarray(scores))  # concrete: the documented result (NaN ranks as -inf), no error


def test_top2_sum_gate_non_finite_logits_reported():
  logits = jnp.asarray(np.random.default_rng(2).standard_normal((4, 8)), jnp.float32)
  f = lambda lg: moe.top2_sum_gate(lg, jnp.zeros((8,), jnp.float32), 2, scoring_func="sigmoid", implementation=REF)
  assert_reported(f, (logits.at[1, 3].set(jnp.inf),), (logits,), "logits[1, 3] = inf is not finite")
  g = lambda b: moe.top2_sum_gate(logits, b, 2, scoring_func="sigmoid", implementation=REF)
  assert_reported(g, (jnp.zeros((8,), jnp.float32).at[6].set(jnp.nan),), (jnp.zeros((8,), jnp.float32),),
                  "top2_sum_gate: bias[6] = nan is not finite")


def test_per_block_cast_lossless_power_of_two_sf():
  x = quant.per_block_cast(jnp.ones((32, 64), jnp.float32), "e2m1", (32, 32), round_sf=True, implementation=REF)
  bad = x.sf.at[0, 1].set(3.0)
  f = lambda s: quant.per_block_cast_lossless((x.data, s), "e4m3", (32, 32), (32, 64), implementation=REF)
  with pytest.raises(ValueError, match=r"x.sf must hold a positive power of two .*; x.sf\[0, 1\] = 3.0"):
    f(bad)
  assert_reported(f, (bad,), (x.sf,), "per_block_cast_lossless: x.sf[0, 1] = 3.0 is not a positive power of two")


def _lossless_input():
  """e2m1 data of ones with 32x32-block sf 0.25 (exponent byte 125), four blocks in a row."""
  return quant.per_block_cast(jnp.ones((32, 128), jnp.float32), "e2m1", (32, 32), round_sf=True, implementation=REF)


@pytest.mark.parametrize("layout", ["A", "B", "C"])
def test_per_block_cast_lossless_sf_spread(layout):
  """Within a (32, 128) output block every sf at least 2^-11 times the largest: 2^-13 next to 0.25 passes,
  2^-14 does not (its exponent byte 113 is below Eout - 5 = 119 - 5)."""
  x = _lossless_input()
  bad, edge = x.sf.at[0, 1].set(2.0**-14), x.sf.at[0, 1].set(2.0**-13)
  col, packed = layout != "A", layout == "C"
  fmt = lambda s: ref_quant.format_sf(s, col, packed)
  f = lambda s: quant.per_block_cast_lossless((x.data, s), "e4m3", (32, 32), (32, 128), implementation=REF,
                                              x_use_tma_aligned_col_major_sf=layout == "B")
  name, where = {"A": ("x.sf", "x.sf[0, 1]"), "B": ("x.sf", "x.sf[1, 0]"),
                 "C": ("x.sf decoded to layout A", "x.sf decoded to layout A[0, 1]")}[layout]
  with pytest.raises(ValueError, match=rf"{name} must hold a scale at least 2\^-11 times the largest of its output "
                     rf"block.*; {re.escape(where)} = 6.1035\d*e-05 is not"):
    f(fmt(bad))
  f(fmt(edge))
  assert_reported(f, (fmt(bad),), (fmt(edge),),
                  f"per_block_cast_lossless: {where} = 6.103515625e-05 is not a scale at least 2^-11 times")


def test_per_block_cast_lossless_sf_spread_per_output_block():
  """The spread counts within an output block only; below 2^-121 for the largest (Eout = 0) any spread passes."""
  x = _lossless_input()
  f = lambda s, out: quant.per_block_cast_lossless((x.data, s), "e4m3", (32, 32), out, implementation=REF)
  spread = jnp.asarray([[0.25, 0.25, 2.0**-14, 2.0**-14]], jnp.float32)
  f(spread, (32, 64))  # blocks {0, 1} and {2, 3}: each uniform
  with pytest.raises(ValueError, match=r"x.sf\[0, 2\] = 6.1035"):
    f(spread, (32, 128))
  f(jnp.asarray([[2.0**-122, 2.0**-126, 2.0**-126, 2.0**-126]], jnp.float32), (32, 128))


# --- precomputed scales, hash table sizes, expert group sizes ------------------------------------------------

@pytest.mark.parametrize("bad", [0.0, np.inf, np.nan])
def test_precomputed_sf(bad):
  x = jnp.ones((4, 64), jnp.float32)
  sf = np.ones((4, 2), np.float32)
  sf[2, 1] = bad
  f = lambda s: quant.per_token_cast_with_precomputed_sf(x, "e4m3", 32, s, implementation=REF)
  with pytest.raises(ValueError, match=rf"sf must hold a finite non-zero scale .*; sf\[2, 1\] = {bad}"):
    f(jnp.asarray(sf))
  assert_reported(f, (jnp.asarray(sf),), (jnp.ones((4, 2), jnp.float32),),
                  f"per_token_cast_with_precomputed_sf: sf[2, 1] = {bad} is not a finite non-zero scale")
  xb = jnp.ones((32, 64), jnp.float32)
  g = lambda s: quant.per_block_cast_with_precomputed_sf(xb, "e4m3", (32, 32), s, implementation=REF)
  sb = np.ones((1, 2), np.float32)
  sb[0, 1] = bad
  with pytest.raises(ValueError, match=r"sf\[0, 1\]"):
    g(jnp.asarray(sb))
  assert "per_block_cast_with_precomputed_sf: sf[0, 1]" in checkify_error(g, jnp.asarray(sb))


def test_engram_hash_vocab_sizes():
  ids = jnp.zeros((4, 3), jnp.int32)
  mult = np.ones((2, 3), np.int64)
  sizes = np.full((2, 2, 4), 7, np.int32)
  offsets = jnp.zeros((2, 8), jnp.int32)
  good = sizes.copy()
  sizes[1, 0, 2] = 0
  f = lambda s: engram.engram_hash(ids, mult, s, offsets)
  with pytest.raises(ValueError, match=r"vocab_sizes must hold a table size >= 1 .*; vocab_sizes\[1, 0, 2\] = 0"):
    f(jnp.asarray(sizes))
  assert_reported(f, (jnp.asarray(sizes),), (jnp.asarray(good),),
                  "engram_hash: vocab_sizes[1, 0, 2] = 0 is not a table size >= 1")


def test_swiglu_pos_to_token_topk():
  x = jnp.ones((4, 256), jnp.float32)
  w = jnp.ones((2, 2), jnp.float32)
  bad, good = jnp.array([0, 4, -1, 3], jnp.int32), jnp.array([0, 2, -1, 3], jnp.int32)
  f = lambda p: quant.swiglu_forward_and_per_token_cast(x, "e4m3", 128, p, w, implementation=REF)
  with pytest.raises(ValueError,
                     match=r"pos_to_token_topk must hold a negative value \(padding\) or a slot in \[0, 4\)"):
    f(bad)
  assert_reported(f, (bad,), (good,), "swiglu_forward_and_per_token_cast: pos_to_token_topk[1] = 4 is not")
  q = quant.per_token_cast(x, "e4m3", 128, implementation=REF)
  g = lambda p: quant.swiglu_backward_and_per_token_cast(q, jnp.ones((4, 128), jnp.bfloat16), w, p,
                                                         jnp.zeros((2, 2), jnp.int32), 128, implementation=REF)
  with pytest.raises(ValueError, match=r"pos_to_token_topk\[1\] = 4"):
    g(bad)
  assert_reported(g, (bad,), (good,), "swiglu_backward_and_per_token_cast: pos_to_token_topk[1] = 4 is not")


@pytest.mark.parametrize("gate", [-100.0, -87.0, np.nan, np.inf])
def test_swiglu_backward_gate_range(gate):
  """The dequantised gate half must be finite and above -87 (the exact division's domain); -86.5 passes."""
  e, h = 4, 128
  w, pos = jnp.ones((e, 1), jnp.float32), jnp.arange(e, dtype=jnp.int32)

  def inputs(value):
    v = np.ones((e, 2 * h), np.float32)
    v[2, 7] = value if np.isfinite(value) else 1.0
    q = quant.per_token_cast(jnp.asarray(v), "e4m3", 128, implementation=REF)
    return q.data, q.sf if np.isfinite(value) else q.sf.at[2, 0].set(value)  # non-finite: through the scale

  f = lambda d, s: quant.swiglu_backward_and_per_token_cast((d, s), jnp.ones((e, h), jnp.bfloat16), w, pos,
                                                            pos.reshape(e, 1), 128, implementation=REF)
  col = 7 if np.isfinite(gate) else 0
  with pytest.raises(ValueError, match=rf"dequantised x must hold a finite gate value > -87 .*; "
                                       rf"dequantised x\[2, {col}\] = {gate} is not"):
    f(*inputs(gate))
  f(*inputs(-86.5))
  assert_reported(f, inputs(gate), inputs(-86.5), f"swiglu_backward_and_per_token_cast: dequantised x[2, {col}] = "
                  f"{gate} is not a finite gate value > -87")


def _expert_params(groups=3, h=128, i=128):
  z = jnp.zeros((groups, h, i), jnp.bfloat16)
  return MoeParams(jnp.zeros((h, groups), jnp.float32), jnp.zeros((groups,), jnp.float32), z, z,
                   jnp.zeros((groups, i, h), jnp.bfloat16))


@pytest.mark.parametrize("sizes, raised, reported", [
    ([256, -128, 256], r"group_sizes must hold a row count >= 0; group_sizes\[1\] = -128",
     "swiglu_experts: group_sizes[1] = -128 is not a row count >= 0"),
    ([128, 0, 0], r"group_sizes must sum to N = xf.shape\[0\] = 384, got 128",
     "swiglu_experts: group_sizes must sum to N = xf.shape[0] = 384, got 128"),
])
def test_swiglu_experts_group_sizes(sizes, raised, reported):
  xf = jnp.zeros((384, 128), jnp.bfloat16)
  params = _expert_params()
  f = lambda s: modeling.swiglu_experts(xf, params, s)
  with pytest.raises(ValueError, match=raised):
    f(jnp.asarray(sizes, jnp.int32))
  assert_reported(f, (jnp.asarray(sizes, jnp.int32),), (jnp.asarray([128, 0, 256], jnp.int32),), reported)


def test_swiglu_experts_aligned_segments_for_fp8_gemm():
  xf = jnp.zeros((384, 128), jnp.bfloat16)
  f = lambda s: modeling.swiglu_experts(xf, _expert_params(), s, fp8_gemm=True, implementation=REF)
  with pytest.raises(ValueError, match=r"group_sizes must hold a multiple of 128 .*; group_sizes\[0\] = 100"):
    f(jnp.asarray([100, 284, 0], jnp.int32))
  msg = checkify_error(f, jnp.asarray([100, 284, 0], jnp.int32))
  assert msg is not None and "swiglu_experts: group_sizes[0] = 100 is not a multiple of 128" in msg, msg


# --- the checks cost nothing without checkify -----------------------------------------------------------------

def test_value_checks_compile_away(monkeypatch):
  """Without checkify the checks' predicates are dead code: the compiled programs are those without them."""
  cases = [
      (lambda be: gemm.fp8_grouped_gemm(*_gemm_args(), be, implementation="xla"),
       jax.ShapeDtypeStruct((2,), jnp.int32)),
      (lambda s: moe.topk_gate(s, 2, implementation="xla"), jax.ShapeDtypeStruct((16, 8), jnp.float32)),
      (lambda i: moe.mask_indices_by_tp(i, 8, 4, 1, 2, implementation="xla"),
       jax.ShapeDtypeStruct((5, 2), jnp.int32)),
      (lambda p, e: moe.expand_to_fused(jnp.ones((3, 64), jnp.float32), p, e, implementation="xla"),
       jax.ShapeDtypeStruct((3, 2), jnp.int32), jax.ShapeDtypeStruct((8,), jnp.int32)),
      (lambda s: quant.per_block_cast_lossless((jnp.zeros((32, 64), jnp.int8), s), "e4m3", (32, 32), (32, 128),
                                               implementation="xla"),
       jax.ShapeDtypeStruct((1, 4), jnp.float32)),
      (lambda d, s: quant.swiglu_backward_and_per_token_cast(
          (d, s), jnp.ones((4, 128), jnp.bfloat16), jnp.ones((4, 1), jnp.float32), jnp.arange(4, dtype=jnp.int32),
          jnp.zeros((4, 1), jnp.int32), 128, implementation="xla"),
       jax.ShapeDtypeStruct((4, 256), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((4, 2), jnp.float32)),
  ]
  checked = [compiled_program(f, *a) for f, *a in cases]
  monkeypatch.setattr(_checks, "debug_check_entries", lambda *args: None)
  monkeypatch.setattr(_routing, "debug_check_positions", lambda *args: None)
  assert [compiled_program(f, *a) for f, *a in cases] == checked


def test_concrete_checks_skip_traced_and_debug_checks_skip_concrete():
  bad = jnp.array([5], jnp.int32)
  _checks.debug_check_entries("op", "x", bad, lambda v: v > 1, "small")  # concrete: nothing to report here
  jax.jit(functools.partial(_checks.check_entries, "x", bad=lambda v: v > 1, requirement="small"))(bad)

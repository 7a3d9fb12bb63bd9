import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

import jaxkern
from jaxkern import _checks
from jaxkern.moe import _top2_sum_gate, top2_sum_gate
from jaxkern.reference import moe as ref
from jaxkern.testing import assert_bitwise_equal, lower_for_h100
from jaxkern.types import TopkRouting, TopkRoutingWithUnmapped
from tests.moe.gating import tricky_rows

FUNCS = ["sigmoid", "sqrtsoftplus", "softmax"]


def _inputs(key, t, e):
  k1, k2 = jax.random.split(key)
  return jax.random.normal(k1, (t, e), jnp.float32), jax.random.normal(k2, (e,), jnp.float32)


def _identity_map(e, s, x=32):
  return jnp.broadcast_to(jnp.arange(e + s, dtype=jnp.int32)[:, None], (e + s, x + 1)), jnp.ones((e + s,), jnp.int32)


def _gate(logits, bias, *, k=6, ntg=0, g=0, s=0, rsf=1.5, ep_rank=0, ep=4, tp_rank=1, tp=2, func="sigmoid",
          mask=None, fix=None, pmap=None, count=None, unmapped=None, implementation=None):
  return top2_sum_gate(logits, bias, k, scoring_func=func, num_topk_groups=ntg, num_groups=g,
                       use_shared_as_routed=s > 0, num_shared_experts=s, routed_scaling_factor=rsf, ep_rank=ep_rank,
                       num_ep_ranks=ep, tp_rank=tp_rank, num_tp_ranks=tp, mask=mask, fix_routing_mask=fix,
                       to_physical_map=pmap, logical_count=count, unmapped_topk_idx=unmapped,
                       implementation=implementation)


def _check(got, want):
  """Same NamedTuple type and fields, bit for bit."""
  assert type(got) is type(want), (type(got), type(want))
  chex.assert_trees_all_equal_structs(got, want)
  jax.tree.map(assert_bitwise_equal, got, want)


# (num_groups, num_topk_groups, E, S, K) from the upstream grid, E scaled down where large; 144 has
# two 128-column blocks in the softmax sum (the second one partial), 40 / 4 groups pads each group.
CONFIGS = [(0, 0, 72, 1, 6), (0, 0, 36, 2, 6), (8, 8, 64, 2, 8), (8, 4, 64, 2, 8), (4, 2, 40, 0, 4),
           (0, 0, 144, 0, 6)]


@pytest.mark.parametrize("cfg, func", [(c, FUNCS[i % 3]) for i, c in enumerate(CONFIGS)], ids=str)
def test_matches_reference(key, cfg, func):
  g, ntg, e, s, k = cfg
  t = 80
  logits, bias = _inputs(key, t, e)
  logits = logits.at[-10:].set(jnp.nan)  # masked rows may hold anything
  mask = jnp.arange(t) < t - 10
  pmap, count = _identity_map(e, s) if s else (None, None)
  kw = dict(k=k, ntg=ntg, g=g, s=s, func=func, mask=mask, pmap=pmap, count=count,
            unmapped=jnp.zeros((t, k), jnp.int32))
  got = _gate(logits, bias, **kw)
  _check(got, _gate(logits, bias, implementation="reference", **kw))
  assert isinstance(got, TopkRoutingWithUnmapped)
  idx, w, unmapped = np.asarray(got.topk_idx), np.asarray(got.topk_weights), np.asarray(got.unmapped_topk_idx)
  assert (idx[-10:] == -1).all() and (w[-10:] == 0).all() and (unmapped[-10:] == -1).all()
  assert all(len(set(r)) == k for r in unmapped[:-10])


def test_fixed_routing_and_replicas(key):
  t, e, s, k, x = 70, 36, 2, 6, 5
  keys = jax.random.split(key, 5)
  logits, bias = _inputs(keys[0], t, e)
  pmap = jax.random.randint(keys[1], (e + s, x + 1), 0, e + x, jnp.int32)
  count = jax.random.randint(keys[2], (e + s,), 1, x + 2, jnp.int32)
  fix = jax.random.bernoulli(keys[3], 0.5, (t,))
  unmapped = jax.random.randint(keys[4], (t, k), 0, e, jnp.int32)
  for func in FUNCS:
    kw = dict(k=k, s=s, func=func, pmap=pmap, count=count, fix=fix, unmapped=unmapped, ep_rank=3, tp_rank=0)
    got = _gate(logits, bias, **kw)
    _check(got, _gate(logits, bias, implementation="reference", **kw))
  np.testing.assert_array_equal(np.asarray(got.unmapped_topk_idx)[np.asarray(fix)],
                                np.asarray(unmapped)[np.asarray(fix)])
  # The hash, by hand: row 5, slot 0, no TP split.
  idx = _gate(logits, bias, **{**kw, "tp": 1}).topk_idx  # one TP rank: ids stay global
  l = int(got.unmapped_topk_idx[5, 0])
  assert int(idx[5, 0]) == int(pmap[l, (5 * 23333 + 3) % int(count[l])])


@pytest.mark.parametrize("tp_rank", [0, 1, 2])
def test_ep_tp_masking(key, tp_rank):
  logits, bias = _inputs(key, 64, 32)
  got = _gate(logits, bias, k=8, ep=8, tp=4, tp_rank=tp_rank)
  assert isinstance(got, TopkRouting)
  _check(got, _gate(logits, bias, k=8, ep=8, tp=4, tp_rank=tp_rank, implementation="reference"))
  idx, w = got
  logical = ref.stable_topk(ref.gate_scores(logits, "sigmoid") + bias, 8)
  q = np.asarray(logical) // 4  # 4 experts per EP rank
  np.testing.assert_array_equal(np.asarray(idx) >= 0, q % 4 == tp_rank)
  assert (np.asarray(w) > 0).all()  # weights of masked slots are kept


def test_weights_are_the_sequential_ieee_formula(key):
  logits, bias = _inputs(key, 64, 16)
  idx, w = _gate(logits, bias, k=4, ep=1, tp=1, tp_rank=0, rsf=2.5)
  u = np.asarray(ref.gate_scores(logits, "sigmoid"))[np.arange(64)[:, None], np.asarray(idx)]
  s = np.full(64, 1e-20, np.float32)
  for j in range(4):
    s = s + u[:, j]
  assert_bitwise_equal(w, (u / s[:, None]).astype(np.float32) * np.float32(2.5))


def test_all_ties_pick_the_lowest_experts():
  t, e, s, k = 74, 72, 1, 6
  pmap, count = _identity_map(e, s)
  mask = jnp.arange(t) < 64
  idx = _gate(jnp.zeros((t, e), jnp.float32), jnp.zeros((e,), jnp.float32), k=k, s=s, tp_rank=0, mask=mask,
              pmap=pmap, count=count).topk_idx
  np.testing.assert_array_equal(np.asarray(idx)[:64, :k], np.tile(np.arange(k), (64, 1)))


@settings(max_examples=3, deadline=None)
@given(tricky_rows((64, 16)), st.sampled_from(FUNCS), st.just(True))
def test_tricky_values(x, func, grouped):
  x = np.where(np.isfinite(x), x, np.float32(0.25))  # logits must be finite on active rows
  x[::7] = 1e30 * np.sign(x[::7] + 0.5)  # large logits
  mask = jnp.asarray(np.arange(64) % 5 != 0)
  kw = dict(k=4, g=4 if grouped else 0, ntg=2 if grouped else 0, func=func, mask=mask)
  logits, bias = jnp.asarray(x), jnp.asarray(x[3])
  _check(_gate(logits, bias, **kw), _gate(logits, bias, implementation="reference", **kw))


def test_all_masked_and_zero_tokens(key):
  logits, bias = _inputs(key, 64, 16)
  idx, w, un = _gate(logits, bias, mask=jnp.zeros((64,), bool), unmapped=jnp.ones((64, 6), jnp.int32))  # unpacks
  assert (np.asarray(idx) == -1).all() and (np.asarray(w) == 0).all() and (np.asarray(un) == -1).all()
  idx, w = _gate(jnp.zeros((0, 16), jnp.float32), bias)
  assert idx.shape == (0, 6) and idx.dtype == jnp.int32 and w.shape == (0, 6)


def test_jit_and_vmap(key):
  logits, bias = _inputs(key, 128, 32)
  f = functools.partial(_gate, k=4, g=4, ntg=2, func="softmax")
  ref_f = jax.jit(functools.partial(f, implementation="reference"))  # XLA:CPU's exp differs fused vs op by op
  _check(jax.jit(f)(logits, bias), ref_f(logits, bias))
  got = jax.jit(jax.vmap(f, in_axes=(0, None)))(logits.reshape(2, 64, 32), bias)
  want = jax.jit(jax.vmap(ref_f, in_axes=(0, None)))(logits.reshape(2, 64, 32), bias)
  _check(got, want)


def _bad(**kw):
  base = dict(logits=jnp.ones((8, 16), jnp.float32), bias=jnp.ones((16,), jnp.float32))
  base.update(kw)
  return base


@pytest.mark.parametrize("kw, match", [
    (_bad(logits=jnp.ones((8, 16), jnp.bfloat16)), "logits must have dtype"),
    (_bad(bias=jnp.ones((8,), jnp.float32)), "bias must have shape"),
    (_bad(k=17), "num_topk"),
    (_bad(g=3, ntg=2), "num_groups"),
    (_bad(g=4, ntg=0), "num_topk_groups"),
    (_bad(g=4, ntg=1, k=5), "num_topk"),
    (_bad(func="identity"), "scoring_func"),
    (_bad(s=2, k=5), "num_shared_experts"),
    (_bad(s=2, k=4), "to_physical_map"),
    (_bad(mask=jnp.ones((7,), bool)), "mask must have shape"),
    (_bad(fix=jnp.ones((8,), bool)), "unmapped_topk_idx"),
    (_bad(unmapped=jnp.ones((8, 5), jnp.int32)), "unmapped_topk_idx must have shape"),
    (_bad(pmap=jnp.ones((16, 3), jnp.int32)), "logical_count"),
    (_bad(tp_rank=2), "tp_rank"),
    (_bad(ep_rank=4), "ep_rank"),
    (_bad(ep_rank=-1), "ep_rank"),
    (_bad(logits=jnp.ones((8, 16), bool)), "logits must have dtype"),
    (_bad(bias=(1.0,) * 16), "bias must be an array"),
])
def test_bad_input(kw, match):
  with pytest.raises(ValueError, match=match):
    _gate(**kw)


@pytest.mark.parametrize("implementation", ["interpret", "pallas"])
def test_experts_not_a_multiple_of_4_name_the_argument(implementation):
  logits, bias = jnp.ones((8, 6), jnp.float32), jnp.ones((6,), jnp.float32)
  with pytest.raises(jaxkern.KernelUnavailableError,
                     match=re.escape("num_experts (logits.shape[1]) = 6; the kernel takes a multiple of 4")):
    _gate(logits, bias, k=2, implementation=implementation)


@pytest.mark.parametrize("implementation", ["auto", "xla"])
def test_experts_not_a_multiple_of_4_run_xla(key, implementation):
  logits, bias = _inputs(key, 8, 6)
  got = _gate(logits, bias, k=2, func="softmax", implementation=implementation)
  _check(got, _gate(logits, bias, k=2, func="softmax", implementation="reference"))


def _non_finite_logits(key):
  """Rows 1-3: one NaN / +Inf / -Inf; 4-6: all NaN / +Inf / -Inf; 7: +Inf and NaN; 0: finite."""
  logits, bias = _inputs(key, 8, 16)
  logits = (logits.at[1, 3].set(jnp.nan).at[2, 5].set(jnp.inf).at[3, 7].set(-jnp.inf).at[4].set(jnp.nan)
            .at[5].set(jnp.inf).at[6].set(-jnp.inf).at[7, 2].set(jnp.inf).at[7, 9].set(jnp.nan))
  return logits, bias


@pytest.mark.parametrize("func", FUNCS)
@pytest.mark.parametrize("grouped", [False, True])
def test_non_finite_logits_give_nan_weights(key, func, grouped):
  """Kernel and reference: NaN routed weights on rows with a non-finite logit, ids ranked with NaN as -inf."""
  logits, bias = _non_finite_logits(key)
  kw = dict(k=4, g=4 if grouped else 0, ntg=2 if grouped else 0, s=1, func=func, tp_rank=0, tp=1, ep=1)
  pmap, count = _identity_map(16, 1)
  mask = jnp.arange(8) != 4  # a masked row keeps weights 0 whatever its logits
  got = _gate(logits, bias, mask=mask, pmap=pmap, count=count, **kw)
  _check(got, _gate(logits, bias, mask=mask, pmap=pmap, count=count, implementation="reference", **kw))
  w = np.asarray(got.topk_weights)
  assert np.isnan(w[[1, 2, 3, 5, 6, 7], :4]).all() and (w[:, 4] == np.where(np.asarray(mask), 1.0, 0.0)).all()
  assert np.isfinite(w[0]).all() and (w[4] == 0).all()


def test_checkify_reports_the_first_non_finite_logit(key):
  logits, bias = _non_finite_logits(key)
  f = functools.partial(_gate, k=4)
  checked = jax.jit(checkify.checkify(f, errors=checkify.user_checks))
  err, out = checked(logits, bias)
  assert "logits[1, 3] = nan is not finite" in err.get()
  _check(out, f(logits, bias))  # without checkify the op runs, same result
  err, _ = checked(logits, bias, mask=jnp.arange(8) == 0)  # masked rows are not checked
  assert err.get() is None


@pytest.mark.parametrize("e, g, ntg, k, func, options", [
    (256, 8, 4, 8, "sigmoid", "mask"),  # DeepSeek-V3
    (256, 8, 8, 8, "softmax", "mask fix"),
    (72, 0, 0, 6, "sqrtsoftplus", "map"),
    (384, 0, 0, 8, "softmax", "map"),
])
def test_lowers_for_h100(e, g, ntg, k, func, options):
  t, s = 8192, 2 if "map" in options else 0
  arrays = dict(mask=jax.ShapeDtypeStruct((t,), jnp.bool_) if "mask" in options else None)
  if "fix" in options:
    arrays.update(fix=jax.ShapeDtypeStruct((t,), jnp.bool_), unmapped=jax.ShapeDtypeStruct((t, k), jnp.int32))
  if "map" in options:
    arrays.update(pmap=jax.ShapeDtypeStruct((e + s, 33), jnp.int32), count=jax.ShapeDtypeStruct((e + s,), jnp.int32))
  f = lambda logits, bias, a: _gate(logits, bias, k=k, g=g, ntg=ntg, s=s, func=func, implementation="pallas", **a)
  args = (jax.ShapeDtypeStruct((t, e), jnp.float32), jax.ShapeDtypeStruct((e,), jnp.float32), arrays)
  assert "xla.gpu.triton" in lower_for_h100(f, *args).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("func", FUNCS)
@pytest.mark.parametrize("cfg", [(0, 0, 72, 1, 6), (0, 0, 144, 2, 6), (8, 8, 256, 2, 8), (8, 4, 256, 2, 8)], ids=str)
def test_spec_shapes_gpu(key, cfg, func):
  g, ntg, e, s, k = cfg
  t = 8001 + 10
  logits, bias = _inputs(key, t, e)
  pmap, count = _identity_map(e, s)
  kw = dict(k=k, ntg=ntg, g=g, s=s, func=func, mask=jnp.arange(t) < 8001, pmap=pmap, count=count,
            unmapped=jnp.zeros((t, k), jnp.int32))
  _check(jax.jit(functools.partial(_gate, **kw))(logits, bias), _gate(logits, bias, implementation="reference", **kw))


def test_defaults_and_required_scoring_func(key):
  logits, bias = _inputs(key, 64, 16)
  with pytest.raises(TypeError, match="scoring_func"):
    top2_sum_gate(logits, bias, 4)
  got = top2_sum_gate(logits, bias, 4, scoring_func="Softmax")
  assert isinstance(got, TopkRouting)
  _check(got, ref.top2_sum_gate(logits, bias, 4, scoring_func="Softmax"))
  _check(got, _gate(logits, bias, k=4, rsf=1.0, ep=1, tp=1, tp_rank=0, func="softmax", implementation="reference"))


def test_list_inputs(key):
  logits, bias = _inputs(key, 64, 16)
  mask = jnp.arange(64) % 3 != 0
  got = _gate(logits.tolist(), bias.tolist(), k=4, mask=mask.tolist())
  _check(got, _gate(logits, bias, k=4, mask=mask, implementation="reference"))


# Fixed-routing ids outside [0, E): the slot is dropped (id -1, weight 0, not in the weight sum).
_BAD_IDS = [-1, 36, 1 << 30, -(1 << 31)]


@pytest.mark.parametrize("with_map", [False, True])
def test_bad_fixed_routing_ids_drop_the_slot(key, with_map):
  t, e, k = 64, 36, 6
  s = 2 if with_map else 0
  keys = jax.random.split(key, 4)
  logits, bias = _inputs(keys[0], t, e)
  unmapped = jax.random.randint(keys[1], (t, k), 0, e, jnp.int32)
  rows = np.arange(0, t, 3)
  unmapped = unmapped.at[rows, rows % k].set(jnp.asarray(_BAD_IDS, jnp.int32)[rows % len(_BAD_IDS)])
  unmapped = unmapped.at[6, :].set(-1)  # every routed slot of a row dropped
  fix = jnp.arange(t) % 2 == 0
  mask = jnp.arange(t) != 12
  pmap, count = (jax.random.randint(keys[2], (e + s, 4), 0, e + 3, jnp.int32),
                 jax.random.randint(keys[3], (e + s,), 1, 5, jnp.int32)) if with_map else (None, None)
  for func in FUNCS:
    kw = dict(k=k, s=s, func=func, mask=mask, fix=fix, unmapped=unmapped, pmap=pmap, count=count, ep=1, tp=1,
              tp_rank=0)
    got = _gate(logits, bias, **kw)
    _check(got, _gate(logits, bias, implementation="reference", **kw))
    idx, w, un = (np.asarray(a) for a in got)
    bad = np.asarray(fix & mask)[:, None] & ((np.asarray(unmapped) < 0) | (np.asarray(unmapped) >= e))
    assert bad.sum() > 10 and not np.isnan(w).any()
    assert (idx[:, :k][bad] == -1).all() and (w[:, :k][bad] == 0).all() and (un[bad] == -1).all()
    assert (idx[:, :k][~bad & np.asarray(mask)[:, None]] >= 0).all()
    # The other slots are normalised without the dropped ones.
    u = np.asarray(ref.gate_scores(logits, func))
    r = 3
    good = [c for c in range(k) if not bad[r, c]]
    total = np.float32(1e-20)
    for c in good:
      total = np.float32(total + u[r, un[r, c]])
    np.testing.assert_array_equal(w[r, good], (u[r, un[r, good]] / total).astype(np.float32) * np.float32(1.5))
    np.testing.assert_array_equal(w[6, :k], 0)


def test_checkify_reports_the_first_bad_fixed_id(key):
  t, e, k = 64, 16, 4
  logits, bias = _inputs(key, t, e)
  unmapped = jnp.zeros((t, k), jnp.int32).at[9, 2].set(99).at[20, 1].set(-3).at[5, 0].set(e)
  fix = jnp.arange(t) > 5  # row 5 is not a fixed-routing row: its id is never read
  f = functools.partial(_gate, k=k, fix=fix)
  checked = jax.jit(checkify.checkify(f, errors=checkify.user_checks))
  err, out = checked(logits, bias, unmapped=unmapped)
  assert "unmapped_topk_idx[9, 2] = 99 is outside [0, 16)" in err.get()
  _check(out, f(logits, bias, unmapped=unmapped))
  err, _ = checked(logits, bias, unmapped=jnp.zeros((t, k), jnp.int32).at[5, 0].set(e))
  assert err.get() is None


def test_debug_check_compiles_to_nothing(key, monkeypatch):
  """Without checkify, the compiled kernel path is the same with and without the debug check."""
  t, e, k = 64, 16, 4
  logits, bias = _inputs(key, t, e)
  args = (logits, bias, jnp.ones((t,), bool), jnp.zeros((t, k), jnp.int32))
  monkeypatch.setattr(_top2_sum_gate, "_debug_check_finite_logits", lambda *a: None)  # its own test below
  monkeypatch.setattr(_checks, "debug_check_entries", lambda *a: None)  # tests/test_preconditions.py
  lower = lambda: jax.jit(lambda l, b, fix, u: _gate(l, b, k=k, fix=fix, unmapped=u)).lower(*args)  # a new trace
  checked = lower()
  assert "argmax" in checked.as_text()  # the debug check's operands are traced ...
  monkeypatch.setattr(_top2_sum_gate, "_debug_check_fixed_ids", lambda *a: None)
  plain = lower()
  assert "argmax" not in plain.as_text()
  assert _hlo_ops(checked.compile().as_text()) == _hlo_ops(plain.compile().as_text())  # ... and XLA drops them


def test_finite_logits_check_compiles_to_nothing(key, monkeypatch):
  """Without checkify, the compiled kernel path is the same with and without the non-finite logits check."""
  logits, bias = _inputs(key, 64, 16)
  lower = lambda: jax.jit(lambda l, b: _gate(l, b, k=4)).lower(logits, bias)  # a new trace
  checked = lower()
  monkeypatch.setattr(_top2_sum_gate, "_debug_check_finite_logits", lambda *a: None)
  plain = lower()
  assert checked.as_text().count("is_finite") > plain.as_text().count("is_finite")
  assert _hlo_ops(checked.compile().as_text()) == _hlo_ops(plain.compile().as_text())


def _hlo_ops(hlo: str) -> str:
  """Compiled HLO text without metadata, source tables and instruction / computation names."""
  hlo = re.sub(r", metadata=\{[^}]*\}", "", hlo)
  hlo = re.sub(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n.*?\n\n", "", hlo, flags=re.S | re.M)
  hlo = re.sub(r"%[\w.\-]+", "%", hlo)
  hlo = re.sub(r"(calls|to_apply|condition|body)=[\w.\-%]+", r"\1=", hlo)
  return re.sub(r"^(ENTRY )?[\w.\-]+ ", r"\1C ", hlo, flags=re.M)


def test_traced_ep_rank_out_of_range(key):
  """A traced ep_rank only enters the replica hash, as a floor modulo (same in kernel and reference)."""
  t, e, s, x = 64, 32, 2, 3
  keys = jax.random.split(key, 3)
  logits, bias = _inputs(keys[0], t, e)
  pmap = jax.random.randint(keys[1], (e + s, x + 1), 0, e + x, jnp.int32)
  count = jax.random.randint(keys[2], (e + s,), 1, x + 2, jnp.int32)
  kw = dict(k=4, s=s, pmap=pmap, count=count, ep=1, tp=1, tp_rank=0)
  for rank in (-7, 11):
    f = jax.jit(lambda logits, bias, r: _gate(logits, bias, ep_rank=r, **kw))
    got = f(logits, bias, jnp.int32(rank))
    _check(got, _gate(logits, bias, ep_rank=jnp.int32(rank), implementation="reference", **kw))
    # counts are 1..4: the hash sees ep_rank mod 12 (a non-negative rank, passed as an array, is not range-checked)
    _check(got, _gate(logits, bias, ep_rank=jnp.int32(rank % 12), implementation="reference", **kw))


def test_no_retrace(key):
  logits, bias = _inputs(key, 64, 16)
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(logits, bias, rsf):
    return _gate(logits, bias, k=4, g=4, ntg=2, rsf=rsf)

  for rsf in (1.0, 2.0):
    f(logits, bias, rsf)
  f(logits + 1, bias, 3.0)


def test_int64_fixed_ids_are_range_checked_before_the_cast(key):
  """int64 ids (x64 mode; the reference path) outside [0, E) are dropped, not wrapped to int32."""
  logits, bias = _inputs(key, 64, 16)
  with jax.enable_x64(True):
    unmapped = jnp.zeros((64, 4), jnp.int64).at[3, 1].set(2**32 + 1)
    got = _gate(logits, bias, k=4, fix=jnp.ones((64,), bool), unmapped=unmapped, implementation="xla")
  assert got.unmapped_topk_idx.dtype == jnp.int32 and int(got.unmapped_topk_idx[3, 1]) == -1
  assert float(got.topk_weights[3, 1]) == 0.0 and int(got.topk_idx[3, 1]) == -1

"""swiglu_backward_and_per_token_cast (docs/quant.md, "Fused SwiGLU"): both kernels (the grouped one for
npc = 128, the step one for npc = 32; interpret mode, inside jit) vs reference bit for bit on the same backend
(weight_grad within atol = rtol = 1e-4), the reference vs numpy (float64 semantics, and upstream's float32 step
sequence with its one fma), argument checks, the fma in the lowered kernel, lowering for an
H100, and a GPU subset of upstream's grid."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkern
from jaxkern import quant
from jaxkern.reference import quant as ref
from jaxkern.testing import assert_bitwise_equal, capture_mosaic_modules, lower_for_h100
from jaxkern.types import QuantTensor, SwigluBackward

OP = quant.swiglu_backward_and_per_token_cast


def _mapping(key, e, num_tokens, num_topk, padding=0.2):
  """A mutually inverse ``(pos_to_token_topk (E,), token_topk_to_pos (T, k))`` pair: a random fraction
  ``padding`` of the rows is padding (-1), the others own distinct random slots; unused slots are -1."""
  kp, ks = jax.random.split(key)
  pad = np.asarray(jax.random.uniform(kp, (e,)) < padding)
  slots = np.asarray(jax.random.permutation(ks, num_tokens * num_topk))[:e]
  pos = np.where(pad, -1, slots).astype(np.int32)
  t2p = np.full(num_tokens * num_topk, -1, np.int32)
  t2p[pos[pos >= 0]] = np.nonzero(pos >= 0)[0]
  return jnp.asarray(pos), jnp.asarray(t2p.reshape(num_tokens, num_topk))


def _inputs(key, e, h, npc, num_topk=3):
  """``x`` = the per-token e4m3 cast of a bf16 ``3·randn`` with 2 % spikes of ±15 (so that clamps 0.5 and 10
  bite), bf16 ``randn`` gradient, ``uniform [0, 1)`` weights (upstream's), a mapping with padding rows."""
  kx, ks, kg, kw, km = jax.random.split(key, 5)
  x = 3.0 * jax.random.normal(kx, (e, 2 * h))
  x = jnp.where(jax.random.uniform(ks, x.shape) < 0.02, 15.0 * jnp.sign(x), x).astype(jnp.bfloat16)
  num_tokens = e // num_topk + 2
  pos, t2p = _mapping(km, e, num_tokens, num_topk)
  return (ref.per_token_cast(x, "e4m3", npc), jax.random.normal(kg, (e, h), jnp.bfloat16),
          jax.random.uniform(kw, (num_tokens, num_topk), jnp.float32), pos, t2p)


@functools.partial(jax.jit, static_argnames=("npc", "round_sf", "clamp", "implementation"))
def _run(x, g, w, pos, t2p, *, npc, round_sf, clamp, implementation):
  fn = ref.swiglu_backward_and_per_token_cast if implementation == "ref" else functools.partial(
      OP, implementation=implementation)
  return fn(x, g, w, pos, t2p, npc, round_sf=round_sf, swiglu_clamp_value=clamp)


def weight_grad_tolerance(x, g, pos, want, npc, clamp):
  """Upstream's ``atol = rtol = 1e-4`` plus ``2^-20 · Σ_c |g · act|``: a float32 sum of ``h`` terms in another
  order (unspecified upstream) differs by up to a few ulps of the sum of the terms' magnitudes, which exceeds
  1e-4 where a slot's terms (up to ~2000 in total at h = 7168) cancel to a small sum (seen on an H100)."""
  v = np.asarray(ref.swiglu_rows(x, npc), np.float64)
  h = v.shape[1] // 2
  xv, yv = v[:, :h], v[:, h:]
  if clamp is not None:
    xv, yv = np.minimum(xv, clamp), np.clip(yv, -clamp, clamp)
  terms = np.abs(np.asarray(g, np.float64).reshape(-1, h) * xv / (1 + np.exp(-xv)) * yv).sum(axis=1)
  pos = np.asarray(pos)
  scale = np.zeros(np.size(want))
  np.add.at(scale, pos[pos >= 0], terms[pos >= 0])
  return 1e-4 + 1e-4 * np.abs(np.asarray(want)) + 2.0**-20 * scale.reshape(np.shape(want))


def _assert_matches(got, want, tol=None):
  chex.assert_trees_all_equal_structs(got, want)
  assert isinstance(got, SwigluBackward) and isinstance(got.x_grad_quant, QuantTensor)
  for a, b in zip(jax.tree.leaves(got)[:4], jax.tree.leaves(want)[:4]):
    assert_bitwise_equal(a, b)
  err = np.abs(np.asarray(got.weight_grad) - np.asarray(want.weight_grad))
  tol = 1e-4 + 1e-4 * np.abs(np.asarray(want.weight_grad)) if tol is None else tol
  assert (err <= tol).all(), f"weight_grad: {int((err > tol).sum())} slots off, max error {err.max()}"


def _both(args, **kw):
  return _run(*args, **kw, implementation="interpret"), _run(*args, **kw, implementation="ref")


@pytest.mark.parametrize("e, h, npc, round_sf, clamp", [
    # npc = 128: the grouped kernel (row blocks of 8, chunks of 16 groups, the next group's inputs prefetched)
    (40, 256, 128, False, None),  # 2 groups per half, 5 row blocks of 8
    (37, 640, 128, True, 10.0),  # 5 groups: one chunk; 5 row blocks, the last shifted back
    (16, 2304, 128, False, 0.5),  # 18 groups: chunks of 16 and 2
    (7, 256, 128, True, 0.5),  # fewer rows than one layout block: padded
    # npc = 32: the step kernel (steps of 4 groups on 8-row blocks, chunks of 16 steps, the next step prefetched)
    (70, 128, 32, True, 0.5),  # 4 groups: one step; 9 row blocks, the last shifted back
    (48, 640, 32, False, 10.0),  # 20 groups: 5 steps in one chunk
    (16, 2304, 32, False, 0.5),  # 72 groups: 18 steps, chunks of 16 and 2
    (20, 192, 32, True, None),  # 6 groups: steps of 2 groups on 16-row blocks
    (40, 96, 32, False, 0.5),  # 3 groups: steps of 1 group on 32-row blocks
    (5, 128, 32, True, 10.0),  # fewer rows than one layout block: padded
])
def test_bit_exact(key, e, h, npc, round_sf, clamp):
  args = _inputs(key, e, h, npc)
  got, want = _both(args, npc=npc, round_sf=round_sf, clamp=clamp)
  _assert_matches(got, want)
  if clamp is not None:  # the clamp bit: some dx / dy are zeroed by it
    v = np.asarray(ref.swiglu_rows(args[0], npc))
    assert (v[:, :h] > clamp).any() and (np.abs(v[:, h:]) > clamp).any()
  pos = np.asarray(args[3])
  assert (pos < 0).any()
  for a in (got.out, got.x_grad):  # padding rows: weight 0, so every gradient and output is a zero
    assert np.all(np.asarray(a, np.float32)[pos < 0] == 0)
  wg = np.asarray(got.weight_grad).reshape(-1)
  unused = np.ones(wg.shape, bool)
  unused[pos[pos >= 0]] = False
  assert np.all(wg[unused] == 0) and np.all(wg[~unused] != 0)


def test_three_d_input(key):
  """A ``(B, S, 2h)`` q and ``(B, S, h)`` gradient are rows ``B·S``."""
  (q, sf), g, w, pos, t2p = _inputs(key, 40, 128, 32)
  kw = dict(npc=32, round_sf=False, clamp=0.5)
  got = _run((q.reshape(2, 20, 256), sf), g.reshape(2, 20, 128), w, pos, t2p, **kw, implementation="interpret")
  _assert_matches(got, _run((q, sf), g, w, pos, t2p, **kw, implementation="ref"))


def test_zero_rows():
  x = (jnp.zeros((0, 512), jnp.float8_e4m3fn), jnp.zeros((0, 16), jnp.float32))
  args = (x, jnp.zeros((0, 256), jnp.bfloat16), jnp.ones((3, 2)), jnp.zeros((0,), jnp.int32),
          jnp.zeros((3, 2), jnp.int32))
  got = OP(*args, 32, round_sf=True)
  assert got.out.shape == (0, 256) and got.out.dtype == jnp.bfloat16
  assert got.x_grad.shape == (0, 512) and got.x_grad.dtype == jnp.bfloat16
  assert got.x_grad_quant.data.shape == (0, 512) and got.x_grad_quant.data.dtype == jnp.float8_e4m3fn
  assert got.x_grad_quant.sf.shape == (0, 16) and got.x_grad_quant.sf.dtype == jnp.float32
  assert_bitwise_equal(got.weight_grad, jnp.zeros((3, 2), jnp.float32))
  assert jaxkern.explain(lambda *a: OP(*a, 32, implementation="pallas"), *args)[0].path == "xla"


def _numpy_backward(v, g, row_w, clamp):
  """docs/quant.md, "Fused SwiGLU", in float64: ``(out, [dx | dy], row sums)``."""
  h = v.shape[1] // 2
  x, y = v[:, :h].copy(), v[:, h:].copy()
  cx = cy = np.zeros(x.shape, bool)
  if clamp is not None:
    cx, cy = x > clamp, np.abs(y) > clamp
    x, y = np.minimum(x, clamp), np.clip(y, -clamp, clamp)
  s = 1 / (1 + np.exp(-x))
  act = x * s * y
  gw = g * row_w[:, None] * s
  dx = np.where(cx, 0, gw * y * (1 + x * (1 - s)))
  dy = np.where(cy, 0, gw * x)
  return act * row_w[:, None], np.concatenate([dx, dy], 1), (g * act).sum(1)


@pytest.mark.parametrize("clamp", [None, 0.5])
def test_reference_against_numpy(key, clamp):
  """Semantics in float64, and bit for bit upstream's float32 sequence (numpy float32 arithmetic, exp taken from
  XLA, the fma of ``x·(1 - s) + 1`` as one rounding of the exact float64 value)."""
  x, g, w, pos, t2p = _inputs(key, 64, 256, 128)
  out, xg, wg = jax.jit(functools.partial(ref.swiglu_backward, num_per_channels=128, swiglu_clamp_value=clamp))(
      x, g, w, pos, t2p)
  v = np.asarray(ref.swiglu_rows(x, 128), np.float64)
  pos_np = np.asarray(pos)
  row_w = np.where(pos_np >= 0, np.asarray(w).reshape(-1)[np.maximum(pos_np, 0)], 0.0)
  g64 = np.asarray(g, np.float64)
  out64, xg64, dots = _numpy_backward(v, g64, row_w, clamp)
  np.testing.assert_allclose(np.asarray(out), out64, rtol=1e-6, atol=1e-30)
  np.testing.assert_allclose(np.asarray(xg), xg64, rtol=1e-5, atol=1e-30)
  want_wg = np.zeros(w.size)
  want_wg[pos_np[pos_np >= 0]] = dots[pos_np >= 0]
  np.testing.assert_allclose(np.asarray(wg).reshape(-1), want_wg, rtol=1e-5, atol=1e-4)
  # The float32 step sequence.
  f = np.float32
  xv, yv = v[:, :256].astype(f), v[:, 256:].astype(f)
  if clamp is not None:
    c = f(clamp)
    xv, yv = np.where(xv > c, c, xv), np.where(yv > c, c, np.where(yv < -c, -c, yv))
  t = f(1) + np.asarray(jnp.exp(-jnp.asarray(xv)))
  s = f(1) / t
  gw = (np.asarray(g, f) * row_w.astype(f)[:, None]) * s
  fma = (xv.astype(np.float64) * (f(1) - s).astype(np.float64) + 1.0).astype(f)  # exact product, one rounding
  dx, dy = (gw * yv) * fma, gw * xv
  if clamp is not None:
    dx, dy = np.where(v[:, :256] > clamp, f(0), dx), np.where(np.abs(v[:, 256:]) > clamp, f(0), dy)
  assert_bitwise_equal(xg, jnp.asarray(np.concatenate([dx, dy], 1)))
  assert_bitwise_equal(out, jnp.asarray((xv / t * yv) * row_w.astype(f)[:, None]))


@pytest.mark.parametrize("npc, sites", [(128, 1), (32, 1)])
def test_kernel_fma_is_contractable(monkeypatch, npc, sites):
  """The Mosaic GPU module computes ``x·(1 - s) + 1`` as a ``fastmath<contract>`` multiply whose only use is an
  add of 1.0 (LLVM fuses the pair into ``fma.rn.f32``) at each place a group is written out: once, in the body of
  the loop over groups (npc = 128, the grouped kernel, 2 groups) or over steps of 4 groups (npc = 32, the step
  kernel, 2 steps). (The other contracted pairs: the elementwise ``g · act`` sums of the weight gradient.) Checked
  on the MLIR handed to the Mosaic GPU compiler; the ``gpu`` test checks the resulting bits."""
  modules = capture_mosaic_modules(monkeypatch)
  s = jax.ShapeDtypeStruct
  e, h = 64, 256  # one chunk
  lower_for_h100(lambda q, sf, g, w, p, t: OP((q, sf), g, w, p, t, npc, implementation="pallas"),
                 s((e, 2 * h), jnp.float8_e4m3fn), s((e, 2 * h // npc), jnp.float32), s((e, h), jnp.bfloat16),
                 s((40, 2), jnp.float32), s((e,), jnp.int32), s((40, 2), jnp.int32))
  m = modules[-1]
  muls = re.findall(r"(%\d+) = arith.mulf (%\d+), (%\d+) fastmath<contract> : vector<\d+xf32>", m)
  fused = []
  for name, _, rhs in muls:
    add = re.search(rf"arith.addf {name}, (%\d+) fastmath<contract>", m)
    # + a constant splat, times (1 - s)
    if add and re.search(rf"{add.group(1)} = vector.broadcast %cst\w* : f32", m) and re.search(rf"{rhs} = arith.subf", m):
      fused.append(name)
  assert len(fused) == sites


def test_reference_of_plain_rows(key):
  """The reference takes dequantised rows too (as :func:`jaxkern.modeling.swiglu`'s tests use it)."""
  x, g, w, pos, t2p = _inputs(key, 16, 128, 32)
  f = jax.jit(lambda x, *a: ref.swiglu_backward(x, *a, 32, 0.5))
  a, b = f(x, g, w, pos, t2p), f(ref.swiglu_rows(x, 32), g, w, pos, t2p)
  jax.tree.map(assert_bitwise_equal, a, b)


_Q = (jnp.zeros((8, 512), jnp.float8_e4m3fn), jnp.ones((8, 4), jnp.float32))
_REST = (jnp.zeros((8, 256), jnp.bfloat16), jnp.ones((4, 2)), jnp.zeros((8,), jnp.int32), jnp.zeros((4, 2), jnp.int32))


@pytest.mark.parametrize("args, npc, match", [
    ((_Q[0],) + _REST, 128, "x must be a QuantTensor"),
    (((_Q[0].astype(jnp.bfloat16), _Q[1]),) + _REST, 128, r"x\[0\] must have dtype"),
    (((_Q[0][None, None], _Q[1]),) + _REST, 128, r"x\[0\] must have rank"),
    ((_Q,) + _REST, 64, "num_per_channels must be 32 or 128"),
    (((jnp.zeros((8, 384), jnp.float8_e4m3fn), jnp.ones((8, 3))),) + _REST, 128, "h % num_per_channels"),
    (((_Q[0], jnp.ones((8, 2))),) + _REST, 128, r"x\[1\] \(sf\) must have shape"),
    (((_Q[0], jnp.ones((8, 4), jnp.int32)),) + _REST, 128, r"x\[1\] must have dtype"),
    ((_Q, _REST[0].astype(jnp.float32)) + _REST[1:], 128, "grad_out must have dtype"),
    ((_Q, _REST[0][:, :128]) + _REST[1:], 128, "grad_out must have 8 rows"),
    ((_Q, _REST[0], jnp.ones((4, 3))) + _REST[2:], 128,
     r"weight must have shape .* \(the shape of token_topk_to_pos\)"),
    ((_Q, _REST[0], jnp.ones((4, 2), jnp.bfloat16)) + _REST[2:], 128, "weight must have dtype"),
    ((_Q,) + _REST[:2] + (jnp.zeros((7,), jnp.int32), _REST[3]), 128, "pos_to_token_topk must have shape"),
    ((_Q,) + _REST[:3] + (jnp.zeros((8,), jnp.int32),), 128, "token_topk_to_pos must have rank"),
])
def test_bad_inputs(args, npc, match):
  with pytest.raises(ValueError, match=match):
    OP(*args, npc)


def test_keyword_only_options():
  with pytest.raises(TypeError):
    OP(_Q, *_REST, 128, True)


def test_not_differentiable(key):
  x, g, w, pos, t2p = _inputs(key, 16, 128, 128)
  loss = lambda g, w: OP(x, g, w, pos, t2p, 128).x_grad.astype(jnp.float32).sum()
  for argnum in (0, 1):
    with pytest.raises(jaxkern.NotDifferentiableError, match="swiglu_backward_and_per_token_cast"):
      jax.grad(loss, argnums=argnum)(g.astype(jnp.bfloat16), w)


@pytest.mark.parametrize("h, npc, round_sf, clamp", [(7168, 128, True, 0.5), (2560, 32, False, None),
                                                     (6144, 32, True, 10.0), (2112, 32, True, None),
                                                     (2080, 32, False, 0.5)])
def test_lowers_for_h100(h, npc, round_sf, clamp):
  """Upstream's shapes, and for npc = 32 steps of 2 groups (h = 2112: 66 groups) and of 1 group (2080: 65)."""
  e = 32016  # 4001 tokens, top-k 8, padded per expert
  s = jax.ShapeDtypeStruct
  f = lambda q, sf, g, w, p, t: OP((q, sf), g, w, p, t, npc, round_sf=round_sf, swiglu_clamp_value=clamp,
                                   implementation="pallas")
  lowered = lower_for_h100(f, s((e, 2 * h), jnp.float8_e4m3fn), s((e, 2 * h // npc), jnp.float32),
                           s((e, h), jnp.bfloat16), s((4001, 8), jnp.float32), s((e,), jnp.int32),
                           s((4001, 8), jnp.int32))
  assert "mosaic_gpu" in lowered.as_text()


def _moe_inputs(key, num_topk, experts, ranks, h, npc):
  """Upstream's test input: ``per_token_cast`` of ``expand_to_fused`` of a bf16 ``randn`` over the fused mapping
  (alignment ``npc``), bf16 ``randn`` gradient, ``uniform [0, 1)`` weights."""
  from jaxkern import moe
  from jaxkern.testing import moe_topk_idx

  idx = jnp.asarray(moe_topk_idx(jax.random.key(0), 4001, num_topk, experts, ranks))
  mapping = moe.get_fused_mapping(idx, experts, 0, npc)
  kx, kg, kw = jax.random.split(key, 3)
  xe = moe.expand_to_fused(jax.random.normal(kx, (idx.shape[0], 2 * h), jnp.bfloat16), mapping.token_topk_to_pos,
                           mapping.pos_to_expert)
  e = xe.shape[0]
  return (quant.per_token_cast(xe, "e4m3", npc), jax.random.normal(kg, (e, h), jnp.bfloat16),
          jax.random.uniform(kw, idx.shape, jnp.float32), mapping.pos_to_token_topk, mapping.token_topk_to_pos)


@pytest.mark.gpu
@pytest.mark.parametrize("num_topk, experts, ranks", [(8, 32, 8), (6, 4, 64)])
@pytest.mark.parametrize("h, npc, round_sf", [(7168, 128, True), (2560, 32, False), (4096, 32, True)])
@pytest.mark.parametrize("clamp", [None, 10.0, 0.5])
def test_spec_shapes_gpu(key, num_topk, experts, ranks, h, npc, round_sf, clamp):
  """Compiled kernel vs the reference run by XLA on the same GPU (CUDA expf on both sides; the fma bit-exact)."""
  args = _moe_inputs(key, num_topk, experts, ranks, h, npc)
  kw = dict(npc=npc, round_sf=round_sf, clamp=clamp)
  want = _run(*args, **kw, implementation="ref")
  _assert_matches(_run(*args, **kw, implementation="pallas"), want,
                  weight_grad_tolerance(args[0], args[1], args[3], want.weight_grad, npc, clamp))


@pytest.mark.gpu
@pytest.mark.parametrize("h, clamp", [(2080, 0.5), (2112, None)])
def test_narrow_steps_gpu(key, h, clamp):
  """npc = 32 compiled with steps of 1 group (h = 2080: 65 groups) and of 2 groups (2112: 66 groups) vs the
  reference run by XLA on the same GPU."""
  args = _inputs(key, 300, h, 32)
  kw = dict(npc=32, round_sf=False, clamp=clamp)
  want = _run(*args, **kw, implementation="ref")
  _assert_matches(_run(*args, **kw, implementation="pallas"), want,
                  weight_grad_tolerance(args[0], args[1], args[3], want.weight_grad, 32, clamp))

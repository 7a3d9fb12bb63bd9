"""swiglu_forward_and_per_token_cast (docs/quant.md, Fused SwiGLU): kernel vs reference bit for bit on the same backend, the
reference vs a float64 numpy formulation, argument checks, lowering for an H100."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkern
from jaxkern import quant
from jaxkern.reference import quant as ref
from jaxkern.testing import assert_bitwise_equal, capture_mosaic_modules, lower_for_h100
from jaxkern.types import QuantTensor, QuantTensorWithClampedCount

FLAGS = {"A": {}, "A-round": dict(round_sf=True), "B": dict(use_tma_aligned_col_major_sf=True),
         "C": dict(use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True)}
OP = quant.swiglu_forward_and_per_token_cast


def assert_same(got, want):
  chex.assert_trees_all_equal_structs(got, want)
  jax.tree.map(assert_bitwise_equal, got, want)


def _inputs(key, e, h, dtype=jnp.bfloat16, num_topk=4):
  """``x`` ``(E, 2h)`` (randn·3, so that clamps bite), a mapping with padding rows (-1 in both
  ``pos_to_token_topk`` and ``pos_to_expert``, zero rows in ``x``) and ``randn`` weights."""
  kx, kw, kp = jax.random.split(key, 3)
  num_tokens = max(1, e // num_topk)
  padding = jax.random.uniform(kp, (e,)) < 0.2
  pos_to_token_topk = jnp.where(padding, -1, jnp.arange(e) % (num_tokens * num_topk)).astype(jnp.int32)
  x = jnp.where(padding[:, None], 0.0, 3.0 * jax.random.normal(kx, (e, 2 * h))).astype(dtype)
  weights = jax.random.normal(kw, (num_tokens, num_topk), jnp.float32)
  return x, pos_to_token_topk, weights, jnp.where(padding, -1, 0).astype(jnp.int32)


def _both(*args, **kw):
  return OP(*args, **kw), ref.swiglu_forward_and_per_token_cast(*args, **kw)


@pytest.mark.parametrize("e, h, npc, flags, weights, mask, clamp", [
    (100, 256, 128, "C", True, True, 0.5),  # packed sf written by the kernel, 2 groups, 100 rows
    (37, 640, 128, "C", False, True, 10.0),  # 5 groups: chunks of 4 and 1; 3 padding rows
    (65, 384, 128, "B", True, False, None),  # layout B written by the kernel
    (40, 256, 256, "A-round", True, True, 0.5),  # one scale per row
    (24, 128, 128, "A", False, False, None),  # one group
    (7, 256, 128, "C", True, True, 0.5),  # fewer rows than one layout block: padded, sf formatted by XLA
])
def test_bit_exact(key, e, h, npc, flags, weights, mask, clamp):
  x, ptt, w, pte = _inputs(key, e, h)
  count = None if clamp is None else jnp.array([1, 2, 3], jnp.int32)
  got, want = _both(x, "e4m3", npc, *((ptt, w) if weights else (None, None)), pte if mask else None, **FLAGS[flags],
                    swiglu_clamp_value=clamp, clamped_count=count)
  assert isinstance(got, QuantTensor if count is None else QuantTensorWithClampedCount)
  assert_same(got, want)


def test_float32_input_and_sf_clamp_min(key):
  x, ptt, w, pte = _inputs(key, 40, 256, jnp.float32)
  x = x * 1e-6  # small activations: the amax clamp minimum decides the sf
  for flags in ("A", "C"):
    assert_same(*_both(x, "e4m3", 128, ptt, w, pte, **FLAGS[flags], sf_clamp_min=1e-9))


def test_skipped_and_padding_rows(key):
  """Skipped rows (pos_to_expert < 0): zeros, sf 0, not counted; rows with pos_to_token_topk < 0 but
  processed: weight 0, sf = the clamp minimum's."""
  x, ptt, w, _ = _inputs(key, 40, 256)
  x = 3.0 * jax.random.normal(key, x.shape).astype(x.dtype)
  pte = jnp.zeros((40,), jnp.int32).at[:5].set(-1)
  ptt = ptt.at[5:10].set(-1)
  out, sf, count = OP(x, "e4m3", 128, ptt, w, pte, swiglu_clamp_value=0.5, clamped_count=jnp.zeros(3, jnp.int32))
  data = np.asarray(out).astype(np.float32)
  assert np.all(data[:10] == 0) and np.all(np.asarray(sf)[:5] == 0)
  assert np.all(np.asarray(sf)[5:10] == np.float32(np.float32(1e-4) / np.float32(448)))
  xf = np.asarray(x, np.float32)[5:]
  assert list(np.asarray(count)) == [(xf[:, :256] > 0.5).sum(), (xf[:, 256:] > 0.5).sum(), (xf[:, 256:] < -0.5).sum()]


def test_zero_tokens():
  x = jnp.zeros((0, 512), jnp.bfloat16)
  out, sf = OP(x, "e4m3", 128)
  assert out.shape == (0, 256) and out.dtype == jnp.float8_e4m3fn and sf.shape == (0, 2)
  got = OP(x, "e4m3", 128, jnp.zeros((0,), jnp.int32), jnp.zeros((0, 2)), **FLAGS["C"], swiglu_clamp_value=0.5,
           clamped_count=jnp.array([4, 5, 6], jnp.int32))
  assert got.sf.shape == (1, 0) and got.sf.dtype == jnp.int32 and list(np.asarray(got.clamped_count)) == [4, 5, 6]
  assert jaxkern.explain(OP, x, "e4m3", 128, implementation="pallas")[0].path == "xla"


def _numpy_swiglu(x, w, clamp):
  """The formula in float64 numpy: clamp, silu(l)·r, times the row weight."""
  v = np.asarray(x, np.float64)
  h = v.shape[1] // 2
  left, right = v[:, :h], v[:, h:]
  if clamp is not None:
    left, right = np.minimum(left, clamp), np.clip(right, -clamp, clamp)
  return left / (1 + np.exp(-left)) * right * np.asarray(w, np.float64)[:, None]


@pytest.mark.parametrize("clamp", [None, 0.5])
def test_reference_against_numpy(key, clamp):
  x, ptt, w, _ = _inputs(key, 64, 256)
  row_w = np.where(np.asarray(ptt) >= 0, np.asarray(w).reshape(-1)[np.maximum(np.asarray(ptt), 0)], 0.0)
  want = _numpy_swiglu(x, row_w, clamp)
  act = ref.swiglu_forward(x, ptt, w, clamp)
  np.testing.assert_allclose(np.asarray(act), want, rtol=3e-7, atol=1e-30)
  out, sf = ref.swiglu_forward_and_per_token_cast(x, "e4m3", 128, ptt, w, swiglu_clamp_value=clamp)
  amax = np.maximum(np.abs(want).reshape(64, 2, 128).max(-1), 1e-4)
  np.testing.assert_allclose(np.asarray(sf), amax / 448, rtol=1e-6)
  back = np.asarray(out, np.float32).reshape(64, 2, 128) * np.asarray(sf)[..., None]
  np.testing.assert_allclose(back.reshape(64, 256), want, rtol=2 ** -3, atol=np.asarray(sf).max() * 2 ** -9)


def test_reference_clamp_counts(key):
  x = jax.random.normal(key, (16, 256), jnp.float32)
  act, count = ref.swiglu_forward(x, swiglu_clamp_value=0.5, clamped_count=jnp.array([1, 1, 1], jnp.int32))
  xf = np.asarray(x)
  assert list(np.asarray(count)) == [1 + (xf[:, :128] > 0.5).sum(), 1 + (xf[:, 128:] > 0.5).sum(),
                                     1 + (xf[:, 128:] < -0.5).sum()]
  assert act.shape == (16, 128) and act.dtype == jnp.float32


@pytest.mark.parametrize("args, kw, match", [
    ((jnp.ones((8, 200), jnp.bfloat16), "e4m3", 128), {}, "x must have 2h columns"),
    ((jnp.ones((8, 256), jnp.float16), "e4m3", 128), {}, "x must have dtype"),
    ((jnp.ones((8, 256)), "e2m1", 128), {}, "fmt"),
    ((jnp.ones((8, 512)), "e4m3", 64), {}, "num_per_channels"),
    ((jnp.ones((8, 512)), "e4m3", 256), FLAGS["B"], "use_tma_aligned_col_major_sf requires"),
    ((jnp.ones((8, 512)), "e4m3", 128), dict(use_packed_ue8m0=True), "use_packed_ue8m0"),
    ((jnp.ones((8, 256)), "e4m3", 128, jnp.zeros((8,), jnp.int32)), {}, "pos_to_token_topk and topk_weights"),
    ((jnp.ones((8, 256)), "e4m3", 128, jnp.zeros((7,), jnp.int32), jnp.ones((4, 2))), {}, "pos_to_token_topk must"),
    ((jnp.ones((8, 256)), "e4m3", 128, jnp.zeros((8,)), jnp.ones((4, 2))), {}, "pos_to_token_topk must have dtype"),
    ((jnp.ones((8, 256)), "e4m3", 128, None, None, jnp.zeros((8, 1), jnp.int32)), {}, "pos_to_expert must"),
    ((jnp.ones((8, 256)), "e4m3", 128), dict(clamped_count=jnp.zeros(3, jnp.int32)), "requires swiglu_clamp_value"),
    ((jnp.ones((8, 256)), "e4m3", 128), dict(swiglu_clamp_value=1.0, clamped_count=jnp.zeros(4, jnp.int32)),
     "clamped_count must"),
])
def test_bad_inputs(args, kw, match):
  with pytest.raises(ValueError, match=match):
    OP(*args, **kw)


def test_keyword_only_options():
  with pytest.raises(TypeError):
    OP(jnp.ones((8, 256)), "e4m3", 128, None, None, None, True)


def test_not_differentiable(key):
  x, ptt, w, _ = _inputs(key, 8, 128, jnp.float32)
  loss = lambda x, w: OP(x, "e4m3", 128, ptt, w).sf.sum()
  for argnum in (0, 1):
    with pytest.raises(jaxkern.NotDifferentiableError, match="swiglu_forward_and_per_token_cast"):
      jax.grad(loss, argnums=argnum)(x, w)


def test_jit(key):
  x, ptt, w, pte = _inputs(key, 40, 256)
  f = jax.jit(functools.partial(OP, fmt="e4m3", num_per_channels=128, **FLAGS["C"]))
  assert_same(f(x, pos_to_token_topk=ptt, topk_weights=w, pos_to_expert=pte),
              ref.swiglu_forward_and_per_token_cast(x, "e4m3", 128, ptt, w, pte, **FLAGS["C"]))


@pytest.mark.parametrize("h, npc, flags, weights, clamp", [
    (3584, 128, "C", False, 0.5), (1280, 128, "B", True, None), (3584, 3584, "A-round", True, 10.0),
    (1024, 128, "A", True, 10.0),
])
def test_lowers_for_h100(h, npc, flags, weights, clamp):
  e = 32016  # 4001 tokens, top-k 8, padded to 16 per expert
  s = jax.ShapeDtypeStruct
  args = [s((e, 2 * h), jnp.bfloat16), s((e,), jnp.int32)] + ([s((e,), jnp.int32), s((4001, 8), jnp.float32)]
                                                               if weights else [])

  def f(x, pte, *w):
    return OP(x, "e4m3", npc, *(w or (None, None)), pte, **FLAGS[flags], swiglu_clamp_value=clamp,
              clamped_count=None if clamp is None else jnp.zeros(3, jnp.int32), implementation="pallas")

  assert "mosaic_gpu" in lower_for_h100(f, *args).as_text()


_CAST = "builtin.unrealized_conversion_cast"


def _op(value_or_op):
  return getattr(value_or_op, "operation", value_or_op)


def _unreconciled_casts(module) -> list[str]:
  """Register-level ``builtin.unrealized_conversion_cast`` ops of a lowered Mosaic GPU module (vectors, not refs)
  that an op other than a cast uses, but whose chain of casts does not start from values of their result types.
  The GPU's pipeline cannot fold them away and fails with "LLVM Translation failed for operation:
  builtin.unrealized_conversion_cast" (an H200, 2026-11-28: a broadcast handed straight to inline PTX)."""
  bad = []

  def chain_start(op):
    values = list(op.operands)
    while values and len({id(v.owner) for v in values}) == 1 and _op(values[0].owner).name == _CAST:
      producer = _op(values[0].owner)
      if [r.get_name() for r in producer.results] != [v.get_name() for v in values]:
        break
      values = list(producer.operands)
    return [str(v.type) for v in values]

  def visit(op):
    for region in op.regions:
      for block in region.blocks:
        for child in block.operations:
          visit(_op(child))
    if op.name != _CAST:
      return
    types = [str(v.type) for v in list(op.operands) + list(op.results)]
    if not any(t.startswith("vector<") for t in types) or any(t.startswith(("memref<", "!")) for t in types):
      return
    used = any(_op(u.owner).name != _CAST for r in op.results for u in r.uses)
    if used and chain_start(op) != [str(r.type) for r in op.results]:
      bad.append(str(op)[:200])

  visit(module.operation)
  return bad


@pytest.fixture
def cast_check(monkeypatch):
  """The :func:`_unreconciled_casts` of every Mosaic GPU module lowered while the test runs (a list per module)."""
  return capture_mosaic_modules(monkeypatch, keep=_unreconciled_casts)


def test_cast_check_finds_a_broadcast_fed_to_inline_ptx(cast_check):
  """The check flags the construct that failed on the GPU (a broadcast array as an inline-PTX operand) and passes
  the same division with a computed operand."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  from jaxkern import _ieee
  from jaxkern._layouts import row_layout

  lay = row_layout(128, 2, 8)[0]

  def lowered(numerator):
    @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((16, 128), jnp.float32))
    def kernel(x_g, o_g):
      d = 1.0 + jnp.exp(-plgpu.load(x_g, layout=lay, optimized=False).astype(jnp.float32))
      o_g[...] = _ieee.mosaic_ptx("rcp.rn.f32" if numerator is None else "div.rn.f32", lay, (16, 128))(
          *(() if numerator is None else (numerator(d),)), d)

    lower_for_h100(kernel, jax.ShapeDtypeStruct((16, 128), jnp.bfloat16))
    return cast_check.pop()

  assert lowered(jnp.ones_like)
  assert not lowered(lambda d: d * d)
  assert not lowered(None)


@pytest.mark.parametrize("h, npc, flags, clamp", [(2048, 128, "C", 0.5), (1280, 128, "A", None),
                                                  (1024, 1024, "A-round", None)])
def test_no_unreconciled_casts(cast_check, h, npc, flags, clamp):
  """The compiled kernel's module (inline PTX divisions included) has no cast the GPU's pipeline cannot fold."""
  e = 512
  s = jax.ShapeDtypeStruct
  lower_for_h100(lambda x, pte, ptt, w: OP(x, "e4m3", npc, ptt, w, pte, **FLAGS[flags], swiglu_clamp_value=clamp,
                                           clamped_count=None if clamp is None else jnp.zeros(3, jnp.int32),
                                           implementation="pallas"),
                 s((e, 2 * h), jnp.bfloat16), s((e,), jnp.int32), s((e,), jnp.int32), s((64, 8), jnp.float32))
  assert cast_check and not any(cast_check), cast_check


def _assert_kernel_is_reference_jitted(x, ptt, w, pte, npc, flags, clamp):
  """The op and its reference, each jitted on this backend (clamp counters from zero where ``clamp`` is set),
  bit for bit."""
  count = None if clamp is None else jnp.zeros(3, jnp.int32)
  f = functools.partial(OP, fmt="e4m3", num_per_channels=npc, **FLAGS[flags], swiglu_clamp_value=clamp)
  g = functools.partial(ref.swiglu_forward_and_per_token_cast, fmt="e4m3", num_per_channels=npc, **FLAGS[flags],
                        swiglu_clamp_value=clamp)
  weights = {} if flags == "C" else dict(pos_to_token_topk=ptt, topk_weights=w)
  got = jax.jit(lambda x, c: f(x, pos_to_expert=pte, clamped_count=c, **weights))(x, count)
  want = jax.jit(lambda x, c: g(x, pos_to_expert=pte, clamped_count=c, **weights))(x, count)
  assert_same(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("h, npc, flags", [(3584, 128, "C"), (1280, 128, "A-round"), (2048, 2048, "A")])
@pytest.mark.parametrize("clamp", [None, 0.5])
def test_spec_shapes_gpu(key, h, npc, flags, clamp):
  """Compiled kernel vs the reference run by XLA on the same GPU (CUDA expf on both sides)."""
  x, ptt, w, pte = _inputs(key, 32016, h)
  _assert_kernel_is_reference_jitted(x, ptt, w, pte, npc, flags, clamp)


@pytest.mark.gpu
@pytest.mark.parametrize("e, h, flags, clamp", [(1001, 640, "C", 0.5), (37, 256, "A", 10.0), (7, 256, "C", 0.5),
                                                (1001, 384, "B", 0.3)])
def test_clamp_counts_gpu(key, e, h, flags, clamp):
  """Compiled kernel vs the reference on the GPU with clamp counters starting at [1, 2, 3] (XLA adds the kernel's
  counts): the packed bf16 clamp counts over a last block of rows shifted back over the block before (its rows
  written twice, counted once), over chunks of 4 and 1 groups (h=640), over fewer rows than one layout block
  (padded), and a clamp bfloat16 does not hold (0.3: the float32 clamp)."""
  x, ptt, w, pte = _inputs(key, e, h)
  count = jnp.array([1, 2, 3], jnp.int32)
  f = functools.partial(OP, fmt="e4m3", num_per_channels=128, **FLAGS[flags], swiglu_clamp_value=clamp)
  g = functools.partial(ref.swiglu_forward_and_per_token_cast, fmt="e4m3", num_per_channels=128, **FLAGS[flags],
                        swiglu_clamp_value=clamp)
  got = jax.jit(lambda x, c: f(x, pos_to_expert=pte, clamped_count=c))(x, count)
  want = jax.jit(lambda x, c: g(x, pos_to_expert=pte, clamped_count=c))(x, count)
  assert_same(got, want)


def _division_kernel(rows_per_cta=64):
  """A compiled kernel ``x (R, 128) float32 -> (guarded x / d, div.rn x / d)`` with ``d = 1 + exp(-x)``
  (:func:`jaxkern.quant._swiglu.guarded_div` with the kernel's bound against PTX ``div.rn.f32``)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  from jaxkern import _ieee
  from jaxkern._layouts import row_layout
  from jaxkern.quant import _swiglu

  lay = row_layout(128, 4, 16)[0]  # float32 rows straight from GMEM: 4-value vectors

  def run(x):
    r = x.shape[0]
    shape = (rows_per_cta, 128)
    out = jax.ShapeDtypeStruct((r, 128), jnp.float32)

    @functools.partial(plgpu.kernel, out_type=(out, out), grid=(r // rows_per_cta,), grid_names=("i",))
    def kernel(x_g, guarded_g, rn_g):
      rows = pl.ds(jax.lax.axis_index("i") * rows_per_cta, rows_per_cta)
      v = plgpu.load(x_g.at[rows], layout=lay, optimized=False)
      d = 1.0 + jnp.exp(-v)
      guarded_g[rows] = _swiglu.guarded_div(lay, shape, _swiglu._SWISH_FAST_LIMIT)(v, d)
      rn_g[rows] = _ieee.mosaic_ptx("div.rn.f32", lay, shape)(v, d)

    return kernel(x)

  return run


def test_division_kernel_lowers(cast_check):
  """The exhaustive check's kernel lowers for an H100 with no cast the GPU's pipeline cannot fold."""
  lower_for_h100(_division_kernel(), jax.ShapeDtypeStruct((128, 128), jnp.float32))
  assert cast_check and not any(cast_check), cast_check


@pytest.mark.gpu
def test_guarded_division_every_float32_gpu():
  """:func:`jaxkern.quant._swiglu.guarded_div` gives div.rn.f32's bits for the swish quotient
  ``l / (1 + exp(-l))`` of every float32 ``l`` on the GPU."""
  run = _division_kernel()
  rows = 1 << 21  # 2^28 values a chunk, 16 chunks

  @jax.jit
  def mismatches(start):
    bits = jax.lax.iota(jnp.uint32, rows * 128) + start
    x = jax.lax.bitcast_convert_type(bits, jnp.float32).reshape(rows, 128)
    guarded, rn = (jax.lax.bitcast_convert_type(o, jnp.uint32) for o in run(x))
    return jnp.sum(guarded != rn)

  for chunk in range(16):
    bad = int(mismatches(jnp.uint32(chunk << 28)))
    assert bad == 0, (chunk, bad)


@pytest.mark.gpu
@pytest.mark.parametrize("h, npc, flags, clamp", [(1024, 128, "C", None), (1024, 128, "C", 0.5),
                                                  (1280, 128, "A-round", None), (2048, 2048, "A", 0.5)])
def test_guarded_division_gpu(key, h, npc, flags, clamp):
  """The kernel (the swish quotient through :func:`jaxkern.quant._swiglu.guarded_div`) against the reference on
  the GPU, on randn·3 input with every bfloat16 bit pattern in the gate of the first rows (NaN, ±inf, subnormals,
  ±0)."""
  x, ptt, w, pte = _inputs(key, 4001, h)
  patterns = jax.lax.bitcast_convert_type(jnp.arange(1 << 16, dtype=jnp.uint32).astype(jnp.uint16), jnp.bfloat16)
  n = -(-(1 << 16) // h)
  x = x.at[:n, :h].set(jnp.resize(patterns, (n * h,)).reshape(n, h))
  _assert_kernel_is_reference_jitted(x, ptt, w, pte, npc, flags, clamp)

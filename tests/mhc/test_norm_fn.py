"""jaxkern.mhc.pre_norm_fn (+ round_to_tf32, fn_normw_merge, pre_norm_fn_fwd / _bwd): references vs numpy float64
transcriptions, hand backward vs autodiff (float64), kernels in interpret mode vs the references at upstream's
tolerances, H100 lowering, argument checks, zero tokens; upstream's shapes on a GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxkern
from jaxkern import mhc
from jaxkern.mhc import _norm_fn
from jaxkern.reference import mhc_norm as ref
from jaxkern.testing import lower_for_h100

sds = jax.ShapeDtypeStruct


def inputs(key, lead, h, m=4, normw=False):
  """Upstream's generators: residual = randn·(1 + 0.01 m) -> bf16, fn = randn·1e-4·(1 + 0.01 m'), normw = randn·0.1 + 1."""
  kx, kf, kw, kg = jax.random.split(key, 4)
  j, k = m * (m + 2), m * h
  x = (jax.random.normal(kx, (*lead, m, h)) * (1 + 0.01 * jnp.arange(m))[:, None]).astype(jnp.bfloat16)
  fn = jax.random.normal(kf, (j, k)) * 1e-4 * (1 + 0.01 * jnp.repeat(jnp.arange(m), h))[None, :]
  w = jax.random.normal(kw, (k,)) * 0.1 + 1 if normw else None
  g = jax.random.normal(kg, (*lead, j))
  return x, fn, w, g


def np_tf32(v):
  u = np.asarray(v, np.float32).view(np.uint32).astype(np.uint64)
  return (((u + 0x1000) & 0xFFFFE000) % 2**32).astype(np.uint32).view(np.float32)


def np_forward(x, fn, w, eps):
  """numpy float64 transcription of docs/mhc.md, "pre_norm_fn" (fn_eff rounded in float32 first)."""
  fn = np.asarray(fn, np.float32)
  if w is not None:
    fn = fn * np.asarray(w, np.float32)[None, :]
  fn_r = np_tf32(fn).astype(np.float64)
  k = fn.shape[1]
  r = np.asarray(x, np.float64).reshape(-1, k)
  om = r @ fn_r.T
  sq = (r * r).sum(1)
  return om / np.sqrt(sq / k + eps)[:, None], om, sq


def close(a, b, atol, rtol):
  np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------- references

def test_round_to_tf32_matches_numpy_and_rounds_to_nearest_ties_away():
  rng = np.random.default_rng(0)
  v = np.concatenate([rng.standard_normal(1000).astype(np.float32) * 10.0 ** rng.integers(-20, 20, 1000),
                      np.float32([0, -0.0, 1, -1, 1 + 2**-11, -(1 + 2**-11), 1 + 2**-11 - 2**-23, 3e38])])
  got = np.asarray(mhc.round_to_tf32(jnp.asarray(v)))
  np.testing.assert_array_equal(got.view(np.uint32), np_tf32(v).view(np.uint32))
  assert np.all(got.view(np.uint32) & 0x1FFF == 0)
  assert got[-4] == 1 + 2**-10 and got[-3] == -(1 + 2**-10) and got[-2] == 1  # ties away from zero, below the tie
  assert np.all(np.abs(got[:1000] - v[:1000]) <= np.abs(v[:1000]) * 2**-11)
  np.testing.assert_array_equal(np.asarray(mhc.round_to_tf32(jnp.asarray(got))), got)  # idempotent
  with jax.enable_x64(True):
    d = jnp.asarray(v[:10], jnp.float64)
    assert mhc.round_to_tf32(d).dtype == jnp.float64 and np.array_equal(mhc.round_to_tf32(d), d)


@pytest.mark.parametrize("normw", [False, True])
def test_reference_vs_numpy_float64(key, normw):
  x, fn, w, _ = inputs(key, (3, 5), 64, normw=normw)
  got = ref.pre_norm_fn(x, fn, w, norm_eps=1e-6)
  want, om, sq = np_forward(x, fn, w, 1e-6)
  assert got.shape == (3, 5, 24) and got.dtype == jnp.float32
  close(got.reshape(-1, 24), want, atol=1e-7, rtol=1e-5)
  fwd = ref.pre_norm_fn_fwd(x, fn if w is None else ref.fn_normw_merge(fn, w), norm_eps=1e-6)
  close(fwd.out_mul.reshape(-1, 24), om, atol=1e-9, rtol=1e-5)
  close(fwd.sqrsum.reshape(-1), sq, atol=0, rtol=1e-6)


def test_reference_backward_vs_numpy_float64(key):
  x, fn, _, g = inputs(key, (7,), 64)
  fwd = ref.pre_norm_fn_fwd(x, fn, norm_eps=1e-6)
  got = ref.pre_norm_fn_bwd(g, x, fn, fwd.out_mul, fwd.sqrsum, norm_eps=1e-6)
  k = fn.shape[1]
  r = np.asarray(x, np.float64).reshape(-1, k)
  gg, om, sq = (np.asarray(a, np.float64) for a in (g, fwd.out_mul, fwd.sqrsum))
  rho = 1 / np.sqrt(sq / k + 1e-6)
  q = np_tf32((gg * rho[:, None]).astype(np.float32)).astype(np.float64)
  sqg = (gg * om).sum(1) * rho / (sq + 1e-6 * k) / -2
  fn_r = np_tf32(fn).astype(np.float64)
  close(got.grad_residual.reshape(-1, k), q @ fn_r + 2 * r * sqg[:, None], atol=1e-5, rtol=1e-2)  # bf16 output
  close(got.grad_fn, q.T @ r, atol=1e-6, rtol=1e-5)
  assert got.grad_residual.dtype == jnp.bfloat16 and got.grad_fn.dtype == jnp.float32


@pytest.mark.parametrize("normw", [False, True])
def test_hand_backward_matches_autodiff_float64(key, normw):
  x, fn, w, g = inputs(key, (2, 3), 64, normw=normw)
  with jax.enable_x64(True):
    x, fn, g = (jnp.asarray(a, jnp.float64) for a in (x, fn, g))
    w = None if w is None else jnp.asarray(w, jnp.float64)

    def loss(x, fn, w):
      return jnp.sum(ref.pre_norm_fn(x, fn, w, norm_eps=1e-3) * g)

    want = jax.grad(loss, argnums=(0, 1) if w is None else (0, 1, 2))(x, fn, w)
    fn_eff = fn if w is None else ref.fn_normw_merge(fn, w)
    fwd = ref.pre_norm_fn_fwd(x, fn_eff, norm_eps=1e-3)
    hand = ref.pre_norm_fn_bwd(g, x, fn_eff, fwd.out_mul, fwd.sqrsum, norm_eps=1e-3)
    np.testing.assert_allclose(hand.grad_residual, want[0], rtol=1e-11, atol=1e-14)
    gfn = hand.grad_fn if w is None else hand.grad_fn * w[None, :]
    np.testing.assert_allclose(gfn, want[1], rtol=1e-11, atol=1e-14)
    # the op's custom_vjp on the reference path gives the same gradients, and passes check_grads
    op = functools.partial(mhc.pre_norm_fn, norm_eps=1e-3, implementation="reference")
    got = jax.jit(jax.grad(lambda x, fn, w: jnp.sum(op(x, fn, w) * g), argnums=(0, 1) if w is None else (0, 1, 2)))(x, fn, w)
    for a, b in zip(got, want):
      np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-14)
    args = (x, fn) if w is None else (x, fn, w)
    check_grads(lambda *a: op(*a), args, order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------- kernels (interpret)

@pytest.mark.parametrize("lead, h, normw, n_splits", [
    ((100,), 64, False, 16),  # partial last tile, 4 splits of K = 256
    ((13,), 64, True, 1),  # fewer tokens than a tile (padded), one split
    ((2, 50), 128, False, 16),  # leading dims, 8 splits
])
def test_forward_interpret_vs_reference(key, lead, h, normw, n_splits):
  x, fn, w, _ = inputs(key, lead, h, normw=normw)
  got = jax.jit(functools.partial(mhc.pre_norm_fn, norm_eps=1e-6, n_splits=n_splits, implementation="interpret"))(x, fn, w)
  want = ref.pre_norm_fn(x, fn, w, norm_eps=1e-6)
  assert got.shape == (*lead, 24) and got.dtype == jnp.float32
  close(got, want, atol=1e-3, rtol=1e-3)  # upstream's tolerance
  close(got, want, atol=1e-6 * float(jnp.max(jnp.abs(want))), rtol=1e-5)  # only the summation order differs
  fn_eff = fn if w is None else ref.fn_normw_merge(fn, w)
  parts = jax.jit(functools.partial(mhc.pre_norm_fn_fwd, norm_eps=1e-6, n_splits=n_splits, implementation="interpret"))(x, fn_eff)
  wparts = ref.pre_norm_fn_fwd(x, fn_eff, norm_eps=1e-6)
  close(parts.sqrsum, wparts.sqrsum, atol=0, rtol=1e-5)
  close(parts.out_mul, wparts.out_mul, atol=1e-7, rtol=1e-5)


def test_split_count_does_not_change_much(key):
  x, fn, _, _ = inputs(key, (70,), 128)
  f = lambda s: jax.jit(functools.partial(mhc.pre_norm_fn, n_splits=s, implementation="interpret"))(x, fn)
  assert [_norm_fn.num_splits(70, 512, s, 132) for s in (1, 3, 16)] == [1, 2, 8]
  close(f(1), f(16), atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("lead, h, normw", [((100,), 64, True), ((200,), 128, False), ((13,), 64, False)])
def test_backward_interpret_vs_reference(key, lead, h, normw):
  x, fn, w, g = inputs(key, lead, h, normw=normw)
  argnums = (0, 1) if w is None else (0, 1, 2)

  def vg(impl):
    f = lambda x, fn, w: jnp.sum(mhc.pre_norm_fn(x, fn, w, implementation=impl) * g)
    return jax.jit(jax.value_and_grad(f, argnums=argnums))(x, fn, w)

  (val, grads), (wval, wgrads) = vg("interpret"), vg("reference")
  close(val, wval, atol=1e-3, rtol=1e-3)
  assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.float32
  close(grads[0], wgrads[0], atol=1e-5, rtol=1.6e-2)  # bf16 defaults
  close(grads[1], wgrads[1], atol=3e-2, rtol=1e-3)  # upstream's fn tolerance
  scale = float(jnp.max(jnp.abs(wgrads[1])))
  close(grads[1], wgrads[1], atol=1e-5 * scale, rtol=1e-4)  # much tighter in fact
  if w is not None:
    close(grads[2], wgrads[2], atol=1e-5 * float(jnp.max(jnp.abs(wgrads[2]))), rtol=1e-4)
  # the public backward op on the forward's sums, with C > 1 token chunks at K = 512
  fwd = ref.pre_norm_fn_fwd(x, fn if w is None else ref.fn_normw_merge(fn, w))
  fn_eff = fn if w is None else ref.fn_normw_merge(fn, w)
  got = jax.jit(functools.partial(mhc.pre_norm_fn_bwd, implementation="interpret"))(g, x, fn_eff, fwd.out_mul, fwd.sqrsum)
  want = ref.pre_norm_fn_bwd(g, x, fn_eff, fwd.out_mul, fwd.sqrsum)
  close(got.grad_residual, want.grad_residual, atol=1e-5, rtol=1.6e-2)
  close(got.grad_fn, want.grad_fn, atol=1e-5 * scale, rtol=1e-4)


def test_zero_tokens(key):
  x, fn, w, _ = inputs(key, (0,), 64, normw=True)
  for impl in ("interpret", "reference"):
    f = functools.partial(mhc.pre_norm_fn, implementation=impl)
    assert jax.jit(f)(x, fn, w).shape == (0, 24)
    gx, gfn, gw = jax.jit(jax.grad(lambda x, fn, w: jnp.sum(f(x, fn, w)), argnums=(0, 1, 2)))(x, fn, w)
    assert gx.shape == x.shape and not np.any(gfn) and not np.any(gw) and gfn.shape == fn.shape


def test_argument_checks(key):
  x, fn, w, _ = inputs(key, (4,), 64)
  with pytest.raises(ValueError, match="residual: mhc_mult"):
    mhc.pre_norm_fn(jnp.zeros((4, 2, 64), jnp.bfloat16), jnp.zeros((8, 128)))
  with pytest.raises(ValueError, match="fn must have shape"):
    mhc.pre_norm_fn(x, fn[:, :128])
  with pytest.raises(ValueError, match="fn must have shape"):
    mhc.pre_norm_fn(x, fn[:16])
  with pytest.raises(ValueError, match="norm_weight must have shape"):
    mhc.pre_norm_fn(x, fn, jnp.ones((10,)))
  with pytest.raises(ValueError, match="n_splits"):
    mhc.pre_norm_fn(x, fn, n_splits=0)
  with pytest.raises(ValueError, match="norm_eps"):
    mhc.pre_norm_fn(x, fn, norm_eps=-1.0)
  with pytest.raises(ValueError, match="residual"):
    mhc.pre_norm_fn(jnp.zeros((256,), jnp.bfloat16), fn)
  with pytest.raises(ValueError, match="sqrsum must have shape"):
    mhc.pre_norm_fn_bwd(jnp.zeros((4, 24)), x, fn, jnp.zeros((4, 24)), jnp.zeros((5,)))
  with pytest.raises(ValueError, match="normw must have shape"):
    mhc.fn_normw_merge(fn, jnp.ones((3,)))
  with pytest.raises(jaxkern.KernelUnavailableError, match="multiple of 256"):
    mhc.pre_norm_fn(jnp.zeros((4, 4, 32), jnp.bfloat16), jnp.zeros((24, 128)), implementation="interpret")
  with pytest.raises(jaxkern.NotDifferentiableError):
    jax.grad(lambda f: jnp.sum(mhc.pre_norm_fn_fwd(x, f, implementation="reference").mixes))(fn)


@pytest.mark.parametrize("t, h", [(4001, 7168), (13, 1280), (8192, 2560), (64, 64)])
def test_kernels_lower_for_h100(t, h):
  x, fn, g = sds((t, 4, h), jnp.bfloat16), sds((24, 4 * h), jnp.float32), sds((t, 24), jnp.float32)
  lower_for_h100(functools.partial(mhc.pre_norm_fn_fwd, implementation="pallas"), x, fn)
  lower_for_h100(lambda *a: mhc.pre_norm_fn_bwd(*a, implementation="pallas"), g, x, fn, g, sds((t,), jnp.float32))
  lower_for_h100(lambda x, fn: jax.grad(lambda x, fn: jnp.sum(mhc.pre_norm_fn(x, fn, implementation="pallas")),
                                        argnums=(0, 1))(x, fn), x, fn)


# ---------------------------------------------------------------------------------------------- GPU, spec shapes

@pytest.mark.gpu
@pytest.mark.parametrize("t", [4096, 8192])
@pytest.mark.parametrize("h", [1280, 2560, 7168])
@pytest.mark.parametrize("normw", [False, True])
def test_gpu_correctness(key, t, h, normw):
  x, fn, w, g = inputs(key, (1, t), h, normw=normw)
  argnums = (0, 1) if w is None else (0, 1, 2)

  def vg(impl):
    f = lambda x, fn, w: jnp.sum(mhc.pre_norm_fn(x, fn, w, implementation=impl) * g)
    return jax.jit(jax.value_and_grad(f, argnums=argnums))(x, fn, w)

  out = jax.jit(functools.partial(mhc.pre_norm_fn, implementation="pallas"))(x, fn, w)
  close(out, jax.jit(ref.pre_norm_fn)(x, fn, w), atol=1e-3, rtol=1e-3)
  (_, grads), (_, wgrads) = vg("pallas"), vg("reference")
  close(grads[0], wgrads[0], atol=1e-5, rtol=1.6e-2)
  close(grads[1], wgrads[1], atol=3e-2, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [13, 48, 512])
@pytest.mark.parametrize("h", [1280, 2560, 4096, 7168])
def test_gpu_split_k_correctness(key, t, h):
  x, fn, _, _ = inputs(key, (1, t), h)
  out = jax.jit(functools.partial(mhc.pre_norm_fn, n_splits=16, implementation="pallas"))(x, fn)
  close(out, jax.jit(ref.pre_norm_fn)(x, fn), atol=1e-3, rtol=1e-3)


def test_float32_reference_autodiff_passes_fn_gradient_through_rounding(key):
  x, fn, _, g = inputs(key, (9,), 64)
  got = jax.grad(lambda f: jnp.sum(ref.pre_norm_fn(x, f) * g))(fn)
  fwd = ref.pre_norm_fn_fwd(x, fn)
  want = ref.pre_norm_fn_bwd(g, x, fn, fwd.out_mul, fwd.sqrsum).grad_fn
  close(got, want, atol=2e-3 * float(jnp.max(jnp.abs(want))), rtol=1e-3)  # want rounds q to TF32 (2^-11)
  assert float(jnp.max(jnp.abs(want))) > 0


# ---------------------------------------------------------------------------------------------- XLA:GPU round trips

_WALK = ("pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call", "remat", "checkpoint")


def narrowing_round_trips(jaxpr):
  """``convert_element_type`` chains ``wide float -> narrower float -> wide float`` in the XLA code of a jaxpr
  (nested jit / custom_jvp / custom_vjp jaxprs included, kernel bodies not): XLA:GPU removes such a round
  trip (``xla_allow_excess_precision``, openxla/xla#41605) while XLA:CPU keeps it, so code that relies on it
  is right in CPU tests and wrong on the GPU."""
  found, narrowed = [], {}

  def walk(jx):
    for e in jx.eqns:
      if e.primitive.name == "convert_element_type":
        src, dst = e.invars[0], e.outvars[0]
        sd, dd = getattr(src.aval, "dtype", None), dst.aval.dtype
        if sd is not None and jnp.issubdtype(sd, jnp.floating) and jnp.issubdtype(dd, jnp.floating):
          if jnp.finfo(dd).bits < jnp.finfo(sd).bits:
            narrowed[dst] = sd
          elif src in narrowed and jnp.finfo(dd).bits > jnp.finfo(sd).bits:
            found.append(f"{narrowed[src]} -> {sd} -> {dd}")
      if e.primitive.name in _WALK:
        for p in e.params.values():
          inner = getattr(p, "jaxpr", p)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(jaxpr.jaxpr)
  return found


def test_narrowing_round_trip_detector_flags_the_old_split():
  def old_split(v):  # the split that lost `lo` on the H100 (2026-11-26)
    hi = v.astype(jnp.bfloat16)
    return hi, (v - hi.astype(jnp.float32)).astype(jnp.bfloat16)

  v = jnp.zeros((4, 8), jnp.float32)
  assert narrowing_round_trips(jax.make_jaxpr(jax.jit(old_split))(v)) == ["float32 -> bfloat16 -> float32"]
  assert narrowing_round_trips(jax.make_jaxpr(_norm_fn.split_bf16)(v)) == []


def test_split_bf16_is_exact_without_float_round_trips():
  """``hi + lo == v`` for TF32 values over the whole exponent range, ``hi`` = ``v`` truncated to bf16."""
  rng = np.random.default_rng(1)
  v = rng.standard_normal(20000).astype(np.float32) * np.float32(10.0) ** rng.integers(-30, 30, 20000)
  v = np_tf32(np.concatenate([v, np.float32([0, -0.0, 1, -1, 1 + 2**-10, 3 * 2**-10, 65504, -1e-30])]))
  hi, lo = jax.jit(_norm_fn.split_bf16)(jnp.asarray(v))
  assert hi.dtype == lo.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(hi, np.float64) + np.asarray(lo, np.float64), v.astype(np.float64))
  np.testing.assert_array_equal(np.asarray(hi, np.float32).view(np.uint32), v.view(np.uint32) & 0xFFFF0000)
  assert np.count_nonzero(np.asarray(lo, np.float32)) > 10000  # the low part is really there


def test_xla_code_of_the_kernel_paths_has_no_float_round_trips(key):
  """The XLA code around the pre_norm_fn kernels (hi/lo splits, partial sums) must not depend on a
  ``float32 -> bfloat16 -> float32`` round trip: the H100 forward was wrong because XLA:GPU removed one."""
  x, fn, _, g = inputs(key, (70,), 64)
  fwd = jax.make_jaxpr(functools.partial(mhc.pre_norm_fn_fwd, implementation="interpret"))(x, fn)
  saved = ref.pre_norm_fn_fwd(x, fn)
  bwd = jax.make_jaxpr(functools.partial(mhc.pre_norm_fn_bwd, implementation="interpret"))(
      g, x, fn, saved.out_mul, saved.sqrsum)
  vg = jax.make_jaxpr(jax.value_and_grad(
      lambda x, fn: jnp.sum(mhc.pre_norm_fn(x, fn, implementation="interpret") * g), argnums=(0, 1)))(x, fn)
  assert narrowing_round_trips(fwd) == [] and narrowing_round_trips(bwd) == [] and narrowing_round_trips(vg) == []

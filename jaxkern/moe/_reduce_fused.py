"""``reduce_fused``: weighted fp32 sum of each token's expert-output rows (docs/moe.md, "Reduce").

Mosaic GPU kernel on a ``(token blocks, hidden chunks)`` grid, one warpgroup per CTA, with no
shared memory: a CTA owns ``BT`` tokens and a chunk of ``W`` hidden elements (the whole row
when ``H <= 8192``). The positions, weights and row scales of its ``BT*K`` slots are scalar
loads issued back to back; then, per token and slot in order, a ``lax.cond`` on ``p >= 0``
loads ``x[p, chunk]`` straight from GMEM into registers (16-byte vector loads in a strided
layout) and accumulates ``acc = x * s + acc`` in fp32, so skipped slots cost no memory
traffic (with routing from other EP ranks most slots are -1). The accumulator is cast and
stored straight to GMEM. The latency of one slot's load is hidden by the other CTAs of the
SM (no shared memory, so occupancy is bounded only by registers); on an H200 this beat a
TMA-into-SMEM version (whose SMEM, sized for all ``K`` slots, capped occupancy at two CTAs
per SM) by 1.4-2.0x. The last token block starts at ``T - BT`` (it recomputes a row of the
previous block, with identical results), so ragged ``T`` needs no masking.

Fused multiply-add: Mosaic GPU lowers vector ``a * b`` and ``a + b`` (``FragmentedArray``
in ``jax/experimental/mosaic/gpu/fragmented_array.py``: ``mulf``/``addf``) to
``arith.mulf``/``arith.addf`` with ``fastmath<contract>``; there is no explicit fma
primitive (``jax.lax`` has none, and no Mosaic GPU rule emits ``math.fma``). In this
kernel's lowered module every accumulation step is such a ``mulf`` whose only use is such
an ``addf`` in the same branch (a CPU test checks this), which LLVM's NVPTX backend fuses
into ``fma.rn.f32``: the single rounding the definition asks for (docs/moe.md, "Reduce"). The ``gpu``-marked test checks
the resulting bits against the exact-FMA reference.
In interpret mode on CPU, XLA contracts ``a * b + c`` into an FMA as well. The per-slot
scale ``w * x_sf[p]`` and the final ``acc * sf`` are scalar / lone multiplies, rounded once.

A position outside ``[0, N)`` (``N = x.shape[0]``) is an unused slot, like -1: the ``lax.cond``
that guards each slot's row load tests ``0 <= p < N`` on the scalar position it already loaded,
and the ``x_sf`` read of the slot's scale uses the position clamped into ``[0, N)`` (its value is
then unused). The reference does the same.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _checks, _config, _dispatch
from jaxkern._autodiff import vary_like
from jaxkern.moe import _fused_grad, _routing
from jaxkern.reference import moe as ref
from jaxkern.types import QuantTensor

CHUNK = 256  # H must be a multiple
_MAX_WIDTH = 8192  # hidden elements per CTA: 64 fp32 accumulator registers per thread
_TOKEN_BLOCK = 2
_FP8_MAX = 448.0


def _width(h: int) -> int:
  """The largest multiple of ``CHUNK`` dividing ``h`` that is at most ``_MAX_WIDTH``."""
  return max(w for w in range(CHUNK, min(h, _MAX_WIDTH) + 1, CHUNK) if h % w == 0)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def _reduce_kernel(x, x_sf, topk_weights, token_topk_to_pos, sf, out_dtype, interpret=None):
  n, h = x.shape
  t, k = token_topk_to_pos.shape
  out_dtype = jnp.dtype(out_dtype)
  width, bt = _width(h), min(_TOKEN_BLOCK, t)
  vec = 16 // x.dtype.itemsize  # 16-byte loads
  while width % (vec * 128):
    vec //= 2
  layout = plgpu.Layout.WG_STRIDED((width,), vec_size=vec)
  optional = [a is not None for a in (x_sf, topk_weights, sf)]

  @functools.partial(
      plgpu.kernel,
      out_type=jax.ShapeDtypeStruct((t, h), out_dtype),
      grid=(h // width, pl.cdiv(t, bt)),
      grid_names=("j", "i"),
      interpret=interpret,
  )
  def kernel(*refs):
    x_g, pos_g, *rest, o_g = refs
    sf_x_g, w_g, sf_g = (rest.pop(0) if present else None for present in optional)
    i, j = lax.axis_index("i"), lax.axis_index("j")
    t0 = jnp.minimum(i * bt, t - bt)
    cols = pl.ds(j * width, width)
    positions = [pos_g[t0 + slot // k, slot % k] for slot in range(bt * k)]
    scales = [jnp.float32(1) if w_g is None else w_g[t0 + slot // k, slot % k] for slot in range(bt * k)]
    if sf_x_g is not None:  # the scale of an unused slot (p outside [0, N)) is read in bounds and not used
      scales = [s * sf_x_g[jnp.minimum(jnp.maximum(p, 0), n - 1)] for s, p in zip(scales, positions)]

    def accumulate(acc, p, s):
      return plgpu.load(x_g.at[p, cols], layout=layout).astype(jnp.float32) * s + acc

    for row in range(bt):
      acc = plgpu.layout_cast(jnp.zeros((width,), jnp.float32), layout)
      for slot in range(row * k, (row + 1) * k):
        p = positions[slot]
        acc = lax.cond((p >= 0) & (p < n), functools.partial(accumulate, p=p, s=scales[slot]), lambda a: a, acc)
      if sf_g is not None:
        acc = acc * sf_g[0]
      if out_dtype == jnp.float8_e4m3fn:
        acc = jnp.minimum(jnp.maximum(acc, -_FP8_MAX), _FP8_MAX)
      o_g[t0 + row, cols] = acc.astype(out_dtype)

  args = [a for a in (x_sf, topk_weights, sf) if a is not None]
  return kernel(x, token_topk_to_pos, *args)


def reduce_fused(x: jax.Array | QuantTensor | tuple[jax.Array, jax.Array], topk_weights: jax.Array | None,
                 token_topk_to_pos: jax.Array, *, fp8_format: str = "", sf: jax.Array | None = None,
                 implementation: str | None = None) -> jax.Array:
  """For each token, the fp32 FMA-accumulated sum of its slots' rows times their weights.

  ``acc = 0; for k: if 0 <= p = token_topk_to_pos[t, k] < N: acc = fma(x[p], w[t, k] * x_sf[p], acc)``;
  then ``acc * sf[0]`` if ``sf`` is given, cast to the output dtype (e4m3: saturating).

  Args:
    x: ``(N, H)`` float32 or bfloat16 expert outputs in the fused layout (``H`` a multiple of 256),
      or a pair ``(x, x_sf)`` (a tuple or :class:`jaxkern.types.QuantTensor`) with a ``(N,)`` float32
      per-row scale.
    topk_weights: ``(T, K)`` float32 routing weights, or ``None`` (weight 1).
    token_topk_to_pos: ``(T, K)`` int32 fused row of each slot; -1 = unused (see below).
    fp8_format: ``""`` (output in ``x.dtype``) or ``"e4m3"`` (float8_e4m3fn, saturated to ±448).
    sf: ``(1,)`` float32 global output scale, only with ``fp8_format="e4m3"``.
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``
      (see :mod:`jaxkern._config`).

  Returns:
    ``(T, H)`` array of ``x.dtype`` (float8_e4m3fn with ``fp8_format="e4m3"``). Tokens without a
    used slot get ``+0`` (times ``sf[0]``).

  Raises:
    ValueError: a rank, dtype or shape above not met, an unknown ``fp8_format``, ``sf`` without
      ``fp8_format="e4m3"``, or a concrete ``token_topk_to_pos`` holding a value below -1 or ``>= N``.

  XLA instead of a kernel: zero-size problems (``T``, ``N`` or ``H`` = 0); every other case runs the kernel.

  Bad mappings (identical in the kernel, interpret mode included, and the reference, under ``jit``):
  an entry of ``token_topk_to_pos`` outside ``[0, N)`` is an unused slot, exactly like -1 (concrete,
  non-traced arrays are range-checked instead: ``ValueError``). Several slots of a token naming one
  fused row add that row once per slot, in slot order (the sum is defined, not an error).

  Checked mode: inside ``checkify.checkify(f, errors=checkify.user_checks)`` (``from
  jax.experimental import checkify``) the first slot (flat order ``t*K + k``) holding an entry
  outside ``{-1} ∪ [0, N)`` or a fused row already named by an earlier slot (of any token) is
  reported with its position and value. Without checkify the check costs nothing: it is dropped,
  and XLA removes its predicate from the compiled program.

  Differentiation (``jax.custom_vjp``) w.r.t. ``x``, ``x_sf``, ``topk_weights`` and ``sf``; with
  ``c = w[t, k] * x_sf[p] * sf[0]`` and ``g`` the output cotangent (for e4m3 output: zero where the
  saturation clipped, as ``jnp.clip``'s derivative): ``dx[p] = c * g[t]`` on each used slot's row and
  zero on every other row, ``dw[t, k] = x_sf[p] sf[0] <g[t], x[p]>``, ``dx_sf[p] = w[t, k] sf[0]
  <g[t], x[p]>`` and ``dsf = sum c/sf[0] <g[t], x[p]>``. One Mosaic GPU kernel writes ``dx`` and the
  slot dot products (:mod:`jaxkern.moe._fused_grad`); only the dot products of perturbed arguments
  are formed. It needs ``H`` a multiple of 256 and float32 / bfloat16 data (always true here); the
  e4m3 output recomputes the unclipped sums with the forward kernel. Several slots naming one row
  race in the backward kernel (one slot's value lands); the XLA path adds them.
  """
  x, x_sf = (x[0], x[1]) if isinstance(x, tuple) else (x, None)
  x = _checks.as_array("x", x)
  _checks.check_rank("x", x, 2)
  _checks.check_dtype("x", x, (jnp.float32, jnp.bfloat16))
  _checks.check_multiple("x", x, 1, CHUNK)
  token_topk_to_pos = _routing.check_index("token_topk_to_pos", token_topk_to_pos, 2, (jnp.int32,))
  if x_sf is not None:
    x_sf = _checks.as_array("x_sf", x_sf)
    _checks.check_dtype("x_sf", x_sf, (jnp.float32,))
    _routing.check_shape("x_sf", x_sf, (x.shape[0],))
  if topk_weights is not None:
    topk_weights = _checks.as_array("topk_weights", topk_weights)
    _checks.check_dtype("topk_weights", topk_weights, (jnp.float32,))
    _routing.check_shape("topk_weights", topk_weights, token_topk_to_pos.shape)
  if fp8_format not in ("", "e4m3"):
    raise ValueError(f"fp8_format must be '' or 'e4m3', got {fp8_format!r}")
  if sf is not None:
    if fp8_format != "e4m3":
      raise ValueError("sf is only allowed with fp8_format='e4m3'")
    sf = _checks.as_array("sf", sf)
    _checks.check_dtype("sf", sf, (jnp.float32,))
    _routing.check_shape("sf", sf, (1,))
  n = x.shape[0]
  _routing.check_values_below("token_topk_to_pos", token_topk_to_pos, n)
  _routing.debug_check_positions("reduce_fused", token_topk_to_pos, n)
  out_dtype = jnp.float8_e4m3fn if fp8_format == "e4m3" else x.dtype
  x, x_sf, topk_weights, sf = vary_like(x, x_sf, topk_weights, sf)  # under shard_map: one vma type
  return _reduce(x, x_sf, topk_weights, token_topk_to_pos, sf, jnp.dtype(out_dtype),
                 _config.get_implementation(implementation))


def _unsupported(x, out_dtype) -> str | None:
  """Why :func:`_reduce_kernel` cannot run (the public op's checks rule these out; its backward and
  :func:`accumulate`'s other callers may not)."""
  if x.dtype not in (jnp.float32, jnp.bfloat16):
    return f"x of dtype {x.dtype} (the kernel reads float32 or bfloat16)"
  if x.shape[1] % CHUNK:
    return f"H = {x.shape[1]} is not a multiple of {CHUNK}"
  if jnp.dtype(out_dtype) not in (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn):
    return f"an output of dtype {out_dtype}"
  return None


def _xla(x, x_sf, topk_weights, token_topk_to_pos, sf, out_dtype):
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype == jnp.float32:
    x = x.astype(jnp.float32)  # the fp32 accumulator itself (the reference casts to x's dtype)
  fp8_format = "e4m3" if out_dtype == jnp.float8_e4m3fn else ""
  return ref.reduce_fused(x if x_sf is None else (x, x_sf), topk_weights, token_topk_to_pos, fp8_format=fp8_format,
                          sf=sf).astype(out_dtype)


def accumulate(op: str, x, x_sf, topk_weights, token_topk_to_pos, sf, out_dtype, implementation: str):
  """The forward of :func:`reduce_fused` with any output dtype (float32: the accumulator, after ``sf``
  and before any cast); kernel or XLA path by ``implementation``, recorded under ``op``."""
  t, n = token_topk_to_pos.shape[0], x.shape[0]
  return _dispatch.run(
      op, implementation,
      kernel=lambda interpret: _reduce_kernel(x, x_sf, topk_weights, token_topk_to_pos, sf, out_dtype,
                                              interpret=_config.mosaic_interpret(interpret)),
      xla=lambda: _xla(x, x_sf, topk_weights, token_topk_to_pos, sf, out_dtype),
      unsupported=_unsupported(x, out_dtype), empty=t == 0 or n == 0 or x.shape[1] == 0)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Needs:
  """Which cotangents a backward pass computes (static residual)."""

  x: bool
  dots: bool  # the slot dot products, for the cotangents of topk_weights, x_sf and sf


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _reduce(x, x_sf, topk_weights, token_topk_to_pos, sf, out_dtype, implementation):
  return accumulate("reduce_fused", x, x_sf, topk_weights, token_topk_to_pos, sf, out_dtype, implementation)


def _reduce_fwd(x, x_sf, topk_weights, token_topk_to_pos, sf, out_dtype, implementation):
  args = [None if a is None else a.value for a in (x, x_sf, topk_weights, token_topk_to_pos, sf)]
  needs = _Needs(x=x.perturbed, dots=any(a is not None and a.perturbed for a in (x_sf, topk_weights, sf)))
  return accumulate("reduce_fused", *args, out_dtype, implementation), (*args, needs)


def _reduce_bwd(out_dtype, implementation, residuals, d_out):
  x, x_sf, topk_weights, pos, sf, needs = residuals
  if isinstance(d_out, SymbolicZero):
    return None, None, None, None, None
  n = x.shape[0]
  if out_dtype == jnp.float8_e4m3fn:  # through the saturation: zero beyond ±448 (as jnp.clip's derivative)
    pre_cast = accumulate("reduce_fused.bwd", x, x_sf, topk_weights, pos, sf, jnp.float32, implementation)
    _, clip_vjp = jax.vjp(lambda a: jnp.clip(a, -_FP8_MAX, _FP8_MAX), pre_cast)
    (d_out,) = clip_vjp(d_out.astype(jnp.float32))
  valid = (pos >= 0) & (pos < n)
  safe = jnp.where(valid, pos, 0)
  ones = jnp.ones(pos.shape, jnp.float32)
  w = ones if topk_weights is None else topk_weights
  row_sf = ones if x_sf is None or n == 0 else x_sf[safe]
  sf0 = jnp.float32(1) if sf is None else sf[0]
  dx, dots = _fused_grad.scatter_grad("reduce_fused.bwd", d_out, x if needs.dots else None, pos, w * row_sf * sf0,
                                      n=n, out_dtype=x.dtype, implementation=implementation)
  d_w = d_x_sf = d_sf = None
  if needs.dots:
    if topk_weights is not None:
      d_w = dots * row_sf * sf0
    if x_sf is not None:
      d_x_sf = jnp.zeros((n,), jnp.float32).at[jnp.where(valid, pos, n)].add(dots * w * sf0, mode="drop")
    if sf is not None:
      d_sf = jnp.sum(dots * w * row_sf).reshape(1)
  return dx if needs.x else None, d_x_sf, d_w, None, d_sf


_reduce.defvjp(_reduce_fwd, _reduce_bwd, symbolic_zeros=True)

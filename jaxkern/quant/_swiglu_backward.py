"""Fused SwiGLU backward and per-token e4m3 cast of the input gradient (docs/quant.md, "Fused SwiGLU").

Two Mosaic GPU kernels, picked by ``num_per_channels``: 128-column scale groups (:data:`GROUPED_NPC`) run the
grouped kernel of this module, 32-column groups the step kernel of :mod:`jaxkern.quant._swiglu_backward_steps`
(this kernel with four 32-wide groups per 128-column step). Both compute the same values (below) and are bit-exact
against the reference; they differ only in how a row's columns are grouped. On one H200 (2026-11-28) the grouped
kernel was 320.4 / 317.2 µs on the npc=128 h=2048 runner shapes (clamp None / 0.5; TileKernels 364.7 / 362.7).
At npc=32, on one H200 (2026-11-29, runner, CUPTI, cold L2), the step kernel was at or ahead of TileKernels on
every shape: E=32x8 K8 h=2048 307.8 / 310.8 µs (TileKernels 368.6 / 367.3), h=4096 605.2 / 608.1 (661.1 / 657.1),
h=7168 1041.8 / 1047.6 (1050.2 / 1061.5); E=4x64 h=2048 305.5 / 307.6 (424.2 / 421.6), h=4096 597.5 / 600.7
(715.3 / 708.9), h=7168 1028.5 / 1034.2 (1100.6 / 1111.6).

Grouped kernel, built like the forward (:mod:`jaxkern.quant._swiglu`): straight GMEM -> registers -> GMEM, no
SMEM or TMA. Each CTA takes one register layout block of rows (the last block shifted back to end at the last row;
the overlap is written twice with equal values) and a chunk of :data:`CHUNK_COLS` columns of the ``h`` gate
columns (grid axis ``g``), walked one scale group of ``num_per_channels`` columns per iteration of a loop, so that
only one group's values are live in registers, besides the next group's inputs, loaded one iteration ahead. Per
group it loads the FP8 gate columns ``[c, c + npc)``, the FP8 value columns ``[h + c, h + c + npc)``, their two
sf (strided loads of the layout-A sf columns ``c / npc`` and ``(h + c) / npc``) and the bf16 ``grad_out`` columns
``[c, c + npc)``, all in the same :func:`jaxkern._layouts.row_layout` (``npc`` wide, 8-element vectors; a
128-wide group on 16 lanes per row: 8 values per thread and array), so that every value meets its partner and its
gradient in the same thread. Then in float32 registers: dequantisation, the optional clamp, ``t = 1 + exp(-x)``,
``act = (x / t) · y`` and ``s = 1 / t`` correctly rounded (the PTX ``div.rn.f32`` and ``rcp.rn.f32``: IEEE
round-to-nearest-even, so the same values as the reference's division; interpret mode has no inline PTX and uses
:func:`jaxkern._ieee.newton_div`), ``gw = (g · w) · s``, ``dx = (gw · y) · fma(x, 1 - s, 1)``, ``dy = gw · x``,
the bf16 ``out = act · w`` and ``x_grad``, the per-token e4m3 cast of the float32 ``dx`` and ``dy`` groups (abs-max
row reduction, :func:`jaxkern.reference.quant.scale_factors` with ``div.rn.f32``, in interpret mode
:func:`jaxkern._ieee.exact_div`; saturating conversion), and ``g · act`` added elementwise over the chunk's
groups (one row reduction per chunk gives its row sums). The sf are stored straight into layout A
(``(E, 2h/npc)``, one strided float32 store per row and group, as the per-token cast loads a QuantTensor's
layout-A sf), which spares XLA a transpose of ``E·2h/npc`` floats (not yet timed against a contiguous
``(2h/npc, E)`` store plus that transpose). No thread reads what another wrote, so the kernel runs without
Pallas's automatic warpgroup barriers around each store (:data:`jaxkern._layouts.NO_AUTO_BARRIERS`).

Fused multiply-add: Mosaic GPU has no fma primitive (``jax.lax`` has none either). ``x * (1 - s) + 1`` is written
as a multiply whose only use is an add; Mosaic GPU emits both with ``fastmath<contract>`` and LLVM's NVPTX backend
fuses such a pair into ``fma.rn.f32`` (as :mod:`jaxkern.moe._reduce_fused` relies on; a CPU test checks the lowered
module, the ``gpu`` test the bits). XLA on CPU contracts the pair as well (interpret mode). No other product in the
kernel feeds an add (``1 + exp(-x)`` adds no product) but the elementwise ``g · act`` sums, whose contraction the
weight-gradient tolerance allows, and the correctly rounded division's own residuals
(:func:`jaxkern._ieee.newton_div`, which needs them fused: in interpret mode only). The step kernel computes the
same steps with the same fused multiply-add.

Steps done outside the kernel, by XLA:

* the per-row top-k weight ``weight.reshape(-1)[pos_to_token_topk[p]]`` (a data-dependent gather of one scalar
  per row, :func:`jaxkern.reference.quant.row_weights`), loaded by the kernel as a row vector;
* ``weight_grad``: Mosaic GPU Pallas has no global atomics, so the kernel writes float32 per-row partial sums of
  each chunk ``(chunks, E)``; XLA adds the chunks and scatters the row sums to the rows' slots
  (:func:`jaxkern.reference.quant.scatter_weight_grad`).

In interpret mode ``exp`` is XLA's CPU ``exp`` (not CUDA's ``expf``), so interpret-mode results equal the
reference run on the CPU, and compiled results the reference run on the GPU.

Timing (one H200, 2026-11-28, E=32x8 K8 N=37376 h=7168 npc=128 clamp=0.5, the worst of the TileKernels shapes):
1077.8 µs against TileKernels' 1065.6 µs and an earlier row-block kernel's 3083.2 µs (one group at a time on row
blocks, since removed; this kernel took 1302.0 µs with 512-column chunks and no prefetch, 1179.2 with the prefetch
alone; see :data:`CHUNK_COLS`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _checks, _config, _dispatch, _ieee
from jaxkern._layouts import NO_AUTO_BARRIERS, row_layout
from jaxkern.quant import _swiglu_backward_steps as steps
from jaxkern.quant import _tiling as tiling
from jaxkern.quant import _validate as validate
from jaxkern.quant._nan import abs_key, gpu_nan, key_value
from jaxkern.quant._per_token_cast import to_e4m3
from jaxkern.reference import quant as ref
from jaxkern.types import QuantTensor, SwigluBackward

NUM_PER_CHANNELS = (32, 128)

# The group width run by the grouped kernel; 32-wide groups run the step kernel
# (:mod:`jaxkern.quant._swiglu_backward_steps`, four groups per 128-column step), on an H200 (2026-11-29, E=32x8 K8,
# clamp None / 0.5) 307.8 / 310.8 µs at h=2048 and 1041.8 / 1047.6 at h=7168 against TileKernels' 368.6 / 367.3 and
# 1050.2 / 1061.5 (the grouped kernel with 32-wide groups took 524.7 / 523.8 µs at h=2048 on 2026-11-28).
GROUPED_NPC = 128

# Gate columns per CTA of the grouped kernel (16 groups of 128). On an H200 (2026-11-28, E=32x8 K8 N=37376 h=7168
# npc=128 clamp=0.5): 1077.8 µs with 2048 columns and the prefetch, against 1179.2 µs with 512 (the forward's chunk
# width) and the prefetch, 1302.0 µs with 512 and no prefetch (TileKernels 1065.6 µs).
CHUNK_COLS = 2048

# Lanes sharing a row of a 128-wide group: 16 (8 values per thread and array). 8 lanes (16 values) timed equal on
# an H200 (2026-11-28, E=32x8 h=7168 npc=128 clamp=0.5: 1290.9 against 1291.2 µs) with 153 registers against 106.
_ROW_LANES = 16


def _layout(npc):
  """``(layout, rows per layout block)`` of one group: bf16 (the widest stored type) sets 8-element vectors,
  :data:`_ROW_LANES` lanes per row."""
  return row_layout(npc, 2, _ROW_LANES)


def backward_kernel(q, sf, grad, weight, *, npc, round_sf, clamp, interpret):
  """``q`` ``(R, 2h)`` e4m3, ``sf`` ``(R, 2h/npc)`` float32, ``grad`` ``(R, h)`` bf16, ``weight`` ``(1, R)``
  float32 (``R`` at least one layout block) -> ``(out (R, h) bf16, x_grad (R, 2h) bf16, x_grad_q (R, 2h) e4m3,
  x_grad_sf (R, 2h/npc) float32 (layout A), row sums (chunks, R) float32)``."""
  r, h = grad.shape
  nseg = h // npc  # groups per half
  chunk = min(max(1, CHUNK_COLS // npc), nseg)
  num_chunks = ref.cdiv(nseg, chunk)
  lay, unit = _layout(npc)
  vec = lay.reduce(1)
  rt = unit
  num_ctas = pl.cdiv(r, rt)
  out_type = steps.output_types(r, h, nseg, num_chunks)
  c = None if clamp is None else float(np.float32(clamp))
  # The PTX div.rn / rcp.rn compiled; newton_div / exact_div there instead cost 12% (1450.9 against 1291.2 µs on an
  # H200, 2026-11-28, E=32x8 h=7168 npc=128 clamp=0.5).
  swish, sf_div = _ieee.mosaic_swish_divisions(lay, (rt, npc), vec, (rt,), interpret)

  @functools.partial(plgpu.kernel, out_type=out_type, grid=(num_chunks, num_ctas), grid_names=("g", "i"),
                     compiler_params=NO_AUTO_BARRIERS, interpret=interpret)
  def kernel(q_g, sf_g, g_g, w_g, c_g, out_g, xg_g, xq_g, xsf_g, dot_g):
    rows = pl.ds(jnp.minimum(lax.axis_index("i") * rt, r - rt), rt)
    maxv = c_g[0]

    def fetch(j):
      """Group ``j``'s inputs as loaded: ``(x, y)`` e4m3 (columns ``j·npc`` and ``h + j·npc``), their sf, ``g``
      bf16."""
      col = j * npc
      load = lambda ref_, c0: plgpu.load(ref_.at[rows, pl.ds(c0, npc)], layout=lay, optimized=False)
      sf_pair = [plgpu.load(sf_g.at[rows, k], layout=vec, optimized=False) for k in (j, nseg + j)]
      return load(q_g, col), load(q_g, h + col), *sf_pair, load(g_g, col)

    def cast(v):
      """Per-token e4m3 cast of one float32 group: ``(data, sf)``."""
      amax = key_value(jnp.max(abs_key(v, interpret), axis=1), interpret)
      s, inv = ref.scale_factors(amax, maxv, "e4m3", round_sf, div=sf_div)
      return to_e4m3(gpu_nan(v * inv[:, None], interpret), interpret), gpu_nan(s, interpret)

    def group(j, inputs, w, acc):
      """Group ``j`` of each half from its :func:`fetch`ed ``inputs``: stores its outputs, returns ``acc`` plus
      its elementwise ``g · act`` (the row sums are taken once per chunk)."""
      xq, yq, sx, sy, g = inputs
      col = j * npc
      xv = xq.astype(jnp.float32) * sx[:, None]
      yv = yq.astype(jnp.float32) * sy[:, None]
      act, dx, dy = steps.swiglu_grads(xv, yv, g.astype(jnp.float32), w, c, swish)
      out_g[rows, pl.ds(col, npc)] = (act * w).astype(jnp.bfloat16)
      for half, v in ((0, dx), (1, dy)):
        cols = pl.ds(half * h + col, npc)
        xg_g[rows, cols] = v.astype(jnp.bfloat16)
        data, s_out = cast(v)
        xq_g[rows, cols] = data
        xsf_g[rows, half * nseg + j] = s_out
      return acc + g * act

    def body(chunk_index, nlocal):
      """Groups ``chunk_index·chunk + t`` of each half for ``t < nlocal`` (static), one per iteration of a loop
      (two per iteration timed equal on an H200, 2026-11-28): one group's values live at a time, and the next
      group's inputs, loaded one iteration ahead (carried through the loop)."""
      seg0 = chunk_index * chunk
      w = plgpu.load(w_g.at[0, rows], layout=vec, optimized=False)[:, None]
      acc = plgpu.layout_cast(jnp.zeros((rt, npc), jnp.float32), lay)

      def step(t, carry):
        acc, inputs = carry
        ahead = fetch(seg0 + jnp.minimum(t + 1, nlocal - 1))  # the last iteration reloads its own group
        return group(seg0 + t, inputs, w, acc), ahead

      acc, _ = lax.fori_loop(0, nlocal, step, (acc, fetch(seg0)))
      dot_g[chunk_index, rows] = jnp.sum(acc, axis=1)

    tiling.over_chunks(body, lax.axis_index("g"), nseg, chunk)

  # The largest e4m3 value as a one-element host constant, loaded by the kernel (not folded in interpret mode).
  consts = np.full((1,), ref.FP8_MAX, np.float32)
  return kernel(q, sf, grad, weight, consts)


@functools.partial(jax.jit, static_argnames=("npc", "round_sf", "clamp", "interpret"))
def _kernel(q, sf, grad, weight, pos_to_token_topk, *, npc, round_sf, clamp, interpret):
  """``q`` ``(E, 2h)``, ``sf`` ``(E, 2h/npc)``, ``grad`` ``(E, h)``, ``weight`` ``(T, k)``, ``pos_to_token_topk``
  ``(E,)`` -> :class:`SwigluBackward`: the weight gather, the kernel and the weight-gradient scatter in one jit
  (eager interpret kernels mixed with eager XLA ops can deadlock XLA:CPU). ``npc`` = :data:`GROUPED_NPC` runs
  :func:`backward_kernel`, 32 :func:`jaxkern.quant._swiglu_backward_steps.backward_kernel`."""
  e = q.shape[0]
  grouped = npc == GROUPED_NPC
  rp = max(e, _layout(npc)[1] if grouped else steps.block_rows(npc, q.shape[1] // 2))

  def pad(a):  # fewer rows than one layout block: zero rows (tiny inputs only)
    return jnp.pad(a, ((0, rp - e),) + ((0, 0),) * (a.ndim - 1))

  row_w = ref.row_weights(pos_to_token_topk, weight, e)
  kernel = backward_kernel if grouped else steps.backward_kernel
  out, xg, xq, xsf, dots = kernel(pad(q), pad(sf), pad(grad), pad(row_w).reshape(1, rp), npc=npc, round_sf=round_sf,
                                  clamp=clamp, interpret=interpret)
  weight_grad = ref.scatter_weight_grad(dots[:, :e].sum(axis=0), pos_to_token_topk, weight.shape)
  return SwigluBackward(out[:e], QuantTensor(xq[:e], xsf[:e]), xg[:e], weight_grad)


def _check(x, grad_out, weight, pos_to_token_topk, token_topk_to_pos, npc):
  """Argument checks (docs/quant.md, "Fused SwiGLU" and "Non-finite inputs and edge cases"); returns
  ``(q (E, 2h), sf, grad_out (E, h), weight, pos, t2p)``."""
  if not (isinstance(x, tuple) and len(x) == 2):
    raise ValueError("x must be a QuantTensor (data, sf)")
  q, sf = (_checks.as_array(n, a) for n, a in (("x[0]", x[0]), ("x[1]", x[1])))
  if q.ndim not in (2, 3):
    raise ValueError(f"x[0] must have rank 2 or 3, got rank {q.ndim}")
  _checks.check_dtype("x[0]", q, (jnp.float8_e4m3fn,))
  if npc not in NUM_PER_CHANNELS:
    raise ValueError(f"num_per_channels must be 32 or 128, got {npc}")
  h2 = q.shape[-1]
  if h2 % (2 * npc):
    raise ValueError(f"x[0] must have 2h columns with h % num_per_channels == 0 (num_per_channels={npc}), "
                     f"got x[0].shape {tuple(q.shape)}")
  h = h2 // 2
  e = int(np.prod(q.shape[:-1]))
  q = q.reshape(e, h2)
  _checks.check_rank("x[1]", sf, 2)
  _checks.check_dtype("x[1]", sf, (jnp.float32,))
  _checks.check_shape("x[1] (sf)", sf, (e, h2 // npc), " (layout A)")
  grad_out = _checks.as_array("grad_out", grad_out)
  _checks.check_dtype("grad_out", grad_out, (jnp.bfloat16,))
  if grad_out.ndim not in (2, 3) or grad_out.shape[-1] != h or int(np.prod(grad_out.shape[:-1])) != e:
    raise ValueError(f"grad_out must have {e} rows of h={h} columns, got shape {tuple(grad_out.shape)}")
  grad_out = grad_out.reshape(e, h)
  arrays = []
  for name, a, rank, dtype in (("weight", weight, 2, jnp.float32), ("pos_to_token_topk", pos_to_token_topk, 1,
                                                                    jnp.int32),
                               ("token_topk_to_pos", token_topk_to_pos, 2, jnp.int32)):
    a = _checks.as_array(name, a)
    _checks.check_rank(name, a, rank)
    _checks.check_dtype(name, a, (dtype,))
    arrays.append(a)
  weight, pos_to_token_topk, token_topk_to_pos = arrays
  _checks.check_shape("pos_to_token_topk", pos_to_token_topk, (e,))
  _checks.check_shape("weight", weight, token_topk_to_pos.shape, " (the shape of token_topk_to_pos)")
  return q, sf, grad_out, weight, pos_to_token_topk, token_topk_to_pos


# The gate's lower bound: 1 / (1 + exp(-x)) is subnormal from x < -87.34 (1 + exp(-x) > 2^126), outside the
# correctly rounded division's domain (the kernel's rcp.rn / div.rn against the reference's division).
GATE_MIN = -87.0


def _gate_out_of_range(x):
  """Elementwise ``x`` is not a finite value above :data:`GATE_MIN` (NaN included), numpy or jax."""
  return ~((x > GATE_MIN) & (x < np.inf))


def _gate(q, sf, npc: int):
  """The dequantised gate half ``q[:, :h] · sf`` in float32 (numpy or jax, as the inputs)."""
  xp = jnp if isinstance(q, jax.Array) or isinstance(sf, jax.Array) else np
  h = q.shape[1] // 2
  return xp.asarray(q)[:, :h].astype(np.float32) * xp.repeat(xp.asarray(sf)[:, :h // npc], npc, axis=1)


@functools.partial(jax.jit, static_argnums=2)
def _any_gate_out_of_range(q, sf, npc: int):
  """One fused pass on the device: whether a concrete ``x`` needs the host-side search for its first bad value."""
  return jnp.any(_gate_out_of_range(_gate(q, sf, npc)))


def _check_gate_range(op: str, q, sf, npc: int) -> None:
  """The dequantised gate half ``x = q[:, :h] · sf`` (float32, one rounding, as the kernel and the reference) is
  finite and above :data:`GATE_MIN`: concrete ``ValueError`` / traced checkify report. A concrete ``x`` on the
  device is scanned there first (the whole array reaches the host only when it breaks the precondition)."""
  traced = _checks.is_traced(q) or _checks.is_traced(sf)
  if not traced:
    with jax.ensure_compile_time_eval():  # concrete inputs closed over by a jit: evaluated now
      if not q.size or not bool(_any_gate_out_of_range(q, sf, npc)):
        return
  gate = _gate(q, sf, npc) if traced else _gate(np.asarray(q), np.asarray(sf), npc)
  _checks.check_and_debug_check(op, "dequantised x", gate, _gate_out_of_range,
                                f"a finite gate value > {GATE_MIN:g} (from about -87.3 down, 1 / (1 + exp(-x)) is "
                                "subnormal: outside the exact division's domain)")


def swiglu_backward_and_per_token_cast(x: jax.typing.ArrayLike, grad_out: jax.Array, weight: jax.Array,
                                       pos_to_token_topk: jax.Array, token_topk_to_pos: jax.Array,
                                       num_per_channels: int, *, round_sf: bool = False,
                                       swiglu_clamp_value: float | None = None,
                                       implementation: str | None = None) -> SwigluBackward:
  """SwiGLU backward from the FP8 forward input, fused with a per-token e4m3 cast of the input gradient (docs/quant.md,
  "Fused SwiGLU").

  Per element (row ``p``, column ``c < h``; float32, each step one IEEE rounding): ``x = q[p, c] · sf``,
  ``y = q[p, h + c] · sf`` (their groups' sf); with a clamp ``C``, ``x`` clamped to ``C`` from above and ``y`` to
  ``[-C, C]``; ``w`` the row's top-k weight (0 where ``pos_to_token_topk < 0``); ``t = 1 + exp(-x)``,
  ``act = (x / t) · y``, ``s = 1 / t``, ``gw = (g · w) · s``, ``dx = (gw · y) · fma(x, 1 - s, 1)`` (one rounding
  of ``x·(1 - s) + 1``; 0 where ``x > C``), ``dy = gw · x`` (0 where ``|y| > C``).

  Args:
    x: QuantTensor ``(q, sf)``: ``q`` float8_e4m3fn ``(E, 2h)`` (a 3-D ``(B, S, 2h)`` is flattened to rows),
      ``sf`` float32 layout A ``(E, 2h/num_per_channels)`` (the forward input cast per token, e.g.
      :func:`jaxkern.quant.per_token_cast` with ``fmt="e4m3"``).
    grad_out: bfloat16 ``(E, h)`` (or ``q``'s leading shape by ``h``): the cotangent of the weighted activation.
    weight: float32 ``(T, k)`` top-k weights; row ``p`` uses ``weight.reshape(-1)[pos_to_token_topk[p]]``.
    pos_to_token_topk: int32 ``(E,)``: each row's flat slot, negative for padding rows (weight 0, no
      ``weight_grad``). Precondition: every index below ``T·k``. A concrete index ``>= T·k`` raises
      ``ValueError``; a traced one gives an unspecified result (the reference drops its ``weight_grad``), and
      ``checkify.checkify(f, errors=checkify.user_checks)`` reports it (docs/usage.md, "Bad values under jit").
    token_topk_to_pos: int32 ``(T, k)``: only its shape is used (with ``pos_to_token_topk`` a mutually inverse
      pair, as :func:`jaxkern.moe.get_fused_mapping` makes them).
    num_per_channels: 32 or 128, dividing ``h``: the group width of ``x``'s sf and of the output cast.
    round_sf: power-of-two output sf (docs/quant.md, "Scale factors").
    swiglu_clamp_value: the clamp ``C`` (a float, taken as float32) or None.
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    :class:`jaxkern.types.SwigluBackward` ``(out, x_grad_quant, x_grad, weight_grad)``: ``out`` ``(E, h)`` bf16
    (``act · w`` rounded), ``x_grad_quant`` a QuantTensor of ``(E, 2h)`` e4m3 and its ``(E, 2h/npc)`` float32
    layout-A sf: the per-token cast (amax clamp minimum 1e-4, ``round_sf``) of the **float32** ``[dx | dy]``;
    ``x_grad`` ``(E, 2h)`` bf16 ``[dx | dy]`` rounded; ``weight_grad`` ``(T, k)`` float32: zeros, plus for each row
    with a slot ``j >= 0`` the float32 sum ``Σ_c f32(grad_out[p, c]) · act[p, c]`` (unweighted activation) at
    ``j`` (rows sharing a slot add up). ``E = 0``: empty arrays and a zero ``weight_grad``.

  Raises:
    ValueError (naming the argument): ``x`` not a QuantTensor of e4m3 data of rank 2 or 3 and a float32 layout-A
    sf of the matching shape, ``num_per_channels`` not 32 / 128 or not dividing ``h``, ``grad_out`` not bf16 with
    ``E`` rows of ``h``, ``weight`` / ``token_topk_to_pos`` / ``pos_to_token_topk`` of another rank, dtype or shape,
    a concrete ``pos_to_token_topk`` entry ``>= T·k``, a concrete ``x`` with a gate value not finite or ``<= -87``
    (below).

  XLA (the reference) instead of the kernel: zero rows (``E = 0``) only. The top-k weight gather, the
  ``weight_grad`` chunk sums and scatter run in XLA around the kernel (see
  :mod:`jaxkern.quant._swiglu_backward`).

  Numerics: ``out``, ``x_grad`` and ``x_grad_quant`` bit-identical to
  :func:`jaxkern.reference.quant.swiglu_backward_and_per_token_cast` run on the same backend (``exp`` differs
  between XLA's CPU and CUDA's ``expf``, which the GPU kernel and XLA on GPU share); ``weight_grad`` sums in
  another order (quant.md: compared with ``atol = rtol = 1e-4``).

  Precondition: every dequantised gate value ``x = q[p, c] · sf`` (``c < h``, before the clamp) finite and
  ``x > -87`` (below that ``s`` is subnormal, outside the exact division's domain; a NaN or infinite ``x`` is
  outside it too). A concrete ``x`` that breaks it raises ``ValueError``; a traced one gives an unspecified result
  (kernel and reference may differ) and ``checkify.checkify(f, errors=checkify.user_checks)`` reports the first
  such value (docs/usage.md, "Bad values under jit"). Non-finite ``y`` and ``grad_out`` propagate as the formulas
  say (IEEE products, no division), in kernel and reference alike.

  Differentiation: not differentiable (it is itself a backward pass; :func:`jaxkern.modeling.swiglu` uses it as
  one); ``jax.grad`` through it raises :class:`jaxkern.NotDifferentiableError`.
  """
  npc = num_per_channels
  q, sf, grad_out, weight, pos_to_token_topk, token_topk_to_pos = _check(x, grad_out, weight, pos_to_token_topk,
                                                                         token_topk_to_pos, npc)
  op = "swiglu_backward_and_per_token_cast"
  _checks.check_and_debug_check(op, "pos_to_token_topk", pos_to_token_topk, lambda v: v >= weight.size,
                                f"a negative value (padding) or a slot in [0, {weight.size}) (T·k = weight.size)")
  _check_gate_range(op, q, sf, npc)
  q, sf, grad_out, weight = validate.guard(op, q, sf, grad_out, weight)
  e = q.shape[0]

  def kernel(interpret):
    return _kernel(q, sf, grad_out, weight, pos_to_token_topk, npc=npc, round_sf=round_sf, clamp=swiglu_clamp_value,
                   interpret=_config.mosaic_interpret(interpret))

  def reference():
    return ref.swiglu_backward_and_per_token_cast((q, sf), grad_out, weight, pos_to_token_topk, token_topk_to_pos,
                                                  npc, round_sf=round_sf, swiglu_clamp_value=swiglu_clamp_value)

  return _dispatch.run(op, implementation, kernel=kernel, xla=reference, empty=e == 0)

"""Fused SwiGLU forward and per-token e4m3 cast (docs/quant.md, "Fused SwiGLU").

Mosaic GPU kernel built like the per-token cast's column-segment path
(:func:`jaxkern.quant._per_token_cast.row_kernel`): straight GMEM -> registers -> GMEM, no SMEM or TMA. Each CTA
takes a block of rows (the last block shifted back to end at the last row) and a chunk of
:data:`jaxkern.quant._per_token_cast.SEG_CHUNK` groups of 128 columns (grid axis ``g``), :data:`_LANES` lanes per
row of a group, or the whole row when one scale covers it (``num_per_channels == h``, whole warps per row). Per
group it loads the gate columns ``[c, c + npc)`` and the value columns ``[h + c, h + c + npc)`` in the same
:func:`jaxkern._layouts.row_layout`, so every value meets its partner in the same thread, then computes in float32
registers: the optional clamp and its per-row flag counts (compiled, on bfloat16 input with a clamp bfloat16
holds: on the packed bf16 pairs before the widening, :func:`packed_clamp`), ``e = exp(-l)``, ``d = 1 + e``,
``g = l / d`` correctly rounded (the GPU's ``/`` is approximate: PTX ``div.rn.f32``'s bits through its Newton fast
path with one range check per register vector, :func:`guarded_div`),
``act = g · r``, ``act · w``, the group's NaN-propagating abs-max (row reduction), sf and sf_inv
(:func:`jaxkern.reference.quant.scale_factors` with ``div.rn.f32``), the saturating e4m3 conversion, and stores
data and sf (float32 ``(groups, rows)`` turned into layout A by the wrapper, or layouts B / C written directly with
zeroed padding rows, as the per-token cast does).
Interpret mode has no inline PTX and divides with :func:`jaxkern._ieee.newton_div` and
:func:`jaxkern._ieee.exact_div` (the same bits).

A CTA issues the loads of all the groups of its chunk before the first group's math and stores (GMEM stores may
alias the input as far as the compilers know, so nothing moves a load above a store), and the kernel runs without
Pallas's automatic warpgroup barriers around every store (:data:`jaxkern._layouts.NO_AUTO_BARRIERS`: no thread
reads what another wrote; the cross-warp row reductions of whole-row groups synchronise themselves).

The packed clamp (PTX ``min / max / set .bf16x2`` on pairs of values, the flags summed as int32 masks and decoded
once per chunk) replaced a float32 clamp with float32 0 / 1 flags per value: NVIDIA H200, 2026-11-29 (CUPTI, cold
L2, median of 20, bit-exact), E=32x8 K8 N=35952 clamp 0.5, h=1024 82.1 -> 64.3 µs, h=2048 151.7 -> 116.7
(TileKernels 70.34 / 138.19). Timed only together with the per-CTA atomic counters below (which cost 8-19 µs at
h=1024 / 2048): h=2048 with ``pos_to_expert`` 155.7 -> 134.6 (138.4), h=3584 257.3 -> 229.7 (414.6), registers
at h=2048 119 -> 78.

Steps done outside the kernel, by XLA:

* the per-row top-k weight ``topk_weights.reshape(-1)[pos_to_token_topk[p]]``: a data-dependent gather of one
  scalar per row, which a register-layout load cannot express (Mosaic GPU loads whole tiles by static or
  scalar offsets); the wrapper gathers the ``(E,)`` weights (``4·E`` bytes) and the kernel loads them as a
  row vector;
* the clamp counters' final sum: the kernel writes float32 per-row counts of its chunk (exact, at most ``h``) and
  XLA sums them in int32. Each CTA adding its chunk's counts into the counters with ``red.global.add`` (inline
  PTX) was slower: H200, 2026-11-29, E=32x8 K8 clamp 0.5, float32 clamp h=1024 82.1 -> 83.3 µs, h=2048
  151.7 -> 155.5; with the packed clamp h=1024 64.3 -> 72.4, h=2048 116.7 -> 135.7.

Rows with ``pos_to_expert < 0`` get e4m3 zeros and sf 0 and are not counted. In interpret mode ``exp`` is XLA's
CPU ``exp`` (not CUDA's ``expf``), so interpret-mode results equal the reference run on the CPU, and compiled
results the reference run on the GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, vector

from jaxkern import _checks, _config, _dispatch, _ieee
from jaxkern._layouts import NO_AUTO_BARRIERS, row_layout
from jaxkern.quant import _tiling as tiling
from jaxkern.quant import _validate as validate
from jaxkern.quant._nan import abs_key, gpu_nan, key_value
from jaxkern.quant._per_token_cast import SEG_CHUNK, to_e4m3
from jaxkern.reference import quant as ref
from jaxkern.types import QuantTensor, QuantTensorWithClampedCount

NUM_COUNTERS = 3  # #(left > C), #(right > C), #(right < -C)


# |l| at most this keeps the swish denominator d = 1 + exp(-l) in [1, 2^126) (1 + e^87 ~ 6.1e37 < 2^126 ~ 8.5e37;
# e^88 ~ 1.7e38 is past it), where div.rn.f32's Newton fast path needs none of its rescaling: rcp.approx.ftz of d
# stays normal (not flushed to zero) and the quotient is ±0, a subnormal l over d = 2 exactly (exp(-l) rounds to
# 1), or normal. Checked for every float32 l on an H200 (:func:`guarded_div`).
_SWISH_FAST_LIMIT = 87.0


def _f32_hex(v: float) -> str:
  """``v`` as a PTX float32 literal (``0f3F800000``)."""
  return "0f%08X" % int(np.asarray(v, np.float32).view(np.uint32))


def _guarded_div_asm(n: int, hi: float) -> str:
  """PTX of ``n`` correctly rounded float32 quotients ``$n+i / $2n+i`` into ``$i``: each by div.rn.f32's Newton
  fast path (``y = rcp.approx(d)`` refined once, ``q = l·y``, ``q + (l - d·q)·y`` with the remainder negated so
  that ``±0 / d`` keeps its sign), and all ``n`` again by ``div.rn.f32`` behind one branch when a numerator is
  above ``hi`` in magnitude or NaN (``setp.gtu``: unordered compares true)."""
  num, den = (lambda i: f"${n + i}"), (lambda i: f"${2 * n + i}")
  lines = ["{", ".reg .pred p;", ".reg .f32 a, y, t, q, s;", ".reg .f32 " + ", ".join(f"o{i}" for i in range(n)) + ";"]
  for i in range(n):
    lines.append(f"abs.f32 a, {num(i)};")
    lines.append(f"setp.gtu.f32 p, a, {_f32_hex(hi)};" if i == 0 else f"setp.gtu.or.f32 p, a, {_f32_hex(hi)}, p;")
  for i in range(n):
    lines += [f"rcp.approx.ftz.f32 y, {den(i)};", f"neg.f32 t, {den(i)};", "fma.rn.f32 t, t, y, 0f3F800000;",
              "fma.rn.f32 y, y, t, y;", f"mul.rn.f32 q, {num(i)}, y;", f"neg.f32 s, {num(i)};",
              f"fma.rn.f32 s, {den(i)}, q, s;", "neg.f32 s, s;", f"fma.rn.f32 o{i}, s, y, q;"]
  lines.append("@!p bra DONE;")
  lines += [f"div.rn.f32 o{i}, {num(i)}, {den(i)};" for i in range(n)]
  lines.append("DONE:")
  lines += [f"mov.f32 ${i}, o{i};" for i in range(n)]
  lines.append("}")
  return "\n".join(lines)


def guarded_div(layout, shape, hi: float):
  """``f(num, den)``: the correctly rounded float32 ``num / den`` (div.rn.f32's bits) of ``shape`` arrays in the
  register layout ``layout`` inside a compiled Mosaic GPU kernel, for a ``den`` that is a normal float32 in
  ``[1, 2^126)`` wherever ``|num| <= hi`` (the swish quotient ``l / (1 + exp(-l))`` with ``hi`` =
  :data:`_SWISH_FAST_LIMIT`). Each value takes div.rn.f32's Newton fast path, and a whole register vector
  takes ``div.rn.f32`` itself when one of its numerators is above ``hi`` in magnitude or NaN
  (:func:`_guarded_div_asm`). Not for interpret mode (inline PTX).

  Why the bits are div.rn.f32's: the fast path is div.rn.f32's own (which it takes when its range check, FCHK,
  passes), and for ``|l| <= 87`` it needs none of the rescaling: ``d`` is normal and below 2^126, so
  ``rcp.approx.ftz`` gives a normal reciprocal, and the quotient is ±0, normal, or a subnormal ``l`` over ``d = 2``
  exactly (``y = 0.5``, ``q`` rounded once, the remainder exact). Every other input (``|l| > 87``, ±inf, NaN)
  goes to ``div.rn.f32``. The remainder is computed negated (``-(d·q - l)``) so that ``-0 / d`` stays -0
  (``l - d·q`` would give ``-0 + +0 = +0``). Checked on the GPU against ``div.rn.f32`` for every float32 ``l``
  (all 2^32 bit patterns; tests/quant/test_swiglu.py, ``test_guarded_division_every_float32_gpu``; NVIDIA H200,
  2026-11-29).

  Why: ``div.rn.f32`` compiles to 10 SASS instructions per division on its fast path (MUFU.RCP, FCHK, five FFMA,
  and BSSY / BRA / BSYNC around a call of the slow path); with one FSETP per value and one branch per register
  vector (8 values on bfloat16 input) this needs ~7.4 (MUFU.RCP, four FFMA, FMUL, FSETP, 3/8 of a branch).
  NVIDIA H200, 2026-11-29 (CUPTI, cold L2, median of 20, two passes, bit-exact), E=32x8 K8 N=35952 h=1024 no
  clamp: ``div.rn.f32`` 55.26 / 55.95 µs, this 50.32 / 50.02 (TileKernels 50.63); the scale factors' divisions
  through the same guard (both operands range-checked) were no faster (53.30 / 51.10) and keep div.rn.f32.
  E=4x64 h=1024 no clamp 55.30 / 55.58 -> 51.52 / 51.39 (TileKernels 50.53) and E=32x8 h=1024 clamp 0.5
  63.89 / 64.66 -> 60.75 / 61.02 (70.34), both with the scale factors guarded too."""
  ret = plgpu.ShapeDtypeStruct(shape, jnp.float32, layout=layout)

  @plgpu.inline_mgpu(arg_types=(layout, layout), return_type=ret)
  def div(_, num, den):
    f32 = ir.F32Type.get()
    pos = lambda i: ir.DenseI64ArrayAttr.get([i])
    regs = np.empty_like(num.registers)
    for idx, nv in np.ndenumerate(num.registers):
      dv = den.registers[idx]
      if isinstance(nv.type, ir.VectorType):
        n = ir.VectorType(nv.type).shape[0]
        nums = [vector.extract(nv, dynamic_position=[], static_position=pos(i)) for i in range(n)]
        dens = [vector.extract(dv, dynamic_position=[], static_position=pos(i)) for i in range(n)]
      else:
        n, nums, dens = 1, [nv], [dv]
      res_ty = f32 if n == 1 else llvm.StructType.get_literal([f32] * n)
      constraints = ",".join(["=f"] * n + ["f"] * (2 * n))
      out = llvm.inline_asm(res_ty, nums + dens, _guarded_div_asm(n, hi), constraints)
      if not isinstance(nv.type, ir.VectorType):
        regs[idx] = out
        continue
      vec = llvm.mlir_undef(nv.type)
      for i in range(n):
        q = out if n == 1 else llvm.extractvalue(f32, out, [i])
        vec = vector.insert(q, vec, dynamic_position=[], static_position=pos(i))
      regs[idx] = vec
    return mgpu_fa.FragmentedArray(_registers=regs, _layout=num.layout, _is_signed=None)

  return div


def _silu_times(left, right, clamp, count, div=_ieee.newton_div):
  """``(act, flags if count else None)`` of one group's float32 halves (docs/quant.md, "Fused SwiGLU"): ``flags`` are the
  elementwise 0 / 1 float32 indicators of ``left > C``, ``right > C``, ``right < -C``, which the caller sums
  elementwise over its groups and reduces along the row once (a row reduction per group and counter cost
  cross-lane shuffles). ``div``: the correctly rounded division of ``l / (1 + exp(-l))``
  (:func:`jaxkern._ieee.newton_div`, or :func:`guarded_div` in a compiled kernel that can hold
  it)."""
  counts = None
  if count:
    counts = [jnp.where(f, 1.0, 0.0) for f in (left > clamp, right > clamp, right < -clamp)]
  if clamp is not None:
    left, right = jnp.minimum(left, clamp), jnp.minimum(jnp.maximum(right, -clamp), clamp)
  return div(left, 1.0 + jnp.exp(-left)) * right, counts


def _bf16_bits(v: float) -> int:
  """The bfloat16 bit pattern of ``v`` (a bfloat16 value) repeated in both halves of a 32-bit word, as int32."""
  b = int(np.asarray(v, jnp.bfloat16).view(np.uint16))
  return int(np.int32(np.uint32((b << 16) | b)))


def packs_clamp(dtype, clamp) -> bool:
  """Whether :func:`packed_clamp` gives the float32 clamp's values and flags: bfloat16 halves and a clamp that
  bfloat16 holds exactly (then ``min`` / ``max`` / ``>`` against ``±C`` agree between the two types)."""
  if clamp is None or dtype != jnp.bfloat16:
    return False
  c = np.float32(clamp)
  return bool(np.float32(np.asarray(c, jnp.bfloat16)) == c or np.isnan(c))


def packed_clamp(layout, shape, nlocal: int, clamp: float, count: bool):
  """``f(halves)``: the SwiGLU clamp of ``nlocal`` groups' bfloat16 ``(left, right)`` pairs (``shape`` arrays in
  the register layout ``layout``) on packed pairs of values, inside a compiled Mosaic GPU kernel (inline PTX, no
  interpreter): ``min.NaN.bf16x2`` of ``left`` and ``C``, ``min(max(right, -C), C)`` (``C`` a bfloat16 value,
  :func:`packs_clamp`: the float32 clamp's values, NaN included), and with ``count`` the flags ``left > C``,
  ``right > C``, ``right < -C`` as ``set.gt / set.lt .u32.bf16x2`` masks (0xFFFF per flagged half) summed in
  int32 per register of a thread over all the groups. A sum ``S`` of masks with ``A`` low and ``B`` high halves
  set is ``65535·A - 65536·B`` mod 2^32, so ``U = -S`` gives ``A = U & 0xFFFF``, ``B - A = U >> 16`` (arithmetic)
  and the count ``A + B``, exact while a register's counts stay below 2^15.

  Returns ``(clamped, counts)``: ``clamped`` the ``nlocal`` bfloat16 ``(left, right)`` pairs, ``counts`` (with
  ``count``) three float32 ``shape`` arrays holding each register's count in its first element and zeros
  elsewhere, so that a row sum gives the row's flag count."""
  bf = plgpu.ShapeDtypeStruct(shape, jnp.bfloat16, layout=layout)
  f32 = plgpu.ShapeDtypeStruct(shape, jnp.float32, layout=layout)
  ret = [bf] * (2 * nlocal) + ([f32] * NUM_COUNTERS if count else [])  # flat (the lowering takes a flat list)
  c_hi, c_lo = _bf16_bits(clamp), _bf16_bits(-clamp)

  @plgpu.inline_mgpu(arg_types=([[layout, layout] for _ in range(nlocal)],), return_type=ret)
  def clamp_all(_, halves):
    i32 = ir.IntegerType.get_signless(32)
    pos = lambda i: ir.DenseI64ArrayAttr.get([i])
    const = lambda v: arith.constant(i32, v)
    asm = lambda instr, *a: llvm.inline_asm(i32, list(a), f"{instr} $0, $1, $2;", "=r" + ",r" * len(a))
    hi, lo = const(c_hi), const(c_lo)

    def words(vec):
      n = ir.VectorType(vec.type).shape[0] // 2
      v32 = vector.bitcast(ir.VectorType.get((n,), i32), vec)
      return [vector.extract(v32, dynamic_position=[], static_position=pos(i)) for i in range(n)]

    def from_words(ws, ty):
      v = llvm.mlir_undef(ir.VectorType.get((len(ws),), i32))
      for i, w in enumerate(ws):
        v = vector.insert(w, v, dynamic_position=[], static_position=pos(i))
      return vector.bitcast(ty, v)

    sums = [{} for _ in range(NUM_COUNTERS)]

    def add(k, idx, masks):
      for m in masks:
        sums[k][idx] = m if idx not in sums[k] else arith.addi(sums[k][idx], m)

    out = []
    for left, right in halves:
      lregs, rregs = np.empty_like(left.registers), np.empty_like(right.registers)
      for idx, lv in np.ndenumerate(left.registers):
        lw, rw = words(lv), words(right.registers[idx])
        lregs[idx] = from_words([asm("min.NaN.bf16x2", w, hi) for w in lw], lv.type)
        rregs[idx] = from_words([asm("min.NaN.bf16x2", asm("max.NaN.bf16x2", w, lo), hi) for w in rw], lv.type)
        if count:
          add(0, idx, [asm("set.gt.u32.bf16x2", w, hi) for w in lw])
          add(1, idx, [asm("set.gt.u32.bf16x2", w, hi) for w in rw])
          add(2, idx, [asm("set.lt.u32.bf16x2", w, lo) for w in rw])
      out += [mgpu_fa.FragmentedArray(_registers=r, _layout=left.layout, _is_signed=None) for r in (lregs, rregs)]
    if count:
      f32_ty = ir.F32Type.get()
      vec_ty = ir.VectorType.get(ir.VectorType(halves[0][0].registers.flat[0].type).shape, f32_ty)
      zeros = arith.constant(vec_ty, ir.DenseElementsAttr.get_splat(vec_ty, ir.FloatAttr.get(f32_ty, 0.0)))
      totals = []
      for k in range(NUM_COUNTERS):
        regs = np.empty_like(halves[0][0].registers)
        for idx, s in sums[k].items():
          u = arith.subi(const(0), s)
          a = arith.andi(u, const(0xFFFF))
          n = arith.addi(arith.addi(a, a), arith.shrsi(u, const(16)))
          regs[idx] = vector.insert(arith.sitofp(f32_ty, n), zeros, dynamic_position=[], static_position=pos(0))
        totals.append(mgpu_fa.FragmentedArray(_registers=regs, _layout=halves[0][0].layout, _is_signed=None))
      out += totals
    return out

  def apply(halves):
    res = clamp_all([list(p) for p in halves])
    return [tuple(res[2 * t:2 * t + 2]) for t in range(nlocal)], (list(res[2 * nlocal:]) if count else None)

  return apply


def _sf_type(sf_layout, nseg, rows):
  mp = ref.cdiv(rows, 4) * 4
  return {"rows": ((nseg, rows), jnp.float32), "B": ((nseg, mp), jnp.float32),
          "C": ((ref.cdiv(nseg, 4), mp), jnp.int32)}[sf_layout]


# Lanes sharing a row of one group (npc < h); each CTA issues all its chunk's loads before the first group's math
# and stores, divides with div.rn.f32 and runs without Pallas's automatic barriers. H200, 2026-11-29 (CUPTI, cold
# L2, median of 20, all bit-exact), swiglu E=32x8 K8 N=35952, clamp None / 0.5: h=2048: 16 lanes with all loads
# first 101.2 / 152.3 µs, 16 lanes loading one group ahead 101.6 / 160.1, 8 lanes one group ahead 108.8 / 199.8,
# 8 lanes with newton_div, automatic barriers and each group's loads with it 145.9 / 205.2 (TileKernels 98.3 /
# 138.2), chunks of 8 groups (16 lanes, one ahead) 106.8 / 161.4; h=1024: 16 lanes one group ahead 55.9 / 86.3,
# 8 lanes 62.3 / 107.4 (TileKernels 50.6 / 70.3); h=3584, timed with 8 lanes one group ahead only: 180.2 / 340.7,
# the automatic barriers and newton_div 250.7 / 352.8 (TileKernels 220.4 / 414.6).
_LANES = 16


def _divisions(lay, vec, rt, npc, interpret):
  """``(swish_div, sf_div)``: the correctly rounded division of ``l / (1 + exp(-l))`` (``(rt, npc)`` arrays in
  ``lay``) and that of the scale factors (``(rt,)`` arrays in ``vec``, or scalars). Compiled: div.rn.f32's bits
  through :func:`guarded_div` for the swish quotient and the PTX ``div.rn.f32`` (:func:`jaxkern._ieee.mosaic_ptx`)
  for the scale factors; in interpret mode (no PTX) :func:`jaxkern._ieee.newton_div` and
  :func:`jaxkern._ieee.exact_div`, which give the same bits."""
  if interpret is None:
    return guarded_div(lay, (rt, npc), _SWISH_FAST_LIMIT), _ieee.mosaic_ptx("div.rn.f32", vec, (rt,))
  return _ieee.newton_div, _ieee.exact_div


def swiglu_kernel(x, weight, pos_to_expert, *, npc, round_sf, sf_layout, clamp, sf_clamp_min, count, interpret):
  """``x`` ``(R, 2h)`` (``R`` at least one layout block of rows), ``weight`` ``(1, R)`` float32 or None,
  ``pos_to_expert`` ``(1, R)`` int32 or None -> ``(out (R, h) e4m3, sf, counts | None)``: ``sf`` float32
  ``(groups, R)`` (``sf_layout="rows"``), layout B or layout C; ``counts`` float32 ``(3·chunks, R)``, the
  per-row flag counts of each chunk of groups."""
  r, h = x.shape[0], x.shape[1] // 2
  nseg = h // npc
  chunk = min(SEG_CHUNK, nseg)
  num_chunks = ref.cdiv(nseg, chunk)
  lay, unit = row_layout(npc, x.dtype.itemsize, 32 if npc == h else _LANES)
  vec = lay.reduce(1)
  rt = tiling.tile_rows(r, 2 * chunk * npc, x.dtype.itemsize, unit)
  num_ctas = pl.cdiv(r, rt)
  sf_type = _sf_type(sf_layout, nseg, r)
  out_type = [jax.ShapeDtypeStruct((r, h), jnp.float8_e4m3fn), jax.ShapeDtypeStruct(*sf_type)]
  if count:
    out_type.append(jax.ShapeDtypeStruct((NUM_COUNTERS * num_chunks, r), jnp.float32))
  c = None if clamp is None else float(np.float32(clamp))
  swish_div, sf_div = _divisions(lay, vec, rt, npc, interpret)
  bf16_clamp = interpret is None and packs_clamp(x.dtype, c)

  @functools.partial(plgpu.kernel, out_type=tuple(out_type), grid=(num_chunks, num_ctas), grid_names=("g", "i"),
                     compiler_params=NO_AUTO_BARRIERS, interpret=interpret)
  def kernel(*refs):
    x_g, c_g, *rest = refs
    w_g = rest.pop(0) if weight is not None else None
    p_g = rest.pop(0) if pos_to_expert is not None else None
    o_g, sf_g = rest.pop(0), rest.pop(0)
    cnt_g = rest.pop(0) if count else None
    rows = pl.ds(jnp.minimum(lax.axis_index("i") * rt, r - rt), rt)

    def body(chunk_index, nlocal):
      """Groups ``chunk_index·chunk + t`` for ``t < nlocal`` (static)."""
      seg0 = chunk_index * chunk
      w = plgpu.load(w_g.at[0, rows], layout=vec, optimized=False) if w_g is not None else None
      keep = plgpu.load(p_g.at[0, rows], layout=vec, optimized=False) >= 0 if p_g is not None else None
      maxv = c_g[0]
      loaded = [[plgpu.load(x_g.at[rows, pl.ds((seg0 + t) * npc + off, npc)], layout=lay, optimized=False)
                 for off in (0, h)] for t in range(nlocal)]
      totals, word = None, None
      if bf16_clamp:
        loaded, totals = packed_clamp(lay, (rt, npc), nlocal, c, count)(loaded)
      for t in range(nlocal):
        left, right = (v.astype(jnp.float32) for v in loaded[t])
        act, counts = _silu_times(left, right, None if bf16_clamp else c, count and not bf16_clamp, swish_div)
        if counts is not None:
          totals = counts if totals is None else [a + b for a, b in zip(totals, counts)]
        if w is not None:
          act = act * w[:, None]
        if keep is not None:
          act = jnp.where(keep[:, None], act, 0.0)
        amax = key_value(jnp.max(abs_key(act, interpret), axis=1), interpret)
        sf, inv = ref.scale_factors(amax, maxv, "e4m3", round_sf, div=sf_div, clamp_min=sf_clamp_min)
        sf = gpu_nan(sf, interpret)
        if keep is not None:
          sf = jnp.where(keep, sf, 0.0)
        if sf_layout != "C":
          sf_g[seg0 + t, rows] = sf
        else:  # UE8M0 byte of group seg0 + t into byte t % 4 of word (seg0 + t) // 4
          byte = ((lax.bitcast_convert_type(sf, jnp.int32) >> 23) & 0xFF) << (8 * (t % 4))
          word = byte if t % 4 == 0 else word | byte
          if t % 4 == 3 or t == nlocal - 1:
            sf_g[seg0 // 4 + t // 4, rows] = word
        o_g[rows, pl.ds((seg0 + t) * npc, npc)] = to_e4m3(gpu_nan(act * inv[:, None], interpret), interpret)
      for k, flags in enumerate(totals or ()):
        n = jnp.sum(flags, axis=1)
        cnt_g[NUM_COUNTERS * chunk_index + k, rows] = n if keep is None else jnp.where(keep, n, 0.0)
      if sf_layout != "rows" and sf_type[0][1] > r:
        @pl.when(lax.axis_index("i") == num_ctas - 1)
        def _():
          first, words = (seg0, nlocal) if sf_layout == "B" else (seg0 // 4, ref.cdiv(nlocal, 4))
          for j in range(r, sf_type[0][1]):
            for t in range(words):
              sf_g[first + t, j] = jnp.zeros((), sf_type[1])

    tiling.over_chunks(body, lax.axis_index("g"), nseg, chunk)

  # The largest e4m3 value as a one-element host constant, loaded by the kernel (not folded in interpret mode).
  consts = np.full((1,), ref.FP8_MAX, np.float32)
  return kernel(x, consts, *(a for a in (weight, pos_to_expert) if a is not None))


@functools.partial(jax.jit, static_argnames=("npc", "round_sf", "col_major", "packed", "clamp", "sf_clamp_min",
                                             "count", "interpret"))
def _kernel(x, weight, pos_to_expert, *, npc, round_sf, col_major, packed, clamp, sf_clamp_min, count, interpret):
  """``x`` ``(E, 2h)``, per-row ``weight`` ``(E,)`` or None, ``pos_to_expert`` ``(E,)`` or None ->
  ``(out (E, h) e4m3, sf in layout A / B / C, counts (3,) int32 | None)``."""
  e, h = x.shape[0], x.shape[1] // 2
  unit = row_layout(npc, x.dtype.itemsize, 32 if npc == h else _LANES)[1]
  rp = max(e, unit)

  def rows(a, fill):  # (E,) -> (1, rp), padded when E is below one layout block
    return None if a is None else jnp.pad(a, (0, rp - e), constant_values=fill).reshape(1, rp)

  in_kernel = col_major and rp == e
  sf_layout = ("C" if packed else "B") if in_kernel else "rows"
  outs = swiglu_kernel(jnp.pad(x, ((0, rp - e), (0, 0))), rows(weight, 0.0), rows(pos_to_expert, -1), npc=npc,
                       round_sf=round_sf, sf_layout=sf_layout, clamp=clamp, sf_clamp_min=sf_clamp_min, count=count,
                       interpret=interpret)
  out, sf = outs[0][:e], outs[1]
  if not in_kernel:
    sf = ref.format_sf(sf[:, :e].T, col_major, packed)
  counts = None
  if count:
    counts = outs[2].reshape(-1, NUM_COUNTERS, rp)[:, :, :e].astype(jnp.int32).sum(axis=(0, 2))
  return out, sf, counts


def _check(x, fmt, npc, pos_to_token_topk, topk_weights, pos_to_expert, clamp, clamped_count, flags):
  """Argument checks; returns the arrays."""
  x = _checks.as_array("x", x)
  _checks.check_rank("x", x, 2)
  _checks.check_dtype("x", x, (jnp.bfloat16, jnp.float32))
  e, h2 = x.shape
  if h2 % 256:
    raise ValueError(f"x must have 2h columns with h % 128 == 0, got x.shape {tuple(x.shape)}")
  h = h2 // 2
  validate.check_fmt(fmt, ("e4m3",))
  if npc not in (128, h):
    raise ValueError(f"num_per_channels must be 128 or h={h}, got {npc}")
  validate.check_sf_flags(**flags)
  if flags["use_tma_aligned_col_major_sf"] and npc != 128:
    raise ValueError("use_tma_aligned_col_major_sf requires num_per_channels == 128")
  if (pos_to_token_topk is None) != (topk_weights is None):
    raise ValueError("pos_to_token_topk and topk_weights must be given together")
  arrays = {}
  for name, a, rank, dtypes in (("pos_to_token_topk", pos_to_token_topk, 1, (jnp.int32,)),
                                ("topk_weights", topk_weights, 2, (jnp.float32,)),
                                ("pos_to_expert", pos_to_expert, 1, (jnp.int32,)),
                                ("clamped_count", clamped_count, 1, (jnp.int32, jnp.int64))):
    if a is not None:
      a = arrays[name] = _checks.as_array(name, a)
      _checks.check_rank(name, a, rank)
      _checks.check_dtype(name, a, dtypes)
  for name in ("pos_to_token_topk", "pos_to_expert"):
    if name in arrays:
      _checks.check_shape(name, arrays[name], (e,))
  if clamped_count is not None:
    _checks.check_shape("clamped_count", arrays["clamped_count"], (NUM_COUNTERS,))
    if clamp is None:
      raise ValueError("clamped_count requires swiglu_clamp_value")
  return x, *(arrays.get(n) for n in ("pos_to_token_topk", "topk_weights", "pos_to_expert", "clamped_count"))


def swiglu_forward_and_per_token_cast(x: jax.typing.ArrayLike, fmt: str, num_per_channels: int,
                                      pos_to_token_topk: jax.Array | None = None, topk_weights: jax.Array | None = None,
                                      pos_to_expert: jax.Array | None = None, *,
                                      use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                      use_packed_ue8m0: bool = False, swiglu_clamp_value: float | None = None,
                                      clamped_count: jax.Array | None = None, sf_clamp_min: float | None = None,
                                      implementation: str | None = None) -> QuantTensor | QuantTensorWithClampedCount:
  """SwiGLU forward of ``x = [left | right]`` fused with a per-token e4m3 cast (docs/quant.md, "Fused SwiGLU").

  Per row ``p`` (float32, each step one IEEE rounding): with a clamp ``C``, ``l = min(left, C)``,
  ``r = clip(right, -C, C)``; ``act = (l / (1 + exp(-l))) · r``; times the row weight ``w`` when weights are
  given; then groups of ``num_per_channels`` columns get ``sf`` from their abs-max (clamped below by
  ``sf_clamp_min``, default 1e-4) as :func:`jaxkern.quant.per_token_cast` and ``data = e4m3(act · sf_inv)``.

  Args:
    x: ``(E, 2h)`` bfloat16 / float32, ``h % 128 == 0``; ``left = x[:, :h]`` (gate), ``right = x[:, h:]``.
    fmt: ``"e4m3"``.
    num_per_channels: 128 or ``h`` (one scale per row).
    pos_to_token_topk: ``(E,)`` int32, with ``topk_weights`` ``(T, k)`` float32 (both or neither): row ``p``
      is scaled by ``topk_weights.reshape(-1)[pos_to_token_topk[p]]``, or by 0 where the index is negative.
      Precondition: every index below ``T·k``. A concrete index ``>= T·k`` raises ``ValueError``; a traced one
      takes the last weight (kernel and reference alike: the gather runs in XLA, clamped) and
      ``checkify.checkify(f, errors=checkify.user_checks)`` reports it (docs/usage.md, "Bad values under jit").
    pos_to_expert: ``(E,)`` int32 or None: rows with a negative entry are skipped (e4m3 zeros, sf 0.0 /
      UE8M0 byte 0, not counted).
    use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0: sf layout B / power-of-two sf / packed UE8M0
      layout C, as :func:`jaxkern.quant.per_token_cast`; column-major needs ``num_per_channels == 128``.
    swiglu_clamp_value: the clamp ``C`` (a float, taken as float32) or None.
    clamped_count: ``(3,)`` int32 / int64 counters, only with a clamp: the result holds
      ``clamped_count + [#(left > C), #(right > C), #(right < -C)]`` over the processed rows (unclamped
      values); upstream adds them in place.
    sf_clamp_min: replaces the amax clamp minimum 1e-4 (taken as float32).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``QuantTensor(data, sf)``, or ``QuantTensorWithClampedCount(data, sf, clamped_count)`` when
    ``clamped_count`` is given: ``data`` ``(E, h)`` float8_e4m3fn; ``sf`` layout A ``(E, h/npc)`` float32,
    B ``(h/128, align(E, 4))`` float32 or C ``(ceil(h/512), align(E, 4))`` int32 (zero padding).

  Raises:
    ValueError (naming the argument): another rank, dtype or shape, ``h % 128 != 0``, ``fmt != "e4m3"``,
      ``num_per_channels`` not 128 / ``h``, column-major with ``num_per_channels == h``, packed without
      column-major and ``round_sf``, only one of ``pos_to_token_topk`` / ``topk_weights``, ``clamped_count``
      without ``swiglu_clamp_value``, a concrete ``pos_to_token_topk`` entry ``>= T·k``.

  XLA (the reference) instead of the kernel: zero rows (``E = 0``) only. The top-k weight gather and the final
  sum of the clamp counters run in XLA around the kernel (see :mod:`jaxkern.quant._swiglu`).

  Numerics: bit-identical to :func:`jaxkern.reference.quant.swiglu_forward_and_per_token_cast` run on the same
  backend (``exp`` differs between XLA's CPU and CUDA's ``expf``, which the GPU kernel and XLA on GPU share).

  Differentiation: not differentiable; ``jax.grad`` through it raises :class:`jaxkern.NotDifferentiableError`.
  """
  flags = dict(use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, round_sf=round_sf,
               use_packed_ue8m0=use_packed_ue8m0)
  npc = num_per_channels
  x, pos_to_token_topk, topk_weights, pos_to_expert, clamped_count = _check(
      x, fmt, npc, pos_to_token_topk, topk_weights, pos_to_expert, swiglu_clamp_value, clamped_count, flags)
  if pos_to_token_topk is not None:
    _checks.check_and_debug_check(
        "swiglu_forward_and_per_token_cast", "pos_to_token_topk", pos_to_token_topk,
        lambda v: v >= topk_weights.size, f"a negative value (padding) or a slot in [0, {topk_weights.size}) "
        "(T·k = topk_weights.size)")
  x = validate.guard("swiglu_forward_and_per_token_cast", x)
  if topk_weights is not None:
    topk_weights = validate.guard("swiglu_forward_and_per_token_cast", topk_weights)
  options = dict(swiglu_clamp_value=swiglu_clamp_value, clamped_count=clamped_count, sf_clamp_min=sf_clamp_min)

  def kernel(interpret):
    weight = None if pos_to_token_topk is None else ref.row_weights(pos_to_token_topk, topk_weights, x.shape[0])
    out, sf, counts = _kernel(x, weight, pos_to_expert, npc=npc, round_sf=round_sf,
                              col_major=use_tma_aligned_col_major_sf, packed=use_packed_ue8m0,
                              clamp=swiglu_clamp_value, sf_clamp_min=sf_clamp_min, count=clamped_count is not None,
                              interpret=_config.mosaic_interpret(interpret))
    if clamped_count is None:
      return QuantTensor(out, sf)
    return QuantTensorWithClampedCount(out, sf, clamped_count + counts.astype(clamped_count.dtype))

  def reference():
    return ref.swiglu_forward_and_per_token_cast(x, fmt, npc, pos_to_token_topk, topk_weights, pos_to_expert,
                                                 **flags, **options)

  return _dispatch.run("swiglu_forward_and_per_token_cast", implementation, kernel=kernel, xla=reference,
                       empty=x.shape[0] == 0)

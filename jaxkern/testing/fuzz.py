"""Differential fuzzing of the public ops: the kernel against the reference on random arguments.

Every public op of :mod:`jaxkern.transpose`, :mod:`jaxkern.moe`, :mod:`jaxkern.quant`,
:mod:`jaxkern.engram`, :mod:`jaxkern.mhc` and :mod:`jaxkern.gemm` has an :class:`OpFuzz` entry in
:data:`OPS` (or a reason in :data:`SKIPPED`): a case generator that draws arguments the op's docstring
allows (awkward sizes, zero and one token where the op takes them, ragged routing with unused ``-1``
slots, every flag), values with the special cases of their format (NaN, ±inf, -0.0, subnormals, the
format's extremes, values at and just past e4m3's 448 clip) wherever the docstring puts them inside
the contract, and a comparison: bit for bit where the op is bit-exact (NaN payloads and signed zeros
included), else the tolerance the op's tests use. A docstring's documented exception (a case whose
result is unspecified or allowed to differ) is excluded by the comparison, which quotes it.

The op runs with ``implementation="interpret"`` (off a GPU: the Pallas kernel in interpret mode) or
``"pallas"`` (the compiled kernel) and with ``implementation="reference"``, on the same backend. Ops
without a kernel run their XLA code (every implementation but ``"reference"``) against the reference.

Each example draws from ``numpy.random.default_rng((seed, crc32(op), index))``, so a disagreement
reprints as ``python -m jaxkern.testing.fuzz --ops OP --seed SEED --first INDEX --examples 1``. ``size="small"``
keeps shapes at a few hundred elements (interpret mode is slow); ``"large"`` draws GPU-sized ones.

Command line: ``python -m jaxkern.testing.fuzz --examples N [--ops OP_OR_PREFIX ...] [--seed S] [--size large]
[--implementation pallas] [--seconds BUDGET]`` runs rounds of one example per op and prints per op the
examples, agreements, disagreements, the examples a kernel declined with :class:`jaxkern.KernelUnavailableError`
(counted as neither) and the agreements in which a Pallas kernel ran (not an XLA path), then a ``TOTAL`` line;
it exits non-zero on a disagreement.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxkern._dispatch import KernelUnavailableError, recording
from jaxkern.testing.numeric import assert_bitwise_equal, calc_diff
from jaxkern.types import FusedMapping, QuantTensor

MODULES = ("transpose", "moe", "quant", "engram", "mhc", "gemm")

BF16 = jnp.bfloat16
E4M3 = jnp.float8_e4m3fn

# Value regimes of :func:`floats`, from the widest to the narrowest.
IEEE = "ieee"  # NaN, ±inf, ±max of the format and everything below
FINITE = "finite"  # ±max of the format, the e4m3 clip, subnormals, -0.0; no NaN or inf
TAME = "tame"  # magnitudes up to 64, subnormals and -0.0: for ops whose contract ends at overflow


# ---------------------------------------------------------------------------------------------------------------
# Values


def special_values(dtype: jax.typing.DTypeLike, regime: str = IEEE) -> np.ndarray:
  """The special values of ``dtype`` a regime allows, as float64: signed zeros, the smallest and largest
  subnormals, the smallest normal, the e4m3 clip (448, 464 = the midpoint to 480, 480), the quantisers' amax
  clamp 1e-4 and E5M6's 65024, the format's ±max (``FINITE``) and NaN, ±inf (``IEEE``), each of either sign."""
  fi = ml_dtypes.finfo(np.dtype(dtype))
  tame = [0.0, float(fi.smallest_subnormal), float(fi.smallest_normal) - float(fi.smallest_subnormal),
          float(fi.smallest_normal), 1e-4, 1.0, 6.0, 48.0, 64.0]
  wide = [448.0, 464.0, 480.0, 65024.0, float(fi.max)]
  values = tame if regime == TAME else tame + [v for v in wide if v <= float(fi.max)]
  values = values + [-v for v in values]
  if regime == IEEE:
    values += [np.nan, np.inf, -np.inf]
  return np.asarray(values, np.float64)


def floats(rng: np.random.Generator, shape: Sequence[int], dtype: jax.typing.DTypeLike = BF16, regime: str = IEEE,
           spread: int = 8) -> np.ndarray:
  """Normal values scaled by ``2^k`` per row (``|k| <= spread``, so rows have different magnitudes), with a
  random fraction (0, 2 % or 20 %) replaced by :func:`special_values`, and sometimes whole rows of one special
  value (an all-zero, all-NaN or all-max row). A NumPy array of ``dtype``."""
  shape = tuple(shape)
  x = rng.standard_normal(shape)
  if len(shape) >= 1:
    x = x * 2.0 ** rng.integers(-spread, spread + 1, size=shape[:-1] + (1,))
  if regime == TAME:
    x = np.clip(x, -64.0, 64.0)
  pool = special_values(dtype, regime)
  fraction = rng.choice([0.0, 0.02, 0.2])
  x = np.where(rng.random(shape) < fraction, rng.choice(pool, size=shape), x)
  if len(shape) >= 2 and shape[0] > 0 and rng.random() < 0.3:
    x[rng.integers(shape[0])] = rng.choice(pool)
  with np.errstate(over="ignore", invalid="ignore"):
    return x.astype(np.dtype(dtype))


def bits(rng: np.random.Generator, shape: Sequence[int], dtype: jax.typing.DTypeLike) -> np.ndarray:
  """Uniformly random bit patterns of ``dtype`` (every NaN payload, infinities, -0.0, subnormals)."""
  dtype = np.dtype(dtype)
  raw = rng.integers(0, 256, size=tuple(shape) + (dtype.itemsize,), dtype=np.uint8)
  return raw.view(dtype).reshape(shape)


def finite_e4m3(rng: np.random.Generator, shape: Sequence[int]) -> np.ndarray:
  """Random e4m3 bit patterns other than NaN (0x7F / 0xFF), subnormals and ±448 included."""
  raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
  raw = np.where((raw & 0x7F) == 0x7F, raw ^ 1, raw).astype(np.uint8)
  return raw.view(np.dtype(E4M3))


def scales(rng: np.random.Generator, shape: Sequence[int], regime: str = IEEE) -> np.ndarray:
  """float32 dequantisation scales: positive powers of two and arbitrary values over ``2^±20``; with ``IEEE``
  also 0, NaN, +inf (the UE8M0 bytes 0 and 255)."""
  x = np.exp2(rng.uniform(-20, 20, size=shape))
  x = np.where(rng.random(shape) < 0.5, np.exp2(np.round(np.log2(x))), x)
  if regime == IEEE:
    x = np.where(rng.random(shape) < 0.05, rng.choice([0.0, np.nan, np.inf], size=shape), x)
  return x.astype(np.float32)


def pow2_scales(rng: np.random.Generator, shape: Sequence[int], span: int = 5) -> np.ndarray:
  """float32 powers of two ``2^k``, ``|k| <= span``."""
  return np.exp2(rng.integers(-span, span + 1, size=shape)).astype(np.float32)


def pack_ue8m0(sf: np.ndarray) -> np.ndarray:
  """Layout C of power-of-two ``(Mb, Kb)`` float32 scales: ``(ceil(Kb/4), align(Mb, 4))`` int32 words."""
  mb, kb = sf.shape
  exps = (sf.view(np.uint32) >> 23).astype(np.uint32) & 0xFF
  padded = np.zeros((_align(mb, 4), _align(kb, 4)), np.uint32)
  padded[:mb, :kb] = exps
  words = padded.reshape(padded.shape[0], padded.shape[1] // 4, 4)
  packed = words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24
  return np.ascontiguousarray(packed.T).view(np.int32)


def col_major(sf: np.ndarray) -> np.ndarray:
  """Layout B of ``(Mb, Kb)`` float32 scales: ``(Kb, align(Mb, 4))``, zero padded."""
  mb, kb = sf.shape
  out = np.zeros((kb, _align(mb, 4)), np.float32)
  out[:, :mb] = sf.T
  return out


def scale_layout(rng: np.random.Generator, sf: np.ndarray, *, packable: bool) -> tuple[np.ndarray, bool]:
  """``sf`` in a random layout: ``(array, use_tma_aligned_col_major_sf)``; layout C only when ``packable``
  (power-of-two scales)."""
  layout = rng.choice(["A", "B", "C"] if packable else ["A", "B"])
  if layout == "A":
    return sf, False
  return (col_major(sf) if layout == "B" else pack_ue8m0(sf)), True


def _align(n: int, a: int) -> int:
  return -(-n // a) * a


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


# ---------------------------------------------------------------------------------------------------------------
# Routing


def topk_ids(rng: np.random.Generator, t: int, k: int, num_experts: int, unused: float | None = None) -> np.ndarray:
  """``(T, K)`` int32 expert ids: distinct per row where possible, a random fraction of -1 slots (whole rows
  sometimes)."""
  unused = rng.choice([0.0, 0.1, 0.5]) if unused is None else unused
  ids = np.stack([rng.permutation(max(num_experts, k))[:k] for _ in range(t)]) if t else np.zeros((0, k), int)
  ids = np.where(ids >= num_experts, -1, ids)
  ids = np.where(rng.random((t, k)) < unused, -1, ids)
  if t and rng.random() < 0.3:
    ids[rng.integers(t)] = -1
  return ids.astype(np.int32)


def fused_mapping(rng: np.random.Generator, t: int, k: int, num_experts: int, alignment: int) -> FusedMapping:
  """The reference's :func:`jaxkern.moe.get_fused_mapping` of random :func:`topk_ids`, sized on the host."""
  from jaxkern import moe

  ids = topk_ids(rng, t, k, num_experts)
  return moe.get_fused_mapping(ids, num_experts, 0, alignment, implementation="reference")


# ---------------------------------------------------------------------------------------------------------------
# Comparisons


def bitwise(got: Any, want: Any) -> None:
  """Equal structure, dtypes, shapes and bits (NaN payloads and signed zeros included)."""
  assert_bitwise_equal(got, want)


def _leaves(got, want):
  (g, gt), (w, wt) = jax.tree.flatten(got), jax.tree.flatten(want)
  if gt != wt:
    raise AssertionError(f"pytree structure mismatch: {gt} != {wt}")
  return list(zip(g, w))


def _same_non_finite(a: np.ndarray, b: np.ndarray, what: str) -> None:
  for name, f in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
    if not np.array_equal(f(a), f(b)):
      idx = tuple(int(i) for i in np.argwhere(f(a) != f(b))[0])
      raise AssertionError(f"{what}: {name} at different places, first {idx}: {a[idx]!r} vs {b[idx]!r}")


def close(rtol: float, atol: float, *, atol_per_max: bool = False, any_non_finite: bool = False
          ) -> Callable[[Any, Any], None]:
  """Leaf-wise ``|got - want| <= atol + rtol·|want|`` in float64 (``atol`` times the leaf's max ``|want|``
  when ``atol_per_max``), NaN and infinities at the same places (with ``any_non_finite``, non-finite entries at
  the same places, NaN and ±inf interchangeable: a documented difference); integer leaves bit for bit."""

  def compare(got, want):
    for i, (g, w) in enumerate(_leaves(got, want)):
      g, w = np.asarray(g), np.asarray(w)
      if g.shape != w.shape or g.dtype != w.dtype:
        raise AssertionError(f"leaf {i}: {g.dtype}{g.shape} != {w.dtype}{w.shape}")
      if not np.issubdtype(g.dtype, np.inexact) and g.dtype.kind != "V":
        assert_bitwise_equal(g, w, f"leaf {i}")
        continue
      g64, w64 = g.astype(np.float64), w.astype(np.float64)
      if any_non_finite:
        g64, w64 = (np.where(np.isfinite(a), a, np.nan) for a in (g64, w64))
      _same_non_finite(g64, w64, f"leaf {i}")
      fin = np.isfinite(w64)
      tol_abs = atol * (float(np.abs(w64[fin]).max()) if atol_per_max and fin.any() else 1.0)
      err = np.abs(g64 - w64)[fin]
      bad = err > tol_abs + rtol * np.abs(w64[fin])
      if bad.any():
        j = int(np.argmax(bad))
        raise AssertionError(f"leaf {i}: {int(bad.sum())} of {bad.size} beyond rtol={rtol} atol={tol_abs:.3g}; "
                             f"first: {g64[fin][j]!r} vs {w64[fin][j]!r}")

  return compare


def diff_below(tol: float, mask: Callable[[Any], list] | None = None) -> Callable[[Any, Any], None]:
  """Leaf-wise upstream metric ``calc_diff <= tol`` over the finite entries, non-finite ones at the same
  places; ``mask(want)`` (a list of boolean arrays or None per leaf) drops documented exceptions."""

  def compare(got, want):
    masks = mask(want) if mask else None
    for i, (g, w) in enumerate(_leaves(got, want)):
      g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
      if g64.shape != w64.shape:
        raise AssertionError(f"leaf {i}: shape {g64.shape} != {w64.shape}")
      keep = np.ones(w64.shape, bool) if masks is None or masks[i] is None else masks[i]
      _same_non_finite(np.where(keep, g64, 0), np.where(keep, w64, 0), f"leaf {i}")
      fin = keep & np.isfinite(w64)
      d = calc_diff(g64[fin], w64[fin])
      if not d <= tol:
        raise AssertionError(f"leaf {i}: calc_diff = {d:.3e} > {tol:.1e}")

  return compare


def per_leaf(*comparisons: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
  """Leaf ``i`` compared by ``comparisons[i]`` (the last one repeats)."""

  def compare(got, want):
    for i, (g, w) in enumerate(_leaves(got, want)):
      try:
        comparisons[min(i, len(comparisons) - 1)](g, w)
      except AssertionError as e:
        raise AssertionError(f"leaf {i}: {e}") from None

  return compare


# ---------------------------------------------------------------------------------------------------------------
# Registry


@dataclasses.dataclass(frozen=True)
class Example:
  """One call: positional and keyword arguments (``implementation`` is added) and a printable label."""

  args: tuple
  kwargs: dict
  label: str


@dataclasses.dataclass(frozen=True)
class OpFuzz:
  """How to fuzz one op: ``make(rng, size) -> Example``, ``compare(got, want)`` raising ``AssertionError``,
  ``exact`` (whether the comparison is bit for bit) and ``unspecified(example, want)``: None, or per output leaf
  None or a boolean mask of the entries the docstring leaves unspecified for these arguments (the kernel's
  value there is replaced by the reference's before the comparison) and ``within(example, want)``: None, or per
  output leaf None or an array of absolute bounds the docstring states for these arguments (entries within
  them are taken as agreeing)."""

  name: str
  make: Callable[[np.random.Generator, str], Example]
  compare: Callable[[Any, Any], None] = bitwise
  exact: bool = True
  unspecified: Callable[[Example, Any], list | None] | None = None
  within: Callable[[Example, Any], list | None] | None = None

  @property
  def fn(self) -> Callable:
    module, attr = self.name.split(".")
    return getattr(importlib.import_module(f"jaxkern.{module}"), attr)


OPS: dict[str, OpFuzz] = {}

SKIPPED = {
    "quant.sf_logical": "a layout view without an implementation (no kernel, no reference to differ from); "
                        "exercised through every layout B / C scale the quant fuzzers pass",
    "quant.sf_to_float": "a layout decoder without an implementation (no kernel, no reference to differ from)",
    "engram.split_multipliers": "a host-side converter without an implementation; engram.engram_hash's fuzzer "
                                "passes its multipliers both as int64 and as its uint32 words",
}


def register(name: str, compare: Callable = bitwise, exact: bool | None = None, unspecified: Callable | None = None,
             within: Callable | None = None) -> Callable[[Callable], Callable]:
  """Decorator adding a case generator to :data:`OPS`."""

  def wrap(make):
    OPS[name] = OpFuzz(name, make, compare, compare is bitwise if exact is None else exact, unspecified, within)
    return make

  return wrap


def pick(rng: np.random.Generator, size: str, small: Sequence[Any], large: Sequence[Any]) -> Any:
  """A random choice from ``small`` or, for ``size="large"``, from ``large``."""
  options = small if size == "small" else large
  return options[int(rng.integers(len(options)))]


def _desc(**kw) -> str:
  return ", ".join(f"{k}={v}" for k, v in kw.items())


# ---------------------------------------------------------------------------------------------------------------
# transpose

TRANSPOSE_DTYPES = (np.float32, BF16, E4M3, np.int8, np.uint8, np.int32, np.int16)


def _transpose_example(rng, size, batched):
  m = pick(rng, size, (0, 64, 128), (64, 192, 576, 4096))
  n = pick(rng, size, (64, 128), (64, 128, 2048, 7168))
  b = pick(rng, size, (1, 2, 3), (1, 3, 8))
  dtype = TRANSPOSE_DTYPES[rng.integers(len(TRANSPOSE_DTYPES))]
  shape = (b, m, n) if batched else (m, n)
  x = bits(rng, shape, dtype)
  return Example((x,), {}, _desc(shape=shape, dtype=np.dtype(dtype).name))


register("transpose.transpose")(lambda rng, size: _transpose_example(rng, size, False))
register("transpose.batched_transpose")(lambda rng, size: _transpose_example(rng, size, True))


# ---------------------------------------------------------------------------------------------------------------
# moe


def _tokens(rng, size):
  return pick(rng, size, (0, 1, 3, 17, 130), (0, 1, 4001, 8001, 20000))


@register("moe.aux_fi")
def _aux_fi(rng, size):
  t, k, e = _tokens(rng, size), int(rng.integers(1, 9)), int(rng.integers(1, 80))
  aux = int(rng.integers(1, 10))
  return Example((topk_ids(rng, t, k, e), e, aux), {}, _desc(T=t, K=k, E=e, num_aux_topk=aux))


@register("moe.group_count")
def _group_count(rng, size):
  t, k, g = _tokens(rng, size), int(rng.integers(1, 9)), int(rng.integers(1, 80))
  return Example((topk_ids(rng, t, k, g), g), {}, _desc(T=t, K=k, num_groups=g))


@register("moe.get_fused_mapping")
def _get_fused_mapping(rng, size):
  t, k, e = _tokens(rng, size), int(rng.integers(1, 9)), int(rng.choice([1, 3, 8, 64, 65, 256]))
  a = int(rng.choice([1, 4, 64, 128]))
  ids = topk_ids(rng, t, k, e)
  mode = rng.choice(["host", "no_sync", "exact"])
  if mode == "host":
    n, no_sync = 0, False
  elif mode == "no_sync":
    n, no_sync = 0, True
  else:
    counts = np.bincount(ids[ids >= 0], minlength=e)
    n, no_sync = int((-(-counts // a) * a).sum()) + int(rng.integers(0, 3)) * a, False
  return Example((ids, e, n, a), {"force_no_sync": no_sync}, _desc(T=t, K=k, E=e, N=n, alignment=a, mode=mode))


def _row_dtype_and_width(rng, size, widths_small, widths_large):
  dtype = (np.float32, BF16, E4M3, np.int8, np.int32)[rng.integers(5)]
  itemsize = np.dtype(dtype).itemsize
  h = pick(rng, size, widths_small, widths_large)
  return dtype, _align(h, 16 // itemsize)


@register("moe.expand_to_fused")
def _expand_to_fused(rng, size):
  t, k, e = _tokens(rng, size), int(rng.integers(1, 9)), int(rng.integers(1, 17))
  dtype, h = _row_dtype_and_width(rng, size, (16, 48, 128), (2048, 7168))
  fm = fused_mapping(rng, t, k, e, int(rng.choice([1, 16, 128])))
  x = bits(rng, (t, h), dtype)
  return Example((x, fm.token_topk_to_pos, fm.pos_to_expert), {},
                 _desc(T=t, K=k, E=e, H=h, N=fm.pos_to_expert.shape[0], dtype=np.dtype(dtype).name))


@register("moe.expand_to_fused_with_sf")
def _expand_to_fused_with_sf(rng, size):
  t, k, e = _tokens(rng, size), int(rng.integers(1, 9)), int(rng.integers(1, 17))
  dtype, h = _row_dtype_and_width(rng, size, (16, 48, 128, 256), (2048, 7168))
  npc = int(rng.choice([16, 32, 128, h]))
  fm = fused_mapping(rng, t, k, e, int(rng.choice([1, 16, 128])))
  packed = bool(rng.random() < 0.3)
  groups = _cdiv(h, npc)
  if packed:
    sf = bits(rng, (t, _cdiv(groups, 4)), np.int32)
    col = True
  else:
    sf, col = scales(rng, (t, groups)), bool(rng.random() < 0.5)
  x = QuantTensor(bits(rng, (t, h), dtype), sf)
  return Example((x, npc, fm.token_topk_to_pos, fm.pos_to_expert), {"use_tma_aligned_col_major_sf": col},
                 _desc(T=t, K=k, E=e, H=h, npc=npc, dtype=np.dtype(dtype).name, packed=packed, col_major=col))


@register("moe.mask_indices_by_tp")
def _mask_indices_by_tp(rng, size):
  t, k = _tokens(rng, size), int(rng.choice([1, 2, 6, 8, 9]))
  ep = int(rng.choice([1, 2, 4, 8]))
  n = ep * int(rng.integers(1, 33))
  tp = int(rng.choice([1, 2, 4]))
  tp_rank = int(rng.integers(0, tp))
  traced = bool(rng.random() < 0.3)
  if traced:
    tp_rank = jnp.int32(int(rng.integers(-1, tp + 1)))
  ids = rng.integers(-3, n, size=(t, k)).astype(np.int32)
  return Example((ids, n, ep, tp_rank, tp), {}, _desc(T=t, K=k, n=n, ep=ep, tp=tp, tp_rank=int(tp_rank),
                                                      traced_rank=traced))


_TINY = float(np.finfo(np.float32).tiny)


def _normal(v):
  return np.isfinite(v) & ((np.abs(v) >= _TINY) | (v == 0))


def _subnormal(v):
  return (v != 0) & (np.abs(v) < _TINY)


def _normalize_weight_compare(got, want):
  """Bit for bit, except the module docstring's range conditions: "A quotient below ``2^-102`` in magnitude
  may be an ulp off" and outside the normal range (a subnormal weight or quotient, a zero, subnormal or
  infinite row sum) within an ulp."""
  assert_bitwise_equal(got.denominator, want.denominator, "denominator")
  g, w = np.asarray(got.normalized_weights), np.asarray(want.normalized_weights)
  d = np.asarray(want.denominator)[:, None]
  in_range = (_normal(w) & _normal(d) & ((np.abs(w) >= 2.0**-102) | (w == 0))).all(axis=1)
  assert_bitwise_equal(g[in_range], w[in_range], "rows of quotients in the exact range")
  gi, wi = g[~in_range].view(np.int32).astype(np.int64), w[~in_range].view(np.int32).astype(np.int64)
  both_nan = np.isnan(g[~in_range]) & np.isnan(w[~in_range])
  off = (np.abs(gi - wi) > 1) & ~both_nan
  if off.any():
    raise AssertionError(f"{int(off.sum())} weights more than an ulp off in rows outside the exact range")


def _normalize_weight_unspecified(example, want):
  """On a GPU, the module docstring: "a row with a subnormal weight, quotient or row sum has unspecified
  quotients; a subnormal row sum is itself unspecified" (the compiled kernel's float32 arithmetic may flush
  subnormals to zero)."""
  if jax.default_backend() != "gpu":
    return None
  (x,) = example.args
  d, q = np.asarray(want.denominator), np.asarray(want.normalized_weights)
  rows = _subnormal(d)
  if q.size:
    rows = rows | _subnormal(np.asarray(x)).any(axis=1) | _subnormal(q).any(axis=1)
  return [_subnormal(d), np.broadcast_to(rows[:, None], q.shape)]


@register("moe.normalize_weight", compare=_normalize_weight_compare, exact=True,
          unspecified=_normalize_weight_unspecified)
def _normalize_weight(rng, size):
  t, k = _tokens(rng, size), int(rng.choice([1, 2, 6, 8, 9, 16, 32]))
  regime = rng.choice([IEEE, FINITE])
  w = np.abs(floats(rng, (t, k), np.float32, regime)) if rng.random() < 0.5 else floats(rng, (t, k), np.float32,
                                                                                           regime)
  return Example((w,), {}, _desc(T=t, K=k, regime=regime))


@register("moe.reduce_fused")
def _reduce_fused(rng, size):
  t, k, e = _tokens(rng, size), int(rng.integers(1, 9)), int(rng.integers(1, 9))
  h = pick(rng, size, (256, 512), (2048, 7168))
  dtype = (np.float32, BF16)[rng.integers(2)]
  fm = fused_mapping(rng, t, k, e, int(rng.choice([1, 16, 128])))
  n = fm.pos_to_expert.shape[0]
  x = floats(rng, (n, h), dtype)
  if rng.random() < 0.3:
    x = QuantTensor(x, scales(rng, (n,)))
  weights = floats(rng, (t, k), np.float32, spread=2) if rng.random() < 0.7 else None
  kw = {}
  if rng.random() < 0.4:
    kw["fp8_format"] = "e4m3"
    if rng.random() < 0.5:
      kw["sf"] = scales(rng, (1,))
  return Example((x, weights, fm.token_topk_to_pos), kw,
                 _desc(T=t, K=k, N=n, H=h, dtype=np.dtype(dtype).name, x_sf=isinstance(x, QuantTensor),
                       weights=weights is not None, **{k_: (v if k_ != "sf" else float(v[0])) for k_, v in kw.items()}))


@register("moe.topk_gate")
def _topk_gate(rng, size):
  t, e = _tokens(rng, size), int(rng.choice([1, 4, 7, 64, 72, 256]))
  k = int(rng.integers(1, min(e, 9) + 1))
  return Example((_tied(rng, (t, e)), k), {}, _desc(T=t, E=e, K=k))


def _tied(rng, shape):
  """float32 scores with ties: :func:`floats` or a few distinct values."""
  if rng.random() < 0.5:
    return floats(rng, shape, np.float32)
  return rng.choice(np.asarray([-np.inf, np.inf, np.nan, -0.0, 0.0, 0.5, 1.0, -1.0], np.float32), size=shape)


@register("moe.topk_sum_and_topk_group_idx")
def _topk_sum_and_topk_group_idx(rng, size):
  t, g, epg = _tokens(rng, size), int(rng.choice([1, 4, 8, 16])), int(rng.choice([1, 2, 3, 8, 32]))
  s = int(rng.integers(1, min(2, epg) + 1))
  ntg = int(rng.integers(1, g + 1))
  return Example((_tied(rng, (t, g, epg)), s, ntg), {}, _desc(T=t, G=g, Epg=epg, num_topk_sum=s, num_topk_groups=ntg))


@register("moe.unique_group_indices")
def _unique_group_indices(rng, size):
  t, k, g = _tokens(rng, size), int(rng.choice([1, 4, 6, 8, 9])), int(rng.integers(1, 129))
  ids = rng.integers(-2, min(g + 2, 10), size=(t, k)).astype(np.int32)
  return Example((ids, g), {}, _desc(T=t, K=k, num_groups=g))


@register("moe.top2_sum_gate")
def _top2_sum_gate(rng, size):
  t = _tokens(rng, size)
  e = int(rng.choice([8, 16, 36, 64, 72] if size == "small" else [64, 72, 256, 384]))
  grouped = rng.random() < 0.4 and e % 4 == 0
  g = int(rng.choice([d for d in (2, 4, 8) if e % d == 0 and e // d >= 2])) if grouped else 0
  ntg = int(rng.integers(1, g + 1)) if grouped else 0
  k_max = min(8, e, ntg * e // g if grouped else e)
  k = int(rng.integers(1, k_max + 1))
  s = 0
  if rng.random() < 0.4:
    s = int(rng.choice([c for c in (1, 2) if k % c == 0 and e % (k // c) == 0] or [0]))
  kw: dict[str, Any] = dict(scoring_func=str(rng.choice(["sigmoid", "sqrtsoftplus", "softmax"])),
                            num_topk_groups=ntg, num_groups=g, use_shared_as_routed=s > 0, num_shared_experts=s,
                            routed_scaling_factor=float(rng.choice([1.0, 2.5])))
  ep = int(rng.choice([1, 2, 4]))
  tp = int(rng.choice([1, 2]))
  kw.update(num_ep_ranks=ep, ep_rank=int(rng.integers(ep)), num_tp_ranks=tp, tp_rank=int(rng.integers(tp)))
  if s or rng.random() < 0.3:
    x = int(rng.integers(s, 4))  # the op raises for fewer than S + 1 replica columns
    kw["to_physical_map"] = rng.integers(0, e + x, size=(e + s, x + 1)).astype(np.int32)
    kw["logical_count"] = rng.integers(1, x + 2, size=(e + s,)).astype(np.int32)
  if rng.random() < 0.4:
    kw["mask"] = rng.random(t) < 0.8
  if rng.random() < 0.3:
    kw["fix_routing_mask"] = rng.random(t) < 0.5
    kw["unmapped_topk_idx"] = rng.integers(0, e, size=(t, k)).astype(np.int32)
  elif rng.random() < 0.3:
    kw["unmapped_topk_idx"] = np.zeros((t, k), np.int32)
  logits = _tied(rng, (t, e))
  bias = floats(rng, (e,), np.float32, FINITE, spread=1)
  label = _desc(T=t, E=e, K=k, S=s, groups=(g, ntg), func=kw["scoring_func"], ep=ep, tp=tp,
                options=sorted(o for o in kw if o in ("to_physical_map", "mask", "fix_routing_mask",
                                                      "unmapped_topk_idx")))
  return Example((logits, bias, k), kw, label)


# ---------------------------------------------------------------------------------------------------------------
# quant


def _quant_input(rng, size, m_small=(1, 3, 32, 130), m_large=(4001, 8192)):
  m = pick(rng, size, m_small, m_large)
  dtype = (np.float32, BF16)[rng.integers(2)]
  return m, dtype


def _sf_flags(rng, allow_packed=True):
  """``(use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)``: packed needs the other two."""
  col, rnd = bool(rng.random() < 0.4), bool(rng.random() < 0.5)
  packed = allow_packed and col and rnd and bool(rng.random() < 0.5)
  return dict(use_tma_aligned_col_major_sf=col, round_sf=rnd, use_packed_ue8m0=packed)


@register("quant.per_token_cast")
def _per_token_cast(rng, size):
  if rng.random() < 0.3:
    return _per_token_cast_of_quant(rng, size)
  m, dtype = _quant_input(rng, size)
  fmt = str(rng.choice(["e4m3", "e2m1"]))
  npc = int(rng.choice([16, 32, 64, 128, 0]))
  k = pick(rng, size, (64, 128, 192, 320), (2048, 7168)) if npc in (0, 128) else pick(
      rng, size, (16, 48, 64, 80, 256), (2048, 7168))
  k = _align(k, 64) if npc == 0 else k
  npc = npc or k
  x = floats(rng, (m, k), dtype)
  flags = _sf_flags(rng)
  return Example((x, fmt, npc), flags, _desc(M=m, K=k, dtype=np.dtype(dtype).name, fmt=fmt, npc=npc, **flags))


def _quant_tensor(rng, m, k, block, fmt="e4m3", layout_packable=True):
  """A random QuantTensor of blocks ``block``: e4m3 or packed e2m1 random bits, scales in a random layout."""
  bm, bk = block
  if fmt == "e4m3":
    q = bits(rng, (m, k), E4M3)
  else:
    q = bits(rng, (m, k // 2), (np.int8, np.uint8)[rng.integers(2)])
  packable = layout_packable and rng.random() < 0.4
  sf = pow2_scales(rng, (_cdiv(m, bm), _cdiv(k, bk)), 20) if packable else scales(rng, (_cdiv(m, bm), _cdiv(k, bk)))
  sf, col = scale_layout(rng, sf, packable=packable)
  return QuantTensor(q, sf), col


def _per_token_cast_of_quant(rng, size):
  m = pick(rng, size, (1, 16, 32, 128, 130), (4096, 8192))
  k = pick(rng, size, (128, 256), (2048, 7168))
  in_fmt = str(rng.choice(["e4m3", "e2m1"]))
  block = (int(rng.choice([1, 32, 128])), int(rng.choice([32, 128])))
  x, x_col = _quant_tensor(rng, m, k, block, in_fmt)
  fmt = str(rng.choice(["e4m3", "e2m1"]))
  npc = int(rng.choice([32, 64, 128]))
  flags = _sf_flags(rng)
  return Example((x, fmt, npc), dict(x_block_size=block, x_use_tma_aligned_col_major_sf=x_col, **flags),
                 _desc(M=m, K=k, input=in_fmt, x_block_size=block, x_col_major=x_col, fmt=fmt, npc=npc, **flags))


@register("quant.per_token_cast_with_sf_only")
def _per_token_cast_with_sf_only(rng, size):
  m, dtype = _quant_input(rng, size)
  npc = int(rng.choice([16, 32, 64, 128]))
  k = pick(rng, size, (64, 128, 320), (2048, 7168))
  fmt = str(rng.choice(["e4m3", "e2m1"]))
  flags = _sf_flags(rng)
  return Example((floats(rng, (m, k), dtype), fmt, npc), flags,
                 _desc(M=m, K=k, dtype=np.dtype(dtype).name, fmt=fmt, npc=npc, **flags))


@register("quant.per_token_cast_with_precomputed_sf")
def _per_token_cast_with_precomputed_sf(rng, size):
  """A zero or non-finite ``sf`` is outside the contract (docstring): positive finite scales only."""
  m, dtype = _quant_input(rng, size)
  npc = int(rng.choice([16, 32, 64, 128]))
  k = pick(rng, size, (64, 128, 320), (2048, 7168))
  fmt = str(rng.choice(["e4m3", "e2m1"]))
  sf = scales(rng, (m, _cdiv(k, npc)), FINITE)
  return Example((floats(rng, (m, k), dtype), fmt, npc, sf), {},
                 _desc(M=m, K=k, dtype=np.dtype(dtype).name, fmt=fmt, npc=npc))


@register("quant.per_token_cast_to_e5m6")
def _per_token_cast_to_e5m6(rng, size):
  m, dtype = _quant_input(rng, size)
  k = pick(rng, size, (8, 24, 64, 136), (2048, 7168))
  flags = _sf_flags(rng)
  return Example((floats(rng, (m, k), dtype), k), flags, _desc(M=m, K=k, dtype=np.dtype(dtype).name, **flags))


@register("quant.per_token_cast_back")
def _per_token_cast_back(rng, size):
  m = pick(rng, size, (0, 1, 3, 32, 130), (4001, 8192))
  k = pick(rng, size, (64, 128, 192), (2048, 7168))
  in_fmt = str(rng.choice(["e4m3", "e2m1"]))
  npc = int(rng.choice([16, 32, 64, 128, 256, k]))
  x, col = _quant_tensor(rng, m, k, (1, npc), in_fmt)
  fmt = str(rng.choice(["bf16", "fp32"]))
  return Example((x, fmt, npc), {"x_use_tma_aligned_col_major_sf": col},
                 _desc(M=m, K=k, input=in_fmt, npc=npc, fmt=fmt, col_major=col))


@register("quant.cast_back")
def _cast_back(rng, size):
  m = pick(rng, size, (0, 1, 3, 32, 130, 256), (4001, 8192))
  k = pick(rng, size, (64, 128, 192), (2048, 7168))
  in_fmt = str(rng.choice(["e4m3", "e2m1"]))
  block = (int(rng.choice([1, 16, 32, 128])), int(rng.choice([1, 16, 32, 64, 128, k])))
  x, col = _quant_tensor(rng, m, k, block, in_fmt)
  fmt = str(rng.choice(["bf16", "fp32"]))
  return Example((x, fmt, block), {"x_use_tma_aligned_col_major_sf": col},
                 _desc(M=m, K=k, input=in_fmt, block=block, fmt=fmt, col_major=col))


@register("quant.cast_back_e5m6")
def _cast_back_e5m6(rng, size):
  m = pick(rng, size, (0, 1, 3, 32, 130), (4001, 8192))
  k = pick(rng, size, (8, 64, 136), (2048, 7168))
  block = (1, k) if rng.random() < 0.7 else (int(rng.choice([1, 32])), int(rng.choice([8, 64])))
  q = bits(rng, (m, 3 * k // 2), np.uint8)
  packable = rng.random() < 0.4
  sf = pow2_scales(rng, (_cdiv(m, block[0]), _cdiv(k, block[1])), 20) if packable else scales(
      rng, (_cdiv(m, block[0]), _cdiv(k, block[1])))
  sf, col = scale_layout(rng, sf, packable=packable)
  fmt = str(rng.choice(["bf16", "fp32"]))
  return Example((QuantTensor(q, sf), fmt, block), {"x_use_tma_aligned_col_major_sf": col},
                 _desc(M=m, K=k, block=block, fmt=fmt, col_major=col, packed=sf.dtype == np.int32))


def _per_block_args(rng, size):
  m, dtype = _quant_input(rng, size, (1, 3, 32, 130), (4001, 8192))
  k = pick(rng, size, (64, 128, 192), (2048, 7168))
  fmt = str(rng.choice(["e4m3", "e2m1"]))
  block = (int(rng.choice([32, 128])), int(rng.choice([32, 128])))
  return m, k, dtype, fmt, block


@register("quant.per_block_cast")
def _per_block_cast(rng, size):
  m, k, dtype, fmt, block = _per_block_args(rng, size)
  flags = _sf_flags(rng)
  return Example((floats(rng, (m, k), dtype), fmt, block), flags,
                 _desc(M=m, K=k, dtype=np.dtype(dtype).name, fmt=fmt, block=block, **flags))


@register("quant.per_block_cast_with_sf_only")
def _per_block_cast_with_sf_only(rng, size):
  return _per_block_cast(rng, size)


@register("quant.per_block_cast_with_precomputed_sf")
def _per_block_cast_with_precomputed_sf(rng, size):
  """A zero or non-finite ``sf`` is outside the contract (docstring): positive finite scales only."""
  m, k, dtype, fmt, block = _per_block_args(rng, size)
  sf = scales(rng, (_cdiv(m, block[0]), _cdiv(k, block[1])), FINITE)
  return Example((floats(rng, (m, k), dtype), fmt, block, sf), {},
                 _desc(M=m, K=k, dtype=np.dtype(dtype).name, fmt=fmt, block=block))


@register("quant.per_block_cast_lossless")
def _per_block_cast_lossless(rng, size):
  """The docstring's precondition: within one output block the input sf span at most 2^11 (scales 2^±5)."""
  m = pick(rng, size, (1, 3, 32, 130), (4001, 8192))
  k = pick(rng, size, (64, 128, 256), (2048, 7168))
  bm, bk = int(rng.choice([1, 16, 32])), int(rng.choice([16, 32]))
  obm, obk = bm * int(rng.choice([1, 2, 4])), bk * int(rng.choice([1, 2, 4]))
  q = bits(rng, (m, k // 2), (np.int8, np.uint8)[rng.integers(2)])
  sf = pow2_scales(rng, (_cdiv(m, bm), _cdiv(k, bk)), 5)
  sf, x_col = scale_layout(rng, sf, packable=True)
  col = bool(rng.random() < 0.5)
  packed = col and bool(rng.random() < 0.5)
  kw = dict(use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed, x_use_tma_aligned_col_major_sf=x_col
            and sf.dtype == np.float32)
  return Example((QuantTensor(q, sf), "e4m3", (bm, bk), (obm, obk)), kw,
                 _desc(M=m, K=k, x_block=(bm, bk), out_block=(obm, obk), x_sf=str(sf.dtype), **kw))


def _per_channel_shape(rng, size):
  m = pick(rng, size, (0, 128, 256), (4096, 8192))
  k = pick(rng, size, (64, 128, 192), (2048, 7168))
  return m, k


@register("quant.per_channel_cast")
def _per_channel_cast(rng, size):
  m, k = _per_channel_shape(rng, size)
  dtype = (np.float32, BF16)[rng.integers(2)]
  rnd = bool(rng.random() < 0.5)
  return Example((floats(rng, (m, k), dtype), "e4m3", 128), {"round_sf": rnd},
                 _desc(M=m, K=k, dtype=np.dtype(dtype).name, round_sf=rnd))


@register("quant.per_channel_cast_and_transpose")
def _per_channel_cast_and_transpose(rng, size):
  m, k = _per_channel_shape(rng, size)
  npt = int(rng.choice([32, 128]))
  rnd = bool(rng.random() < 0.5)
  return Example((floats(rng, (m, k), BF16), "e4m3", npt), {"round_sf": rnd}, _desc(M=m, K=k, npt=npt, round_sf=rnd))


@register("quant.per_channel_cast_fused")
def _per_channel_cast_fused(rng, size):
  m, k = _per_channel_shape(rng, size)
  kw: dict[str, Any] = {"round_sf": bool(rng.random() < 0.5)}
  quantised = rng.random() < 0.3
  if quantised:
    k = _align(k, 128)
    x = QuantTensor(bits(rng, (m, k), E4M3), scales(rng, (m, k // 128)))
    kw["num_per_channels"] = 128
  else:
    x = floats(rng, (m, k), (np.float32, BF16)[rng.integers(2)])
  if rng.random() < 0.6:
    m_in = pick(rng, size, (0, 1, 5, 40), (4001, 8000))
    if quantised:
      x = QuantTensor(bits(rng, (m_in, k), E4M3), scales(rng, (m_in, k // 128)))
    else:
      x = floats(rng, (m_in, k), x.dtype)
    mo = pick(rng, size, (16, 48, 144), (8192, 16384))
    kw["pos_to_token"] = rng.integers(-1, m_in + 2, size=(mo,)).astype(np.int32)
  label = _desc(M=(x.data if quantised else x).shape[0], K=k, quantised=quantised,
                Mo=kw["pos_to_token"].shape[0] if "pos_to_token" in kw else None, round_sf=kw["round_sf"])
  return Example((x, "e4m3", 128), kw, label)


@register("quant.unpack_from_e2m1fn_x2")
def _unpack_from_e2m1fn_x2(rng, size):
  shape = (pick(rng, size, (0, 1, 3, 64), (4096,)), pick(rng, size, (8, 32, 64), (1024, 3584)))
  if rng.random() < 0.3:
    shape = (2,) + shape
  dtype = (np.int8, np.uint8)[rng.integers(2)]
  out = (BF16, jnp.float32)[rng.integers(2)]
  return Example((bits(rng, shape, dtype),), {"out_dtype": out}, _desc(shape=shape, dtype=np.dtype(dtype).name,
                                                                       out_dtype=np.dtype(out).name))


def _clamp(rng):
  return rng.choice([None, 0.5, 10.0])


@register("quant.swiglu_forward_and_per_token_cast")
def _swiglu_forward_and_per_token_cast(rng, size):
  """Values up to ±max of the format (overflowing products included); the docstring states no exception."""
  e = pick(rng, size, (0, 1, 3, 17, 64), (4096, 8192))
  h = pick(rng, size, (128, 256), (2048, 3072))
  dtype = (np.float32, BF16)[rng.integers(2)]
  npc = int(rng.choice([128, h]))
  col = npc == 128 and bool(rng.random() < 0.4)
  rnd = bool(rng.random() < 0.5)
  packed = col and rnd and bool(rng.random() < 0.5)
  kw: dict[str, Any] = dict(use_tma_aligned_col_major_sf=col, round_sf=rnd, use_packed_ue8m0=packed)
  clamp = _clamp(rng)
  kw["swiglu_clamp_value"] = None if clamp is None else float(clamp)
  args = [floats(rng, (e, 2 * h), dtype, regime=str(rng.choice([IEEE, FINITE, TAME])))]
  if rng.random() < 0.5:
    t, k = e // 2 + 1, 3
    args += [rng.integers(-1, t * k, size=(e,)).astype(np.int32), rng.random((t, k)).astype(np.float32)]
    if rng.random() < 0.5:
      args.append(rng.integers(-1, 4, size=(e,)).astype(np.int32))
  if clamp is not None and rng.random() < 0.5:
    kw["clamped_count"] = rng.integers(0, 100, size=(3,)).astype(np.int32)
  if rng.random() < 0.2:
    kw["sf_clamp_min"] = float(rng.choice([1e-8, 1.0]))
  return Example((args[0], "e4m3", npc, *args[1:]), kw,
                 _desc(E=e, h=h, dtype=np.dtype(dtype).name, npc=npc, weights=len(args) > 1,
                       pos_to_expert=len(args) > 3, **{k_: v for k_, v in kw.items() if k_ != "clamped_count"}))


@register("quant.swiglu_forward_and_per_channel_cast_and_transpose")
def _swiglu_per_channel(rng, size):
  """"Non-finite values (inputs, or products that overflow) are outside the contract": ``TAME`` values."""
  m = pick(rng, size, (0, 128, 256), (4096, 8192))
  h = pick(rng, size, (64, 128, 192), (2048, 3072))
  npt = int(rng.choice([32, 128]))
  clamp = _clamp(rng)
  kw = dict(round_sf=bool(rng.random() < 0.5), without_transpose=bool(rng.random() < 0.5),
            swiglu_clamp_value=None if clamp is None else float(clamp))
  return Example((floats(rng, (m, 2 * h), BF16, TAME), "e4m3", npt), kw, _desc(M=m, h=h, npt=npt, **kw))


def _slot_mapping(rng, e, t, k):
  """A mutually inverse ``(pos_to_token_topk (E,), token_topk_to_pos (T, k))`` with padding rows."""
  slots = rng.permutation(t * k)[:e]
  pos = np.where(rng.random(e) < 0.2, -1, slots).astype(np.int32)
  t2p = np.full(t * k, -1, np.int32)
  t2p[pos[pos >= 0]] = np.nonzero(pos >= 0)[0]
  return pos, t2p.reshape(t, k)


def _swiglu_backward_compare(got, want):
  """``out``, ``x_grad_quant`` and ``x_grad`` bit for bit; ``weight_grad`` "sums in another order (quant.md:
  compared with atol = rtol = 1e-4)" plus ``2^-20·Σ|terms|`` as the op's tests allow for cancelling sums."""
  for i, (g, w) in enumerate(_leaves(got, want)[:4]):
    assert_bitwise_equal(g, w, f"leaf {i}")
  g, w = np.asarray(got.weight_grad, np.float64), np.asarray(want.weight_grad, np.float64)
  close(1e-4, 1e-4)(g, w)


@register("quant.swiglu_backward_and_per_token_cast", compare=_swiglu_backward_compare, exact=True)
def _swiglu_backward_and_per_token_cast(rng, size):
  """The precondition "every dequantised gate value finite and > -87": the forward input is drawn in [-80, 80]
  (``TAME``)."""
  from jaxkern.reference import quant as ref

  e = pick(rng, size, (0, 1, 3, 17, 64), (4096, 8192))
  h = pick(rng, size, (128, 256), (2048, 3072))
  npc = int(rng.choice([32, 128]))
  x = np.clip(floats(rng, (e, 2 * h), BF16, TAME, spread=2).astype(np.float32), -80, 80).astype(BF16)
  xq = ref.per_token_cast(jnp.asarray(x), "e4m3", npc)
  k = int(rng.integers(1, 5))
  t = e // k + 2
  pos, t2p = _slot_mapping(rng, e, t, k)
  g = floats(rng, (e, h), BF16, TAME, spread=2)
  w = rng.random((t, k)).astype(np.float32)
  clamp = _clamp(rng)
  kw = dict(round_sf=bool(rng.random() < 0.5), swiglu_clamp_value=None if clamp is None else float(clamp))
  return Example((xq, g, w, pos, t2p, npc), kw, _desc(E=e, h=h, npc=npc, T=t, k=k, **kw))


# ---------------------------------------------------------------------------------------------------------------
# engram


def _engram_dims(rng, size):
  t = pick(rng, size, (0, 1, 3, 17), (4001, 8001))
  m = int(rng.choice([1, 2, 4]))
  d = pick(rng, size, (256, 512), (2048, 4096, 7168))
  return t, m, d


def _engram_fwd_mask(want):
  """The docstring's exception: "At d = ±0 (raw = ±0, an rstd of 0 from an infinite Σx² or Σk², or a product
  raw·rx·rk·s that underflows) the kernel's copysign gives the gate σ(±sqrt(c)), the reference's sign 0.5":
  tokens whose ``d`` is zero or may underflow in some order of the product are left out of ``output`` (and
  ``gate_score``)."""
  out = np.asarray(want.output)
  if want.dot is None:
    return None
  raw, rx, rk = (np.abs(np.asarray(a, np.float64)) for a in (want.dot, want.rstd_x, want.rstd_k))
  s = out.shape[-1] ** -0.5
  with np.errstate(invalid="ignore", over="ignore"):
    partial = [raw * rx, raw * rk, rx * rk, raw * rx * rk * s]
  zero = (raw == 0) | (rx == 0) | (rk == 0) | np.any([p < _TINY for p in partial], axis=0)
  keep_out = ~np.broadcast_to(zero[..., None], out.shape)
  return [keep_out, None, ~zero, None, None]


# Relative width of the band around FLT_MAX in which a float32 sum of D <= 7168 terms may or may not overflow
# depending on its order (each of at most 2^13 roundings moves it by 2^-24: 2^-11 in all, 2^-8 with margin).
SUM_OVERFLOW_BAND = 2.0**-8


def _engram_gate_fwd_unspecified(example, want):
  """The docstring: "Where a (token, stream)'s sum reaches float32's range (``Σ|x·wf·k|`` of the finite terms
  at FLT_MAX or beyond; ``Σx²`` or ``Σk²`` within rounding of it), its result depends on the summation order:
  that stream's ``dot``, ``gate_score`` and ``output`` (``rstd_x`` / ``rstd_k`` for their sums) are
  unspecified"."""
  x, k = (np.asarray(a, np.float64) for a in example.args[:2])
  wf = np.asarray(example.args[3], np.float32)
  with np.errstate(invalid="ignore", over="ignore"):
    xw = (np.asarray(example.args[0], np.float32) * wf).astype(np.float64)  # rounded as kernel and reference do
    terms = np.abs(xw * k)
    finite = np.isfinite(xw) & np.isfinite(k)
    dot_open = np.where(finite, terms, 0.0).sum(axis=-1) >= FLT_MAX * (1 - SUM_OVERFLOW_BAND)

    def near_max(v):
      sq = np.where(np.isfinite(v), v * v, 0.0).sum(axis=-1)
      return np.abs(sq - FLT_MAX) <= FLT_MAX * SUM_OVERFLOW_BAND

    rx_open, rk_open = near_max(x), near_max(k)
  gate_open = dot_open | rx_open | rk_open
  return [np.broadcast_to(gate_open[..., None], np.shape(want.output)), dot_open, gate_open, rx_open, rk_open]


@register("engram.engram_gate_fwd", compare=diff_below(2e-10, _engram_fwd_mask), exact=False,
          unspecified=_engram_gate_fwd_unspecified)
def _engram_gate_fwd(rng, size):
  t, m, d = _engram_dims(rng, size)
  x, k = floats(rng, (t, m, d), BF16, spread=2), floats(rng, (t, m, d), BF16, spread=2)
  v = floats(rng, (t, d), BF16, spread=2)
  wf = floats(rng, (m, d), np.float32, FINITE, spread=1)
  kw = dict(eps=float(rng.choice([1e-20, 1e-6])), clamp_value=float(rng.choice([1e-6, 1e-2])), save_for_backward=True)
  return Example((x, k, v, wf), kw, _desc(T=t, M=m, D=d, **kw))


@register("engram.engram_gate_bwd", compare=diff_below(1e-8), exact=False)
def _engram_gate_bwd(rng, size):
  from jaxkern.reference import engram as ref

  t, m, d = _engram_dims(rng, size)
  x, k = floats(rng, (t, m, d), BF16, spread=2), floats(rng, (t, m, d), BF16, spread=2)
  v = floats(rng, (t, d), BF16, spread=2)
  wf = floats(rng, (m, d), np.float32, FINITE, spread=1)
  clamp = float(rng.choice([1e-6, 1e-2]))
  fwd = ref.engram_gate_fwd(jnp.asarray(x), jnp.asarray(k), jnp.asarray(v), jnp.asarray(wf), eps=1e-6,
                            clamp_value=clamp)
  go = floats(rng, (t, m, d), BF16, spread=2)
  kw = dict(clamp_value=clamp)
  if rng.random() < 0.5:
    kw["num_partials"] = int(rng.integers(1, 9))
  return Example((go, x, k, v, wf, fwd.dot, fwd.gate_score, fwd.rstd_x, fwd.rstd_k), kw, _desc(T=t, M=m, D=d, **kw))


@register("engram.engram_hash")
def _engram_hash(rng, size):
  t = pick(rng, size, (0, 1, 5, 33), (4001, 8001))
  layers, n, e = int(rng.integers(1, 4)), int(rng.integers(2, 5)), int(rng.integers(1, 9))
  ids = rng.integers(-2**31, 2**31, size=(t, n), dtype=np.int64).astype(np.int32)
  if rng.random() < 0.5:
    ids = rng.integers(0, 130000, size=(t, n)).astype(np.int32)
  mult = rng.integers(-2**63, 2**63, size=(layers, n), dtype=np.int64)
  sizes = rng.choice([1, 2, 3, 7, 2**31 - 1, 1000003, 129280], size=(layers, n - 1, e))
  sizes = np.where(rng.random(sizes.shape) < 0.5, rng.integers(1, 2**31 - 1, size=sizes.shape), sizes).astype(np.int32)
  offsets = np.asarray(importlib.import_module("jaxkern.engram").make_offsets(sizes, implementation="reference"))
  words = rng.random() < 0.5
  if words:
    mult = mult.view(np.uint32).reshape(layers, n, 2)
  return Example((ids, mult, sizes, offsets), {}, _desc(T=t, L=layers, N=n, E=e, multipliers_as_words=words))


@register("engram.fused_weight")
def _fused_weight(rng, size):
  m, d = int(rng.choice([1, 4])), pick(rng, size, (1, 7, 256), (4096, 7168))
  return Example((floats(rng, (m, d), BF16), floats(rng, (m, d), BF16)), {}, _desc(M=m, D=d))


@register("engram.grad_w_reduce")
def _grad_w_reduce(rng, size):
  p, m, d = int(rng.integers(1, 20)), int(rng.choice([1, 4])), pick(rng, size, (1, 7, 256), (4096, 7168))
  args = (floats(rng, (p, m, d), np.float32, spread=2), floats(rng, (m, d), BF16), floats(rng, (m, d), BF16),
          floats(rng, (m, d), np.float32), floats(rng, (m, d), np.float32))
  return Example(args, {}, _desc(P=p, M=m, D=d))


@register("engram.make_offsets")
def _make_offsets(rng, size):
  shape = (int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(1, 9)))
  return Example((rng.integers(1, 2**31 - 1, size=shape).astype(np.int32),), {}, _desc(shape=shape))


# ---------------------------------------------------------------------------------------------------------------
# mhc

BF16_TOL = dict(rtol=1.6e-2, atol=1e-5)  # torch.testing.assert_close's bf16 defaults, as upstream's tests use them
FP32_TOL = dict(rtol=1.3e-6, atol=1e-5)  # and its float32 ones


def _lead(rng, size):
  return pick(rng, size, ((0,), (1,), (3,), (2, 5), (130,)), ((4096,), (2, 4096), (8192,)))


def _hidden(rng, size):
  return pick(rng, size, (8, 12, 20, 64, 136, 256), (1280, 2560, 4096, 7168))


@register("mhc.expand_to_mhc")
def _expand_to_mhc(rng, size):
  lead, h, m = _lead(rng, size), _hidden(rng, size), int(rng.choice([1, 2, 4, 8]))
  return Example((floats(rng, lead + (h,), BF16),), {"mhc_mult": m}, _desc(lead=lead, H=h, M=m))


@register("mhc.expand_to_mhc_bwd")
def _expand_to_mhc_bwd(rng, size):
  lead, h, m = _lead(rng, size), _hidden(rng, size), int(rng.choice([1, 2, 4, 8]))
  return Example((floats(rng, lead + (m, h), BF16),), {}, _desc(lead=lead, H=h, M=m))


@register("mhc.fn_normw_merge")
def _fn_normw_merge(rng, size):
  j, k = 24, 4 * _hidden(rng, size)
  return Example((floats(rng, (j, k), np.float32), floats(rng, (k,), np.float32)), {}, _desc(J=j, K=k))


@register("mhc.round_to_tf32")
def _round_to_tf32(rng, size):
  shape = _lead(rng, size) + (int(rng.integers(1, 40)),)
  return Example((bits(rng, shape, np.float32),), {}, _desc(shape=shape))


@register("mhc.head_compute_mix")
def _head_compute_mix(rng, size):
  lead, m = _lead(rng, size), int(rng.choice([1, 4]))
  args = (floats(rng, lead + (m,), np.float32), floats(rng, (1,), np.float32, FINITE), floats(rng, (m,), np.float32))
  return Example(args, {"mhc_pre_eps": float(rng.choice([1e-6, 0.0]))}, _desc(lead=lead, M=m))


@register("mhc.head_compute_mix_bwd")
def _head_compute_mix_bwd(rng, size):
  lead, m = _lead(rng, size), int(rng.choice([1, 4]))
  args = (floats(rng, lead + (m,), np.float32), floats(rng, lead + (m,), np.float32),
          floats(rng, (1,), np.float32, FINITE), floats(rng, (m,), np.float32))
  return Example(args, {}, _desc(lead=lead, M=m))


def _split_args(rng, size):
  lead, m = _lead(rng, size), int(rng.choice([1, 2, 4]))
  j = m * (m + 2)
  return lead, m, (floats(rng, lead + (j,), np.float32), floats(rng, (3,), np.float32, FINITE),
                   floats(rng, (j,), np.float32))


@register("mhc.pre_split_mixes")
def _pre_split_mixes(rng, size):
  lead, m, args = _split_args(rng, size)
  kw = dict(mhc_mult=m, mhc_post_mult_value=float(rng.choice([1.0, 2.0])), mhc_pre_eps=1e-6)
  return Example(args, kw, _desc(lead=lead, **kw))


@register("mhc.pre_split_mixes_bwd")
def _pre_split_mixes_bwd(rng, size):
  lead, m, (z, scale, base) = _split_args(rng, size)
  grads = (floats(rng, lead + (m, 1), np.float32), floats(rng, lead + (m, 1), np.float32),
           floats(rng, lead + (m, m), np.float32))
  post = floats(rng, lead + (m, 1), np.float32)
  kw = dict(mhc_mult=m, mhc_post_mult_value=float(rng.choice([1.0, 2.0])))
  return Example(grads + (z, post, scale, base), kw, _desc(lead=lead, **kw))


def _mixes(rng, lead, m, regime):
  return floats(rng, lead + (m, 1), np.float32, regime, spread=1)


FLT_MAX = float(np.finfo(np.float32).max)


def _overflows(a, b) -> np.ndarray:
  """Where the product of finite ``a`` and ``b`` (broadcast) lies beyond float32's range (float64, exact for
  float32 times bfloat16)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  with np.errstate(invalid="ignore", over="ignore"):
    return np.isfinite(a) & np.isfinite(b) & (np.abs(a * b) > FLT_MAX)


def _apply_mix_overflow(x, mix) -> np.ndarray:
  """``(..., H)``: tokens and columns where some ``mix[m]·x[m]`` of finite factors overflows float32."""
  return _overflows(mix, x).any(axis=-2)


def _post_overflow(x, residual, post, comb) -> np.ndarray:
  """``(..., H)``: where some product of :func:`jaxkern.mhc.post` (``post[n]·x``, ``comb[m, n]·residual[m]``)
  of finite factors overflows float32, for any output stream ``n``."""
  by_post = _overflows(post, np.asarray(x, np.float64)[..., None, :]).any(axis=-2)
  by_comb = _overflows(np.asarray(comb)[..., None], np.asarray(residual, np.float64)[..., :, None, :])
  return by_post | by_comb.any(axis=(-3, -2))


def _pre_apply_mix_unspecified(example, want):
  """The docstring: "Where a product ``mix[m]·x[m]`` of finite factors overflows float32, the output element is
  unspecified"."""
  x, mix = example.args
  return [_apply_mix_overflow(x, mix)]


def _post_unspecified(example, want):
  """The docstring: "Where a product of finite factors overflows float32 ..., that column of every output
  stream is unspecified"."""
  x, residual, post, comb = example.args
  over = _post_overflow(x, residual, post, comb)
  return [np.broadcast_to(over[..., None, :], np.shape(want))]


def _multilayer_recompute_unspecified(example, want):
  """The per-layer ops' exception (``pre_apply_mix``, ``post``), carried down the chain: an unspecified
  residual column leaves that column of every later layer input and residual unspecified. The reference's
  residuals stand in for the later layers' inputs."""
  r0, pre_mixes, outputs, post_mixes, comb_mixes = example.args
  residuals = [r0] + [np.asarray(r) for r in want.residual_list]
  open_cols = np.zeros(np.shape(r0)[:-2] + np.shape(r0)[-1:], bool)
  inputs, outs = [], []
  for i, pre in enumerate(pre_mixes):
    inputs.append(open_cols | _apply_mix_overflow(residuals[i], pre))
    if i < len(outputs):
      open_cols = open_cols | _post_overflow(outputs[i], residuals[i], post_mixes[i], comb_mixes[i])
      outs.append(np.broadcast_to(open_cols[..., None, :], np.shape(residuals[i])))
  return inputs + outs


def _sum_rounding(terms, m: int) -> np.ndarray:
  """How far two float32 sums of ``m`` products may differ when one contracts adds into FMAs and the other
  rounds every product (the docstrings' FMA difference): ``2m`` roundings of at most ``2^-24`` of ``Σ|terms|``."""
  return m * 2.0**-23 * terms


def _bf16_ulp(v) -> np.ndarray:
  """An upper bound of one bfloat16 ulp at ``v``."""
  return 2.0**-7 * np.abs(np.asarray(v, np.float64))


def _apply_mix_bound(x, mix, x_err, want):
  """``pre_apply_mix``'s bound: the FMA difference of ``Σ_m mix[m]·x[m]``, ``x``'s own error carried
  (``Σ_m |mix[m]|·x_err[m]``) and one bf16 ulp of the rounded output."""
  x64, mix64 = np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(mix, np.float64))
  with np.errstate(invalid="ignore", over="ignore"):
    return (_sum_rounding((mix64 * x64).sum(axis=-2), x64.shape[-2]) + (mix64 * x_err).sum(axis=-2)
            + _bf16_ulp(want))


def _post_bound(x, residual, post, comb, res_err, want):
  """``post``'s bound per output stream ``n``: the FMA difference of ``post[n]·x + Σ_m comb[m, n]·res[m]``,
  the residual's own error carried through ``|comb|`` and one bf16 ulp of the rounded output."""
  x64, r64 = np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(residual, np.float64))
  p64, c64 = np.abs(np.asarray(post, np.float64)), np.abs(np.asarray(comb, np.float64))
  m = r64.shape[-2]
  with np.errstate(invalid="ignore", over="ignore"):
    terms = p64 * x64[..., None, :] + np.einsum("...mn,...mh->...nh", c64, r64)
    carried = np.einsum("...mn,...mh->...nh", c64, np.broadcast_to(res_err, r64.shape))
  return _sum_rounding(terms, m + 1) + carried + _bf16_ulp(want)


def _pre_apply_mix_within(example, want):
  """The docstring's FMA difference, where terms cancel more than one bf16 ulp of the output."""
  x, mix = example.args
  return [_apply_mix_bound(x, mix, 0.0, want)]


def _post_within(example, want):
  x, residual, post, comb = example.args
  return [_post_bound(x, residual, post, comb, 0.0, want)]


def _multilayer_recompute_within(example, want):
  """The per-layer bounds carried down the chain (the reference's residuals stand in for the kernel's)."""
  r0, pre_mixes, outputs, post_mixes, comb_mixes = example.args
  residuals = [r0] + [np.asarray(r) for r in want.residual_list]
  err, inputs, outs = 0.0, [], []
  for i, pre in enumerate(pre_mixes):
    inputs.append(_apply_mix_bound(residuals[i], pre, err, want.layer_input_list[i]))
    if i < len(outputs):
      err = _post_bound(outputs[i], residuals[i], post_mixes[i], comb_mixes[i], err, residuals[i + 1])
      outs.append(err)
  return inputs + outs


@register("mhc.pre_apply_mix", compare=close(**BF16_TOL), unspecified=_pre_apply_mix_unspecified,
          within=_pre_apply_mix_within)
def _pre_apply_mix(rng, size):
  """The docstring: the kernel contracts each add into an FMA, XLA on a GPU does not (one bf16 ulp on about 1e-4
  of the outputs): the tests' bf16 tolerance."""
  lead, h, m = _lead(rng, size), _hidden(rng, size), int(rng.choice([1, 2, 4, 8]))
  return Example((floats(rng, lead + (m, h), BF16), _mixes(rng, lead, m, IEEE)), {}, _desc(lead=lead, M=m, H=h))


@register("mhc.pre_apply_mix_bwd", compare=per_leaf(close(**BF16_TOL), close(rtol=1e-4, atol=1e-4, atol_per_max=True,
                                                                            any_non_finite=True)))
def _pre_apply_mix_bwd(rng, size):
  """``x_grad`` within the bf16 tolerance, ``mix_grad`` (another summation order) within 1e-4 of its scale; where
  its sum overflows, ±inf or NaN (the docstring: the order decides)."""
  lead, h, m = _lead(rng, size), _hidden(rng, size), int(rng.choice([1, 2, 4, 8]))
  args = [floats(rng, lead + (h,), BF16), floats(rng, lead + (m, h), BF16), _mixes(rng, lead, m, IEEE)]
  if rng.random() < 0.5:
    args.append(floats(rng, lead + (m, h), BF16))
  return Example(tuple(args), {}, _desc(lead=lead, M=m, H=h, x_grad_acc=len(args) == 4))


@register("mhc.post", compare=close(**BF16_TOL), unspecified=_post_unspecified, within=_post_within)
def _post(rng, size):
  lead, h, m = _lead(rng, size), _hidden(rng, size), int(rng.choice([1, 2, 4]))
  args = (floats(rng, lead + (h,), BF16), floats(rng, lead + (m, h), BF16), _mixes(rng, lead, m, IEEE),
          floats(rng, lead + (m, m), np.float32, IEEE, spread=1))
  return Example(args, {}, _desc(lead=lead, M=m, H=h))


def _post_bwd_unspecified(example, want):
  """The docstring: where a product ``post[n]·dO[n]`` (``d_x``) or ``comb[m, n]·dO[n]`` (``d_residual[m]``)
  of finite factors overflows float32, that element is unspecified (the forward's FMA exception)."""
  d_o, _, _, post, comb = example.args
  d_x = _overflows(post, d_o).any(axis=-2)
  d_residual = _overflows(np.asarray(comb)[..., None], np.asarray(d_o, np.float64)[..., None, :, :]).any(axis=-2)
  return [d_x, d_residual]


@register("mhc.post_bwd", compare=per_leaf(close(**BF16_TOL), close(**BF16_TOL),
                                           close(rtol=1e-4, atol=1e-4, atol_per_max=True, any_non_finite=True)),
          unspecified=_post_bwd_unspecified)
def _post_bwd(rng, size):
  """``d_x`` / ``d_residual`` within the bf16 tolerance, the mix gradients (another summation order) within
  1e-4 of their scale (the op's tests: rtol = atol = 1e-4); where their sums overflow, ±inf or NaN."""
  lead, h, m = _lead(rng, size), _hidden(rng, size), int(rng.choice([1, 2, 4]))
  args = (floats(rng, lead + (m, h), BF16), floats(rng, lead + (h,), BF16), floats(rng, lead + (m, h), BF16),
          _mixes(rng, lead, m, IEEE), floats(rng, lead + (m, m), np.float32, IEEE, spread=1))
  return Example(args, {}, _desc(lead=lead, M=m, H=h))


@register("mhc.multilayer_recompute", compare=close(**BF16_TOL), unspecified=_multilayer_recompute_unspecified,
          within=_multilayer_recompute_within)
def _multilayer_recompute(rng, size):
  """The kernel rounds as the per-layer kernels; the reference composition's ``pre_apply_mix`` does not contract
  into FMAs on a GPU (``pre_apply_mix``'s docstring): the bf16 tolerance."""
  lead, m = _lead(rng, size), int(rng.choice([1, 2, 4]))
  h = pick(rng, size, (128, 256), (2560, 4096))
  layers = int(rng.integers(1, 4))
  lp = layers - int(rng.integers(0, 2))
  args = (floats(rng, lead + (m, h), BF16), [_mixes(rng, lead, m, IEEE) for _ in range(layers)],
          [floats(rng, lead + (h,), BF16) for _ in range(lp)], [_mixes(rng, lead, m, IEEE) for _ in range(lp)],
          [floats(rng, lead + (m, m), np.float32, IEEE, spread=1) for _ in range(lp)])
  return Example(args, {}, _desc(lead=lead, M=m, H=h, L=layers, Lp=lp))


# Residual values of the pre_norm_fn ops: the full range. Their docstrings: a non-finite residual element or a float32
# overflow gives non-finite out_mul and mixes, "NaN or ±inf, not always the same in kernel and reference"
# (compared with any_non_finite).
NORM_FN_RESIDUAL = IEEE


def _norm_fn_args(rng, size):
  lead = _lead(rng, size)
  h = pick(rng, size, (64, 128, 192), (1280, 4096, 7168))
  # fn below 2^127·(2 - 2^-10): "values that round past FLT_MAX become ±inf (out of contract)" (round_to_tf32)
  fn = np.clip(floats(rng, (24, 4 * h), np.float32, FINITE, spread=2), -1e38, 1e38)
  return lead, h, floats(rng, lead + (4, h), BF16, NORM_FN_RESIDUAL), fn


NORM_FN_TOL = dict(rtol=1e-3, atol=1e-3, any_non_finite=True)  # pre_norm_fn's docstring: "mixes atol = rtol = 1e-3"


@register("mhc.pre_norm_fn_fwd", compare=close(**NORM_FN_TOL))
def _pre_norm_fn_fwd(rng, size):
  lead, h, r, fn = _norm_fn_args(rng, size)
  kw = dict(norm_eps=float(rng.choice([1e-6, 0.0])), n_splits=int(rng.choice([1, 3, 16])))
  return Example((r, fn), kw, _desc(lead=lead, H=h, **kw))


@register("mhc.pre_norm_fn", compare=close(**NORM_FN_TOL))
def _pre_norm_fn(rng, size):
  lead, h, r, fn = _norm_fn_args(rng, size)
  weight = floats(rng, (4 * h,), np.float32, NORM_FN_RESIDUAL, spread=1)  # fn · weight must not overflow either
  args = (r, fn) + ((weight,) if rng.random() < 0.5 else ())
  kw = dict(norm_eps=1e-6, n_splits=int(rng.choice([1, 16])))
  return Example(args, kw, _desc(lead=lead, H=h, norm_weight=len(args) == 3, **kw))


@register("mhc.pre_norm_fn_bwd", compare=per_leaf(close(rtol=1.6e-2, atol=1e-5, any_non_finite=True),
                                                      close(rtol=1e-3, atol=3e-2, any_non_finite=True)))
def _pre_norm_fn_bwd(rng, size):
  """pre_norm_fn's docstring: "residual gradient bf16 (rtol 1.6e-2); fn gradient atol 3e-2, rtol 1e-3"."""
  from jaxkern.reference import mhc_norm as ref

  lead, h, r, fn = _norm_fn_args(rng, size)
  fwd = ref.pre_norm_fn_fwd(jnp.asarray(r), jnp.asarray(fn))
  g = floats(rng, lead + (24,), np.float32, NORM_FN_RESIDUAL, spread=1)  # split into hi / lo like fn_r
  return Example((g, r, fn, fwd.out_mul, fwd.sqrsum), {}, _desc(lead=lead, H=h))


@register("mhc.pre_big_fuse", compare=close(**NORM_FN_TOL))
def _pre_big_fuse(rng, size):
  """pre_norm_fn's tolerance carried through the chain (the op's tests). Moderate ``fn``, scale and base: the
  docstring leaves a token whose mixes are not finite unspecified ("NaN against 0" after Sinkhorn)."""
  lead, h, r, _ = _norm_fn_args(rng, size)
  fn = floats(rng, (24, 4 * h), np.float32, TAME, spread=0)  # no mixes overflowing into Sinkhorn's softmax
  scale, base = floats(rng, (3,), np.float32, TAME, spread=0), floats(rng, (24,), np.float32, TAME, spread=0)
  kw = dict(sinkhorn_repeat=int(rng.choice([1, 10])), n_splits=int(rng.choice([1, 16])))
  return Example((r, fn, scale, base), kw, _desc(lead=lead, H=h, **kw))


@register("mhc.sinkhorn_normalize", compare=close(**FP32_TOL))
def _sinkhorn_normalize(rng, size):
  """"The GPU's float32 division is approximate (within ~2 ulp)": the tests' fp32 tolerance."""
  lead, m = _lead(rng, size), int(rng.choice([2, 4, 6, 8]))
  kw = dict(repeat=int(rng.choice([1, 3, 10, 20])), eps=float(rng.choice([1e-6, 1e-3])))
  return Example((floats(rng, lead + (m, m), np.float32, spread=2),), kw, _desc(lead=lead, M=m, **kw))


@register("mhc.sinkhorn_normalize_bwd", compare=close(**FP32_TOL))
def _sinkhorn_normalize_bwd(rng, size):
  lead, m = _lead(rng, size), int(rng.choice([2, 4, 6, 8]))
  kw = dict(repeat=int(rng.choice([1, 3, 10, 20])), eps=float(rng.choice([1e-6, 1e-3])))
  args = (floats(rng, lead + (m, m), np.float32, spread=1), floats(rng, lead + (m, m), np.float32, spread=2))
  return Example(args, kw, _desc(lead=lead, M=m, **kw))


# ---------------------------------------------------------------------------------------------------------------
# gemm


def _gemm_compare(got, want):
  """The op's tests: ``rtol = 1e-5`` (0 on a GPU) and ``atol`` 1e-6 (1e-3 on a GPU) of the largest ``|want|``
  (kernel and reference differ in the summation order inside a 128-deep step); a bfloat16 output adds one bf16
  ulp (``2^-7`` relative): two float32 results on either side of a rounding midpoint round to neighbours (the
  tests compare with a float32 reference and allow half of it). An H200 run (2026-11-29) found exactly that:
  2.1578e13 against 2.1440e13, one bf16 ulp (2^37), beyond 1e-3 of the largest entry (7.3e13)."""
  on_gpu = jax.default_backend() == "gpu"
  bf16_ulp = 2.0**-7 if np.asarray(want).dtype == np.dtype(BF16) else 0.0
  close(rtol=(0.0 if on_gpu else 1e-5) + bf16_ulp, atol=1e-3 if on_gpu else 1e-6, atol_per_max=True)(got, want)


def _gemm_operand(rng, m, k, layout):
  """A finite e4m3 ``(M, K)`` operand with per-token 1x128 scales in layout ``A``, ``B`` or ``C``."""
  data = finite_e4m3(rng, (m, k))
  sf = pow2_scales(rng, (m, k // 128), 8) if layout == "C" else scales(rng, (m, k // 128), FINITE)
  if layout == "A":
    return QuantTensor(data, sf)
  return QuantTensor(data, col_major(sf) if layout == "B" else pack_ue8m0(sf))


def _gemm_weights(rng, g, n, k):
  return QuantTensor(finite_e4m3(rng, (g, n, k)), scales(rng, (g, n // 128, k // 128), FINITE))


def _gemm_dims(rng, size):
  g = int(rng.integers(1, 4))
  blocks = pick(rng, size, (0, 1, 2), (16, 64))
  n = 128 * pick(rng, size, (1, 2), (8, 16))
  k = 128 * pick(rng, size, (1, 2), (8, 16))
  block_expert = rng.integers(-1, g, size=(blocks,)).astype(np.int32)
  return g, 128 * blocks, n, k, block_expert


def _gemm_example(rng, size, input_grad: bool) -> Example:
  """The forward (``x`` of width K) or the input gradient (``dy`` of width N): finite e4m3 data and scales, the
  docstrings define no non-finite behaviour for the GEMMs."""
  g, m, n, k, be = _gemm_dims(rng, size)
  layout = str(rng.choice(["A", "B", "C"]))
  out = (BF16, jnp.float32)[rng.integers(2)]
  return Example((_gemm_operand(rng, m, n if input_grad else k, layout), _gemm_weights(rng, g, n, k), be),
                 {"out_dtype": out, "x_use_tma_aligned_col_major_sf": layout != "A"},
                 _desc(G=g, M=m, N=n, K=k, layout=layout, out_dtype=np.dtype(out).name))


@register("gemm.fp8_grouped_gemm", compare=_gemm_compare, exact=False)
def _fp8_grouped_gemm(rng, size):
  return _gemm_example(rng, size, input_grad=False)


@register("gemm.fp8_grouped_gemm_input_grad", compare=_gemm_compare, exact=False)
def _fp8_grouped_gemm_input_grad(rng, size):
  return _gemm_example(rng, size, input_grad=True)


@register("gemm.fp8_grouped_gemm_weight_grad", compare=_gemm_compare, exact=False)
def _fp8_grouped_gemm_weight_grad(rng, size):
  g, m, n, k, be = _gemm_dims(rng, size)
  dy_t = QuantTensor(finite_e4m3(rng, (n, m)), scales(rng, (m // 128, n), FINITE))
  x_t = QuantTensor(finite_e4m3(rng, (k, m)), scales(rng, (m // 128, k), FINITE))
  out = (BF16, jnp.float32)[rng.integers(2)]
  return Example((dy_t, x_t, be), {"num_experts": g, "out_dtype": out},
                 _desc(G=g, M=m, N=n, K=k, out_dtype=np.dtype(out).name))


@register("gemm.transpose_weights")
def _transpose_weights(rng, size):
  g, _, n, k, _ = _gemm_dims(rng, size)
  w = QuantTensor(bits(rng, (g, n, k), E4M3), scales(rng, (g, n // 128, k // 128)))
  return Example((w,), {}, _desc(G=g, N=n, K=k))


# ---------------------------------------------------------------------------------------------------------------
# Running


def public_ops() -> list[str]:
  """``module.name`` of every public function of :data:`MODULES` (their ``__all__``, types left out)."""
  names = []
  for module in MODULES:
    mod = importlib.import_module(f"jaxkern.{module}")
    names += [f"{module}.{n}" for n in mod.__all__ if callable(getattr(mod, n)) and not isinstance(getattr(mod, n),
                                                                                                    type)]
  return names


def example_rng(seed: int, op: str, index: int) -> np.random.Generator:
  """The generator of example ``index`` of ``op``: independent of the other ops and examples."""
  return np.random.default_rng((seed, zlib.crc32(op.encode()), index))


def make_example(op: str, seed: int, index: int, size: str = "small") -> Example:
  """Example ``index`` of ``op`` for ``seed``."""
  return OPS[op].make(example_rng(seed, op, index), size)


def _to_jax(x):
  """NumPy arrays to jax arrays, except 64-bit integers (truncated with x64 off: the ops take them from NumPy)."""
  if isinstance(x, np.ndarray) and x.dtype not in (np.int64, np.uint64):
    return jnp.asarray(x)
  if isinstance(x, QuantTensor):
    return QuantTensor(_to_jax(x.data), _to_jax(x.sf))
  if isinstance(x, list):
    return [_to_jax(v) for v in x]
  return x


def check(op: str, example: Example, implementation: str) -> bool:
  """Runs ``op`` on ``example`` with ``implementation`` and the reference and compares; raises
  ``AssertionError`` on a disagreement, :class:`KernelUnavailableError` where the kernel declines. Returns
  whether a Pallas kernel ran (not the XLA path of a zero-size problem or of an op without a kernel)."""
  fz = OPS[op]
  args = tuple(_to_jax(a) for a in example.args)
  kwargs = {k: _to_jax(v) for k, v in example.kwargs.items()}
  with recording() as decisions:
    got = jax.block_until_ready(fz.fn(*args, implementation=implementation, **kwargs))
  want = jax.block_until_ready(fz.fn(*args, implementation="reference", **kwargs))
  if fz.unspecified is not None:
    got = _with_unspecified_from(got, want, fz.unspecified(example, want))
  if fz.within is not None:
    got = _with_unspecified_from(got, want, _within_masks(got, want, fz.within(example, want)))
  fz.compare(got, want)
  return any(d.path in ("pallas", "interpret") for d in decisions)


def _within_masks(got, want, bounds):
  """Per leaf: where finite ``got`` and ``want`` differ by at most ``bounds`` (None: no mask)."""
  if bounds is None:
    return None
  out = []
  for g, w, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), bounds):
    if b is None or np.shape(g) != np.shape(w):
      out.append(None)
      continue
    g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
    with np.errstate(invalid="ignore"):
      out.append(np.isfinite(g64) & np.isfinite(w64) & (np.abs(g64 - w64) <= b))
  return out


def _with_unspecified_from(got, want, masks):
  """``got`` with the entries of ``masks`` (per leaf: None or a boolean array) taken from ``want``."""
  if masks is None:
    return got
  g, tree = jax.tree.flatten(got)
  w = jax.tree.leaves(want)
  if len(g) != len(w):
    return got  # a structure mismatch: the comparison reports it
  out = [gi if mi is None or np.shape(gi) != np.shape(wi) else np.where(mi, np.asarray(wi), np.asarray(gi))
         for gi, wi, mi in zip(g, w, list(masks) + [None] * (len(g) - len(masks)))]
  return jax.tree.unflatten(tree, out)


@dataclasses.dataclass
class Tally:
  """Counts of one op's run."""

  examples: int = 0
  agreements: int = 0
  disagreements: int = 0
  unavailable: int = 0
  kernel_runs: int = 0  # agreements in which a Pallas kernel ran
  seconds: float = 0.0
  failures: list = dataclasses.field(default_factory=list)


def fuzz_op(op: str, examples: int, seed: int = 0, implementation: str = "interpret", size: str = "small",
            first: int = 0, log: Callable[[str], None] = print) -> Tally:
  """Runs examples ``first .. first + examples - 1`` of ``op``; a disagreement (or an unexpected exception) is
  logged with the command that reproduces it."""
  tally = Tally()
  start = time.perf_counter()
  for index in range(first, first + examples):
    tally.examples += 1
    example = Example((), {}, "(the generator failed)")
    try:
      example = make_example(op, seed, index, size)
      tally.kernel_runs += check(op, example, implementation)
      tally.agreements += 1
    except KernelUnavailableError:
      tally.unavailable += 1
    except Exception as e:  # noqa: BLE001 - every failure of the kernel or the reference is a finding
      tally.disagreements += 1
      what = f"{type(e).__name__}: {e}" if isinstance(e, AssertionError) else traceback.format_exc(limit=-3)
      tally.failures.append((index, example.label, what))
      log(f"DISAGREEMENT {op} index={index} ({example.label})\n  {what.strip()}\n  reproduce: python -m "
          f"jaxkern.testing.fuzz --ops {op} --seed {seed} --first {index} --examples 1 --size {size} "
          f"--implementation {implementation}")
  tally.seconds = time.perf_counter() - start
  return tally


def _default_implementation() -> str:
  return "pallas" if jax.default_backend() == "gpu" else "interpret"


def fuzz(ops: list[str], examples: int, seed: int = 0, implementation: str = "interpret", size: str = "small",
         first: int = 0, seconds: float | None = None, log: Callable[[str], None] = print) -> dict[str, Tally]:
  """Example ``first`` of every op, then the next one of every op, ... (``examples`` rounds), so that a time
  budget of ``seconds`` (no new round starts after it) spreads over the ops; per-op tallies."""
  tallies = {op: Tally() for op in ops}
  start = time.perf_counter()
  for index in range(first, first + examples):
    if seconds is not None and time.perf_counter() - start > seconds:
      log(f"# time budget of {seconds} s spent after {index - first} rounds")
      break
    for op in ops:
      t = fuzz_op(op, 1, seed, implementation, size, index, log)
      tally = tallies[op]
      for f in ("examples", "agreements", "disagreements", "unavailable", "kernel_runs", "seconds"):
        setattr(tally, f, getattr(tally, f) + getattr(t, f))
      tally.failures += t.failures
  return tallies


def main(argv: list[str] | None = None) -> int:
  """The command line (module docstring); returns the exit status."""
  parser = argparse.ArgumentParser(prog="python -m jaxkern.testing.fuzz", description=__doc__.splitlines()[0])
  parser.add_argument("--examples", type=int, default=10, help="examples per op")
  parser.add_argument("--ops", nargs="*", default=None, help="ops (module.name) or prefixes such as 'quant.'")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--first", type=int, default=0, help="index of the first example")
  parser.add_argument("--seconds", type=float, default=None, help="start no new round of examples after this")
  parser.add_argument("--size", choices=("small", "large"), default=None,
                      help="shape range (default: large on a GPU, small elsewhere)")
  parser.add_argument("--implementation", choices=("interpret", "pallas", "xla"), default=None)
  parser.add_argument("--list", action="store_true", help="list the ops and the skipped ones, then exit")
  a = parser.parse_args(argv)
  if a.list:
    for op in OPS:
      print(op, "(bitwise)" if OPS[op].exact else "(tolerance)")
    for op, why in SKIPPED.items():
      print(op, "SKIPPED:", why)
    return 0
  implementation = a.implementation or _default_implementation()
  size = a.size or ("large" if jax.default_backend() == "gpu" else "small")
  ops = [op for op in OPS if a.ops is None or any(op == s or op.startswith(s) for s in a.ops)]
  print(f"# fuzz: seed={a.seed} examples={a.examples} first={a.first} implementation={implementation} size={size} "
        f"backend={jax.default_backend()}", flush=True)
  tallies = fuzz(ops, a.examples, a.seed, implementation, size, a.first, a.seconds,
                 log=functools.partial(print, flush=True))
  totals = Tally()
  for op, t in tallies.items():
    print(f"{op:55s} examples {t.examples:4d}  agreements {t.agreements:4d}  disagreements {t.disagreements:3d}  "
          f"unavailable {t.unavailable:3d}  kernel runs {t.kernel_runs:4d}  ({t.seconds:.1f} s)")
    for f in ("examples", "agreements", "disagreements", "unavailable", "kernel_runs", "seconds"):
      setattr(totals, f, getattr(totals, f) + getattr(t, f))
  print(f"TOTAL ops {len(ops)}  examples {totals.examples}  agreements {totals.agreements}  disagreements "
        f"{totals.disagreements}  unavailable {totals.unavailable}  kernel runs {totals.kernel_runs}  "
        f"({totals.seconds:.1f} s)", flush=True)
  return 1 if totals.disagreements else 0


if __name__ == "__main__":
  sys.exit(main())

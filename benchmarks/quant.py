"""jaxkern.quant casts on upstream's benchmark shapes.

Static arguments cannot travel through ``make_args``, so each group width is its own benchmark op
(``npc=K`` derives the width from the input). Byte counts are the logical sizes (input, data, sf).
Registered: the e4m3 and e2m1 grids of per_token_cast (flags T, T, T), its QuantTensor inputs
(``per_token_cast_quant_input``: e4m3 / e2m1 data with (128, 128) / (32, 32) blocks re-cast to e4m3 /
e2m1 with npc 32 / 128, flags T, T, T; one op, the static arguments travel as case kwargs),
per_block_cast (e4m3 and e2m1 from float32 and bf16), the per-channel casts, per_token_cast_back of
e4m3 and e2m1 data (layout-A and packed layout-C input), cast_back with (128, 128) and (128, 1) blocks,
unpack_from_e2m1fn_x2, per_block_cast_lossless (e2m1 (1, 32) -> e4m3 (128, 128), packed sf) and
per_channel_cast_fused (plain 4096 tokens and the K=6 MoE gathers, bf16 or QuantTensor input),
per_token_cast_to_e5m6 and cast_back_e5m6 (full grid, random input, flags (F, T, F) and (T, T, T)),
swiglu_forward_and_per_token_cast (the 12 MoE configs x 6 h x pos_to_expert or not x clamp 0.5 / None, flags T, T,
T, npc 128, no weights; the clamp is a case kwarg, counters returned with a clamp) and
swiglu_forward_and_per_channel_cast_and_transpose (one op per npt 32 / 128 over tokens {4096, 8064} x 7 hidden sizes
as h; without_transpose, round_sf and the clamp None / 0.5 are case kwargs). The
T, npc 128, no weights; the clamp is a case kwarg, counters returned with a clamp),
swiglu_backward_and_per_token_cast (the 12 MoE configs x h in {2048, 4096, 7168} (a subset of upstream's 6 hidden
sizes, to keep the grid at 144 shapes) x npc {32, 128} x clamp 0.5 / None, round_sf=True). The
inputs whose ops fall back to the jnp reference (fewer rows than one register layout block, cast_back
of e2m1 data with (bm, 1) blocks) are outside these grids.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.registry import BenchOp, Case, bitwise_check, register, upstream_topk_idx
from jaxkern import quant
from jaxkern.reference import quant as ref
from jaxkern.testing import hidden_sizes, num_tokens, randn

_DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}
_NPCS = {"npc32": 32, "npc64": 64, "npc128": 128, "row": None}
_PACKED = dict(use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True)  # flags T, T, T


def _npc(x, npc):
  return npc or x.shape[-1]


def _cast_case(m, k, dtype_name, npc, fmt="e4m3"):
  dtype = _DTYPES[dtype_name]
  kb = -(-k // (npc or k))
  nbytes = m * k * jnp.dtype(dtype).itemsize + m * k // (2 if fmt == "e2m1" else 1) + m * kb * 4
  return Case(f"M={m} K={k} {dtype_name}", lambda key: (randn(key, (m, k), dtype),), nbytes)


def _back_case(m, k, out_name, npc, packed=False, fmt="e4m3"):
  npc = npc or k
  nbytes = (m * k * jnp.dtype(_DTYPES[out_name]).itemsize + m * k // (2 if fmt == "e2m1" else 1)
            + m * (-(-k // npc)) * (1 if packed else 4))

  def make(key):
    return ref.cast(randn(key, (m, k), jnp.float32), fmt, (1, npc), round_sf=True,
                    use_tma_aligned_col_major_sf=packed, use_packed_ue8m0=packed)

  return Case(f"M={m} K={k} {out_name}", make, nbytes)


def _grid(case, npc, names, *extra):
  return lambda: [case(m, k, d, npc, *extra) for d, m, k in itertools.product(names, num_tokens(), hidden_sizes(64))]


for _fmt, _prefix in (("e4m3", "per_token_cast_"), ("e2m1", "per_token_cast_e2m1_")):
  for _name, _w in _NPCS.items():
    register(BenchOp(
        _prefix + _name,
        lambda x, _w=_w, _fmt=_fmt: quant.per_token_cast(x, _fmt, _npc(x, _w), **_PACKED),
        lambda x, _w=_w, _fmt=_fmt: ref.per_token_cast(x, _fmt, _npc(x, _w), **_PACKED),
        _grid(_cast_case, _w, ("fp32", "bf16"), _fmt),
        lambda _w=_w, _fmt=_fmt: [_cast_case(100, 576, "bf16", _w, _fmt)]))

def _quant_input_case(m, k, in_fmt, x_block, npc, fmt):
  """A QuantTensor made by the reference cast of a bf16 ``randn`` with packed UE8M0 sf (flags T, T, T),
  re-cast with the same flags; bytes: data, sf (one byte per block), out, out sf (one byte per group)."""
  mb, kb = -(-m // x_block[0]), -(-k // x_block[1])
  nbytes = m * k // (2 if in_fmt == "e2m1" else 1) + mb * kb + m * k // (2 if fmt == "e2m1" else 1) + m * (-(-k // npc))

  def make(key):
    return ref.cast(randn(key, (m, k), jnp.bfloat16), in_fmt, x_block, round_sf=True,
                    use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)

  label = f"M={m} K={k} {in_fmt} {x_block[0]}x{x_block[1]} -> {fmt} npc{npc}"
  return Case(label, make, nbytes, dict(x_block_size=x_block, npc=npc, fmt=fmt))


register(BenchOp(
    "per_token_cast_quant_input",
    lambda q, sf, x_block_size, npc, fmt: quant.per_token_cast((q, sf), fmt, npc, x_block_size=x_block_size,
                                                               **_PACKED),
    lambda q, sf, x_block_size, npc, fmt: ref.per_token_cast((q, sf), fmt, npc, x_block_size=x_block_size, **_PACKED),
    lambda: [_quant_input_case(m, k, i, b, n, f) for i, b, n, f, m, k in itertools.product(
        ("e4m3", "e2m1"), ((128, 128), (32, 32)), (32, 128), ("e4m3", "e2m1"), num_tokens(), hidden_sizes(64))],
    lambda: [_quant_input_case(130, 576, "e2m1", (32, 32), 128, "e4m3")]))


def _logical_k(q):
  return q.shape[-1] * (2 if q.dtype == jnp.int8 else 1)


for (_fmt, _prefix), (_name, _w), _out, _packed in itertools.product(
    (("e4m3", "per_token_cast_back_"), ("e2m1", "per_token_cast_back_e2m1_")), (("npc128", 128), ("row", None)),
    ("bf16", "fp32"), (False, True)):
  register(BenchOp(
      f"{_prefix}{_name}{'_packed' if _packed else ''}_{_out}",
      lambda q, sf, _w=_w, _out=_out: quant.per_token_cast_back((q, sf), _out, _w or _logical_k(q)),
      lambda q, sf, _w=_w, _out=_out: ref.cast_back((q, sf), _out, (1, _w or _logical_k(q))),
      lambda _w=_w, _out=_out, _packed=_packed, _fmt=_fmt: [
          _back_case(m, k, _out, _w, _packed, _fmt) for m, k in itertools.product(num_tokens(), hidden_sizes(64))],
      lambda _w=_w, _out=_out, _packed=_packed, _fmt=_fmt: [_back_case(72, 576, _out, _w, _packed, _fmt)]))


def _unpack_case(m, k, out_name):
  nbytes = m * k // 2 + m * k * jnp.dtype(_DTYPES[out_name]).itemsize
  return Case(f"M={m} K={k} {out_name}", lambda key: (
      jax.random.randint(key, (m, k // 2), -128, 128).astype(jnp.int8),), nbytes)


for _out in ("bf16", "fp32"):
  register(BenchOp(
      f"unpack_from_e2m1fn_x2_{_out}",
      lambda b, _out=_out: quant.unpack_from_e2m1fn_x2(b, out_dtype=_DTYPES[_out]),
      lambda b, _out=_out: ref.unpack_from_e2m1fn_x2(b, out_dtype=_DTYPES[_out]),
      lambda _out=_out: [_unpack_case(m, k, _out) for m, k in itertools.product(num_tokens(), hidden_sizes(64))],
      lambda _out=_out: [_unpack_case(72, 576, _out)]))


def _block_back_case(m, k, out_name, round_sf, block):
  nbytes = m * k * jnp.dtype(_DTYPES[out_name]).itemsize + m * k + (-(-m // block[0])) * (-(-k // block[1])) * 4

  def make(key):
    return ref.cast(randn(key, (m, k), jnp.float32), "e4m3", block, round_sf=round_sf)

  return Case(f"M={m} K={k} {out_name}{' round' if round_sf else ''}", make, nbytes)


for _out, _block in itertools.product(("bf16", "fp32"), ((128, 128), (128, 1))):
  register(BenchOp(
      f"cast_back_{_block[0]}x{_block[1]}_{_out}",
      lambda q, sf, _out=_out, _block=_block: quant.cast_back((q, sf), _out, _block),
      lambda q, sf, _out=_out, _block=_block: ref.cast_back((q, sf), _out, _block),
      lambda _out=_out, _block=_block: [
          _block_back_case(m, k, _out, r, _block)
          for r, m, k in itertools.product((False, True), num_tokens(), hidden_sizes(64))],
      lambda _out=_out, _block=_block: [_block_back_case(72, 576, _out, True, _block)]))


def _block_case(m, k, dtype_name, block, fmt="e4m3"):
  dtype = _DTYPES[dtype_name]
  nbytes = (m * k * jnp.dtype(dtype).itemsize + m * k // (2 if fmt == "e2m1" else 1)
            + (-(-m // block[0])) * (-(-k // block[1])) * 4)
  return Case(f"M={m} K={k} {dtype_name}", lambda key: (randn(key, (m, k), dtype),), nbytes)


for (_fmt, _prefix, _dts), _bm, _bk in itertools.product(
    (("e4m3", "per_block_cast_", ("fp32", "bf16")), ("e2m1", "per_block_cast_e2m1_", ("fp32", "bf16"))), (32, 128),
    (32, 128)):
  register(BenchOp(
      f"{_prefix}{_bm}x{_bk}",
      lambda x, _b=(_bm, _bk), _fmt=_fmt: quant.per_block_cast(x, _fmt, _b, **_PACKED),
      lambda x, _b=(_bm, _bk), _fmt=_fmt: ref.per_block_cast(x, _fmt, _b, **_PACKED),
      _grid(lambda m, k, d, b, _fmt=_fmt: _block_case(m, k, d, b, _fmt), (_bm, _bk), _dts),
      lambda _b=(_bm, _bk), _fmt=_fmt: [_block_case(100, 576, "bf16", _b, _fmt)]))


def _channel_grid(npt, dtypes):
  return lambda: [_block_case(m, k, d, (npt, 1))
                  for d, m, k in itertools.product(dtypes, num_tokens(128), hidden_sizes(64))]


register(BenchOp(
    "per_channel_cast",
    lambda x: quant.per_channel_cast(x, "e4m3", 128),
    lambda x: ref.cast(x, "e4m3", (128, 1)),
    _channel_grid(128, ("bf16",)),
    lambda: [_block_case(256, 576, "bf16", (128, 1))]))
for _npt in (32, 128):
  register(BenchOp(
      f"per_channel_cast_and_transpose_npt{_npt}",
      lambda x, _npt=_npt: quant.per_channel_cast_and_transpose(x, "e4m3", _npt),
      lambda x, _npt=_npt: (lambda o: (o[0].T, o[1]))(ref.cast(x, "e4m3", (_npt, 1))),
      _channel_grid(_npt, ("bf16",)),
      lambda _npt=_npt: [_block_case(128, 192, "bf16", (_npt, 1))]))



def _lossless_case(m, k):
  nbytes = m * k // 2 + m * (k // 32) * 4 + m * k + (-(-m // 128)) * (-(-k // 128))

  def make(key):
    return (ref.cast(randn(key, (m, k), jnp.float32), "e2m1", (1, 32), round_sf=True),)

  return Case(f"M={m} K={k}", make, nbytes)


register(BenchOp(
    "per_block_cast_lossless_128x128",
    lambda x: quant.per_block_cast_lossless(x, "e4m3", (1, 32), (128, 128), **_PACKED),
    lambda x: ref.per_block_cast_lossless(x, "e4m3", (1, 32), (128, 128), **_PACKED),
    lambda: [_lossless_case(m, k) for m, k in itertools.product(num_tokens(), hidden_sizes(64))],
    lambda: [_lossless_case(100, 576)]))


@functools.lru_cache(maxsize=None)
def _gather_rows(experts, ranks):
  """``(T, pos_to_token)`` of upstream's MoE config (4001 tokens sent per rank, alignment 128), as
  NumPy, computed once per config (the grid repeats each over hidden sizes); ``experts == 0``: 4096 plain tokens,
  no mapping."""
  if not experts:
    return 4096, None
  from jaxkern.reference import moe as moe_ref

  idx = upstream_topk_idx(4001, 6, experts, ranks)
  counts = [int((idx == e).sum()) for e in range(experts)]
  n = sum(-(-c // 128) * 128 for c in counts)
  return idx.shape[0], np.asarray(moe_ref.get_fused_mapping(jnp.asarray(idx), experts, n, 128).pos_to_token)


def _fused_case(experts, ranks, k, quant_input):
  t, pos = _gather_rows(experts, ranks)
  mo = t if pos is None else pos.shape[0]
  x_bytes = t * k * (1 + 4 / 128) if quant_input else t * k * 2
  nbytes = int(x_bytes + (0 if pos is None else mo * 4) + mo * k + -(-mo // 128) * k * 4)
  label = (f"T={t} K={k}" if pos is None else f"E={experts}x{ranks} K6 Mo={mo} H={k}") + (" qt" if quant_input else "")

  def make(key):
    x = randn(key, (t, k), jnp.bfloat16)
    if quant_input:
      x = ref.cast(x, "e4m3", (1, 128))
    return (x,) if pos is None else (x, jnp.asarray(pos))

  return Case(label, make, nbytes, dict(num_per_channels=128 if quant_input else None))


register(BenchOp(
    "per_channel_cast_fused",
    lambda x, pos=None, num_per_channels=None: quant.per_channel_cast_fused(
        x, "e4m3", 128, num_per_channels=num_per_channels, pos_to_token=pos),
    lambda x, pos=None, num_per_channels=None: ref.per_channel_cast_fused(
        x, "e4m3", 128, num_per_channels=num_per_channels, pos_to_token=pos),
    lambda: [_fused_case(e, r, k, qt) for qt in (False, True) for e, r in ((0, 0), (9, 8), (32, 8), (4, 64))
             for k in hidden_sizes(128)],
    lambda: [_fused_case(0, 0, 256, True)]))

_E5M6_FLAGS = {"round": dict(round_sf=True), "packed": _PACKED}  # upstream's flag sets (F, T, F) and (T, T, T)


def _e5m6_case(m, k, dtype_name, flags):
  """Random input only (as upstream's benchmark); bytes: x, packed data (1.5 bytes per value), sf (4 or 1 byte per row)."""
  nbytes = m * k * jnp.dtype(_DTYPES[dtype_name]).itemsize + m * k * 3 // 2 + m * (1 if flags == "packed" else 4)
  return Case(f"M={m} K={k} {dtype_name} {flags}", lambda key: (randn(key, (m, k), _DTYPES[dtype_name]),), nbytes,
              _E5M6_FLAGS[flags])


def _e5m6_back_case(m, k, out_name, flags):
  """The kernel's cast of a ``randn`` in the output dtype; bytes: packed data, sf, output."""
  nbytes = m * k * 3 // 2 + m * (1 if flags == "packed" else 4) + m * k * jnp.dtype(_DTYPES[out_name]).itemsize

  def make(key):
    return quant.per_token_cast_to_e5m6(randn(key, (m, k), _DTYPES[out_name]), k, **_E5M6_FLAGS[flags])

  return Case(f"M={m} K={k} {out_name} {flags}", make, nbytes, dict(fmt=out_name, col_major=flags == "packed"))


register(BenchOp(
    "per_token_cast_to_e5m6",
    lambda x, implementation=None, **flags: quant.per_token_cast_to_e5m6(x, x.shape[1], **flags,
                                                                          implementation=implementation),
    lambda x, **flags: ref.per_token_cast_to_e5m6(x, x.shape[1], **flags),
    lambda: [_e5m6_case(m, k, d, f) for f, d, m, k in itertools.product(
        _E5M6_FLAGS, ("fp32", "bf16"), num_tokens(), hidden_sizes(64))],
    lambda: [_e5m6_case(37, 576, "bf16", "packed"), _e5m6_case(20, 128, "fp32", "round")]))

register(BenchOp(
    "cast_back_e5m6",
    lambda q, sf, fmt, col_major, implementation=None: quant.cast_back_e5m6(
        (q, sf), fmt, (1, 2 * q.shape[1] // 3), x_use_tma_aligned_col_major_sf=col_major,
        implementation=implementation),
    lambda q, sf, fmt, col_major: ref.cast_back_e5m6((q, sf), fmt, (1, 2 * q.shape[1] // 3),
                                                     x_use_tma_aligned_col_major_sf=col_major),
    lambda: [_e5m6_back_case(m, k, o, f) for f, o, m, k in itertools.product(
        _E5M6_FLAGS, ("bf16", "fp32"), num_tokens(), hidden_sizes(64))],
    lambda: [_e5m6_back_case(37, 576, "bf16", "packed"), _e5m6_back_case(20, 128, "fp32", "round")]))


@functools.lru_cache(maxsize=None)
def _moe_rows(send_tokens, num_topk, experts, ranks, alignment):
  """``(topk_idx, expanded rows)`` of an upstream MoE benchmark config: what a case's label and byte count need."""
  idx = upstream_topk_idx(send_tokens, num_topk, experts, ranks)
  counts = [int((idx == e).sum()) for e in range(experts)]
  return idx, sum(-(-c // alignment) * alignment for c in counts)


@functools.lru_cache(maxsize=None)
def _moe_mapping(send_tokens, num_topk, experts, ranks, alignment):
  """The fields of ``get_fused_mapping(...)`` of an upstream MoE benchmark config as read-only NumPy arrays,
  computed once per config (the SwiGLU grids repeat each config over hidden sizes and flags) and only when a case's
  inputs are built or traced (``make_args``, also under the runner's ``jax.eval_shape``: evaluated there, never
  traced): a list of cases needs only :func:`_moe_rows` (36 mappings took about a CPU second each, 2026-11-29)."""
  from jaxkern.reference import moe as moe_ref

  idx, n = _moe_rows(send_tokens, num_topk, experts, ranks, alignment)
  with jax.ensure_compile_time_eval():
    mapping = moe_ref.get_fused_mapping(jnp.asarray(idx), experts, n, alignment)
    fields = {name: np.asarray(getattr(mapping, name))
              for name in ("pos_to_token", "pos_to_expert", "pos_to_token_topk", "token_topk_to_pos")}
  for a in fields.values():
    a.setflags(write=False)
  return fields


def _swiglu_case(send_tokens, num_topk, experts, ranks, h, with_mapping, clamp):
  """Upstream's SwiGLU benchmark input: ``expand_to_fused`` of a bf16 ``randn`` ``(T, 2h)`` over the fused
  mapping of the MoE config (alignment 16, padding rows zero); ``pos_to_expert`` passed or not; flags T, T, T,
  so npc 128 and no weights. Bytes: x, out, the logical packed sf (mappings not counted, as upstream counts them)."""
  idx, n = _moe_rows(send_tokens, num_topk, experts, ranks, 16)
  nbytes = n * 2 * h * 2 + n * h + n * (-(-h // 512)) * 4
  label = f"E={experts}x{ranks} K{num_topk} N={n} h={h}{' pte' if with_mapping else ''} clamp={clamp}"

  def make(key):
    mapping = _moe_mapping(send_tokens, num_topk, experts, ranks, 16)
    pos_to_token, pos_to_expert = mapping["pos_to_token"], mapping["pos_to_expert"]
    x = randn(key, (idx.shape[0], 2 * h), jnp.bfloat16)
    x = jnp.where(pos_to_token[:, None] >= 0, x[np.maximum(pos_to_token, 0)], 0).astype(jnp.bfloat16)
    return (x, jnp.asarray(pos_to_expert)) if with_mapping else (x,)

  return Case(label, make, nbytes, dict(clamp=clamp))


def _swiglu(op):
  def run(x, pos_to_expert=None, clamp=None, **implementation):  # implementation: only for the jaxkern op
    count = None if clamp is None else jnp.zeros(3, jnp.int32)
    return op(x, "e4m3", 128, None, None, pos_to_expert, **_PACKED, swiglu_clamp_value=clamp, clamped_count=count,
              **implementation)
  return run


register(BenchOp(
    "swiglu_forward_and_per_token_cast",
    _swiglu(quant.swiglu_forward_and_per_token_cast),
    _swiglu(ref.swiglu_forward_and_per_token_cast),
    lambda: [_swiglu_case(4001, k, e, r, h, pte, c) for k in (2, 6, 8, 9) for e, r in ((9, 8), (32, 8), (4, 64))
             for h in (1024, 1280, 1536, 2048, 3072, 3584) for pte in (True, False) for c in (0.5, None)],
    lambda: [_swiglu_case(64, 2, 4, 2, 640, True, 0.5), _swiglu_case(64, 2, 4, 2, 256, False, None)]))


def _swiglu_channel_case(m, h, npt, without_transpose, round_sf, clamp):
  """bf16 ``randn`` ``(M, 2h)``; bytes: x, out, sf."""
  label = (f"M={m} h={h}{' no-transpose' if without_transpose else ''}{' round' if round_sf else ''} "
           f"clamp={clamp}")
  return Case(label, lambda key: (randn(key, (m, 2 * h), jnp.bfloat16),), m * 2 * h * 2 + m * h + m // npt * h * 4,
              dict(round_sf=round_sf, without_transpose=without_transpose, swiglu_clamp_value=clamp))


for _npt in (32, 128):
  register(BenchOp(
      f"swiglu_forward_and_per_channel_cast_and_transpose_npt{_npt}",
      lambda x, _npt=_npt, **kw: quant.swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", _npt, **kw),
      lambda x, _npt=_npt, **kw: ref.swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", _npt, **kw),
      lambda _npt=_npt: [_swiglu_channel_case(m, h, _npt, t, r, c)
                         for m, h, t, r, c in itertools.product(num_tokens(128), hidden_sizes(64), (False, True),
                                                                (False, True), (None, 0.5))],
      lambda _npt=_npt: [_swiglu_channel_case(128, 192, _npt, False, True, 0.5),
                         _swiglu_channel_case(128, 128, _npt, True, False, None)]))


def _swiglu_backward_case(send_tokens, num_topk, experts, ranks, h, npc, clamp):
  """Upstream's SwiGLU-backward benchmark input: ``per_token_cast(expand_to_fused(bf16 randn (T, 2h)), 'e4m3', npc)``
  over the fused mapping of the MoE config (alignment ``npc``), a bf16 ``randn`` gradient, ``uniform [0, 1)`` top-k
  weights; ``round_sf=True``. Bytes (as upstream counts them): x data and sf, grad_out, weights, both mappings, out, x_grad_q,
  x_grad_sf, x_grad, weight_grad."""
  idx, n = _moe_rows(send_tokens, num_topk, experts, ranks, npc)
  t = idx.shape[0]
  sf_bytes = n * 2 * h // npc * 4
  nbytes = (n * 2 * h + sf_bytes + n * h * 2 + t * num_topk * 4 + n * 4 + t * num_topk * 4  # inputs
            + n * h * 2 + n * 2 * h + sf_bytes + n * 2 * h * 2 + t * num_topk * 4)  # outputs
  label = f"E={experts}x{ranks} K{num_topk} N={n} h={h} npc={npc} clamp={clamp}"

  def make(key):
    mapping = _moe_mapping(send_tokens, num_topk, experts, ranks, npc)
    pos_to_token = mapping["pos_to_token"]
    kx, kg, kw = jax.random.split(key, 3)
    x = randn(kx, (t, 2 * h), jnp.bfloat16)
    x = jnp.where(pos_to_token[:, None] >= 0, x[np.maximum(pos_to_token, 0)], 0).astype(jnp.bfloat16)
    q, sf = ref.per_token_cast(x, "e4m3", npc)
    return (q, sf, randn(kg, (n, h), jnp.bfloat16), jax.random.uniform(kw, (t, num_topk), jnp.float32),
            jnp.asarray(mapping["pos_to_token_topk"]), jnp.asarray(mapping["token_topk_to_pos"]))

  return Case(label, make, nbytes, dict(npc=npc, clamp=clamp))


def _swiglu_backward(op):
  def run(q, sf, grad_out, weight, pos_to_token_topk, token_topk_to_pos, npc=128, clamp=None, **implementation):
    return op((q, sf), grad_out, weight, pos_to_token_topk, token_topk_to_pos, npc, round_sf=True,
              swiglu_clamp_value=clamp, **implementation)
  return run


def _swiglu_backward_check(out, expected):
  """Bitwise, except ``weight_grad`` (summed in another order): ``atol = rtol = 1e-4`` (upstream's test) or, where
  a slot's sum cancels, a few float32 ulps of the largest slot (the runner has no inputs here to bound each slot by
  the sum of its terms' magnitudes, as tests/quant/test_swiglu_backward.py does): ``2^-20 · max |weight_grad|``."""
  bitwise_check(tuple(out)[:3], tuple(expected)[:3])
  got, want = np.asarray(out[3]), np.asarray(expected[3])
  tol = 1e-4 + 1e-4 * np.abs(want) + 2.0**-20 * np.abs(want).max(initial=0.0)
  assert (np.abs(got - want) <= tol).all(), f"weight_grad off by up to {np.abs(got - want).max()}"


register(BenchOp(
    "swiglu_backward_and_per_token_cast",
    _swiglu_backward(quant.swiglu_backward_and_per_token_cast),
    _swiglu_backward(ref.swiglu_backward_and_per_token_cast),
    lambda: [_swiglu_backward_case(4001, k, e, r, h, npc, c) for k in (2, 6, 8, 9)
             for e, r in ((9, 8), (32, 8), (4, 64)) for h in (2048, 4096, 7168) for npc in (32, 128)
             for c in (0.5, None)],
    lambda: [_swiglu_backward_case(64, 2, 4, 2, 256, 32, 0.5), _swiglu_backward_case(64, 2, 4, 2, 128, 128, None)],
    check=_swiglu_backward_check))

del _fmt, _prefix, _dts, _name, _w, _out, _packed, _bm, _bk, _npt, _block

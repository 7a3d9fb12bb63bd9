import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkern
from jaxkern import reference
from jaxkern.testing import (assert_bitwise_equal, capture_mosaic_modules, hidden_sizes, lower_for_h100, num_tokens,
                             randn, random_bits)
from jaxkern.transpose import _transpose as module
from jaxkern.transpose import batched_transpose, transpose

DTYPES = [jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32, jnp.int8, jnp.uint16]


def _poisoned_call(f, x):
  """Runs ``f(x)`` right after freeing a same-sized all-ones buffer, so on a GPU the output is
  likely to land on poisoned memory; unwritten elements then fail the bitwise comparison."""
  out = jax.eval_shape(f, x)
  jnp.full(out.shape, -1, jnp.int8 if out.dtype.itemsize == 1 else out.dtype).block_until_ready()
  return f(x)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(64, 64), (128, 192), (192, 320)])
def test_transpose_bit_exact(key, dtype, shape):
  x = random_bits(key, shape, dtype)  # every bit pattern, NaN payloads and -0 included
  assert_bitwise_equal(transpose(x), np.asarray(x).T)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_batched_transpose_bit_exact(key, dtype):
  x = randn(key, (3, 128, 320), dtype)
  assert_bitwise_equal(batched_transpose(x), np.swapaxes(np.asarray(x), 1, 2))


@pytest.mark.parametrize("tiling", [(128, 128, "bji"), (128, 64, "bji"), (64, 128, "bij")])
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_every_tiling_bit_exact(key, dtype, tiling):
  """The large-array tilings, forced on a small array so the interpreter can run them."""
  from jaxkern.transpose._transpose import _batched_transpose_kernel

  x = random_bits(key, (2, 256, 128), dtype)
  y = _batched_transpose_kernel(x, interpret=jaxkern._config.mosaic_interpret(jaxkern.get_implementation() == "interpret"),
                                tiling=tiling)
  assert_bitwise_equal(y, np.swapaxes(np.asarray(x), 1, 2))


def test_transpose_of_a_slice(key):
  """Upstream transposes a row-strided view (left half of a wider buffer): here a sliced array."""
  wide = randn(key, (128, 2 * 192), jnp.bfloat16)
  x = wide[:, :192]
  assert_bitwise_equal(jax.jit(transpose)(x), np.asarray(x).T)


@pytest.mark.parametrize("shape", [(0, 576), (64, 0), (0, 0)])
def test_zero_size(shape):
  y = transpose(jnp.ones(shape, jnp.bfloat16))
  assert y.shape == shape[::-1] and y.dtype == jnp.bfloat16
  assert batched_transpose(jnp.ones((0, 64, 128), jnp.float32)).shape == (0, 128, 64)
  assert batched_transpose(jnp.ones((2,) + shape, jnp.float32)).shape == (2,) + shape[::-1]


def test_jit_and_vmap(key):
  x = randn(key, (2, 64, 128), jnp.bfloat16)
  want = np.swapaxes(np.asarray(x), 1, 2)
  assert_bitwise_equal(jax.jit(jax.vmap(transpose))(x), want)
  assert_bitwise_equal(jax.jit(batched_transpose)(x), want)


def test_implementation_switch(key):
  x = randn(key, (64, 128), jnp.bfloat16)
  for impl in ("reference", "interpret"):
    assert_bitwise_equal(transpose(x, implementation=impl), np.asarray(x).T)
  with jaxkern.use_implementation("reference"):
    assert jaxkern.get_implementation() == "reference"
  with pytest.raises(ValueError, match="implementation"):
    transpose(x, implementation="cuda")


@pytest.mark.parametrize("bad, match", [
    (jnp.ones((64,), jnp.bfloat16), "x must have rank 2"),
    (jnp.ones((2, 64, 64), jnp.bfloat16), "x must have rank 2"),
    (jnp.ones((100, 64), jnp.bfloat16), r"x.shape\[-2\] must be a multiple of 64"),
    (jnp.ones((64, 96), jnp.bfloat16), r"x.shape\[-1\] must be a multiple of 64"),
    (jnp.ones((64, 64), jnp.complex64), "1-, 2- or 4-byte dtype"),
])
def test_transpose_bad_input(bad, match):
  with pytest.raises(ValueError, match=match):
    transpose(bad)


def test_batched_transpose_bad_rank():
  with pytest.raises(ValueError, match="x must have rank 3"):
    batched_transpose(jnp.ones((64, 64), jnp.bfloat16))


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(1, 4032, 576), (1, 4032, 3072), (1, 8064, 7168), (32, 8064, 7168), (8, 128, 2560)])
def test_lowers_for_h100(dtype, shape):
  """Every tile configuration and grid order lowers through Mosaic GPU for an H100."""
  f = functools.partial(batched_transpose, implementation="pallas")
  text = lower_for_h100(f, jax.ShapeDtypeStruct(shape, dtype)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("n", hidden_sizes(64))
@pytest.mark.parametrize("m", num_tokens(64))
def test_transpose_spec_shapes_gpu(key, m, n, dtype):
  x = randn(key, (m, n), dtype)
  assert_bitwise_equal(_poisoned_call(jax.jit(transpose), x), reference.transpose.transpose(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("n", [576, 7168])
@pytest.mark.parametrize("b", [8, 32])
def test_batched_transpose_spec_shapes_gpu(key, b, n, dtype):
  x = randn(key, (b, 4032, n), dtype)
  assert_bitwise_equal(_poisoned_call(jax.jit(batched_transpose), x), reference.transpose.batched_transpose(x))


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.int8, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape, tile, ctas", [((256, 384), (64, 64), 5), ((192, 320), (64, 64), 4),
                                               ((384, 576), (64, 128), 1)])
def test_ring_kernel_bit_exact(key, monkeypatch, dtype, shape, tile, ctas):
  """The persistent kernel of large 8-bit and mid-sized 16-bit 2-D transposes (size thresholds
  lowered, tiles in words): row and column tiles moved back at the edges (192 rows = 1.5 8-bit
  tiles, 320 / 576 columns), tiles not shared evenly by the CTAs, fewer tiles than pipeline stages
  and one CTA going round the 5-stage ring (9 or more tiles). The smem kernel's threshold is lowered too, so
  that a GPU runs the ring kernel on the 8-bit arrays."""
  itemsize = jnp.dtype(dtype).itemsize
  monkeypatch.setattr(module, "_RING_BYTES", {itemsize: (0, None)})
  monkeypatch.setattr(module, "_RING_TILE", {itemsize: tile})
  monkeypatch.setattr(module, "SMEM_TRANSPOSE_MAX_ELEMENTS", 0)
  monkeypatch.setattr(jaxkern._config, "num_sms", lambda: ctas)
  x = random_bits(key, shape, dtype)
  assert module._use_ring(x) and not module._use_smem_transpose(x)
  assert_bitwise_equal(_poisoned_call(transpose, x), np.asarray(x).T)


@pytest.mark.parametrize("dtype, shape, ring", [(jnp.float8_e4m3fn, (4032, 2048), True),
                                                (jnp.float8_e4m3fn, (8064, 7168), True),
                                                (jnp.bfloat16, (4032, 2048), True), (jnp.bfloat16, (8064, 4096), True),
                                                (jnp.bfloat16, (8064, 7168), False), (jnp.bfloat16, (4032, 576), False)],
                         ids=str)
def test_ring_kernel_choice_and_lowering_for_h100(dtype, shape, ring):
  x = jax.ShapeDtypeStruct(shape, dtype)
  assert module._use_ring(x) == ring
  assert "mosaic_gpu" in lower_for_h100(functools.partial(transpose, implementation="pallas"), x).as_text()


def test_repeated_calls_do_not_retrace(key):
  # Pallas' Mosaic GPU interpreter adds a JAX config state on its first run in a process, which changes
  # jit's cache key once (also before jaxkern's own user context existed): warm it up first.
  transpose(jnp.zeros((64, 64), jnp.float32))

  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(x, y):
    return transpose(x), batched_transpose(y)

  for _ in range(3):
    x, y = random_bits(key, (64, 128), jnp.bfloat16), random_bits(key, (2, 64, 64), jnp.float32)
    chex.assert_trees_all_equal(f(x, y), (x.T, jnp.swapaxes(y, 1, 2)))


def test_list_and_bool_inputs():
  """A nested list is converted; bool data run XLA's transpose under "auto"/"xla" and are refused by
  the kernel with a clear error."""
  rows = [[float(i * 64 + j) for j in range(64)] for i in range(64)]
  assert_bitwise_equal(transpose(rows, implementation="xla"), np.asarray(rows, np.float32).T)
  with pytest.raises(ValueError, match="x must be an array, got str"):
    transpose("abc")
  b = jnp.arange(64 * 128).reshape(64, 128) % 3 == 0
  assert_bitwise_equal(transpose(b, implementation="auto"), np.asarray(b).T)
  with pytest.raises(jaxkern.KernelUnavailableError, match="bool data"):
    batched_transpose(b[None], implementation="interpret")


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.int8], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(256, 192), (192, 320)], ids=str)
def test_pair_tile_kernel_bit_exact(key, monkeypatch, dtype, shape):
  """The one-tile byte-pair kernel of small 2-D 8-bit transposes in interpret mode (64x32-word tiles): 3 column
  tiles of 32 words, and 96 word rows (a row tile moved back at the edge) with 5 column tiles. The smem kernel's
  threshold is lowered, so that a GPU runs the byte-pair kernel too."""
  monkeypatch.setattr(module, "SMEM_TRANSPOSE_MAX_ELEMENTS", 0)
  x = random_bits(key, shape, dtype)
  assert module._use_pair_tiles(x) and not module._use_ring(x) and not module._use_smem_transpose(x)
  assert_bitwise_equal(_poisoned_call(transpose, x), np.asarray(x).T)


def test_pair_tile_kernel_choice():
  """64-row 8-bit arrays (below one tile) keep the widening one-tile kernel; 16-bit data never takes pairs."""
  assert not module._use_pair_tiles(jax.ShapeDtypeStruct((64, 576), jnp.float8_e4m3fn))
  assert module._use_pair_tiles(jax.ShapeDtypeStruct((128, 64), jnp.float8_e4m3fn))
  assert not module._use_pair_tiles(jax.ShapeDtypeStruct((4032, 576), jnp.bfloat16))


# The smem kernel of small 2-D 8-bit transposes (lane-level code: compiled on a GPU only, never interpreted).
_SMEM_SHAPES = [(4032, 576), (8064, 576), (4032, 2048), (4032, 2560), (4032, 3072)]  # the shapes it was timed at
_SMEM_ODD_SHAPES = [(64, 64), (64, 576), (128, 192), (192, 320), (320, 64), (8064, 1536)]
_SMEM_MARK = "prmt.b32 $0, $1, $2, 0x5140"  # its inline PTX, in the serialized Mosaic GPU module


# On a GPU the byte-pair kernel runs 8-bit arrays above SMEM_TRANSPOSE_MAX_ELEMENTS too narrow for the ring kernel
# (196608x64); at N = 576 only in interpret mode (the smem kernel's threshold is lowered to reach it).
_PAIR_SHAPES = [(8064, 576), (4032, 576), (196608, 64)]


@pytest.mark.parametrize("shape", _PAIR_SHAPES, ids=str)
def test_pair_tile_kernel_lowers_for_h100(monkeypatch, shape):
  if shape[0] * shape[1] <= module.SMEM_TRANSPOSE_MAX_ELEMENTS:
    monkeypatch.setattr(module, "SMEM_TRANSPOSE_MAX_ELEMENTS", 0)
  x = jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn)
  assert module._use_pair_tiles(x) and not module._use_ring(x) and not module._use_smem_transpose(x)
  text = lower_for_h100(functools.partial(transpose, implementation="pallas"), x).as_text()
  assert "mosaic_gpu" in text and _SMEM_MARK not in text


@pytest.mark.gpu
@pytest.mark.parametrize("shape", _PAIR_SHAPES, ids=str)
def test_pair_tile_kernel_gpu(key, monkeypatch, shape):
  if shape[0] * shape[1] <= module.SMEM_TRANSPOSE_MAX_ELEMENTS:
    monkeypatch.setattr(module, "SMEM_TRANSPOSE_MAX_ELEMENTS", 0)
  x = random_bits(key, shape, jnp.float8_e4m3fn)
  assert module._use_pair_tiles(x) and not module._use_smem_transpose(x)
  assert_bitwise_equal(_poisoned_call(transpose, x), np.asarray(x).T)  # not jitted: the threshold is read per call


def _prmt(a, b, sel):
  """PTX ``prmt.b32`` (default mode): byte ``i`` of the result is byte ``sel[4i:4i+4]`` of ``b:a``."""
  src = a | b << 32
  assert all((sel >> (4 * i)) & 0xF < 8 for i in range(4))  # the sign-replicating selectors are not used
  return sum(((src >> (8 * ((sel >> (4 * i)) & 0xF))) & 0xFF) << (8 * i) for i in range(4))


class _SmemTransposeEmulator:
  """The memory accesses of thread ``tid``'s :func:`module._smem_transpose_program` on numpy bytes (``smem``, the
  CTA's SMEM tile, shared by its threads); counts the writes of every output byte and the accesses of every SMEM
  word, records the SMEM words of each of the thread's SMEM instructions in ``banks[(kind, warp, i)]`` and checks
  the alignment of every access."""

  def __init__(self, x, out, writes, smem, smem_count, banks, tid):
    self.x, self.o, self.writes, self.s, self.s_count = x, out, writes, smem, smem_count
    self.banks, self.warp, self.n = banks, tid // 32, {"sts": 0, "lds": 0}

  def _smem(self, kind, off):
    assert off % 4 == 0 and off + 4 <= self.s.size, off
    self.s_count[off // 4] += 1
    self.banks.setdefault((kind, self.warp, self.n[kind]), set()).add(off // 4)
    self.n[kind] += 1

  def gload(self, off):
    assert off % 4 == 0, off
    return int.from_bytes(self.x[off:off + 4].tobytes(), "little")

  def gstore(self, off, words):
    assert off % 16 == 0 and len(words) == 4, off
    self.o[off:off + 16] = np.frombuffer(b"".join(w.to_bytes(4, "little") for w in words), np.uint8)
    self.writes[off:off + 16] += 1

  def sts(self, off, word):
    self._smem("sts", off)
    self.s[off:off + 4] = np.frombuffer(word.to_bytes(4, "little"), np.uint8)

  def lds(self, off):
    self._smem("lds", off)
    return int.from_bytes(self.s[off:off + 4].tobytes(), "little")

  prmt = staticmethod(_prmt)


@pytest.mark.parametrize("shape, wide, tile, conflicts", [
    ((64, 64), False, (64, 64), 1), ((192, 320), False, (64, 64), 1), ((192, 256), True, (64, 128), 1),
    ((256, 384), True, (128, 128), 1), ((256, 192), True, (128, 64), 2)], ids=str)
def test_smem_transpose_thread_program(monkeypatch, shape, wide, tile, conflicts):
  """Every thread's program of the smem kernel, run on a CPU with ``prmt`` emulated bit for bit (interpret mode
  cannot run the kernel): the output is ``x.T``, every output byte is written once, every access is aligned, the
  swizzled SMEM tile (no padding) has each word stored once and loaded once, and no warp's SMEM instruction hits a
  bank with more than ``conflicts`` words (none at the 64x64, 64x128 and 128x128 tiles). ``wide``: the 128-byte
  tiles of arrays from 8 MB, forced on a small array."""
  if wide:
    monkeypatch.setattr(module, "_SMEM_TRANSPOSE_WIDE_BYTES", 0)
  m, n = shape
  assert module._smem_transpose_tile(m, n) == tile
  br, bc = tile
  x = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
  out, writes = np.zeros(m * n, np.uint8), np.zeros(m * n, np.int32)
  for bi in range(m // br):
    for bj in range(n // bc):
      smem, smem_count, banks = np.zeros(bc * br, np.uint8), np.zeros(bc * br // 4, np.int32), {}  # the SMEM tile
      threads = [module._smem_transpose_program(
          _SmemTransposeEmulator(x.reshape(-1), out, writes, smem, smem_count, banks, t), m, n, bi, bj, t)
          for t in range(128)]
      for phase in range(2):  # the barrier: every thread finishes phase 1 before any starts phase 2
        assert [next(t, "done") for t in threads] == [None if phase == 0 else "done"] * 128
        assert (smem_count == phase + 1).all()  # phase 1 stores every word once, phase 2 loads every word once
      assert {kind for kind, _, _ in banks} == {"sts", "lds"} and all(len(words) == 32 for words in banks.values())
      worst = max(max(np.bincount([w % 32 for w in words], minlength=32)) for words in banks.values())
      assert worst == conflicts
  assert (writes == 1).all()
  np.testing.assert_array_equal(out.reshape(n, m), x.T)


@pytest.mark.parametrize("dtype, shape, smem, path", [
    (jnp.float8_e4m3fn, (4032, 576), True, None), (jnp.float8_e4m3fn, (4032, 3072), True, None),
    (jnp.float8_e4m3fn, (8064, 1536), True, None), (jnp.float8_e4m3fn, (64, 64), True, None),
    (jnp.int8, (64, 576), True, None), (jnp.uint8, (192, 320), True, None),
    (jnp.float8_e4m3fn, (4032, 3136), False, "ring"), (jnp.float8_e4m3fn, (8064, 2048), False, "ring"),
    (jnp.float8_e4m3fn, (196608, 64), False, "pairs"), (jnp.float8_e4m3fn, (64, 196608), False, "widened"),
    (jnp.bfloat16, (64, 64), False, "widened")], ids=str)
def test_smem_transpose_choice(dtype, shape, smem, path):
  """2-D 8-bit arrays of up to 4032x3072 elements take the smem kernel (it tiles every shape of multiples of 64);
  larger ones and other dtypes keep the kernels they took before."""
  x = jax.ShapeDtypeStruct(shape, dtype)
  assert module._use_smem_transpose(x) == smem
  if not smem:
    assert path == ("ring" if module._use_ring(x) else "pairs" if module._use_pair_tiles(x) else "widened")


@pytest.mark.parametrize("shape", _SMEM_SHAPES + [(64, 64), (8064, 1536), (8064, 1088), (4032, 3136), (4032, 4096)],
                         ids=str)
def test_smem_transpose_lowers_for_h100(monkeypatch, shape):
  """The smem kernel runs where it was measured faster (up to 4032x3072 elements), the ring kernel above; it loads
  with ``ld.global.nc.L2::256B`` and its SMEM tile has no padding (tiles 64x64, 64x128, 128x128 and 128x64)."""
  modules = capture_mosaic_modules(monkeypatch)
  x = jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn)
  text = lower_for_h100(functools.partial(transpose, implementation="pallas"), x).as_text()
  assert "mosaic_gpu" in text
  smem = shape[0] * shape[1] <= module.SMEM_TRANSPOSE_MAX_ELEMENTS
  assert (_SMEM_MARK in text) == smem
  if smem:
    br, bc = module._smem_transpose_tile(*shape)
    (mod,) = modules
    assert "ld.global.nc.L2::256B.b32" in mod and "arith.xori" in mod
    assert f"memref<{br * bc}xi8, #gpu.address_space<workgroup>>" in mod


def test_smem_transpose_not_interpreted():
  """Interpret mode (which cannot run lane-level code) keeps the byte-pair kernel for small 8-bit arrays."""
  x = jax.ShapeDtypeStruct((128, 192), jnp.float8_e4m3fn)
  with jaxkern.use_implementation("interpret"):
    text = jax.jit(transpose).lower(x).as_text()
  assert _SMEM_MARK not in text and "ld.global" not in text


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.int8], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", _SMEM_SHAPES + _SMEM_ODD_SHAPES, ids=str)
def test_smem_transpose_gpu(key, shape, dtype):
  x = random_bits(key, shape, dtype)
  assert module._use_smem_transpose(x)
  assert_bitwise_equal(_poisoned_call(jax.jit(transpose), x), np.asarray(x).T)

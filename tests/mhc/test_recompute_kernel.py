"""The fused multilayer_recompute kernel (jaxkern.mhc._recompute_kernel): bit-exact against the layer-by-layer
composition of jaxkern's own kernels (interpret mode here, compiled on a GPU), over ragged token counts, both
``Lp`` cases, every vector width of its layout and each tiling / prefetch code path; its chunk plan; the H100
lowering, with its sums pinned to PTX (FMAs for ``"pallas"``, separate products for ``"auto"``'s pre-mix sums);
and, on a GPU, the ``"pallas"`` and ``"auto"`` paths against their own compositions."""

import functools

import jax
import jax.numpy as jnp
import pytest

from jaxkern import mhc
from jaxkern.mhc import _recompute_kernel as rck
from jaxkern.testing import capture_mosaic_modules, lower_for_h100
from tests.mhc.helpers import sds
from tests.mhc.test_fused import exact, layer_by_layer, recompute_inputs

M = 4
VARIANTS = {  # Config fields set on top of the defaults
    "defaults": {},
    "eight_tokens_per_cta": dict(tokens_per_cta=8),  # 9 tokens: mixes in SMEM, the last block overlaps the first
    "no_prefetch": dict(out_prefetch=0),  # 9 tokens in one block: mixes read from GMEM
    "one_token_per_cta": dict(tokens_per_cta=1, out_prefetch=5),
    "wide_chunks": dict(values_per_thread=16, tokens_per_cta=3, out_prefetch=1),
}


def use_variant(monkeypatch, name):
  monkeypatch.setattr(rck, "DEFAULT_CONFIG", rck.DEFAULT_CONFIG._replace(**VARIANTS[name]))


def check_bit_exact(key, lead, h, num_layers, num_post, implementation):
  args = recompute_inputs(key, lead, h, num_layers, num_post)
  got = jax.jit(lambda *a: mhc.multilayer_recompute(*a, implementation=implementation))(*args)
  want = jax.jit(lambda *a: layer_by_layer(*a, implementation))(*args)
  assert len(got.layer_input_list) == num_layers and len(got.residual_list) == num_post
  names = [f"layer_input[{i}]" for i in range(num_layers)] + [f"residual[{i}]" for i in range(num_post)]
  for name, a, b in zip(names, got.layer_input_list + got.residual_list, want[0] + want[1], strict=True):
    try:
      exact(a, b)
    except AssertionError as e:
      raise AssertionError(f"{implementation}: {name} differs from the composition's") from e


@pytest.mark.parametrize("lead, h, num_layers, num_post", [
    ((11,), 1024, 3, 3),  # fewer tokens than a block, 16-byte vectors
    ((2, 3), 2560, 2, 1),  # 8-byte vectors, Lp = L - 1
    ((5,), 1152, 1, 0),  # 2-byte vectors, one layer without a post
    ((3,), 2048, 2, 2)])  # fewer tokens than a block
def test_interpret_bit_exact_vs_layer_by_layer(key, lead, h, num_layers, num_post):
  check_bit_exact(key, lead, h, num_layers, num_post, "interpret")


@pytest.mark.parametrize("variant", sorted(set(VARIANTS) - {"defaults"}))
def test_interpret_variants_bit_exact(key, monkeypatch, variant):
  use_variant(monkeypatch, variant)
  check_bit_exact(key, (9,), 2048, 3, 2, "interpret")


def test_chunk_plan():
  assert rck.chunk_plan(4096, 8) == (1024, 8)
  assert rck.chunk_plan(8192, 16) == (2048, 8)
  assert rck.chunk_plan(7168, 16) == (1024, 8)  # 7 vectors per row: no divisor between 1 and 7
  assert rck.chunk_plan(2560, 8) == (512, 4)
  assert rck.chunk_plan(2560, 20) == (2560, 4)
  assert rck.chunk_plan(1152, 8) == (384, 1)
  assert rck.chunk_plan(1024, 1) == (1024, 8)  # at least one vector


def _lower(h, num_layers, num_post, contract_pre):
  t = 4001
  args = (sds((t, M, h), jnp.bfloat16), [sds((t, M), jnp.float32)] * num_layers,
          [sds((t, h), jnp.bfloat16)] * num_post, [sds((t, M), jnp.float32)] * num_post,
          [sds((t, M * M), jnp.float32)] * num_post)
  f = functools.partial(rck.recompute_kernel, contract_pre=contract_pre, config=rck.current_config())
  return lower_for_h100(f, *args)


def test_lowers_for_h100_with_sums_pinned_to_ptx(monkeypatch):
  modules = capture_mosaic_modules(monkeypatch)
  _lower(2560, 2, 1, contract_pre=True)
  _lower(2560, 2, 1, contract_pre=False)
  assert len(modules) == 2
  # H = 2560: 4 values per thread and stream; 2 pre sums of 4 products, 4 post sums of 5
  pre_terms, post_terms, values = 2 * M, M * (M + 1), 4
  for text, contracted in zip(modules, (True, False)):
    count = lambda op, text=text: text.count(f'"{op} $0')
    assert "arith.mulf" not in text and "arith.addf" not in text  # no sum left for LLVM / ptxas to contract
    if contracted:
      assert count("fma.rn.f32") == values * (pre_terms - 2 + post_terms - M)
      assert count("mul.rn.f32") == values * (2 + M) and count("add.rn.f32") == 0
    else:
      assert count("fma.rn.f32") == values * (post_terms - M)
      assert count("mul.rn.f32") == values * (pre_terms + M) and count("add.rn.f32") == values * (pre_terms - 2)


def test_interpret_mode_refuses_separate_products():
  args = (jnp.zeros((8, M, 1024), jnp.bfloat16), [jnp.zeros((8, M), jnp.float32)], [], [], [])
  with pytest.raises(ValueError, match="contract_pre"):
    rck.recompute_kernel(*args, contract_pre=False, config=rck.current_config(), interpret=True)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_lower_for_h100(monkeypatch, variant):
  use_variant(monkeypatch, variant)
  _lower(2560, 2, 1, contract_pre=False)


# (tests/mhc/test_fused.py::test_gpu_multilayer_recompute_bit_exact has the 8192-token benchmark cases)
@pytest.mark.gpu
@pytest.mark.parametrize("lead, h, num_layers, num_post", [((1000,), 8192, 3, 3), ((1, 999), 2560, 4, 3)])
def test_gpu_bit_exact_vs_layer_by_layer(key, lead, h, num_layers, num_post):
  for implementation in ("pallas", "auto"):
    check_bit_exact(key, lead, h, num_layers, num_post, implementation)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(set(VARIANTS) - {"defaults"}))
def test_gpu_variants_bit_exact(key, monkeypatch, variant):
  use_variant(monkeypatch, variant)
  check_bit_exact(key, (1001,), 4096, 3, 2, "auto")

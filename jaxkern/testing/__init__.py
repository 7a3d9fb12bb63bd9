"""Test and benchmark helpers: bit-exact and relative-difference checks, input generators,
cross-lowering for an H100 on CPU, and a CUPTI device timer (imported lazily: GPU only)."""

from jaxkern.testing.generators import (HIDDEN_SIZES, NUM_TOKENS, align, hidden_sizes, moe_topk_idx, num_tokens,
                                       randn, random_bits)
from jaxkern.testing.lowering import capture_mosaic_modules, lower_for_h100
from jaxkern.testing.numeric import assert_bitwise_equal, assert_diff_below, calc_diff

__all__ = [
    "HIDDEN_SIZES",
    "NUM_TOKENS",
    "align",
    "capture_mosaic_modules",
    "assert_bitwise_equal",
    "assert_diff_below",
    "calc_diff",
    "hidden_sizes",
    "lower_for_h100",
    "moe_topk_idx",
    "num_tokens",
    "randn",
    "random_bits",
]

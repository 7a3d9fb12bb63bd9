"""FP8 e4m3 / FP4 e2m1 casts with per-token, per-block and per-channel scales, the 12-bit E5M6 per-token
cast, and the SwiGLU forward fused with a per-token or a per-channel e4m3 cast (spec: quant.md).

Casts return a :class:`QuantTensor` ``(data, sf)`` (a NamedTuple; plain 2-tuples are accepted as
inputs). Scale-factor layouts: see :mod:`jaxkern.reference.quant`.
"""

from jaxkern.quant._cast_back import cast_back, per_token_cast_back, unpack_from_e2m1fn_x2
from jaxkern.quant._e5m6 import cast_back_e5m6, per_token_cast_to_e5m6
from jaxkern.quant._per_block_cast import (
    per_block_cast,
    per_block_cast_lossless,
    per_block_cast_with_precomputed_sf,
    per_block_cast_with_sf_only,
)
from jaxkern.quant._per_channel_cast import per_channel_cast, per_channel_cast_and_transpose, per_channel_cast_fused
from jaxkern.quant._per_token_cast import (
    per_token_cast,
    per_token_cast_with_precomputed_sf,
    per_token_cast_with_sf_only,
)
from jaxkern.quant._swiglu import swiglu_forward_and_per_token_cast
from jaxkern.quant._swiglu_per_channel import swiglu_forward_and_per_channel_cast_and_transpose
from jaxkern.quant._swiglu_backward import swiglu_backward_and_per_token_cast
from jaxkern.reference.quant import sf_logical, sf_to_float
from jaxkern.types import QuantTensor, QuantTensorWithClampedCount, SwigluBackward

__all__ = [
    "QuantTensor",
    "QuantTensorWithClampedCount",
    "SwigluBackward",
    "cast_back",
    "cast_back_e5m6",
    "per_block_cast",
    "per_block_cast_lossless",
    "per_block_cast_with_precomputed_sf",
    "per_block_cast_with_sf_only",
    "per_channel_cast",
    "per_channel_cast_and_transpose",
    "per_channel_cast_fused",
    "per_token_cast",
    "per_token_cast_back",
    "per_token_cast_to_e5m6",
    "per_token_cast_with_precomputed_sf",
    "per_token_cast_with_sf_only",
    "sf_logical",
    "sf_to_float",
    "swiglu_forward_and_per_channel_cast_and_transpose",
    "swiglu_backward_and_per_token_cast",
    "swiglu_forward_and_per_token_cast",
    "unpack_from_e2m1fn_x2",
]

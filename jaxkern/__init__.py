"""jaxkern: Pallas GPU kernels for MoE / FP8 training and inference on NVIDIA Hopper."""

from jaxkern import moe, quant, reference, transpose
from jaxkern._config import IMPLEMENTATIONS, get_implementation, set_implementation, use_implementation

__version__ = "0.1.0"

__all__ = [
    "IMPLEMENTATIONS",
    "get_implementation",
    "moe",
    "quant",
    "reference",
    "set_implementation",
    "transpose",
    "use_implementation",
]

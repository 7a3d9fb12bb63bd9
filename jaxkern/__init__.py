"""jaxkern: Pallas GPU kernels for MoE / FP8 training and inference on NVIDIA Hopper."""

from jaxkern import engram, gemm, mhc, moe, quant, reference, testing, transpose, types
from jaxkern._config import IMPLEMENTATIONS, get_implementation, set_implementation, use_implementation
from jaxkern._autodiff import NotDifferentiableError
from jaxkern._dispatch import Decision, KernelUnavailableError, explain
from jaxkern.types import QuantTensor

# The trainable layers build on every op above; imported last.
from jaxkern import modeling  # noqa: E402  isort: skip

__version__ = "0.1.0"

__all__ = [
    "IMPLEMENTATIONS",
    "Decision",
    "KernelUnavailableError",
    "NotDifferentiableError",
    "QuantTensor",
    "engram",
    "explain",
    "gemm",
    "mhc",
    "modeling",
    "get_implementation",
    "moe",
    "quant",
    "reference",
    "set_implementation",
    "testing",
    "transpose",
    "types",
    "use_implementation",
]

"""Transposes: ``transpose`` (2-D) and ``batched_transpose`` (3-D, last two axes)."""

from jaxkern.transpose._transpose import batched_transpose, transpose

__all__ = ["batched_transpose", "transpose"]

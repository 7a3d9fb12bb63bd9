"""Engram: n-gram hash, fused RMSNorm gate and its backward; ops land here as they are ported."""

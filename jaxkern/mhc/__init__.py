"""Manifold-constrained hyper-connections (mHC); ops land here as they are ported."""

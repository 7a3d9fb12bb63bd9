"""Trainable layers built from the kernels with ``jax.custom_vjp``; layers land here as they are built."""

"""Jitted forward and gradient calls of a MoE layer, shared by the layer tests."""

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames=("layer", "config", "implementation"))
def forward(params, x, *, layer, config, implementation):
  return layer(params, x, config=config, implementation=implementation)


def loss(params, x, layer, config, implementation):
  """A nonlinear scalar of the output, so that every output element gets its own cotangent."""
  return jnp.sum(jnp.sin(layer(params, x, config=config, implementation=implementation).astype(jnp.float32)))


grads = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=(2, 3, 4))

"""The sharded training step under ``jax.distributed.initialize``: two processes of 4 simulated CPU devices each, on
this machine (a local coordinator on a free port, CPU collectives over gloo), one global mesh of 8 devices over both.

Each process builds the same params and batch from fixed seeds, places its shards on the global mesh
(``jax.make_array_from_callback``), runs one step of the expert-parallel layer's loss (all-to-all exchange in two
chunks, routed experts split over the 8 devices, the batch over the tokens) with SGD, and gathers the updated params
to the host (``multihost_utils.process_allgather``); the first process checks them and the loss against the unsharded
step run on one of its own devices. What this checks is the multi-process plumbing (initialisation, global arrays,
collectives across processes) and the chunked exchange against the unsharded layer; the layer's other numerics are
tested on simulated devices in one process (test_ep_all_to_all.py, test_sharding.py).

Skipped where the platform lacks it (no gloo CPU collectives in this jaxlib, or the processes cannot reach a local
port); about 35 CPU-seconds (2026-11-29: two processes, each compiling the step, one the unsharded reference).
"""

import os
import socket
import subprocess
import sys

import pytest

UNSUPPORTED = 3  # a child's exit status when this platform cannot run multi-process CPU collectives
PROCESSES, LOCAL_DEVICES = 2, 4
H, I, LOCAL_TOKENS = 256, 128, 8


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_match_unsharded_step():
  port = _free_port()
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={LOCAL_DEVICES} --xla_backend_optimization_level=0",
             PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  children = [subprocess.Popen([sys.executable, os.path.abspath(__file__), str(i), str(port)], cwd=root, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for i in range(PROCESSES)]
  outputs = []
  for child in children:
    try:
      outputs.append(child.communicate(timeout=600)[0])
    except subprocess.TimeoutExpired:
      for c in children:
        c.kill()
      pytest.fail("a process of the two-process step did not finish in 600 s")
  codes = [c.returncode for c in children]
  if UNSUPPORTED in codes:
    pytest.skip("multi-process CPU collectives unavailable here: " + outputs[codes.index(UNSUPPORTED)][-500:])
  for i, (code, out) in enumerate(zip(codes, outputs)):
    assert code == 0, f"process {i}:\n{out[-6000:]}"
  assert "match the unsharded step" in outputs[0], outputs[0][-2000:]


def _child(process_id: int, port: int) -> int:
  import jax

  try:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=PROCESSES,
                               process_id=process_id, initialization_timeout=120)
  except Exception as e:  # noqa: BLE001 - any failure to set up the platform means "unsupported here"
    print(f"unsupported: {type(e).__name__}: {e}")
    return UNSUPPORTED
  import functools

  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from jaxkern.modeling import MoeConfig, init_moe_params, moe_layer
  from jaxkern.modeling.sharding import (init_optimizer_state, make_sharded_train_step, merge_shared_experts,
                                         moe_layer_ep, moe_param_specs, split_shared_experts)

  assert jax.process_count() == PROCESSES and jax.local_device_count() == LOCAL_DEVICES
  devices = jax.device_count()
  mesh = Mesh(np.array(jax.devices()), ("d",))  # ordered by process: each host's devices adjacent
  config = MoeConfig(num_experts=8, num_topk=2, num_shared_experts=1, alignment=8, ep_exchange="all_to_all",
                     ep_exchange_chunks=2)
  params = init_moe_params(jax.random.key(0), config, H, I, jnp.float32)
  params = params._replace(router_bias=jax.random.normal(jax.random.key(1), (config.num_experts,)) * 0.1)
  x = jax.random.normal(jax.random.key(2), (LOCAL_TOKENS * devices, H), jnp.float32)
  host = jax.tree.map(np.asarray, (split_shared_experts(params, config), x))
  specs = (moe_param_specs(host[0], "d"), P("d"))

  def place(value, spec):  # every process holds the whole value; each array gets its addressable shards from it
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda index: value[index])

  ep, xs = jax.tree.map(place, host, specs, is_leaf=lambda v: isinstance(v, np.ndarray))
  optimizer = optax.sgd(0.5)
  layer = functools.partial(moe_layer_ep, config=config, mesh_axis="d", implementation="reference")
  loss_fn = lambda p, batch: jnp.mean(jnp.sin(layer(p, batch)))
  step = make_sharded_train_step(loss_fn, optimizer, mesh, specs[0], check_vma=False)
  new, _, loss = step(ep, init_optimizer_state(optimizer, ep, mesh), xs)
  new = merge_shared_experts(multihost_utils.process_allgather(new, tiled=True))
  loss = float(loss.addressable_data(0))  # replicated

  if process_id == 0:  # the reference once: both processes hold the same gathered values
    local = jax.local_devices()[0]
    unsharded = lambda p, x: jnp.mean(jnp.sin(moe_layer(p, x, config=config, implementation="reference")))
    want_loss, grads = jax.jit(jax.value_and_grad(unsharded), device=local)(params, x)
    want = jax.tree.map(lambda p, g: np.asarray(p) - 0.5 * np.asarray(g), params, grads)
    assert abs(loss - float(want_loss)) <= 1e-5 * abs(float(want_loss)), (loss, float(want_loss))
    for name, a, b, p in zip(params._fields, new, want, params):
      moved = np.abs(b - np.asarray(p)).max()
      assert np.abs(np.asarray(a) - b).max() <= 1e-3 * moved + 1e-7, name
    assert np.abs(np.asarray(new.w_down) - np.asarray(params.w_down)).max() > 0, "the step moved the experts"
  print(f"process {process_id}: loss {loss:.6f}" + (" and params match the unsharded step" if process_id == 0 else ""))
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(_child(int(sys.argv[1]), int(sys.argv[2])))

"""Test setup: 16 virtual CPU devices, configured before JAX is first used."""

import jax

jax.config.update("jax_num_cpu_devices", 16)

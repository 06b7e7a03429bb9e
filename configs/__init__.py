"""Model, runtime and cluster configurations (data files), installed as `cp_runtime.configs`."""

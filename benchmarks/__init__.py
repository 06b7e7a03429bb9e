"""The long-context benchmark suite: `cp-runtime bench NAME` runs one. Which module runs which
benchmark, and what each measures: benchmarks/registry.py, the one table of them. Beside the
entry points: _shared/ (the code they share) and hand_model/ (the analytical TPU model)."""

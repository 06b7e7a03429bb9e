"""The long-context benchmark suite: each module is runnable as `python -m benchmarks.NAME`."""

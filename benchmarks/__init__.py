"""The long-context benchmark suite: each module is runnable as `cp-runtime bench NAME`."""

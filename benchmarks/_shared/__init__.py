"""The code two or more benchmarks share, private to the suite: the benchmarks' argument base
(bench_parser), results and tables (results, markdown), plots, the machine's measured roofline
(roofline_probe), the least work of a step (minimum_work), the needle contexts (needles), the
parts of `bench profile` and `bench decode` (profile_*) and of `bench chip` (chip_*). None of
these is a benchmark (the benchmarks: benchmarks/registry.py)."""

"""The command line: `cp-runtime` and its subcommands (`main`), the flags they share (`args`),
the demo (`demo`) and `cp-runtime compile` (`compile`).

The top floor: may import every other part of cp_runtime.
"""

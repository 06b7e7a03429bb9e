"""Which implementation of the per-shard hot paths a step uses.

`reference` is the XLA path (kernels/reference.py); `pallas` the TPU kernels; `pallas_interpret`
the same kernels in TPU interpret mode (CPU tests); `auto` picks pallas on TPU and the reference
elsewhere. An unknown name is refused with the list of choices.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from kernels import reference

__all__ = ["Kernels", "select_kernels", "resolve_backend"]


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The four per-shard operations, all with the signatures of kernels/reference.py."""

    name: str
    write_kv: Callable
    indexer_page_scores: Callable
    sparse_attention: Callable


REFERENCE = Kernels("reference", reference.write_kv, reference.indexer_page_scores,
                    reference.sparse_attention)


def resolve_backend(name: str) -> str:
    if name == "auto":
        return "pallas" if jax.default_backend() == "tpu" else "reference"
    return name


def select_kernels(name: str) -> Kernels:
    resolved = resolve_backend(name)
    if resolved == "reference":
        return REFERENCE
    raise ValueError(f"unknown kernel backend {name!r}; choices: auto, reference")

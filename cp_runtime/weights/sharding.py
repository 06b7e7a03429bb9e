"""Where each weight lies on the `cp` mesh: the one rule that placement, the step's partition
specs and the capacity arithmetic share. Pure Python (no JAX): capacity imports it.

Runtime field `weights` chooses the mode:
    replicated  every device holds every tensor (small models; the oracle's layout)
    sharded     each tensor below is split over the S devices that hold the KV pool, so a
                device holds about 1/S of the model (DESIGN: weights live where the cache does)

The split of each tensor (model layout: HF names, routed experts stacked, see
`cp_runtime.weights.params.model_layout`):

    embed_tokens, lm_head                  rows, by vocabulary
    q_a_proj, kv_a_proj_with_mqa,          replicated: the down projections from the hidden
    indexer wk, weights_proj               state. Every device projects its tokens through
                                           them itself (17 MB of fp8 a GLM-5.2 layer, 1.3 GB
                                           its 78 layers), as vLLM and SGLang keep them, so a
                                           decode step sends no gather of their few features
                                           (a collective a layer;
                                           docs/notes/2026-12-03-decode-step.md,
                                           "The down projections whole")
    q_b_proj, kv_b_proj                    rows, by attention head (whole heads per device)
    o_proj                                 columns, by attention head
    indexer wq_b                           rows, by indexer head
    dense MLP and shared experts           gate/up by rows (column parallel), down by columns
                                           (row parallel)
    router gate                            replicated: every device scores every expert for
                                           its tokens itself (E x hidden, 3 MB of bf16 a
                                           GLM-5.2 layer), so routing needs no gather
    routed experts [E, ...]                by inner feature: every device holds every expert's
                                           slice (gate/up [E, hidden, inner / S], down
                                           [E, inner / S, hidden]), so the few experts a decode
                                           step's tokens choose are read by all devices evenly,
                                           and no device waits on a popular one. In g expert
                                           groups (runtime field `expert_groups`): g groups of
                                           E / g whole experts, each group's split by inner
                                           feature over its S / g devices (`grouped_experts`)
    norms and biases                       replicated

An axis of `units` parts (heads, experts, features) is padded with zero parts up to a multiple
of S when S does not divide it, so the tiny test models shard at S = 16 too; a padded head or
expert has zero weights and adds nothing.
"""

from __future__ import annotations

import dataclasses
import math

from cp_runtime.config import WEIGHT_MODES, ModelConfig

__all__ = ["WEIGHT_MODES", "Split", "split_of", "local_shape", "padded_shape",
           "EXPERT_STACKS", "ExpertGroups", "grouped_experts"]

# Routed experts, stacked per layer: gate/up [E, hidden, inner], down [E, inner, hidden].
EXPERT_STACKS = ("mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight",
                 "mlp.experts.down_proj.weight")


@dataclasses.dataclass(frozen=True)
class Split:
    """A tensor cut along `axis` into `units` equal parts (heads, experts, features), each
    part kept whole on one device."""

    axis: int
    units: int

    def units_per_device(self, shards: int) -> int:
        return math.ceil(self.units / shards)

    def unit_size(self, shape: tuple[int, ...]) -> int:
        """Elements of one part along the axis (a head's rows, 1 for features)."""
        return shape[self.axis] // self.units


def _by_suffix(model: ModelConfig) -> dict[str, tuple[int, int]]:
    h, hi = model.num_attention_heads, model.index_n_heads
    return {
        "embed_tokens.weight": (0, model.vocab_size),
        "lm_head.weight": (0, model.vocab_size),
        "self_attn.q_b_proj.weight": (0, h),
        "self_attn.kv_b_proj.weight": (0, h),
        "self_attn.o_proj.weight": (1, h),
        "indexer.wq_b.weight": (0, hi),
    }


def split_of(name: str, shape: tuple[int, ...], model: ModelConfig) -> Split | None:
    """How tensor `name` (model layout) of `shape` is split over the devices; None: replicated
    (norms, biases, the router and its correction bias, the down projections)."""
    if name.endswith(EXPERT_STACKS):                                # gate/up [E, hid, inner]
        inner = 1 if name.endswith("down_proj.weight") else 2      # down [E, inner, hid]
        return Split(inner, shape[inner])
    for suffix, (axis, units) in _by_suffix(model).items():
        if name.endswith(suffix):
            return Split(axis, units)
    if name.endswith(("gate_proj.weight", "up_proj.weight")):       # column parallel
        return Split(0, shape[0])
    if name.endswith("down_proj.weight"):                           # row parallel
        return Split(1, shape[1])
    return None


def _resized(shape: tuple[int, ...], split: Split, units: int) -> tuple[int, ...]:
    out = list(shape)
    out[split.axis] = units * split.unit_size(shape)
    return tuple(out)


def padded_shape(name: str, shape: tuple[int, ...], model: ModelConfig,
                 shards: int) -> tuple[int, ...]:
    """The global shape once the split axis is padded to a multiple of `shards` parts."""
    split = split_of(name, shape, model)
    if split is None:
        return shape
    return _resized(shape, split, split.units_per_device(shards) * shards)


def local_shape(name: str, shape: tuple[int, ...], model: ModelConfig,
                shards: int) -> tuple[int, ...]:
    """The shape each of `shards` devices holds of tensor `name` in sharded mode."""
    split = split_of(name, shape, model)
    if split is None:
        return shape
    return _resized(shape, split, split.units_per_device(shards))


@dataclasses.dataclass(frozen=True)
class ExpertGroups:
    """A routed-expert stack [E, a, b] in `groups` groups over `shards` devices: device d holds
    experts `experts(d)` (whole, of group d // (S / g)) and, of each, inner features
    `features(d)` along `inner_axis` (slice d % (S / g) of S / g), E and the inner axis padded
    with zeros to a multiple of g and of S / g.

    The global array is device-major, [S * E_g, ...] with device d's block at rows
    d * E_g .. (d + 1) * E_g: a split along axis 0 places it, as every other split tensor is
    placed, and a device's block has the shape one group's slice would have."""

    shape: tuple[int, ...]                # the stack's model-layout shape [E, a, b]
    inner_axis: int                       # 2: gate/up [E, hidden, inner]; 1: down
    shards: int
    groups: int

    @property
    def experts_per_device(self) -> int:
        return math.ceil(self.shape[0] / self.groups)

    @property
    def features_per_device(self) -> int:
        return math.ceil(self.shape[self.inner_axis] / (self.shards // self.groups))

    @property
    def local(self) -> tuple[int, ...]:
        out = [self.experts_per_device, *self.shape[1:]]
        out[self.inner_axis] = self.features_per_device
        return tuple(out)

    @property
    def full(self) -> tuple[int, ...]:
        return (self.shards * self.local[0], *self.local[1:])

    def experts(self, device: int) -> tuple[int, int]:
        """[lo, hi) of the model's experts device `device` holds (padding past E included)."""
        group = device // (self.shards // self.groups)
        return group * self.experts_per_device, (group + 1) * self.experts_per_device

    def features(self, device: int) -> tuple[int, int]:
        """[lo, hi) of each of its experts' inner features (padding past the end included)."""
        part = device % (self.shards // self.groups)
        return part * self.features_per_device, (part + 1) * self.features_per_device


def grouped_experts(name: str, shape: tuple[int, ...], shards: int,
                    groups: int) -> ExpertGroups | None:
    """How routed-expert stack `name` lies in `groups` > 1 groups; None for any other tensor,
    or for one group (the by-feature split of `split_of`)."""
    if groups == 1 or not name.endswith(EXPERT_STACKS):
        return None
    if shards % groups:
        raise ValueError(f"{groups} expert groups do not divide {shards} devices")
    return ExpertGroups(tuple(shape), 1 if name.endswith("down_proj.weight") else 2,
                        shards, groups)

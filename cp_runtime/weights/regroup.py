"""The routed experts moved, in place, between one group and g groups: g groups while long
prompts prefill, one group for decode (RuntimeConfig.prefill_expert_groups).

Why. In one group every device holds a 1/S feature slice of every expert, so a decode step
reads each chosen expert from all S devices at once. In g groups a prefill chunk's device runs
only its group's (token, expert) pairs, about 1/g of them, and gathers and sums g times fewer
rows (cp_runtime.model.expert_groups). Exchanging the experts inside every chunk's program
costs the exchange each chunk; held in g groups across a prompt's chunks, it is paid once
before the prompt and once after (docs/notes/2026-12-07-expert-groups.md, "The experts regrouped for
a prompt").

Layouts of one stack on device d of S (features along axis a: 2 for gate and up [E, hidden,
F], 1 for down [E, F, hidden]; block scales alike):

    one group   [E, ..., F / S, ...]        feature slice d of every expert, split along a
    g groups    [E_g, ..., g F / S, ...]    group d mod g's E_g = ceil(E / g) experts (zero
                                            experts pad E to g E_g), features of part d // g
                                            of S / g; device-major along axis 0 (the
                                            WeightShards field `groups_strided`)

The devices go in blocks of g consecutive ones: block b holds feature slices b g .. b g + g - 1
of S, together part b of S / g. One all-to-all within each block hands device b g + i group
i's experts of all the block's slices (`to_groups`), and one more hands them back
(`to_one`): the values only move, so the round trip is exact.

In place. Each MoE layer's stacks are exchanged by a program of their own, and the next layer
starts when it is done, so a device holds at most one layer's stacks twice. (The layouts'
shapes differ, so XLA cannot alias a donated stack to its exchanged one; a program over every
layer would hold all the new stacks beside all the old.)
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from cp_runtime.weights.format import SCALE_SUFFIX, DeviceTensor
from cp_runtime.weights.sharding import EXPERT_STACKS
from cp_runtime.weights.params import Params
from cp_runtime.weights.placement import param_specs

__all__ = ["ExpertRegrouping", "to_groups", "to_one", "regrouped_tensors"]

# The features' axis of each routed-expert stack (and of its block scales).
FEATURE_AXIS = {stack: 1 if stack.endswith("down_proj.weight") else 2 for stack in EXPERT_STACKS}
_LAYER = re.compile(r"^(.*)(" + "|".join(re.escape(s) for s in EXPERT_STACKS) + r")("
                    + re.escape(SCALE_SUFFIX) + r")?$")


def _blocks(groups: int, axis_name: str) -> list[list[int]]:
    size = lax.axis_size(axis_name)
    return [list(range(b, b + groups)) for b in range(0, size, groups)]


def to_groups(x: jax.Array, axis: int, groups: int, axis_name: str) -> jax.Array:
    """This device's one-group slice x [E, ..., F / S (axis), ...] -> its g-group part
    [ceil(E / g), ..., g F / S, ...] (module docstring). Inside shard_map over `axis_name`."""
    experts = -(-x.shape[0] // groups) * groups
    x = jnp.pad(x, [(0, experts - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    x = lax.all_to_all(x.reshape(groups, experts // groups, *x.shape[1:]), axis_name, 0,
                       axis + 1, axis_index_groups=_blocks(groups, axis_name), tiled=True)
    return x.reshape(x.shape[1:])


def to_one(x: jax.Array, axis: int, groups: int, num_experts: int, axis_name: str
           ) -> jax.Array:
    """`to_groups`' inverse: this device's g-group part -> its one-group slice of the
    model's `num_experts` experts (the padding experts dropped)."""
    x = lax.all_to_all(x[None], axis_name, axis + 1, 0,
                       axis_index_groups=_blocks(groups, axis_name), tiled=True)
    return x.reshape(-1, *x.shape[2:])[:num_experts]


def _stack_of(name: str) -> str | None:
    """The stack a tensor name is (or holds the scales of), or None."""
    found = _LAYER.match(name)
    return None if found is None else found.group(2)


def regrouped_tensors(tensors: dict[str, DeviceTensor], groups: int, shards: int
                      ) -> dict[str, DeviceTensor]:
    """The device tensors of `tensors` (the experts in one group over `shards` devices) with
    every routed-expert stack and its scales in `groups` groups: device-major along axis 0."""
    out = dict(tensors)
    for name, t in tensors.items():
        stack = _stack_of(name)
        if stack is None:
            continue
        local = list(t.local)
        local[0] = math.ceil(local[0] / groups)
        local[FEATURE_AXIS[stack]] *= groups
        out[name] = dataclasses.replace(t, shape=(shards * local[0], *local[1:]),
                                        local=tuple(local), split_axis=0, experts=None)
    return out


class ExpertRegrouping:
    """`to_groups(params)` / `to_one(params)`: every MoE layer's routed experts in `params` (a
    dict, updated in place, so that each layer's old stacks go as its new ones come)
    exchanged, a layer at a time (module docstring). `tensors`: the device tensors with the
    experts in one group; `grouped`: the same in g groups (`regrouped_tensors`)."""

    def __init__(self, mesh: Mesh, tensors: dict[str, DeviceTensor], groups: int,
                 axis_name: str):
        self.groups = groups
        self.grouped = regrouped_tensors(tensors, groups, mesh.devices.size)
        self._layers = self._layer_names(tensors)
        if not self._layers:
            raise ValueError("no routed experts to regroup: the model has no MoE layer")
        prefix, suffixes = self._layers[0]
        one_specs = param_specs(tensors, axis_name)
        group_specs = param_specs(self.grouped, axis_name)
        by_suffix = {s: (one_specs[prefix + s], group_specs[prefix + s]) for s in suffixes}
        num_experts = {s: tensors[prefix + s].local[0] for s in suffixes}

        def exchange(forward: bool):
            def body(stacks: dict[str, jax.Array]) -> dict[str, jax.Array]:
                out = {}
                for s, x in stacks.items():
                    axis = FEATURE_AXIS[_stack_of(s)]
                    out[s] = (to_groups(x, axis, groups, axis_name) if forward
                              else to_one(x, axis, groups, num_experts[s], axis_name))
                return out
            src, dst = (0, 1) if forward else (1, 0)
            specs_in = {s: by_suffix[s][src] for s in suffixes}
            specs_out = {s: by_suffix[s][dst] for s in suffixes}
            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs_in,),
                                         out_specs=specs_out, check_vma=False))

        self.to_groups_layer, self.to_one_layer = exchange(True), exchange(False)

    @staticmethod
    def _layer_names(tensors) -> list[tuple[str, tuple[str, ...]]]:
        """[(layer prefix, its stack and scale names without the prefix)], in layer order."""
        layers: dict[str, list[str]] = {}
        for name in tensors:
            found = _LAYER.match(name)
            if found is not None:
                layers.setdefault(found.group(1), []).append(name[len(found.group(1)):])
        return [(prefix, tuple(sorted(names))) for prefix, names in layers.items()]

    def layer_arguments(self, params: Params) -> dict[str, jax.Array]:
        """The first MoE layer's stacks, as the per-layer programs take them (for lowering)."""
        prefix, suffixes = self._layers[0]
        return {s: params[prefix + s] for s in suffixes}

    @staticmethod
    def _move(params: Params, prefix: str, suffixes: tuple[str, ...], program) -> None:
        moved = program({s: params[prefix + s] for s in suffixes})
        jax.block_until_ready(moved)              # one layer twice at most (module docstring)
        params.update({prefix + s: x for s, x in moved.items()})       # the old ones go

    def _each_layer(self, params: Params, program, undo) -> None:
        """`program` over every MoE layer; if one fails, `undo` puts back those it moved (the
        values only moved, so exactly), and the failure is raised: the layers are never
        left in two layouts."""
        done = []
        try:
            for prefix, suffixes in self._layers:
                self._move(params, prefix, suffixes, program)
                done.append((prefix, suffixes))
        except BaseException:
            for prefix, suffixes in done:
                self._move(params, prefix, suffixes, undo)
            raise

    def to_groups(self, params: Params) -> None:
        self._each_layer(params, self.to_groups_layer, self.to_one_layer)

    def to_one(self, params: Params) -> None:
        self._each_layer(params, self.to_one_layer, self.to_groups_layer)

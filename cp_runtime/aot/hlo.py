"""The text of a compiled HLO module (`compiled.as_text()`), read into instructions with their
shapes, operands and the figures XLA:TPU attaches to them.

What one instruction costs, from the module alone:

    HBM bytes   an entry instruction that does work (a fusion, copy, sort, scatter, ...) reads
                its operands and writes its result. An operand that the called computation only
                slices (dynamic-slice, slice, gather) is counted by the slices it takes, and a
                buffer updated in place (the output aliases an operand: a cache write) by what
                is written into it, not by its size: the pool is read through both. An async
                copy or slice (XLA prefetching into VMEM) moves its destination's bytes. Arrays
                placed in VMEM (layout `S(1)`) move no HBM bytes.
    MXU flops   2 x multiply-adds of every convolution and dot, inside fusions too. XLA:TPU
                writes batched matmuls as convolutions with dilated windows, so the taps of a
                window that land on real (not dilated, not padded) inputs are counted one by
                one, per spatial dimension.
    cycles      the TPU compiler's `estimated_cycles` in the backend config (fusions, copies,
                convolutions; none on Mosaic calls or async collectives)
    kernel      a Mosaic call (`tpu_custom_call`): the flops and bytes of the `cost_estimate`
                it carries (cp_runtime.kernels.costs for ours; XLA's own for the ragged dots
                of the MoE)

Shapes are `dtype[d0,d1,...]{layout}`; a tuple is a parenthesised list of them.
"""

from __future__ import annotations

import dataclasses
import math
import re

from cp_runtime.kernels.costs import FP8_MXU_SUFFIX, VPU_SUFFIX

__all__ = ["Instruction", "Module", "parse_module", "called_computations", "shape_bytes",
           "array_bytes", "last_array_bytes", "ici_bytes", "COLLECTIVES", "matmul_flops",
           "hbm_bytes", "FREE_OPS"]

_HEADER = re.compile(r"^(?:ENTRY )?%(?P<name>[\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<shape>.+?) (?P<op>[a-z][a-z0-9\-]*)\(")
_ARRAY = re.compile(r"\b(?P<dtype>pred|token|[sufc]\d+|bf16|f8e\w+)\[(?P<dims>[\d,]*)\]")
_PLACED_ARRAY = re.compile(_ARRAY.pattern + r"(?P<layout>\{[^}]*\})?")
_OPERAND = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_KERNEL_COST = re.compile(r'"cost_estimate":\{"flops":"(\d+)".*?"bytes_accessed":"(\d+)"')
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_CALLEES = re.compile(r"(?:calls|to_apply)=%([\w.\-]+)")
_ALIASED = re.compile(r"output_to_operand_aliasing=\{([^}]*)\}")
_ALIAS_OPERAND = re.compile(r"\((\d+),")
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_GROUPS = re.compile(r"feature_group_count=(\d+)")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_GROUP = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_IOTA_GROUP = re.compile(r"replica_groups=\[\d+,(\d+)\]")
_OFF_HBM = re.compile(r"S\((?:1|5)\)")
_BITS = {"pred": 8, "bf16": 16, "token": 0}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

# Instructions that move no data of their own: views, tuples, constants, and the halves of
# async pairs whose work is counted elsewhere (collectives by the collective instruction).
FREE_OPS = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "reshape",
    "partition-id", "replica-id", "iota", "after-all", "add-dependency", "opt-barrier",
    "copy-done", "slice-done", "call-done", "all-gather-done", "all-reduce-done",
    "collective-permute-done", "async-done", "call-start", "async-start"})
# Ops through which a fused computation reads only part of an operand.
_SLICING = frozenset({"dynamic-slice", "slice", "gather"})


def array_bytes(dtype: str, dims: str) -> int:
    bits = _BITS.get(dtype)
    if bits is None:
        bits = 8 if dtype.startswith("f8") else int(re.sub(r"\D", "", dtype))
    return math.prod(int(d) for d in dims.split(",") if d) * bits // 8


def last_array_bytes(shape: str) -> int:
    """Bytes of the last array in a shape's text that is not a scalar: an async start's
    result (a collective-permute-start's tuple ends with two u32[] contexts after it)."""
    arrays = _ARRAY.findall(shape)
    arrays = [a for a in arrays if a[1]] or arrays
    return array_bytes(*arrays[-1]) if arrays else 0


def shape_bytes(shape: str) -> int:
    """Bytes of every array in a shape's text (a tuple's members added)."""
    return sum(array_bytes(d, dims) for d, dims in _ARRAY.findall(shape))


def hbm_shape_bytes(shape: str) -> int:
    """`shape_bytes` of the arrays that live in HBM: not those whose layout places them in
    VMEM (memory space 1, `S(1)`) or in host memory (`S(5)`: a latent cache held there)."""
    return sum(array_bytes(m.group("dtype"), m.group("dims"))
               for m in _PLACED_ARRAY.finditer(shape)
               if not _OFF_HBM.search(m.group("layout") or ""))


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    op: str
    shape: str                   # the result's shape, as printed
    operands: tuple[str, ...]
    line: str

    @property
    def bytes(self) -> int:
        return shape_bytes(self.shape)

    @property
    def hbm_bytes(self) -> int:
        return hbm_shape_bytes(self.shape)

    @property
    def dims(self) -> list[int]:
        """Dimensions of a single-array result."""
        found = _ARRAY.search(self.shape)
        return [int(d) for d in found.group("dims").split(",") if d] if found else []

    @property
    def dtype(self) -> str:
        found = _ARRAY.search(self.shape)
        return found.group("dtype") if found else ""

    @property
    def op_name(self) -> str:
        found = _OP_NAME.search(self.line)
        return found.group(1) if found else ""

    @property
    def cycles(self) -> int:
        found = _CYCLES.search(self.line)
        return int(found.group(1)) if found else 0

    @property
    def is_kernel(self) -> bool:
        return 'custom_call_target="tpu_custom_call"' in self.line

    @property
    def fp8_mxu(self) -> bool:
        """A Mosaic call whose name says its matmuls are fp8 x fp8 (kernels/costs.py)."""
        return self.is_kernel and self.name.split(".")[0].endswith(FP8_MXU_SUFFIX)

    @property
    def vpu(self) -> bool:
        """A Mosaic call whose name says its flops are VPU operations (kernels/costs.py)."""
        return self.is_kernel and self.name.split(".")[0].endswith(VPU_SUFFIX)

    @property
    def unpriced(self) -> bool:
        """Work XLA:TPU gives no price: a sort (no estimated cycles), a custom fusion without
        them (a scatter it rewrote), or a call it moved to the SparseCores (a gather, a
        relayout). A SparseCore call holding collectives is priced as those
        (cp_runtime.aot.phases), so the caller rules those out."""
        if self.cycles or self.is_kernel:
            return False
        return (self.op == "sort" or (self.op == "fusion" and "kind=kCustom" in self.line)
                or (self.op == "call-start" and 'async_execution_thread="sparsecore"' in self.line))

    @property
    def result_bytes(self) -> int:
        """Bytes of what the instruction makes: an async start's result (its shape also lists
        the operands), else every array of its shape."""
        return last_array_bytes(self.shape) if self.op.endswith("-start") else shape_bytes(
            self.shape)

    @property
    def kernel_cost(self) -> tuple[int, int]:
        """(flops, bytes) of a Mosaic call's cost estimate; zeros where it carries none."""
        found = _KERNEL_COST.search(self.line)
        return (int(found.group(1)), int(found.group(2))) if found else (0, 0)

    @property
    def group_size(self) -> int:
        """Participants of a collective's groups (1 where it names none)."""
        found = _GROUP.search(self.line)
        if found:
            return len(found.group(1).split(","))
        found = _IOTA_GROUP.search(self.line)
        return int(found.group(1)) if found else 1

    @property
    def called(self) -> str | None:
        found = _CALLS.search(self.line)
        return found.group(1) if found else None

    @property
    def aliased_operands(self) -> frozenset[int]:
        """Operands the result updates in place (output_to_operand_aliasing)."""
        found = _ALIASED.search(self.line)
        return frozenset(int(i) for i in _ALIAS_OPERAND.findall(found.group(1))) if found \
            else frozenset()


@dataclasses.dataclass(frozen=True)
class Module:
    """Computations by name (their instructions in order), the entry's name, and every
    instruction by name (HLO names are unique within a module)."""

    computations: dict[str, list[Instruction]]
    entry: str
    by_name: dict[str, Instruction]

    def parameters(self, computation: str) -> list[Instruction]:
        """A computation's parameters in parameter-number order."""
        params = [i for i in self.computations[computation] if i.op == "parameter"]
        return sorted(params, key=lambda i: int(re.search(r"parameter\((\d+)\)", i.line)
                                                .group(1)))

    def callers(self) -> dict[str, Instruction]:
        """The instruction that calls each called computation (`calls=` or `to_apply=`;
        the first one where several do)."""
        out: dict[str, Instruction] = {}
        for instructions in self.computations.values():
            for ins in instructions:
                for callee in _CALLEES.findall(ins.line):
                    out.setdefault(callee, ins)
        return out

    def users(self, computation: str) -> dict[str, list[Instruction]]:
        out: dict[str, list[Instruction]] = {}
        for ins in self.computations[computation]:
            for operand in ins.operands:
                out.setdefault(operand, []).append(ins)
        return out


def called_computations(ins: Instruction) -> list[str]:
    """The computations an instruction calls (`calls=`, `to_apply=`)."""
    return _CALLEES.findall(ins.line)


def _operands(line: str, start: int) -> tuple[str, ...]:
    """Names inside the op's parentheses, which open at line[start - 1]."""
    depth, end = 1, start
    while end < len(line) and depth:
        depth += {"(": 1, ")": -1}.get(line[end], 0)
        end += 1
    return tuple(_OPERAND.findall(line[start:end - 1]))


def parse_module(text: str) -> Module:
    computations: dict[str, list[Instruction]] = {}
    by_name: dict[str, Instruction] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group("name")
            computations[current] = []
            if line.startswith("ENTRY "):
                entry = current
            continue
        found = _INSTRUCTION.match(line) if current else None
        if found is None:
            continue
        ins = Instruction(name=found.group("name"), op=found.group("op"),
                          shape=found.group("shape"),
                          operands=_operands(line, found.end()), line=line)
        computations[current].append(ins)
        by_name[ins.name] = ins
    if entry is None:
        raise ValueError("no ENTRY computation in the module text")
    return Module(computations=computations, entry=entry, by_name=by_name)


def _window_taps(window: str, lhs_sizes: list[int], out_sizes: list[int]) -> int:
    """Product over spatial dimensions of the window taps, summed over output positions, that
    land on a real input element (not padding, not a hole of lhs dilation)."""
    fields = dict(f.split("=", 1) for f in window.split())
    spatial = len(out_sizes)

    def per_dim(key: str, default: int) -> list[int]:
        if key not in fields:
            return [default] * spatial
        return [int(v) for v in fields[key].split("x")]

    size, stride = per_dim("size", 1), per_dim("stride", 1)
    lhs_dil, rhs_dil = per_dim("lhs_dilate", 1), per_dim("rhs_dilate", 1)
    pads = ([int(p.split("_")[0]) for p in fields["pad"].split("x")] if "pad" in fields
            else [0] * spatial)
    total = 1
    for d in range(spatial):
        span = (lhs_sizes[d] - 1) * lhs_dil[d]           # last real input, dilated coordinates
        taps = 0
        for p in range(out_sizes[d]):
            for k in range(size[d]):
                q = p * stride[d] + k * rhs_dil[d] - pads[d]
                taps += 0 <= q <= span and q % lhs_dil[d] == 0
        total *= taps
    return total


def _convolution_macs(ins: Instruction, module: Module) -> int:
    labels = _DIM_LABELS.search(ins.line)
    lhs, rhs = (module.by_name[o] for o in ins.operands[:2])
    lhs_l, rhs_l, out_l = labels.groups()
    lhs_dims, rhs_dims, out_dims = lhs.dims, rhs.dims, ins.dims
    spatial = sorted(c for c in out_l if c.isdigit())
    out_sizes = [out_dims[out_l.index(c)] for c in spatial]
    lhs_sizes = [lhs_dims[lhs_l.index(c)] for c in spatial]
    window = _WINDOW.search(ins.line)
    taps = _window_taps(window.group(1), lhs_sizes, out_sizes) if window and spatial else 1
    groups = int(_GROUPS.search(ins.line).group(1)) if _GROUPS.search(ins.line) else 1
    batch = out_dims[out_l.index("b")]
    features_in = lhs_dims[lhs_l.index("f")] // groups
    features_out = rhs_dims[rhs_l.index("o")]
    return batch * features_out * features_in * taps


def _dot_macs(ins: Instruction, module: Module) -> int:
    lhs = module.by_name[ins.operands[0]]
    found = _CONTRACTING.search(ins.line)
    contracted = [lhs.dims[int(i)] for i in found.group(1).split(",") if i] if found else []
    return math.prod(ins.dims) * math.prod(contracted)


def matmul_flops(ins: Instruction, module: Module) -> dict[str, int]:
    """MXU flops of a convolution, dot or fusion (its called computation's, recursively), keyed
    by the narrower operand dtype: 'f8' when both operands are fp8, else the operands' dtype
    ('bf16', 'f32', ...)."""
    if ins.op in ("convolution", "dot"):
        macs = (_convolution_macs if ins.op == "convolution" else _dot_macs)(ins, module)
        dtypes = {module.by_name[o].dtype for o in ins.operands[:2]}
        key = "f8" if all(d.startswith("f8") for d in dtypes) else (
            "bf16" if "bf16" in dtypes or any(d.startswith("f8") for d in dtypes)
            else sorted(dtypes)[0])
        return {key: 2 * macs}
    out: dict[str, int] = {}
    if ins.op == "fusion" and ins.called in module.computations:
        for inner in module.computations[ins.called]:
            for key, flops in matmul_flops(inner, module).items():
                out[key] = out.get(key, 0) + flops
    return out


def _read_bytes(module: Module, computation: str, index: int, operand: Instruction) -> int:
    """Bytes a fusion reads of its operand `index`: the slices its computation takes when it
    only slices it, else the whole operand."""
    params = module.parameters(computation)
    if index >= len(params):
        return operand.bytes
    users = module.users(computation).get(params[index].name, [])
    if users and all(u.op in _SLICING and u.operands[0] == params[index].name for u in users):
        return min(operand.hbm_bytes, sum(u.bytes for u in users))
    return operand.hbm_bytes


def _updated_in_place(ins: Instruction, module: Module) -> frozenset[int]:
    """The operand a fusion updates in place: its root is a dynamic-update-slice or scatter of
    one of its parameters (XLA gives such a fusion the operand's buffer)."""
    body = module.computations.get(ins.called or "")
    if ins.op != "fusion" or not body:
        return frozenset()
    root = next((i for i in body if i.line.lstrip().startswith("ROOT ")), body[-1])
    if root.op not in ("dynamic-update-slice", "scatter"):
        return frozenset()
    params = [p.name for p in module.parameters(ins.called)]
    target = root.operands[0]
    return frozenset({params.index(target)}) if target in params else frozenset()


def ici_bytes(ins: Instruction) -> tuple[int, int]:
    """(bytes the collective produces per device, bytes each device sends over the
    interconnect, by the ring algorithm): all-gather and all-to-all send (G-1)/G of their
    result, reduce-scatter G-1 times it, all-reduce 2 (G-1)/G, a permute all of it. An async
    start's result tuple ends with what the collective produces. (0, 0) for other ops."""
    op = ins.op.removesuffix("-start")
    if op not in COLLECTIVES:
        return 0, 0
    out = last_array_bytes(ins.shape) if ins.op.endswith("-start") else ins.bytes
    g = ins.group_size
    sent = {"all-gather": (g - 1) / g, "all-to-all": (g - 1) / g, "reduce-scatter": g - 1,
            "all-reduce": 2 * (g - 1) / g, "collective-permute": 1}[op]
    return out, int(out * sent)


def hbm_bytes(ins: Instruction, module: Module) -> int:
    """HBM bytes an entry instruction reads and writes (module docstring); 0 for the free ops,
    collectives and Mosaic calls, which are counted on their own."""
    if ins.op in FREE_OPS or ins.is_kernel or ins.op.removesuffix("-start") in COLLECTIVES:
        return 0
    if ins.op == "dynamic-update-slice":            # in place: the update is read and written
        return 2 * module.by_name[ins.operands[1]].hbm_bytes
    if ins.op == "copy-start":        # its result tuple is (destination, source, context)
        return module.by_name[ins.operands[0]].hbm_bytes + hbm_shape_bytes(
            ins.shape.split("}, ", 1)[0] + "}")
    if ins.op == "slice-start":       # ((source), destination, context): one slice of the
        piece = ins.shape.split("), ", 1)[1].split("}, ", 1)[0] + "}"   # source moves
        source_in_hbm = hbm_shape_bytes(ins.shape.split("), ", 1)[0]) > 0
        return source_in_hbm * shape_bytes(piece) + hbm_shape_bytes(piece)
    aliased = ins.aliased_operands | _updated_in_place(ins, module)
    total = 0 if aliased else ins.hbm_bytes
    for index, name in enumerate(ins.operands):
        operand = module.by_name.get(name)
        if operand is None or index in aliased:
            continue
        if ins.op == "fusion" and ins.called in module.computations:
            total += _read_bytes(module, ins.called, index, operand)
        elif ins.op in _SLICING and index == 0:
            total += ins.bytes
        else:
            total += operand.hbm_bytes
    if aliased:       # an in-place update writes what it reads of its other operands, at most
        total *= 2
    return total

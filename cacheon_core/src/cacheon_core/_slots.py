"""The slot ABI: typed contracts for kernel operations, variants and call descriptors.

Everything here is frozen attrs data. Nothing in this module imports torch: descriptors are built
from any object with ``shape``, ``stride()``, ``dtype`` and ``device`` (a torch tensor in practice).
"""

from __future__ import annotations

import inspect
import keyword
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs

from ._errors import ContractError, DescriptorError

Layout = Literal["contiguous", "rows", "any"]
ScalarKind = Literal["float", "int", "bool"]
Scalar = float | int | bool

_SLOT_ID = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")
# Contract names become keyword parameters of generated code: lowercase, no leading underscore.
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_RESERVED = frozenset({"self"}) | frozenset(keyword.kwlist)
_VARIANT_NAME = re.compile(r"^[a-z][a-z0-9_.-]{0,63}$")

# Canonical dtype names and the spellings accepted for them.
_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "f32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float64": "float64",
    "fp64": "float64",
    "double": "float64",
    "float8_e4m3fn": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "fp8_e5m2": "float8_e5m2",
    "int8": "int8",
    "uint8": "uint8",
    "int16": "int16",
    "int32": "int32",
    "int": "int32",
    "int64": "int64",
    "long": "int64",
    "bool": "bool",
}
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2"})


def canonical_dtype(dtype: object) -> str:
    """Return the canonical name of a dtype given as a torch dtype or a string alias."""
    text = str(dtype)
    if text.startswith("torch."):
        text = text[len("torch.") :]
    name = _DTYPE_ALIASES.get(text.lower())
    if name is None:
        raise DescriptorError(f"unknown dtype {dtype!r}: expected one of {sorted(set(_DTYPE_ALIASES.values()))}")
    return name


def canonical_device(device: object) -> str:
    """``cuda`` -> ``cuda:0``; ``cpu:0`` -> ``cpu``; anything else must be ``type[:index]``."""
    text = str(device)
    kind, _, index = text.partition(":")
    if not kind.isalpha() or (index and not index.isdigit()):
        raise DescriptorError(f"unknown device {device!r}: expected 'type' or 'type:index'")
    if kind == "cpu":
        return "cpu"
    return f"{kind}:{int(index) if index else 0}"


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def canonical_strides(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """Strides with every layout-irrelevant entry replaced by its contiguous value.

    The stride of a dimension of size 1 never addresses memory, and nothing addresses memory in a
    tensor with no elements; two tensors that differ only there have the same layout.
    """
    if len(shape) != len(strides):
        raise DescriptorError(f"shape {tuple(shape)} and strides {tuple(strides)} differ in rank")
    dense = contiguous_strides(shape)
    if any(int(size) == 0 for size in shape):
        return dense
    return tuple(d if int(size) == 1 else int(s) for size, s, d in zip(shape, strides, dense, strict=True))


@attrs.frozen
class Tolerance:
    """Allowed difference to the reference: ``|out - ref| <= atol + rtol * |ref|``."""

    atol: float
    rtol: float


@attrs.frozen
class TensorSpec:
    """One tensor of a slot contract.

    ``shape`` entries are symbol names (bound consistently across the call) or fixed sizes.
    ``layout``: ``contiguous`` (dense row-major), ``rows`` (last dimension dense, any outer
    strides), ``any``. ``dynamic`` marks a graph-dynamic input refreshed in place between CUDA
    graph replays. ``written`` marks an input the operation updates in place. An output takes
    ``same_dtype_as`` another tensor's dtype or the only dtype in ``dtypes``; outputs are always
    allocated contiguous by the dispatcher. ``value_range`` bounds integer samples for verify.
    """

    name: str
    shape: tuple[str | int, ...]
    dtypes: tuple[str, ...] = ()
    layout: Layout = "contiguous"
    dynamic: bool = False
    written: bool = False
    same_dtype_as: str | None = None
    value_range: tuple[int, int] | None = None

    def __attrs_post_init__(self) -> None:
        if not _NAME.fullmatch(self.name) or self.name in _RESERVED:
            raise ContractError(f"tensor name {self.name!r} is not a lowercase identifier (nor a keyword)")
        for dim in self.shape:
            if isinstance(dim, int) and dim < 0:
                raise ContractError(f"tensor {self.name!r}: fixed size {dim} is negative")
            if isinstance(dim, str) and not _NAME.fullmatch(dim.lower()):
                raise ContractError(f"tensor {self.name!r}: symbol {dim!r} is not an identifier")
        if self.layout not in ("contiguous", "rows", "any"):
            raise ContractError(f"tensor {self.name!r}: layout {self.layout!r} is not contiguous|rows|any")
        for dtype in self.dtypes:
            if canonical_dtype(dtype) != dtype:
                raise ContractError(f"tensor {self.name!r}: dtype {dtype!r} is not canonical")


@attrs.frozen
class ScalarSpec:
    """A scalar parameter passed by keyword (``eps``, ``scale``).

    ``default`` fills a call that omits it; ``example`` is what ``cacheon verify`` passes when
    there is no default.
    """

    name: str
    kind: ScalarKind
    default: Scalar | None = None
    example: Scalar | None = None

    def __attrs_post_init__(self) -> None:
        if not _NAME.fullmatch(self.name) or self.name in _RESERVED:
            raise ContractError(f"scalar name {self.name!r} is not a lowercase identifier (nor a keyword)")
        if self.kind not in ("float", "int", "bool"):
            raise ContractError(f"scalar {self.name!r}: kind {self.kind!r} is not float|int|bool")


def _tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value)


def _frozen_bindings(value: Any) -> tuple[Any, ...]:
    """A variant's verify_dims as its own tuple of copied maps (anything else is kept for the check
    in Variant to name)."""
    if value is None:
        return ()
    try:
        items = tuple(value)
    except TypeError:
        return (value,)
    return tuple(dict(item) if isinstance(item, Mapping) else item for item in items)


def _frozen_mapping(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return dict(sorted(value.items()))


@attrs.frozen
class SlotSpec:
    """A semantic operation with its typed tensor contract.

    Calling convention (fixed ABI): an implementation is called with every input, scalar and
    output by keyword, using the names below; it writes its outputs (and ``written`` inputs) in
    place and returns None. ``reference`` follows the same convention and is the trusted answer.
    ``verify_dims`` are the symbol bindings ``cacheon verify`` samples; ``sampler`` (optional)
    builds valid inputs for slots whose inputs are not free random data (block tables);
    ``dims_rule`` (optional) says why a binding of symbols is illegal, or returns None.

    A ``collective`` slot's operation spans the ranks of a process group: its implementation and
    reference also receive ``group`` (a ``torch.distributed`` process group) by keyword, the ranks
    agree on the route before a candidate serves it, and ``cacheon verify`` runs it on a group of
    its own ranks.
    """

    id: str
    version: int
    summary: str
    inputs: tuple[TensorSpec, ...] = attrs.field(converter=_tuple)
    outputs: tuple[TensorSpec, ...] = attrs.field(converter=_tuple)
    scalars: tuple[ScalarSpec, ...] = attrs.field(converter=_tuple, default=())
    reference: Callable[..., None] | None = attrs.field(default=None, eq=False)
    tolerances: Mapping[str, Tolerance] = attrs.field(factory=dict, converter=_frozen_mapping, hash=False)
    verify_dims: tuple[Mapping[str, int], ...] = attrs.field(default=(), converter=_tuple, hash=False)
    sampler: Callable[..., dict[str, Any]] | None = attrs.field(default=None, eq=False)
    dims_rule: Callable[[Mapping[str, int]], str | None] | None = attrs.field(default=None, eq=False)
    collective: bool = False

    def __attrs_post_init__(self) -> None:
        if not _SLOT_ID.fullmatch(self.id):
            raise ContractError(f"slot id {self.id!r} is not of the form family.operation in lowercase")
        if self.version < 1:
            raise ContractError(f"slot {self.id!r}: version {self.version} must be >= 1")
        if not self.outputs:
            raise ContractError(f"slot {self.id!r}: a contract needs at least one output")
        names = [t.name for t in (*self.inputs, *self.outputs)] + [s.name for s in self.scalars]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ContractError(f"slot {self.id!r}: names {duplicated} are used more than once")
        if self.collective and "group" in names:
            raise ContractError(
                f"slot {self.id!r}: a collective slot passes 'group' itself; no tensor may take the name"
            )
        bound = {d for t in self.inputs for d in t.shape if isinstance(d, str)}
        input_names = {t.name for t in self.inputs}
        for out in self.outputs:
            if out.written:
                raise ContractError(f"slot {self.id!r}: output {out.name!r} cannot be marked written")
            free = sorted(d for d in out.shape if isinstance(d, str) and d not in bound)
            if free:
                raise ContractError(f"slot {self.id!r}: output {out.name!r} uses symbols {free} no input binds")
            if out.same_dtype_as is not None:
                if out.same_dtype_as not in input_names:
                    raise ContractError(
                        f"slot {self.id!r}: output {out.name!r} takes the dtype of unknown input {out.same_dtype_as!r}"
                    )
            elif len(out.dtypes) != 1:
                raise ContractError(f"slot {self.id!r}: output {out.name!r} needs exactly one dtype or same_dtype_as")
        float_dtypes = {d for t in self.inputs for d in t.dtypes if d in FLOAT_DTYPES}
        missing = sorted(float_dtypes - set(self.tolerances))
        if self.reference is not None and missing:
            raise ContractError(f"slot {self.id!r}: no tolerance for dtypes {missing}")

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @property
    def argument_names(self) -> tuple[str, ...]:
        """Every keyword an implementation receives, in contract order (``group`` last, for a collective)."""
        names = (*(t.name for t in self.inputs), *(s.name for s in self.scalars), *(t.name for t in self.outputs))
        return (*names, "group") if self.collective else names

    def tensor(self, name: str) -> TensorSpec:
        for spec in (*self.inputs, *self.outputs):
            if spec.name == name:
                return spec
        raise ContractError(f"slot {self.id!r} has no tensor {name!r}")


@attrs.frozen
class TensorMeta:
    """Concrete facts about one live tensor, normalized."""

    name: str
    shape: tuple[int, ...] = attrs.field(converter=_tuple)
    dtype: str
    stride: tuple[int, ...] = attrs.field(converter=_tuple)


@attrs.frozen
class Topology:
    """Where the call runs: tensor-parallel rank and size, data-parallel rank."""

    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0


@attrs.frozen
class CallDescriptor:
    """Slot id plus the concrete shapes, dtypes, strides, device, scalars and topology of a call."""

    slot: str
    version: int
    tensors: tuple[TensorMeta, ...] = attrs.field(converter=_tuple)
    scalars: tuple[tuple[str, Scalar], ...] = attrs.field(converter=_tuple, default=())
    device: str = "cpu"
    topology: Topology = Topology()
    dims: Mapping[str, int] = attrs.field(factory=dict, converter=_frozen_mapping, hash=False, eq=False)

    def tensor(self, name: str) -> TensorMeta:
        for meta in self.tensors:
            if meta.name == name:
                return meta
        raise DescriptorError(f"descriptor of {self.slot!r} has no tensor {name!r}")

    def scalar(self, name: str) -> Scalar:
        for key, value in self.scalars:
            if key == name:
                return value
        raise DescriptorError(f"descriptor of {self.slot!r} has no scalar {name!r}")


def _layout_ok(layout: Layout, shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    if layout == "any":
        return True
    if layout == "contiguous":
        return stride == contiguous_strides(shape)
    # rows: the last dimension is dense; outer dimensions may be padded (a row stride >= row size).
    return not shape or stride[-1] == 1


def bind_symbols(spec: SlotSpec, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
    """Bind every shape symbol of ``spec`` from concrete input shapes, or raise DescriptorError."""
    dims: dict[str, int] = {}
    for tspec in spec.inputs:
        shape = shapes[tspec.name]
        if len(shape) != len(tspec.shape):
            raise DescriptorError(
                f"slot {spec.id!r}: {tspec.name!r} has rank {len(shape)}, "
                f"contract says {len(tspec.shape)} {tspec.shape}"
            )
        for axis, (want, got) in enumerate(zip(tspec.shape, shape, strict=True)):
            if isinstance(want, int):
                if got != want:
                    raise DescriptorError(
                        f"slot {spec.id!r}: {tspec.name!r} dim {axis} is {got}, contract fixes {want}"
                    )
            elif dims.setdefault(want, got) != got:
                raise DescriptorError(
                    f"slot {spec.id!r}: symbol {want!r} is {dims[want]} elsewhere "
                    f"but {got} in {tspec.name!r} dim {axis}"
                )
    return dims


def output_shape(tspec: TensorSpec, dims: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) else dims[d] for d in tspec.shape)


def output_dtype(tspec: TensorSpec, dtypes: Mapping[str, str]) -> str:
    return dtypes[tspec.same_dtype_as] if tspec.same_dtype_as is not None else tspec.dtypes[0]


def describe(
    spec: SlotSpec,
    tensors: Mapping[str, Any],
    scalars: Mapping[str, Scalar] | None = None,
    topology: Topology = Topology(),
) -> CallDescriptor:
    """Step 1 of dispatch: the canonical, checked descriptor of a live call.

    Raises DescriptorError when a tensor is missing, has the wrong rank, breaks a symbol binding,
    has a dtype the contract does not allow, breaks its layout rule, or sits on another device.
    """
    scalars = dict(scalars or {})
    metas: list[TensorMeta] = []
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    device: str | None = None
    for tspec in spec.inputs:
        if tspec.name not in tensors:
            raise DescriptorError(f"slot {spec.id!r}: input {tspec.name!r} is missing")
        live = tensors[tspec.name]
        shape = tuple(int(s) for s in live.shape)
        dtype = canonical_dtype(live.dtype)
        if tspec.dtypes and dtype not in tspec.dtypes:
            raise DescriptorError(
                f"slot {spec.id!r}: {tspec.name!r} has dtype {dtype}, contract allows {list(tspec.dtypes)}"
            )
        stride = canonical_strides(shape, tuple(int(s) for s in live.stride()))
        if not _layout_ok(tspec.layout, shape, stride):
            raise DescriptorError(
                f"slot {spec.id!r}: {tspec.name!r} with shape {shape} and strides {stride} "
                f"breaks layout {tspec.layout!r}"
            )
        here = canonical_device(live.device)
        if device is None:
            device = here
        elif here != device:
            raise DescriptorError(f"slot {spec.id!r}: {tspec.name!r} is on {here}, other inputs on {device}")
        shapes[tspec.name] = shape
        dtypes[tspec.name] = dtype
        metas.append(TensorMeta(tspec.name, shape, dtype, stride))
    dims = bind_symbols(spec, shapes)
    if spec.dims_rule is not None:
        why = spec.dims_rule(dims)
        if why:
            raise DescriptorError(f"slot {spec.id!r}: {why}")
    values: list[tuple[str, Scalar]] = []
    for sspec in spec.scalars:
        value = scalars.get(sspec.name, sspec.default)
        if value is None:
            raise DescriptorError(f"slot {spec.id!r}: scalar {sspec.name!r} is missing and has no default")
        values.append((sspec.name, _check_scalar(spec.id, sspec, value)))
    extra = sorted(set(scalars) - {s.name for s in spec.scalars})
    if extra:
        raise DescriptorError(f"slot {spec.id!r}: unknown scalars {extra}")
    return CallDescriptor(spec.id, spec.version, metas, values, device or "cpu", topology, dims)


def _check_scalar(slot: str, sspec: ScalarSpec, value: object) -> Scalar:
    if sspec.kind == "bool":
        if not isinstance(value, bool):
            raise DescriptorError(f"slot {slot!r}: scalar {sspec.name!r}={value!r} is not a bool")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DescriptorError(f"slot {slot!r}: scalar {sspec.name!r}={value!r} is not a {sspec.kind}")
    if sspec.kind == "int":
        if isinstance(value, float) and not value.is_integer():
            raise DescriptorError(f"slot {slot!r}: scalar {sspec.name!r}={value!r} is not an int")
        return int(value)
    return float(value)


@attrs.frozen
class Variant:
    """One implementation of a slot, contributed by a plugin.

    ``impl`` follows the slot's calling convention. ``supports(descriptor) -> bool`` narrows
    eligibility (device, dtype, sizes); ``prepare(descriptor)`` runs once per resolved descriptor
    before the first call (compile, pick a config). Higher ``priority`` wins among eligible
    variants. ``graph_safe`` claims the variant may be captured in a CUDA graph. ``verify_dims`` are
    symbol bindings ``cacheon verify`` runs after the slot's own: a variant that picks its code by
    size (another kernel from 1024 rows, say) names a binding that reaches each path, so that every
    path is checked against the reference.
    """

    slot: str
    name: str
    impl: Callable[..., object] = attrs.field(eq=False)
    supports: Callable[[CallDescriptor], object] | None = attrs.field(default=None, eq=False)
    priority: int = 0
    graph_safe: bool = False
    slot_version: int = 1
    prepare: Callable[[CallDescriptor], None] | None = attrs.field(default=None, eq=False)
    verify_dims: tuple[Mapping[str, int], ...] = attrs.field(default=(), converter=_frozen_bindings, eq=False)

    def __attrs_post_init__(self) -> None:
        if not _VARIANT_NAME.fullmatch(self.name):
            raise ContractError(f"variant name {self.name!r} is not lowercase [a-z0-9_.-], 64 characters at most")
        if not callable(self.impl):
            raise ContractError(f"variant {self.name!r}: impl {self.impl!r} is not callable")
        for dims in self.verify_dims:
            if not isinstance(dims, Mapping) or not all(
                isinstance(k, str) and type(v) is int and v >= 0 for k, v in dims.items()
            ):
                raise ContractError(
                    f"variant {self.name!r}: verify_dims entries map symbol names to integers >= 0, got {dims!r:.80}"
                )


def check_signature(spec: SlotSpec, impl: Callable[..., Any]) -> str | None:
    """Why ``impl`` cannot be called with the contract's keywords, or None when it can."""
    try:
        sig = inspect.signature(impl)
    except (TypeError, ValueError) as exc:
        return f"signature cannot be read: {exc}"
    names = set(spec.argument_names)
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    accepted = set()
    for param in sig.parameters.values():
        if param.kind is inspect.Parameter.POSITIONAL_ONLY and param.default is inspect.Parameter.empty:
            return f"parameter {param.name!r} is positional-only; the ABI passes every argument by keyword"
        if param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            accepted.add(param.name)
            if param.name not in names and param.default is inspect.Parameter.empty:
                return f"parameter {param.name!r} is required but the contract of {spec.id!r} has no such argument"
    missing = sorted(names - accepted)
    if missing and not accepts_any:
        return f"does not accept contract arguments {missing} of {spec.id!r}"
    return None

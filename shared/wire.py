"""The versioned wire format: typed dataclass messages in msgpack envelopes, tensors as raw extra frames.

Frame 0 is msgpack {"v": SCHEMA_VERSION, "type": name, "body": {field: value}, "tensors": [descriptors]};
frames 1..k hold raw tensor bytes (dtype and shape in the descriptors), never pickled. This module does not
import torch (the gateway uses it too); shared/tensor_frames.py turns RawTensor into torch tensors and back.

decode() checks the version, the type (against the channel's registry), the field names and their types,
and the message's own validate(); anything wrong raises WireError, which receivers log and skip. A field may be
a plain dataclass of such fields (a request's sampling parameters): it travels as a map of its fields, checked
the same way, and is rebuilt (its own __post_init__ checks run; what they raise is a WireError too).
"""

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass

import msgpack

SCHEMA_VERSION = 6  # 2: log-probabilities in submit and tokens; 3: token_batch; 4: sampling nested in submit;
# 5: grammars in draft calls; 6: submit is the engine's GenerationRequest (positional fields, thinking_end)
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1}


class WireError(ValueError):
    """A message that cannot be accepted: wrong version, type, fields or shapes."""


@dataclass(frozen=True)
class RawTensor:
    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview

    def __post_init__(self):
        if self.dtype not in DTYPE_SIZES:
            raise WireError(f"unsupported tensor dtype {self.dtype!r}")
        count = 1
        for dim in self.shape:
            if not isinstance(dim, int) or dim < 0:
                raise WireError(f"bad tensor shape {self.shape!r}")
            count *= dim
        if count * DTYPE_SIZES[self.dtype] != len(memoryview(self.data).cast("B")):
            raise WireError(f"tensor of shape {list(self.shape)} and dtype {self.dtype} does not match its "
                            f"{len(memoryview(self.data).cast('B'))} bytes")


class Message:
    """Base of wire messages: subclasses are dataclasses with a class-level TYPE name."""

    TYPE: typing.ClassVar[str] = ""

    def validate(self) -> None:
        """Cross-field checks (lengths, shapes); raise WireError."""


def channel(*classes: type) -> dict[str, type]:
    return {cls.TYPE: cls for cls in classes}


def encode(message: Message) -> list[bytes | memoryview]:
    body, descriptors, frames = {}, [], []
    records = _schema(type(message))[3]
    for field in dataclasses.fields(message):
        value = getattr(message, field.name)
        if isinstance(value, RawTensor):
            descriptors.append({"field": field.name, "dtype": value.dtype, "shape": list(value.shape)})
            frames.append(value.data)
        elif field.name in records:
            body[field.name] = dataclasses.asdict(value)
        else:
            body[field.name] = value
    header = msgpack.packb({"v": SCHEMA_VERSION, "type": message.TYPE, "body": body, "tensors": descriptors})
    return [header, *frames]


def decode(frames: list, registry: dict[str, type]) -> Message:
    try:
        header = msgpack.unpackb(bytes(frames[0]), raw=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError(f"undecodable envelope: {exc}") from None
    if not isinstance(header, dict) or header.get("v") != SCHEMA_VERSION:
        raise WireError(f"schema version {header.get('v') if isinstance(header, dict) else None!r} "
                        f"!= {SCHEMA_VERSION}")
    cls = registry.get(header.get("type"))
    if cls is None:
        raise WireError(f"unknown message type {header.get('type')!r} on this channel")
    body, descriptors = header.get("body"), header.get("tensors") or []
    if not isinstance(body, dict) or not isinstance(descriptors, list) or len(descriptors) != len(frames) - 1:
        raise WireError(f"{cls.TYPE}: malformed body or tensor frames")
    values = dict(body)
    for descriptor, frame in zip(descriptors, frames[1:]):
        try:
            values[descriptor["field"]] = RawTensor(descriptor["dtype"], tuple(descriptor["shape"]), frame)
        except (KeyError, TypeError) as exc:
            raise WireError(f"{cls.TYPE}: bad tensor descriptor {descriptor!r}: {exc}") from None
    return _build(cls, values, cls.TYPE)


def _build(cls: type, values: dict, where: str):
    """cls(**values) once every field is present and of its declared type (nested dataclasses built first);
    a Message's validate() runs on it."""
    hints, names, checks, records = _schema(cls)
    if values.keys() != names:
        missing, extra = sorted(names - set(values)), sorted(set(values) - names)
        raise WireError(f"{where}: missing fields {missing}, unexpected fields {extra}")
    for name, value in values.items():
        if name in records:
            if not isinstance(value, dict):
                raise WireError(f"{where}.{name}: {value!r:.80} is not a map of {records[name].__name__}'s fields")
            values[name] = _build(records[name], dict(value), f"{where}.{name}")
        elif not checks[name](value):
            raise WireError(f"{where}.{name}: {value!r:.80} is not a {hints[name]}")
    try:
        built = cls(**values)
    except ValueError as exc:  # a nested record's own checks (RequestError is a ValueError)
        raise WireError(f"{where}: {exc}") from None
    if isinstance(built, Message):
        built.validate()
    return built


def _is_record(hint) -> bool:
    """A field type that travels as a map of its own fields: a dataclass that is not a message or a tensor."""
    return isinstance(hint, type) and dataclasses.is_dataclass(hint) and not issubclass(hint, (Message, RawTensor))


@functools.cache
def _schema(cls: type) -> tuple[dict, frozenset, dict, dict]:
    """A message class's field types, names, a check per field and its record fields (name -> dataclass), once
    per class (resolving the annotations, and reading them for every value, cost more than the rest of decode)."""
    hints = typing.get_type_hints(cls)
    names = frozenset(f.name for f in dataclasses.fields(cls))
    records = {name: hints[name] for name in names if _is_record(hints[name])}
    return hints, names, {name: _check(hints[name]) for name in names if name not in records}, records


@functools.cache
def _check(hint) -> typing.Callable[[object], bool]:
    """Whether a decoded value is of this declared type (bool is not an int, an int is a float): the test,
    built once per hint."""
    origin = typing.get_origin(hint)
    if hint is typing.Any:
        return lambda value: True
    if origin in (typing.Union, types.UnionType):
        options = tuple(_check(arg) for arg in typing.get_args(hint))
        return lambda value: any(option(value) for option in options)
    if hint is type(None):
        return lambda value: value is None
    if origin is list:
        item_check = _check(*typing.get_args(hint))
        return lambda value: isinstance(value, list) and all(item_check(v) for v in value)
    if origin is tuple:  # msgpack sends a tuple as a list: either is taken (the record keeps tuples)
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            item_check = _check(args[0])
            return lambda value: isinstance(value, (list, tuple)) and all(item_check(v) for v in value)
        checks = tuple(_check(arg) for arg in args)
        return lambda value: (isinstance(value, (list, tuple)) and len(value) == len(checks)
                              and all(check(v) for check, v in zip(checks, value)))
    if origin is dict:
        key, item = (_check(arg) for arg in typing.get_args(hint))
        return lambda value: isinstance(value, dict) and all(key(k) and item(v) for k, v in value.items())
    if hint is float:
        return lambda value: isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return lambda value: isinstance(value, int) and not isinstance(value, bool)
    return lambda value: isinstance(value, hint)

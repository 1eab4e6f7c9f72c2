"""The versioned wire format: typed dataclass messages in msgpack envelopes, tensors as raw extra frames.

Frame 0 is msgpack {"v": SCHEMA_VERSION, "type": name, "body": {field: value}, "tensors": [descriptors]};
frames 1..k hold raw tensor bytes (dtype and shape in the descriptors), never pickled. This module does not
import torch (the gateway uses it too); shared/tensor_frames.py turns RawTensor into torch tensors and back.

decode() checks the version, the type (against the channel's registry), the field names and their types,
and the message's own validate(); anything wrong raises WireError, which receivers log and skip.
"""

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass

import msgpack

SCHEMA_VERSION = 2  # 2: log-probabilities in submit and tokens
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
    for field in dataclasses.fields(message):
        value = getattr(message, field.name)
        if isinstance(value, RawTensor):
            descriptors.append({"field": field.name, "dtype": value.dtype, "shape": list(value.shape)})
            frames.append(value.data)
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
    hints, names = _schema(cls)
    if set(values) != names:
        missing, extra = sorted(names - set(values)), sorted(set(values) - names)
        raise WireError(f"{cls.TYPE}: missing fields {missing}, unexpected fields {extra}")
    for name, value in values.items():
        if not _matches(value, hints[name]):
            raise WireError(f"{cls.TYPE}.{name}: {value!r:.80} is not a {hints[name]}")
    message = cls(**values)
    message.validate()
    return message


@functools.cache
def _schema(cls: type) -> tuple[dict, frozenset]:
    """A message class's field types and names (resolving the annotations costs more than the rest of decode)."""
    return typing.get_type_hints(cls), frozenset(f.name for f in dataclasses.fields(cls))


def _matches(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if hint is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if origin is dict:
        key, item = typing.get_args(hint)
        return isinstance(value, dict) and all(_matches(k, key) and _matches(v, item) for k, v in value.items())
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)

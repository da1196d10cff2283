"""hypothesis strategies for any protobuf message, built from its descriptor.

Each field draws from its wire type's whole range with a bias towards the
values the services treat specially: zero, small and negative numbers, enum
values just past the defined ones, names from `names`. Fuzz tests send these
as messages, and as bytes (serialized, truncated, padded, random).
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    small = st.integers(max(low, -3), min(high, 16))
    edges = st.sampled_from(sorted({low, high, max(low, min(high, 2**32)), 0}))
    return st.one_of(small, edges, st.integers(low, high))


def _scalar(field: FieldDescriptor, names: tuple[str, ...]) -> st.SearchStrategy:
    t = field.type
    if t in _INT_RANGES:
        return _integers(*_INT_RANGES[t])
    if t == FieldDescriptor.TYPE_ENUM:
        defined = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(defined), st.integers(-2, max(defined) + 3))
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        width = 32 if t == FieldDescriptor.TYPE_FLOAT else 64
        return st.one_of(st.sampled_from([0.0, 0.5, 1.0, -1.0]), st.floats(width=width))
    if t == FieldDescriptor.TYPE_STRING:
        named = [st.sampled_from(names)] if names else []
        return st.one_of(*named, st.text(max_size=12), st.sampled_from(["", "float32", "bfloat16", "p"]))
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    raise TypeError(f"no strategy for field type {t} of {field.full_name}")


def _message(descriptor: Descriptor, depth: int, names: tuple[str, ...],
             overrides: dict[str, st.SearchStrategy]) -> st.SearchStrategy[Message]:
    message_class = GetMessageClass(descriptor)
    fields = []  # (field, strategy of its value or list of values), built once
    for field in descriptor.fields:
        if field.full_name in overrides:
            values = overrides[field.full_name]
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth <= 0:
                continue
            values = _message(field.message_type, depth - 1, names, overrides)
        else:
            values = _scalar(field, names)
        if field.is_repeated:
            values = st.lists(values, max_size=2 if field.type == FieldDescriptor.TYPE_MESSAGE else 4)
        fields.append((field, values))
    oneofs = {o.name: list(o.fields) for o in descriptor.oneofs if not o.name.startswith("_")}

    @st.composite
    def build(draw) -> Message:
        message = message_class()
        chosen = {name: draw(st.sampled_from([None, *members])) for name, members in oneofs.items()}
        for field, values in fields:
            oneof = field.containing_oneof
            if oneof is not None and oneof.name in chosen:
                if chosen[oneof.name] is not field:
                    continue
            elif not field.is_repeated and not draw(st.booleans()):  # about half the fields unset
                continue
            value = draw(values)
            if field.is_repeated and field.type == FieldDescriptor.TYPE_MESSAGE:
                for item in value:
                    getattr(message, field.name).add().CopyFrom(item)
            elif field.is_repeated:
                getattr(message, field.name).extend(value)
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                getattr(message, field.name).CopyFrom(value)
            else:
                setattr(message, field.name, value)
        return message

    return build()


def messages(message_class, depth: int = 3, names: tuple[str, ...] = (),
             overrides: dict[str, st.SearchStrategy] | None = None) -> st.SearchStrategy[Message]:
    """Messages of message_class; `overrides` maps a field's full name
    ("undercurrent.v1.SamplingParams.max_tokens") to its own strategy."""
    return _message(message_class.DESCRIPTOR, depth, names, overrides or {})


def wire_bytes(message_class, **kwargs) -> st.SearchStrategy[bytes]:
    """Bytes for a call of message_class: serialized, truncated, with a stray
    field appended, or random."""
    serialized = messages(message_class, **kwargs).map(lambda m: m.SerializeToString())

    @st.composite
    def truncated(draw):
        data = draw(serialized)
        return data[: draw(st.integers(0, max(0, len(data) - 1)))]

    return st.one_of(
        serialized,
        truncated(),
        st.binary(min_size=1, max_size=64),
        st.tuples(serialized, st.binary(min_size=1, max_size=16)).map(lambda pair: pair[0] + pair[1]),
    )

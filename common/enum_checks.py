"""Unknown enum values in a message, found by walking its descriptor.

proto3 enums are open: a peer may send any integer, and the parser keeps it.
Both services refuse such a value with INVALID_ARGUMENT naming the field
(`probes[0].failure_policy: 9 is not a FailurePolicy`) before anything reads it.
"""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from common.errors import InvalidArgument


def unknown_enum(message: Message, where: str = "") -> str | None:
    """The first enum field (depth first, in field order) holding a value its enum
    does not define, as "path: value is not a EnumName"; None when all are known."""
    for field in _enum_paths(message.DESCRIPTOR):
        repeated = field.is_repeated
        if field.type == FieldDescriptor.TYPE_ENUM:
            value = getattr(message, field.name)
            known = field.enum_type.values_by_number
            if repeated:
                for i, item in enumerate(value):
                    if item not in known:
                        return f"{_path(where, field)}[{i}]: {item} is not a {_enum_name(field)}"
            elif value not in known:  # the usual case costs one lookup: a request_start checks each binding
                return f"{_path(where, field)}: {value} is not a {_enum_name(field)}"
        elif repeated or message.HasField(field.name):
            value = getattr(message, field.name)
            path = _path(where, field)
            for i, item in enumerate(value if repeated else [value]):
                found = unknown_enum(item, f"{path}[{i}]" if repeated else path)
                if found:
                    return found
    return None


def _path(where: str, field: FieldDescriptor) -> str:
    return f"{where}.{field.name}" if where else field.name


# Message type -> its fields, in field order, that are enums or messages holding
# enums somewhere below. Only those are read: reading every field would copy
# each bytes field (an activation block's rows) just to skip it.
_ENUM_PATHS: dict[str, list[FieldDescriptor]] = {}


def _enum_paths(descriptor, visiting: frozenset[str] = frozenset()) -> list[FieldDescriptor]:
    found = _ENUM_PATHS.get(descriptor.full_name)
    if found is not None:
        return found
    if descriptor.full_name in visiting:
        return [descriptor]  # a recursive type: assume it may hold enums (read it)
    visiting = visiting | {descriptor.full_name}
    found = []
    for field in sorted(descriptor.fields, key=lambda f: f.number):
        if field.type == FieldDescriptor.TYPE_ENUM:
            found.append(field)
        elif (field.type == FieldDescriptor.TYPE_MESSAGE and not field.message_type.GetOptions().map_entry
              and _enum_paths(field.message_type, visiting)):
            found.append(field)
    _ENUM_PATHS[descriptor.full_name] = found
    return found


def check_enums(message: Message, where: str = "") -> None:
    """Raises InvalidArgument naming the first unknown enum value in message."""
    found = unknown_enum(message, where)
    if found:
        raise InvalidArgument(found)


def _enum_name(field: FieldDescriptor) -> str:
    """Nested enums keep their container's name: "TokenSelector.Scope"."""
    enum = field.enum_type
    return enum.full_name.removeprefix(enum.file.package + ".")

"""Short names of the contract's enum values, for logs, metrics and messages.

The proto prefixes every enum value with its enum's name (buf STANDARD:
`FINISH_REASON_LENGTH`); people and metric labels read the short form
(`LENGTH`). This is the one place that strips and restores the prefix.
"""

from __future__ import annotations

from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper


def _prefix(enum: EnumTypeWrapper) -> str:
    return enum.DESCRIPTOR.values[0].name.removesuffix("UNSPECIFIED")


def short_name(enum: EnumTypeWrapper, value: int) -> str:
    """FinishReason 2 -> "LENGTH"; an unknown value -> its number as text."""
    if value not in enum.values():
        return str(value)
    return enum.Name(value).removeprefix(_prefix(enum))


def from_short_name(enum: EnumTypeWrapper, name: str) -> int:
    """("LENGTH" or "length") -> FinishReason 2; raises ValueError for an unknown name."""
    return enum.Value(_prefix(enum) + name.upper())

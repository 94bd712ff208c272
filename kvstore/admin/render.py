"""How `kvstore admin` shows answers: JSON whose numbers are numbers, and tables that fit an
80-column terminal (or a pipe, which rich gives 80 columns).

protobuf's JSON mapping writes 64-bit integers as strings (JavaScript loses precision above 2^53);
a shell pipeline (`jq '.nodes[].tiers[].used_bytes > 1e9'`) wants numbers, and Python reads them
exactly, so `message_dict` turns them back into integers by the message's own field types.
"""
from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from rich.table import Table
from rich.text import Text

_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}
WIDTH = 80


def message_dict(message: Message, *, defaults: bool = True) -> dict[str, Any]:
    """`MessageToDict` (field names as in the .proto), with 64-bit integers as JSON numbers."""
    data = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=defaults)
    return _numbers(message.DESCRIPTOR, data)


def _repeated(field: FieldDescriptor) -> bool:
    flag = getattr(field, "is_repeated", None)
    return bool(flag) if flag is not None else field.label == FieldDescriptor.LABEL_REPEATED


def _value(field: FieldDescriptor, value: Any) -> Any:
    if field.message_type is not None:
        return _numbers(field.message_type, value) if isinstance(value, dict) else value
    if field.type in _INT64 and isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return value
    return value


def _numbers(descriptor: Descriptor, data: dict[str, Any]) -> dict[str, Any]:
    for field in descriptor.fields:
        if field.name not in data:
            continue
        value = data[field.name]
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            inner = entry.fields_by_name["value"]
            data[field.name] = {k: _value(inner, v) for k, v in value.items()}
        elif _repeated(field):
            data[field.name] = [_value(field, v) for v in value]
        else:
            data[field.name] = _value(field, value)
    return data


class FitTable(Table):
    """A table that fits the console's width: number columns keep their figures whole; when the
    width is short the widest text column gives way first (cut with an ellipsis), none below its
    header's width, and no row wraps onto a second line."""

    def __rich_console__(self, console, options):
        widths = []
        for column in self.columns:
            cells = [(Text.from_markup(c) if isinstance(c, str) else c).cell_len for c in column.cells]
            widths.append(max(cells + [Text(str(column.header)).cell_len]))
        floors = [w if c.justify == "right" else min(w, max(Text(str(c.header)).cell_len, 6))
                  for c, w in zip(self.columns, widths)]
        budget = options.max_width - 2 * (len(widths) - 1)  # one space each side of every inner edge
        while sum(widths) > budget:
            shrinkable = [i for i, w in enumerate(widths) if w > floors[i]]
            if not shrinkable:
                break
            widest = max(shrinkable, key=lambda i: widths[i])
            widths[widest] -= 1
        for column, width in zip(self.columns, widths):
            column.width = width
        yield from super().__rich_console__(console, options)


def table(title: str, columns: list[str], right: tuple[str, ...] = ()) -> Table:
    """A table drawn to fit WIDTH columns: light borders, numbers right-aligned and whole, long
    text cut with an ellipsis rather than wrapped onto a second line."""
    t = FitTable(title=title, box=None, pad_edge=False, show_edge=False, padding=(0, 1), title_justify="left",
                 header_style="bold underline")
    for name in columns:
        t.add_column(name, justify="right" if name in right else "left", overflow="ellipsis", no_wrap=True)
    return t


def size(n: float) -> str:
    """Bytes, short: `1.5G`, `512M`, `0`."""
    for unit in ("", "K", "M", "G", "T"):
        if n < 1024:
            return f"{n:.0f}{unit}" if unit == "" or n >= 100 or n == int(n) else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}P"

"""Parsing and encoding of the values users pass to queries: block hashes and pagination cursors.

Both are parsed here, once, so REST and CLI refuse the same inputs with the same messages.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

_HEX16 = re.compile(r"[0-9a-fA-F]{16}")
_DEC = re.compile(r"[+-]?[0-9]{1,20}")
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


class BadParameter(ValueError):
    """A query parameter that cannot be used (REST answers 422 with this message)."""


def parse_block_hash(text: str) -> int:
    """A block digest as stored (signed int64) from its printed forms.

    Accepted: exactly 16 hex digits (the form family ids use, ``kvfabric.contract.schema.family_of_hash``) or
    ``0x``-prefixed hex, both read as the unsigned 64-bit pattern; otherwise a signed decimal integer. A 16-digit
    *decimal* number is therefore read as hex: write it with a sign (``+1234567890123456``) to force decimal.
    """
    t = text.strip()
    try:
        if t.lower().startswith("0x"):
            value = int(t[2:], 16)
            if value >> 64:
                raise BadParameter(f"block hash {text!r} does not fit in 64 bits")
            return value - (1 << 64) if value >= 1 << 63 else value
        if _HEX16.fullmatch(t):
            value = int(t, 16)
            return value - (1 << 64) if value >= 1 << 63 else value
        if _DEC.fullmatch(t):
            value = int(t)
            if not _INT64_MIN <= value <= _INT64_MAX:
                raise BadParameter(f"block hash {text!r} is outside the signed 64-bit range")
            return value
    except ValueError as e:
        if isinstance(e, BadParameter):
            raise
        raise BadParameter(f"block hash {text!r} is not a number") from e
    raise BadParameter(f"block hash {text!r} is neither 16 hex digits, 0x-hex, nor a decimal integer")


@dataclass(frozen=True)
class Cursor:
    """Position after the last item of a page: its (ts_ns, row_key) order key."""

    ts_ns: int
    row_key: int

    def encode(self) -> str:
        raw = f"v1:{self.ts_ns}:{self.row_key}".encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> Cursor:
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
            version, ts, key = raw.split(":")
            if version != "v1":
                raise ValueError(version)
            cursor = cls(int(ts), int(key))
        except (ValueError, binascii.Error, UnicodeDecodeError) as e:
            raise BadParameter(f"cursor {text[:60]!r} is not a cursor returned by this API") from e
        # Both numbers go to SQL as BIGINT: a forged cursor outside that range is refused here, not by DuckDB.
        if not (_INT64_MIN <= cursor.ts_ns <= _INT64_MAX and 0 <= cursor.row_key <= _INT64_MAX):
            raise BadParameter(f"cursor {text[:60]!r} is not a cursor returned by this API (values out of range)")
        return cursor

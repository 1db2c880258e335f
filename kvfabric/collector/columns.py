"""Plain-text tables for the terminal: a header and rows of cells, each column as wide as its widest cell, two
spaces between columns, no trailing blanks. Shared by ``kvfabric query`` and ``kvfabric status``."""

from __future__ import annotations

from collections.abc import Sequence


def aligned(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The table's lines: the header first, then one line per row (every row has the header's length)."""
    widths = [max(len(title), *(len(row[i]) for row in rows)) for i, title in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return [line(header), *(line(row) for row in rows)]

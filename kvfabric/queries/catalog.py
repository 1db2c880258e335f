"""Named SQL: ``kvfabric/queries/sql/NAME.sql``, loaded once from package data.

The files are the single definition of every analytic the REST API, the CLI and the reports show; each states its
parameters (DuckDB ``$name`` placeholders) in its header comment. A line ``-- @include PART`` is replaced by the text
of ``sql/parts/PART.sql`` (a piece several queries share, e.g. one CTE); parts are not queries of their own.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_PARAM = re.compile(r"\$([a-z_][a-z0-9_]*)")
_INCLUDE = re.compile(r"^-- @include ([a-z_]+)[ \t]*$", re.MULTILINE)


def _part(match: re.Match[str]) -> str:
    path = resources.files("kvfabric.queries").joinpath("sql", "parts", f"{match.group(1)}.sql")
    if not path.is_file():
        raise ValueError(f"SQL part {match.group(1)!r} (sql/parts/{match.group(1)}.sql) does not exist")
    return path.read_text(encoding="utf-8").rstrip("\n")


@cache
def sql(name: str) -> str:
    """The text of ``sql/NAME.sql``. Raises KeyError for an unknown name."""
    if not re.fullmatch(r"[a-z_]+", name):
        raise KeyError(name)
    path = resources.files("kvfabric.queries").joinpath("sql", f"{name}.sql")
    if not path.is_file():
        raise KeyError(name)
    return _INCLUDE.sub(_part, path.read_text(encoding="utf-8"))


@cache
def parameters(name: str) -> frozenset[str]:
    """The ``$name`` parameters a query uses (comments included: headers name only real parameters)."""
    return frozenset(_PARAM.findall(sql(name)))


def sql_names() -> list[str]:
    """Every query file shipped."""
    root = resources.files("kvfabric.queries").joinpath("sql")
    return sorted(p.name[:-4] for p in root.iterdir() if p.name.endswith(".sql"))

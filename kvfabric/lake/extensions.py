"""DuckDB extensions from their PyPI wheels, loaded by file path: nothing is downloaded at run time.

The wheels (``duckdb-extension-ducklake`` etc., the ``lake`` extra) put each binary at
``<site-packages>/duckdb_extension_<name>/extensions/v<duckdb version>/<name>.duckdb_extension``; an extension
loads only into the DuckDB release it was built for, so the folder must match ``duckdb.__version__``.
"""

from __future__ import annotations

import importlib.util
import os

import duckdb


class MissingExtension(RuntimeError):
    """An extension's wheel is not installed, or was built for another DuckDB release."""


def extension_path(name: str) -> str:
    """The ``.duckdb_extension`` file of ``name`` (e.g. ``"ducklake"``) for the running DuckDB."""
    package = f"duckdb_extension_{name}"
    spec = importlib.util.find_spec(package)
    wheel = f"duckdb-extension-{name.replace('_', '-')}"
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtension(
            f"DuckDB's {name} extension is not installed: pip install 'kvfabric[lake]' "
            f"(or {wheel}=={duckdb.__version__})"
        )
    folder = os.path.join(next(iter(spec.submodule_search_locations)), "extensions", f"v{duckdb.__version__}")
    path = os.path.join(folder, f"{name}.duckdb_extension")
    if not os.path.isfile(path):
        raise MissingExtension(
            f"{wheel} does not match DuckDB {duckdb.__version__} (no {path}); install {wheel}=={duckdb.__version__}"
        )
    return path


def load_extensions(con: duckdb.DuckDBPyConnection, names: tuple[str, ...]) -> None:
    """LOAD each of ``names`` into ``con``'s database from its wheel."""
    for name in names:
        path = extension_path(name)
        con.execute(f"LOAD '{path.replace(chr(39), chr(39) * 2)}'")

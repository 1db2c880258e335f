"""Where a lake is: its catalog (``--lake``) and its data path (``--data``), and the DuckDB statements that reach
them. Credentials never come from flags: S3 takes the usual ``AWS_*`` variables or a DuckDB persistent secret.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

LAKE_ALIAS = "lake"
"""The name the lake is attached under; every statement reads its tables unqualified after ``USE lake``."""


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


@dataclass(frozen=True)
class LakeLocation:
    """``catalog``: ``postgres:<libpq keywords>`` (many hosts), ``sqlite:FILE`` or a DuckDB FILE (one host).
    ``data``: a local folder or ``s3://bucket/prefix``. Both as the user gave them (see :meth:`parse`)."""

    catalog: str
    data: str

    @classmethod
    def parse(cls, catalog: str, data: str) -> LakeLocation:
        """Check the two flags; raises ValueError naming the flag at fault. Local paths become absolute."""
        catalog = catalog.strip()
        data = data.strip()
        if not catalog:
            raise ValueError("--lake is empty: give postgres:dbname=... host=... port=..., sqlite:FILE or a FILE")
        if not data:
            raise ValueError("--data is empty: give a local folder or s3://bucket/prefix")
        kind, _, rest = catalog.partition(":")
        if kind == "postgres":
            if "dbname=" not in rest:
                raise ValueError(f"--lake {catalog!r}: a postgres catalog needs dbname=... (libpq keywords, e.g. "
                                 "postgres:dbname=kvf host=db port=5432 user=kvf)")
        elif kind in ("sqlite", "duckdb"):
            if not rest:
                raise ValueError(f"--lake {catalog!r}: name the catalog file after '{kind}:'")
            catalog = f"{kind}:{os.path.abspath(rest)}"
        elif kind in ("ducklake",):
            raise ValueError(f"--lake {catalog!r}: leave out the 'ducklake:' prefix")
        else:
            catalog = os.path.abspath(catalog)  # a DuckDB catalog file
        if "://" in data:
            scheme = data.split("://", 1)[0]
            if scheme not in ("s3", "s3a", "r2", "gcs", "gs"):
                raise ValueError(f"--data {data!r}: use a local folder or s3://bucket/prefix")
            if not urlsplit(data).netloc:
                raise ValueError(f"--data {data!r}: no bucket")
        else:
            data = os.path.abspath(data)
        if not data.endswith("/"):
            data += "/"
        return cls(catalog, data)

    @property
    def remote_data(self) -> bool:
        return "://" in self.data

    @property
    def catalog_kind(self) -> str:
        """``postgres``, ``sqlite`` or ``duckdb``."""
        kind = self.catalog.partition(":")[0]
        return kind if kind in ("postgres", "sqlite", "duckdb") else "duckdb"

    def extensions(self) -> tuple[str, ...]:
        names = ["ducklake"]
        if self.catalog_kind == "postgres":
            names.append("postgres_scanner")
        elif self.catalog_kind == "sqlite":
            names.append("sqlite_scanner")
        if self.remote_data:
            names.append("httpfs")
        return tuple(names)

    def attach_sql(self, *, read_only: bool = False) -> str:
        target = self.catalog[len("duckdb:"):] if self.catalog.startswith("duckdb:") else self.catalog
        options = [f"DATA_PATH {_quote(self.data)}"]
        if read_only:
            options.append("READ_ONLY")
        return f"ATTACH {_quote('ducklake:' + target)} AS {LAKE_ALIAS} ({', '.join(options)})"

    def describe(self) -> str:
        """For logs: the catalog without any password= keyword, and the data path."""
        words = [w for w in self.catalog.split() if not w.lower().startswith("password=")]
        return f"lake {' '.join(words)} data {self.data}"


def s3_secret_sql(env: Mapping[str, str]) -> str | None:
    """A temporary S3 secret from the ``AWS_*`` variables in ``env``, or None when no key is set (then DuckDB's own
    persistent secrets apply). ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) selects an S3-compatible server and
    path-style URLs; ``http://`` turns TLS off."""
    key = env.get("AWS_ACCESS_KEY_ID")
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if not key and not endpoint:
        return None
    parts = ["TYPE s3"]
    if key:
        parts.append(f"KEY_ID {_quote(key)}")
        parts.append(f"SECRET {_quote(env.get('AWS_SECRET_ACCESS_KEY', ''))}")
    if env.get("AWS_SESSION_TOKEN"):
        parts.append(f"SESSION_TOKEN {_quote(env['AWS_SESSION_TOKEN'])}")
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        parts.append(f"REGION {_quote(region)}")
    if endpoint:
        url = urlsplit(endpoint if "://" in endpoint else "https://" + endpoint)
        parts.append(f"ENDPOINT {_quote(url.netloc + url.path.rstrip('/'))}")
        parts.append("URL_STYLE 'path'")
        parts.append(f"USE_SSL {'false' if url.scheme == 'http' else 'true'}")
    return f"CREATE OR REPLACE SECRET kvfabric_s3 ({', '.join(parts)})"

"""Real parts for the collector's lake backend (DuckDB's DuckLake: catalog in PostgreSQL, Parquet data in a local
folder or on S3), started by the tests themselves and gone afterwards.

- :class:`PostgresServer` / fixture ``postgres`` (session): a throwaway PostgreSQL cluster from Debian's server
  binaries (the newest ``/usr/lib/postgresql/*/bin``) on a free loopback port, trust authentication for user
  ``postgres``; ``create_database(name)`` gives a DuckLake catalog string, ``stop()``/``start()`` take the catalog
  away and give it back.
- :class:`MotoS3` / fixture ``moto_s3`` (session): moto's standalone server (``moto_server``, from ``moto[server]``)
  as an S3 endpoint on a free loopback port; ``create_bucket(name)``, ``endpoint``, ``env()`` (the ``AWS_*``
  variables a child process needs), ``secret_sql()`` (the DuckDB secret that reaches it).
- fixture ``lake_location`` (function, params ``"local"`` and ``"s3"``): a fresh catalog database and a fresh data
  path (a tmp folder, or ``s3://BUCKET/lake/`` on a fresh bucket) per test, as a :class:`LakeLocation`.
- :func:`extension_path` / :func:`load_lake_extensions`: DuckDB's ducklake, postgres_scanner and httpfs extensions
  LOADed from their PyPI wheels (``duckdb-extension-*``), so nothing is fetched from DuckDB's extension server.

``tests/conftest.py`` registers this module as a plugin (``pytest_plugins``), so every test can ask for ``postgres``,
``moto_s3`` and ``lake_location`` by name; nothing starts until a test asks.
Nothing here skips: a missing PostgreSQL, moto or extension wheel is an error that says what to install.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import itertools
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

LAKE_EXTENSIONS = ("ducklake", "postgres_scanner", "httpfs")
"""The DuckDB extensions the lake needs, in LOAD order (ducklake's postgres catalog and s3:// data need the others)."""

S3_ACCESS_KEY_ID = "testing"
S3_SECRET_ACCESS_KEY = "testing"  # moto accepts any key pair; these are the ones env() and secret_sql() hand out
S3_REGION = "us-east-1"

_INSTALL_POSTGRES = (
    "install Debian's PostgreSQL server with `apt-get install -y --no-install-recommends postgresql` "
    "(scripts/test.sh does this when it runs as root)"
)
_INSTALL_PY = 'install the test extras with `.venv/bin/pip install -c constraints.txt -e ".[vllm,dev,lake]"`'


class LakeKitError(RuntimeError):
    """A part the lake tests need is missing or would not start (never a skip: the message says what to do)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


# --------------------------------------------------------------------------------------------- DuckDB extensions


def extension_path(name: str) -> Path:
    """The ``.duckdb_extension`` file of extension ``name`` from its wheel (``duckdb-extension-<name>``), built for
    the DuckDB that is installed."""
    import duckdb

    version = duckdb.__version__
    module = f"duckdb_extension_{name}"
    try:
        package = __import__(module)
    except ImportError as e:
        raise LakeKitError(f"DuckDB's {name} extension is not installed (module {module}): {_INSTALL_PY}") from e
    folder = Path(package.__file__).parent / "extensions"
    path = folder / f"v{version}" / f"{name}.duckdb_extension"
    if not path.is_file():
        built = sorted(p.name for p in folder.glob("v*")) if folder.is_dir() else []
        raise LakeKitError(
            f"{path} is missing: the {module} wheel is built for DuckDB {built or '?'} but DuckDB {version} is "
            f"installed; an extension loads only into its own DuckDB version ({_INSTALL_PY})"
        )
    return path


def load_lake_extensions(con: Any) -> None:
    """LOAD ducklake, postgres_scanner and httpfs into DuckDB connection ``con`` from their wheels (offline)."""
    for name in LAKE_EXTENSIONS:
        con.execute(f"LOAD '{extension_path(name)}'")


# --------------------------------------------------------------------------------------------------- PostgreSQL


def postgres_bin_dir() -> Path:
    """The newest ``/usr/lib/postgresql/<version>/bin`` that holds ``initdb`` (Debian's layout)."""
    found = glob.glob("/usr/lib/postgresql/*/bin/initdb")

    def major(path: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", Path(path).parent.parent.name)) or (0,)

    if not found:
        raise LakeKitError(f"PostgreSQL's initdb is not under /usr/lib/postgresql/*/bin: {_INSTALL_POSTGRES}")
    return Path(max(found, key=major)).parent


class PostgresServer:
    """A throwaway PostgreSQL cluster: ``initdb -A trust -U postgres`` in a temp folder, listening on 127.0.0.1:``port``
    (unix socket in the same folder). As root the folder goes to the ``postgres`` user and initdb/pg_ctl run through
    ``runuser -u postgres --`` (initdb refuses root); otherwise they run as the current user.

    Attributes: ``bin_dir`` (Path), ``root`` (Path: the temp folder), ``data_dir`` (Path), ``port`` (int), ``host``
    (``"127.0.0.1"``), ``user`` (``"postgres"``), ``log_path`` (Path: the server's log), ``running`` (bool).
    """

    host = "127.0.0.1"
    user = "postgres"

    def __init__(self, bin_dir: Path | None = None) -> None:
        self.bin_dir = bin_dir or postgres_bin_dir()
        for tool in ("initdb", "pg_ctl", "createdb", "pg_isready"):
            if not (self.bin_dir / tool).is_file():
                raise LakeKitError(f"{self.bin_dir / tool} is missing: {_INSTALL_POSTGRES}")
        self._as_root = os.geteuid() == 0
        self._runas: list[str] = []
        if self._as_root:
            runuser = shutil.which("runuser")
            if runuser is None:
                raise LakeKitError("running as root needs runuser (util-linux) to start PostgreSQL as user postgres")
            try:
                import pwd

                self._pw = pwd.getpwnam("postgres")
            except KeyError as e:
                raise LakeKitError(f"running as root needs the `postgres` system user: {_INSTALL_POSTGRES}") from e
            self._runas = [runuser, "-u", "postgres", "--"]
        self.root = Path(tempfile.mkdtemp(prefix="kvf-pg-"))
        self.data_dir = self.root / "data"
        self.log_path = self.root / "server.log"
        self.port = 0
        self.running = False
        self._names = itertools.count(1)
        if self._as_root:
            os.chown(self.root, self._pw.pw_uid, self._pw.pw_gid)
        self._run_server_tool(
            ["initdb", "-D", str(self.data_dir), "-A", "trust", "-U", self.user, "-E", "UTF8", "--locale=C",
             "--no-sync"],
            what="initdb",
        )

    def _run_server_tool(self, argv: list[str], *, what: str, timeout: float = 60) -> None:
        cmd = [*self._runas, str(self.bin_dir / argv[0]), *argv[1:]]
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=self.root)
        if proc.returncode != 0:
            raise LakeKitError(
                f"PostgreSQL {what} failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
                f"\n--- server log ---\n{_tail(self.log_path)}"
            )

    def start(self, *, timeout: float = 30) -> None:
        """Start (or restart, on the same port once it has one) and return when it accepts TCP connections."""
        if self.running:
            return
        attempts = 1 if self.port else 3  # a first start retries on a fresh port if another process took this one
        for attempt in range(attempts):
            port = self.port or free_port()
            options = (
                f"-p {port} -k {self.root} -c listen_addresses={self.host} -c fsync=off "
                "-c full_page_writes=off -c dynamic_shared_memory_type=mmap -c max_connections=200"
            )
            try:
                self._run_server_tool(
                    ["pg_ctl", "-D", str(self.data_dir), "-l", str(self.log_path), "-o", options, "-w",
                     "-t", str(int(timeout)), "start"],
                    what="start",
                    timeout=timeout + 10,
                )
            except LakeKitError:
                if attempt + 1 == attempts:
                    raise
                continue
            self.port = port
            break
        self.running = True
        deadline = time.monotonic() + timeout
        while True:
            ok = subprocess.run(
                [str(self.bin_dir / "pg_isready"), "-q", "-h", self.host, "-p", str(self.port), "-U", self.user],
                capture_output=True,
            )
            if ok.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise LakeKitError(
                    f"PostgreSQL on {self.host}:{self.port} does not accept connections after {timeout:.0f}s"
                    f"\n--- server log ---\n{_tail(self.log_path)}"
                )
            time.sleep(0.05)

    def stop(self, mode: str = "immediate") -> None:
        """Stop the server (``pg_ctl stop -m MODE``); the cluster and its databases stay for :meth:`start`."""
        if not self.running:
            return
        self._run_server_tool(["pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "stop"], what="stop")
        self.running = False

    def close(self) -> None:
        """Stop the server and remove its folder (the fixture's teardown)."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def dsn(self, dbname: str) -> str:
        """A libpq connection string for database ``dbname``."""
        return f"dbname={dbname} host={self.host} port={self.port} user={self.user}"

    def create_database(self, name: str | None = None) -> str:
        """Create database ``name`` (a fresh ``lake_<n>`` when None) and return its DuckLake catalog string,
        ``postgres:dbname=NAME host=127.0.0.1 port=PORT user=postgres`` (``ATTACH 'ducklake:' || that``)."""
        if not self.running:
            raise LakeKitError("PostgreSQL is stopped: start() it before create_database()")
        name = name or f"lake_{next(self._names)}"
        proc = subprocess.run(
            [str(self.bin_dir / "createdb"), "-h", self.host, "-p", str(self.port), "-U", self.user, name],
            capture_output=True, text=True, timeout=30, env={**os.environ, "PGCONNECT_TIMEOUT": "10"},
        )
        if proc.returncode != 0:
            raise LakeKitError(f"createdb {name} failed ({proc.returncode}): {proc.stderr.strip()}")
        return f"postgres:{self.dsn(name)}"

    def __enter__(self) -> PostgresServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------- moto S3


def moto_server_path() -> Path:
    """The ``moto_server`` console script of this interpreter's environment (next to ``sys.executable``)."""
    here = Path(sys.executable).parent / "moto_server"
    if here.is_file():
        return here
    found = shutil.which("moto_server")
    if found is None:
        raise LakeKitError(f"moto_server (moto[server]) is not next to {sys.executable} nor on PATH: {_INSTALL_PY}")
    return Path(found)


class MotoS3:
    """moto's standalone server as an S3 endpoint on 127.0.0.1:``port``, path-style, plain HTTP.

    Attributes: ``port`` (int), ``endpoint`` (``"127.0.0.1:PORT"``, DuckDB's ``ENDPOINT``), ``url``
    (``"http://127.0.0.1:PORT"``), ``log_path`` (Path). Methods: ``create_bucket(name=None) -> str``,
    ``env() -> dict[str, str]``, ``secret_sql(name=None) -> str``, ``close()``.
    """

    def __init__(self, *, timeout: float = 30) -> None:
        exe = moto_server_path()
        self._root = Path(tempfile.mkdtemp(prefix="kvf-moto-"))
        self.log_path = self._root / "moto.log"
        self._names = itertools.count(1)
        self._proc: subprocess.Popen[bytes] | None = None
        for attempt in range(3):
            self.port = free_port()
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(
                    [str(exe), "-H", "127.0.0.1", "-p", str(self.port)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                )
            if self._wait(timeout):
                break
            self._terminate()
            if attempt == 2:
                raise LakeKitError(
                    f"moto_server did not answer on {self.url} within {timeout:.0f}s\n--- log ---\n"
                    f"{_tail(self.log_path)}"
                )

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    def _wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                return False  # it exited (the port was taken, or moto is broken): the caller retries or reports
            if _port_open(self.port):
                try:
                    if httpx.get(self.url + "/", timeout=2).status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
            time.sleep(0.05)
        return False

    def create_bucket(self, name: str | None = None) -> str:
        """Create bucket ``name`` (a fresh ``lake-<n>`` when None) and return its name."""
        name = name or f"lake-{next(self._names)}"
        r = httpx.put(f"{self.url}/{name}", timeout=10)
        if r.status_code != 200:
            raise LakeKitError(f"moto would not create bucket {name}: HTTP {r.status_code} {r.text[:500]}")
        return name

    def env(self) -> dict[str, str]:
        """The environment a child process needs to reach this endpoint: the standard ``AWS_*`` variables (boto3 and
        the AWS CLI take the endpoint from ``AWS_ENDPOINT_URL``) plus the two DuckDB's httpfs reads for a custom
        endpoint, ``DUCKDB_S3_ENDPOINT`` and ``DUCKDB_S3_USE_SSL`` (httpfs 1.5.5 ignores ``AWS_ENDPOINT_URL``). No
        variable sets the URL style, and httpfs's default (virtual host, ``BUCKET.127.0.0.1:PORT``) does not resolve:
        a DuckDB child also runs ``SET s3_url_style='path'`` (or makes a secret with ``URL_STYLE 'path'``)."""
        return {
            "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": S3_SECRET_ACCESS_KEY,
            "AWS_REGION": S3_REGION,
            "AWS_ENDPOINT_URL": self.url,
            "DUCKDB_S3_ENDPOINT": self.endpoint,
            "DUCKDB_S3_USE_SSL": "false",
        }

    def secret_sql(self, name: str | None = None) -> str:
        """``CREATE SECRET`` for DuckDB's httpfs that points s3:// at this endpoint (path style, no TLS)."""
        label = f"{name} " if name else ""
        return (
            f"CREATE OR REPLACE SECRET {label}(TYPE s3, KEY_ID '{S3_ACCESS_KEY_ID}', SECRET '{S3_SECRET_ACCESS_KEY}', "
            f"REGION '{S3_REGION}', ENDPOINT '{self.endpoint}', URL_STYLE 'path', USE_SSL false)"
        )

    def _terminate(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def close(self) -> None:
        """Stop the server and remove its log folder (the fixture's teardown)."""
        self._terminate()
        shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> MotoS3:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------- the lake


@dataclass(frozen=True)
class LakeLocation:
    """Where one test's lake lives. ``kind``: ``"local"`` or ``"s3"``; ``catalog``: the DuckLake catalog string
    (``postgres:dbname=... host=127.0.0.1 port=... user=postgres``, a fresh database); ``data``: the DATA_PATH (a tmp
    folder path ending in ``/``, or ``s3://BUCKET/lake/`` on a fresh bucket); ``env``: extra environment for child
    processes (:meth:`MotoS3.env` for s3, ``{}`` for local); ``s3``: the :class:`MotoS3` for s3, else None."""

    kind: str
    catalog: str
    data: str
    env: dict[str, str] = field(default_factory=dict)
    s3: MotoS3 | None = None

    def attach_sql(self, alias: str = "lake") -> str:
        return f"ATTACH 'ducklake:{self.catalog}' AS {alias} (DATA_PATH '{self.data}')"

    def connect(self, alias: str = "lake") -> Any:
        """A new in-memory DuckDB connection with the lake extensions loaded, the S3 secret made (s3), and the lake
        attached as ``alias``."""
        import duckdb

        con = duckdb.connect(config={"autoinstall_known_extensions": False})
        try:
            load_lake_extensions(con)
            if self.s3 is not None:
                con.execute(self.s3.secret_sql())
            con.execute(self.attach_sql(alias))
        except BaseException:
            con.close()
            raise
        return con


_started: list[PostgresServer | MotoS3] = []


@atexit.register
def _close_leftovers() -> None:  # a run killed between setup and teardown still leaves no server behind
    for part in _started:
        with contextlib.suppress(Exception):
            part.close()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A running throwaway PostgreSQL cluster for the whole session (see :class:`PostgresServer`)."""
    server = PostgresServer()
    _started.append(server)
    try:
        server.start()
        yield server
    finally:
        server.close()
        _started.remove(server)


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    """moto's S3 server for the whole session (see :class:`MotoS3`)."""
    s3 = MotoS3()
    _started.append(s3)
    try:
        yield s3
    finally:
        s3.close()
        _started.remove(s3)


_database_names = itertools.count(1)


@pytest.fixture(params=["local", "s3"])
def lake_location(
    request: pytest.FixtureRequest, postgres: PostgresServer, moto_s3: MotoS3, tmp_path: Path
) -> Iterator[LakeLocation]:
    """A fresh lake per test: its own catalog database, and its data in a tmp folder (``"local"``) or under
    ``s3://<fresh bucket>/lake/`` (``"s3"``). Runs every test twice, once per kind; a test picks one with
    ``@pytest.mark.parametrize("lake_location", ["s3"], indirect=True)``."""
    kind = request.param
    if not postgres.running:
        postgres.start()  # a test that stopped it and failed before start() leaves it for the next one
    slug = re.sub(r"[^a-z0-9]+", "_", request.node.name.lower()).strip("_")[:40]
    catalog = postgres.create_database(f"lake_{next(_database_names)}_{slug}")
    if kind == "local":
        data = tmp_path / "lake-data"
        data.mkdir()
        yield LakeLocation("local", catalog, f"{data}/", {})
    elif kind == "s3":
        bucket = moto_s3.create_bucket()
        yield LakeLocation("s3", catalog, f"s3://{bucket}/lake/", moto_s3.env(), moto_s3)
    else:
        raise LakeKitError(f"lake_location takes 'local' or 's3', not {kind!r}")

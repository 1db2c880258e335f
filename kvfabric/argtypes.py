"""Command-line value types and help layout shared by every ``kvfabric`` subcommand.

Each type is an ``argparse`` ``type=`` callable: a value outside its range raises ``argparse.ArgumentTypeError``,
which argparse reports as one line naming the option (``kvfabric.cli`` makes every parser's error one line, exit
status 2). Messages say what is accepted and what was given, in the same words everywhere::

    parser.add_argument("--max-connections", type=positive_int, default=64)
    parser.add_argument("--port", type=port, default=8321)
    parser.add_argument("--ratio", type=float_range(0.0, 1.0), default=0.5)

:class:`HelpFormatter` shows every option's default in ``--help`` (appended as ``(default: X)`` unless the help
text already states it) and keeps descriptions and epilogs as written.
"""

from __future__ import annotations

import argparse
import copy
import math
import re
from collections.abc import Callable
from typing import NoReturn

__all__ = [
    "HelpFormatter",
    "OneLineErrorParser",
    "duckdb_setting",
    "duration",
    "duration_text",
    "float_range",
    "int_range",
    "nonneg_float",
    "nonneg_int",
    "number_text",
    "port",
    "positive_float",
    "positive_int",
    "shows_default",
]


def _int(text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def int_range(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An integer in ``[low, high]`` (either bound may be None: unbounded on that side)."""

    def parse(text: str) -> int:
        value = _int(text)
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be an integer {_bounds(low, high)}, got {text!r}")
        return value

    parse.__name__ = "integer"  # argparse names the type in some messages
    return parse


def float_range(low: float | None = None, high: float | None = None, *, low_open: bool = False
                ) -> Callable[[str], float]:
    """A finite number in ``[low, high]`` (``(low, high]`` with ``low_open``)."""

    def parse(text: str) -> float:
        value = _float(text)
        too_low = low is not None and (value <= low if low_open else value < low)
        if too_low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be a number {_bounds(low, high, low_open)}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def number_text(value: float) -> str:
    """A bound or value as messages print it: whole numbers without a decimal point or exponent (``1000000``, not
    ``1e+06``), others as Python writes them."""
    return str(int(value)) if float(value).is_integer() else str(value)


def _bounds(low: float | None, high: float | None, low_open: bool = False) -> str:
    if low is not None and high is not None:
        return f"{'>' if low_open else '>='} {number_text(low)} and <= {number_text(high)}"
    if low is not None:
        return f"{'>' if low_open else '>='} {number_text(low)}"
    assert high is not None
    return f"<= {number_text(high)}"


positive_int = int_range(1)
"""An integer >= 1 (counts, sizes, limits)."""
nonneg_int = int_range(0)
"""An integer >= 0 (offsets, optional counts where 0 means off)."""
positive_float = float_range(0.0, low_open=True)
"""A finite number > 0 (durations, rates, scales)."""
nonneg_float = float_range(0.0)
"""A finite number >= 0 (waits where 0 means none)."""


def port(text: str) -> int:
    """A TCP port, 0 to 65535 (0: any free port)."""
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 0 to 65535 (0: any free one), got {text!r}")
    return value


_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)\s*")
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def duration(text: str) -> float:
    """A duration in seconds: ``90``, ``90s``, ``15m``, ``12h``, ``7d``, ``2w``; ``0`` or ``off`` for none."""
    if text.strip().lower() in ("off", "none", "forever"):
        return 0.0
    m = _DURATION.fullmatch(text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"must be a duration such as 90s, 15m, 12h, 7d or 2w (0 or off: none), "
                                         f"got {text!r}")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def duration_text(seconds: float) -> str:
    """The shortest exact form :func:`duration` reads back (``0`` when none)."""
    if seconds <= 0:
        return "0"
    for unit in ("d", "h", "m"):  # (weeks read back too, but 7d says it plainer than 1w)
        size = _DURATION_UNITS[unit]
        if seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


_SIZE = re.compile(r"\s*[0-9]+(\.[0-9]+)?\s*[A-Za-z]*\s*")


def duckdb_setting(name: str, *, empty_ok: bool = True) -> Callable[[str], str]:
    """A value of DuckDB setting ``name`` (``memory_limit``, ``checkpoint_threshold``), checked by DuckDB itself
    on a throwaway in-memory database, so what DuckDB refuses is refused before anything is opened. ``''`` means
    DuckDB's default when ``empty_ok``."""

    def parse(text: str) -> str:
        if text == "" and empty_ok:
            return text
        if not _SIZE.fullmatch(text):
            raise argparse.ArgumentTypeError(f"must be a size such as 256MB, 1.5GB or 2GiB, got {text!r}")
        # duckdb: only to read a size; argtypes loads for every `kvfabric --help`
        import duckdb

        con = duckdb.connect()
        try:
            con.execute(f"SET {name} = '{text}'")
        except duckdb.Error as exc:
            first = str(exc).splitlines()[0]
            raise argparse.ArgumentTypeError(
                f"must be a size such as 256MB, 1.5GB or 2GiB, got {text!r} (DuckDB: {first})") from None
        finally:
            con.close()
        return text

    parse.__name__ = "size"
    return parse


# --------------------------------------------------------------------------------------------- help and errors


def shows_default(action: argparse.Action) -> bool:
    """Whether ``--help`` should state this option's default: it has one worth saying (not None, False, an empty
    list or SUPPRESS) and the option takes a value or is optional."""
    default = action.default
    if default is None or default is False or default is argparse.SUPPRESS or default == []:
        return False
    if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._StoreConstAction)):
        return False
    return bool(action.option_strings) or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)


_STATED = re.compile(r"%\(default\)|\(default[:\s]|;\s*default[:\s]")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written; every option's default shown (``(default: X)`` appended unless the help
    text already states the default; an option without help text gets just that)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if shows_default(action) and not _STATED.search(text):
            text = f"{text} (default: %(default)s)" if text else "default: %(default)s"
        return text

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and shows_default(action):
            action = _copy_with_help(action, "default: %(default)s")
        return super()._format_action(action)


def _copy_with_help(action: argparse.Action, text: str) -> argparse.Action:
    clone = copy.copy(action)
    clone.help = text
    return clone


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (``PROG: MESSAGE (PROG --help lists the
    options)``) and exit status 2, instead of the usage block followed by the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

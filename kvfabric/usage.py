"""The one way a command reports a user's mistake.

Raise :class:`UsageError` anywhere below a subcommand's ``run(args)`` for anything the user can fix (a bad value,
a path that cannot be read or written, an address in use, a malformed input file): ``kvfabric.cli.main`` prints
``kvfabric COMMAND: MESSAGE`` on one line to stderr and exits 2, with no traceback. The message names the thing at
fault (the option or variable, the path, the address, the file and line) and what is accepted.
"""

from __future__ import annotations

EXIT_USAGE = 2


class UsageError(Exception):
    """A user's mistake: one line, exit status 2, no traceback."""


def unwritable(option: str, path: str, exc: BaseException) -> UsageError:
    """The one-line error for an output path that cannot be created or written."""
    if isinstance(exc, OSError):
        at = f" ({exc.filename}: {exc.strerror})" if exc.filename and exc.filename != path else f" ({exc.strerror})"
        return UsageError(f"{option} {path}: cannot write there{at}")
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return UsageError(f"{option} {path}: cannot write there ({first})")

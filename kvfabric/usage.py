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

"""The one error type of the command line: a message for the user, printed on one line, exit status 2."""

from __future__ import annotations

USAGE_ERROR = 2


class CLIError(Exception):
    """Bad input or a missing piece the user can fix: ``flashcodec <command>: <message>`` on stderr, exit 2."""

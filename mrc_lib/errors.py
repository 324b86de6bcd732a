"""User-facing errors.

Anything the user can fix (a malformed file, a missing dataset, a bad option) raises
:class:`UserError`. The CLI prints its message on one line and exits with status 2; it never
shows a traceback for these.
"""


class UserError(Exception):
    """An error caused by the user's input; its message names the file and record."""

    exit_code = 2


class ChecksumError(UserError):
    """A downloaded file does not match its published digest."""

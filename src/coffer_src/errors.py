"""Errors: the one exception root every Coffer error derives from."""

from __future__ import annotations


class CofferError(Exception):
    """A problem the user can fix; the CLI prints it as one line and exits 1."""


class NotListedYet(CofferError):
    """A capability name on a registered server that Coffer has not seen listed (yet)."""

"""Errors: the one exception root every Coffer error derives from.

``CofferException`` is the root: ``except CofferException`` catches whatever Coffer raises on purpose, and
nothing else (a bug stays a bug).  Each module keeps its own errors beside the code that raises them, all under
this root; the ones that several layers raise or catch live here.
"""

from __future__ import annotations


class CofferException(Exception):
    """The root of every exception Coffer raises on purpose."""


class CofferError(CofferException):
    """A problem the user can fix; the CLI prints it as one line and exits 1."""


class NotListedYet(CofferError):
    """A capability name on a registered server that Coffer has not seen listed (yet)."""

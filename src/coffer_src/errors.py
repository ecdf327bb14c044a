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


# What SQLite's complaint means for the user, by words in its message (first match wins).
_SQLITE_ADVICE = (
    (("locked", "busy"), "another Coffer process held it too long; try again"),
    (("readonly", "read-only", "permission"), "it cannot be written: check that it and its folder belong to you"),
    (("not a database", "malformed", "corrupt"), "the file is damaged: restore it from a backup, or move it away "
                                                 "and register your servers again (coffer import)"),
    (("full",), "the disk is full: free some space and try again"),
    (("no such table", "no such column", "has no column"), "part of its schema is missing: coffer doctor says "
                                                           "which and how to repair it"),
    (("unable to open",), "it cannot be opened: check that its folder exists and belongs to you"),
    (("disk i/o",), "the disk failed to read or write it: check the disk, then run coffer doctor"),
)


class VaultError(CofferError):
    """coffer.db failed under a Vault or InvocationLog method: SQLite's complaint and what to do about it, in one
    line.  Every sqlite3.Error from their public methods arrives as this (the original is its __cause__), so a
    caller catches CofferError and never needs to know SQLite is underneath.  Raised by the vault, caught by the
    gateway, the probes and the CLI: so it lives here."""

    @classmethod
    def wrap(cls, exc: Exception, path: str) -> VaultError:
        """The VaultError for a sqlite3.Error on the vault at ``path``."""
        text = str(exc) or exc.__class__.__name__
        advice = next((advice for words, advice in _SQLITE_ADVICE if any(w in text.lower() for w in words)), None)
        return cls(f"the vault {path}: {text}" + (f"; {advice}" if advice else ""))

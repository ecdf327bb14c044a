"""Package data: the word lists and web assets that ship inside coffer.py.

In the development package ``package_data("search/stop_words.txt")`` reads src/coffer_src/search/stop_words.txt;
tools/amalgamate.py replaces every such call, whose argument must be a literal, by the file's text, so the
generated coffer.py carries its data as string constants and never reads a file of its own.
"""

from __future__ import annotations

from pathlib import Path


def package_data(name: str) -> str:
    """The text of a data file of the package, by its path relative to src/coffer_src/ (UTF-8)."""
    return (Path(__file__).resolve().parent / name).read_text(encoding="utf-8")

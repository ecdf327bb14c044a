"""Package data: the word lists and web assets that ship inside coffer.py.

In the development package ``package_data("search/stop_words.txt")`` reads src/coffer_src/search/stop_words.txt;
tools/amalgamate.py replaces every such call, whose argument must be a literal, by the file's text, so the
generated coffer.py carries its data as string constants and never reads a file of its own.
"""

from __future__ import annotations

import sys
from pathlib import Path


def package_data(name: str) -> str:
    """The text of a data file of the package, by its path relative to src/coffer_src/ (UTF-8)."""
    return (Path(__file__).resolve().parent / name).read_text(encoding="utf-8")


def own_command(*args: str) -> list[str]:
    """An argv that runs this same Coffer again with ``args``: the interpreter running now, and this code imported
    from its compiled bytecode (a script would be compiled again at every start).  For coffer.py (installed or
    vendored) that is the module in its folder; for the development package, the package in src/."""
    here = Path(__file__).resolve()
    if here.parent.name == "coffer_src" and here.name == "resources.py":
        folder, module = here.parent.parent, "coffer_src.cli"
    else:
        folder, module = here.parent, here.stem
    bootstrap = (f"import sys; sys.path.insert(0, {str(folder)!r}); from {module} import main; "
                 f"sys.exit(main({list(args)!r}))")
    return [sys.executable, "-c", bootstrap]

"""Lay out the documentation corpus of the knowledge eval (``evals.ask``) reproducibly.

The corpus is the documentation tree that ships inside two pinned PyPI source distributions (both BSD-3-Clause,
redistribution allowed with the notice, kept in ``evals/ask_data/licenses/``):

* ``click`` 8.5.1 -- ``docs/*.md`` (Markdown, MyST flavoured)
* ``flask`` 3.1.3 -- ``docs/**/*.rst`` (reStructuredText)

so both splitters (Markdown and reStructuredText) are exercised on real, unedited documentation.  The tree is
committed (about 0.7 MB of text) so the eval needs no network; this script re-creates it byte for byte::

    python -m evals.ask_corpus            # download the pinned sdists with pip, verify, (re)write the tree
    python -m evals.ask_corpus --check    # verify the committed tree against corpus.sha256 (no network)
    python -m evals.ask_corpus --sdist-dir DIR   # use sdists already downloaded into DIR

The questions in ``evals/ask_data/questions.jsonl`` label answers by file and line range, so this tree must not
be edited by hand: ``--check`` fails on any drift.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

DATA_DIR = Path(__file__).resolve().parent / "ask_data"
CORPUS_DIR = DATA_DIR / "corpus"
LICENSE_DIR = DATA_DIR / "licenses"
MANIFEST = DATA_DIR / "corpus.sha256"

# package -> (version, sha256 of the sdist, suffixes of the documentation files taken from its docs/ folder)
PINNED = {
    "click": ("8.5.1", "9bbfada76703fd1d784b83eea012e3e8c6a001a876543ef104fa56aaaeb072b4", (".md",)),
    "flask": ("3.1.3", "0ef0e52b8a9cd932855379197dd8f94047b359ca0a78695144304cb45f87c9eb", (".rst",)),
}


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def download(package: str, version: str, into: Path) -> Path:
    """The sdist through pip (the ordinary client), source only, no dependencies."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    f"{package}=={version}", "-d", str(into)], check=True)
    return sdist_path(package, version, into)


def sdist_path(package: str, version: str, folder: Path) -> Path:
    path = folder / f"{package}-{version}.tar.gz"
    if not path.exists():
        raise SystemExit(f"{path} not found")
    return path


def extract_docs(package: str, version: str, sdist: Path) -> dict[str, bytes]:
    """corpus-relative path -> bytes of every documentation file (and the licence, returned under 'LICENSE')."""
    prefix = PurePosixPath(f"{package}-{version}")
    suffixes = PINNED[package][2]
    files: dict[str, bytes] = {}
    with tarfile.open(sdist, "r:gz") as archive:
        for member in archive.getmembers():
            if not member.isfile():
                continue
            path = PurePosixPath(member.name)
            if path == prefix / "LICENSE.txt":
                files["LICENSE"] = archive.extractfile(member).read()
                continue
            try:
                inside_docs = path.relative_to(prefix / "docs")
            except ValueError:
                continue
            if path.suffix in suffixes and not any(part.startswith(("_", ".")) for part in inside_docs.parts):
                files[f"{package}/{inside_docs}"] = archive.extractfile(member).read()
    return files


def manifest_lines() -> list[str]:
    return [f"{sha256_file(path)}  {path.relative_to(CORPUS_DIR).as_posix()}"
            for path in sorted(CORPUS_DIR.rglob("*")) if path.is_file()]


def write_tree(sdist_dir: Path | None) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        folder = sdist_dir or Path(scratch)
        trees = {}
        for package, (version, digest, _) in PINNED.items():
            sdist = sdist_path(package, version, folder) if sdist_dir else download(package, version, folder)
            actual = sha256_file(sdist)
            if actual != digest:
                raise SystemExit(f"{sdist.name}: sha256 {actual} is not the pinned {digest}")
            trees[package] = extract_docs(package, version, sdist)
    if CORPUS_DIR.exists():
        shutil.rmtree(CORPUS_DIR)
    LICENSE_DIR.mkdir(parents=True, exist_ok=True)
    for package, files in trees.items():
        (LICENSE_DIR / f"{package}-LICENSE.txt").write_bytes(files.pop("LICENSE"))
        for relative, data in files.items():
            target = CORPUS_DIR / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    MANIFEST.write_text("\n".join(manifest_lines()) + "\n", encoding="utf-8")
    print(f"wrote {sum(len(f) for f in trees.values())} files under {CORPUS_DIR}")


def check_tree() -> int:
    if not MANIFEST.exists():
        print(f"{MANIFEST} is missing", file=sys.stderr)
        return 1
    expected = MANIFEST.read_text(encoding="utf-8").splitlines()
    actual = manifest_lines()
    if expected != actual:
        drift = sorted(set(expected) ^ set(actual))
        print("corpus drift:\n  " + "\n  ".join(drift[:20]), file=sys.stderr)
        return 1
    print(f"corpus ok: {len(actual)} files match {MANIFEST.name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="verify the committed tree, no network")
    parser.add_argument("--sdist-dir", type=Path, help="folder holding the pinned sdists already")
    args = parser.parse_args(argv)
    if args.check:
        return check_tree()
    write_tree(args.sdist_dir)
    return check_tree()


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Write coffer.py, the one-module distributable, from the package under src/coffer_src/.

Coffer is developed as modules in a strict layer order and shipped as one standard-library-only file, the way
SQLite ships its amalgamation.  This generator is the only writer of coffer.py:

    python3 tools/amalgamate.py            write coffer.py
    python3 tools/amalgamate.py --check    exit 1 if coffer.py differs from what would be written
    python3 tools/amalgamate.py --where N  the source file and line behind line N of coffer.py

What it does, and refuses to do:
  - modules are concatenated in LAYERS order, each under a banner naming its source file; the table of contents
    at the top is made from each module's first docstring line, with the line each module starts at;
  - ``from coffer_src.<module> import name, ...`` lines are dropped (every module shares one namespace in the
    output); such an import of a module later in LAYERS, of a name the module does not define, an aliased one,
    a relative or plain ``import coffer_src...``, or one inside a function fails the build;
  - standard-library imports at module level are hoisted to the top, de-duplicated; a module-level import of
    anything outside the standard library fails the build (a lazy one inside a function stays where it is);
  - a top-level name defined in two modules fails the build (in one namespace the later would silently win);
  - ``package_data("path")`` calls are replaced by the text of src/coffer_src/<path>, so data files (word lists,
    web assets) ship inside the one module;
  - ``logging.getLogger(__name__)`` gets the module's dotted name as the logger name ("coffer.vault"), since
    ``__name__`` in coffer.py is the same for every module.
Output is deterministic: the same sources always give the same bytes.
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "coffer_src"
PACKAGE_DIR = ROOT / "src" / PACKAGE
OUTPUT = ROOT / "coffer.py"
DIST_NAME = "coffer"  # logger names and banners say coffer.<module>, as users see them

# The layer order: each module may import only the standard library and modules above it in this list.
LAYERS = (
    "errors",
    "resources",
    "digests",
    "terminal",
    "jsonrpc",
    "threads",
    "modern",
    "names",
    "secret_store",
    "settings",
    "vault_rows",
    "vault_schema",
    "vault",
    "invocations",
    "profiles",
    "transport/stdio",
    "transport/http",
    "oauth",
    "transport/remote",
    "upstream/definitions",
    "upstream/requests",
    "upstream/listing",
    "upstream/supervisor",
    "search/lexicon",
    "search/text",
    "search/entities",
    "search/index",
    "search/semantic",
    "search/explain",
    "search/feedback",
    "search/preference",
    "catalogue",
    "knowledge/documents",
    "knowledge/ranking",
    "knowledge/base",
    "gateway/calls",
    "gateway/builtins",
    "gateway/pages",
    "gateway/sharing",
    "gateway/view",
    "gateway/hub",
    "gateway/routing",
    "gateway/bridge",
    "gateway/instances",
    "gateway/session",
    "service/channel",
    "service/relay",
    "service/server",
    "service/tokens",
    "service/http_wire",
    "service/http_session",
    "service/http",
    "service/commands",
    "probe",
    "clients/files",
    "clients/move_in",
    "clients/doctor",
    "profile_commands",
    "knowledge_commands",
    "remote_commands",
    "service/web_activity",
    "service/web_views",
    "service/web",
    "cli",
)
NOT_AMALGAMATED = {"__main__"}
#: Standard-library modules that cost a process real memory and start-up time to import and that most runs of
#: coffer.py never use (the relay behind `coffer serve`, a quick `coffer list`): coffer.py binds each to a module
#: object that imports it on first use.  Only `import X` may name them (a `from X import y` would load X at once).
LAZY_STDLIB = ("difflib", "hashlib", "hmac", "html", "ipaddress", "secrets", "shutil", "sqlite3", "subprocess",
               "tempfile")
LAZY_HELPER = '''

class _ImportedOnFirstUse:
    """A standard-library module bound by name and imported when first used (tools/amalgamate.py LAZY_STDLIB):
    most runs of coffer.py never need it.  After the import its names are copied in, so later uses cost what a
    plain module's do."""

    def __init__(self, name: str):
        self.__dict__["_name"] = name

    def __getattr__(self, attr: str):
        module = importlib.import_module(self.__dict__["_name"])
        self.__dict__.update(vars(module))
        return getattr(module, attr)

'''  # `python -m coffer_src` for development; coffer.py has its own __main__ block
RULE = "# " + "=" * 108
SUMMARY_MAX = 84  # a table-of-contents line (line number, module, summary) within 120 characters


class BuildError(Exception):
    """The sources break a rule of the amalgamation; the message names the file and line."""


def stdlib_modules() -> frozenset[str]:
    return frozenset(sys.stdlib_module_names) | {"__future__"}


def top_level_names(tree: ast.Module) -> dict[str, int]:
    """Names a module binds at its top level (functions, classes, assignments, loop targets), with their line."""
    names: dict[str, int] = {}

    def bind(target, line):
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                names.setdefault(node.id, line)

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.setdefault(node.name, node.lineno)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                bind(target, node.lineno)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            bind(node.target, node.lineno)
        elif isinstance(node, (ast.For, ast.With)):
            bind(node.target if isinstance(node, ast.For) else ast.Tuple(
                [item.optional_vars for item in node.items if item.optional_vars], ast.Load()), node.lineno)
    return names


class Module:
    """One source module: its text, its parsed form, and what the amalgamation keeps of it."""

    def __init__(self, layer: str):
        self.layer = layer
        self.path = PACKAGE_DIR / f"{layer}.py"
        if not self.path.is_file():
            raise BuildError(f"{self.rel}: listed in LAYERS but missing")
        self.text = self.path.read_text(encoding="utf-8")
        try:
            self.tree = ast.parse(self.text, str(self.path))
        except SyntaxError as exc:
            raise BuildError(f"{self.rel}:{exc.lineno}: {exc.msg}") from None
        self.defined = top_level_names(self.tree)
        doc = ast.get_docstring(self.tree, clean=True)
        if not doc:
            raise BuildError(f"{self.rel}: a module needs a docstring (its first line is its table-of-contents entry)")
        self.doc = doc
        self.summary = doc.splitlines()[0].strip()
        if len(self.summary) > SUMMARY_MAX:
            raise BuildError(f"{self.rel}: the docstring's first line is its table-of-contents entry: at most "
                             f"{SUMMARY_MAX} characters, not {len(self.summary)}")

    @property
    def rel(self) -> str:
        return f"src/{PACKAGE}/{self.layer}.py"

    @property
    def dotted(self) -> str:
        return self.layer.replace("/", ".")


def check_imports(module: Module, order: dict[str, int], defined_by: dict[str, dict[str, int]],
                  stdlib: frozenset[str]) -> tuple[list[tuple[int, int]], set[str], dict[str, set[str]]]:
    """The import rules for one module.  Returns the line spans to drop, the hoisted `import x` names and the
    hoisted `from x import y` names by module."""
    drop: list[tuple[int, int]] = []
    plain: set[str] = set()
    froms: dict[str, set[str]] = {}
    here = order[module.layer]
    top = set(map(id, module.tree.body))
    for node in ast.walk(module.tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        where = f"{module.rel}:{node.lineno}"
        at_top = id(node) in top
        if isinstance(node, ast.ImportFrom) and node.level:
            raise BuildError(f"{where}: relative import; import names with `from {PACKAGE}.<module> import ...`")
        roots = [alias.name.split(".")[0] for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module.split(".")[0]]
        if PACKAGE in roots:
            if isinstance(node, ast.Import):
                raise BuildError(f"{where}: `import {PACKAGE}...` would need the module's name at run time; "
                                 f"import the names themselves")
            if not at_top:
                raise BuildError(f"{where}: a package import inside a function or block cannot be amalgamated")
            if node.module == PACKAGE:
                if [alias.name for alias in node.names] != ["__version__"]:
                    raise BuildError(f"{where}: the package itself exports only __version__")
                drop.append((node.lineno, node.end_lineno))
                continue
            source = node.module[len(PACKAGE) + 1:].replace(".", "/")
            if source not in order:
                raise BuildError(f"{where}: {node.module} is not a module listed in LAYERS")
            if order[source] >= here:
                raise BuildError(f"{where}: {module.layer} imports {source}, which comes at or after it in the "
                                 f"layer order")
            for alias in node.names:
                if alias.asname:
                    raise BuildError(f"{where}: `import {alias.name} as {alias.asname}` would be a second name in "
                                     f"one namespace")
                if alias.name not in defined_by[source]:
                    raise BuildError(f"{where}: {source} does not define {alias.name}")
            drop.append((node.lineno, node.end_lineno))
            continue
        outside = [root for root in roots if root not in stdlib]
        if not at_top:
            continue  # a lazy import stays where it is: optional packages are imported this way
        if outside:
            raise BuildError(f"{where}: {', '.join(outside)} is not in the standard library; import it lazily "
                             f"inside the function that needs it")
        drop.append((node.lineno, node.end_lineno))
        if isinstance(node, ast.Import):
            for alias in node.names:
                plain.add(alias.name if not alias.asname else f"{alias.name} as {alias.asname}")
        elif node.module != "__future__":
            froms.setdefault(node.module, set()).update(
                alias.name if not alias.asname else f"{alias.name} as {alias.asname}" for alias in node.names)
    return drop, plain, froms


def docstring_span(module: Module) -> tuple[int, int] | None:
    first = module.tree.body[0] if module.tree.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.lineno, first.end_lineno
    return None


def data_literal(call: ast.Call, module: Module) -> str:
    if len(call.args) != 1 or call.keywords or not isinstance(call.args[0], ast.Constant) \
            or not isinstance(call.args[0].value, str):
        raise BuildError(f"{module.rel}:{call.lineno}: package_data() takes one literal path")
    name = call.args[0].value
    path = (PACKAGE_DIR / name).resolve()
    if PACKAGE_DIR.resolve() not in path.parents or not path.is_file():
        raise BuildError(f"{module.rel}:{call.lineno}: no data file src/{PACKAGE}/{name}")
    return text_literal(path.read_text(encoding="utf-8"))


DATA_WIDTH = 96  # characters of data per line of the literal, so coffer.py stays readable at 120 columns


def text_literal(text: str) -> str:
    """A data file's text as a parenthesised run of string literals, one file line (or a slice of a long one)
    per line of coffer.py: diffable and readable where it is embedded."""
    pieces = []
    for line in text.splitlines(keepends=True):
        while len(line) > DATA_WIDTH:
            pieces.append(line[:DATA_WIDTH])
            line = line[DATA_WIDTH:]
        pieces.append(line)
    if len(pieces) <= 1:
        return repr(text)
    body = "\n".join("    " + repr(piece) for piece in pieces)
    return f"(\n{body}\n)"


def rewritten_lines(module: Module, drop: list[tuple[int, int]]) -> list[tuple[int, str]]:
    """The module's lines as they go into coffer.py, each with its source line number (0 for inserted text):
    docstring and imports dropped, data inlined, logger names filled in."""
    replacements: dict[tuple[int, int], tuple[int, int, str]] = {}
    for node in ast.walk(module.tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "package_data":
            replacements[(node.lineno, node.col_offset)] = (node.end_lineno, node.end_col_offset,
                                                            data_literal(node, module))
        elif isinstance(func, ast.Attribute) and func.attr == "getLogger" and len(node.args) == 1 \
                and isinstance(node.args[0], ast.Name) and node.args[0].id == "__name__":
            arg = node.args[0]
            replacements[(arg.lineno, arg.col_offset)] = (arg.end_lineno, arg.end_col_offset,
                                                          repr(f"{DIST_NAME}.{module.dotted}"))
    source = module.text.splitlines()
    skip = set()
    span = docstring_span(module)
    if span:
        skip.update(range(span[0], span[1] + 1))
    for start, end in drop:
        skip.update(range(start, end + 1))
    out: list[tuple[int, str]] = []
    line_no = 0
    while line_no < len(source):
        line_no += 1
        if line_no in skip:
            continue
        line = source[line_no - 1]
        starts = sorted(col for (ln, col) in replacements if ln == line_no)
        if not starts:
            out.append((line_no, line))
            continue
        # Replacements are applied left to right; one that spans lines swallows the lines it covers.
        text, col, cur_line = "", 0, line_no
        for start_col in starts:
            end_line, end_col, literal = replacements[(line_no, start_col)]
            text += line[col:start_col] + literal
            col, cur_line = end_col, end_line
        tail_source = source[cur_line - 1]
        text += tail_source[col:]
        out.extend((line_no, piece) for piece in text.split("\n"))
        line_no = cur_line
    while out and not out[0][1].strip():
        out.pop(0)
    while out and not out[-1][1].strip():
        out.pop()
    return out


def check_tokens(module: Module) -> None:
    """Tabs for indentation or a missing final newline would make the output differ by platform or editor."""
    if not module.text.endswith("\n"):
        raise BuildError(f"{module.rel}: the file must end with a newline")
    for token in tokenize.generate_tokens(io.StringIO(module.text).readline):
        if token.type == tokenize.INDENT and "\t" in token.string:
            raise BuildError(f"{module.rel}:{token.start[0]}: indentation with a tab")


def build() -> tuple[str, list[tuple[int, str, int]]]:
    """The text of coffer.py, and for each of its lines (1-based) the source file and line it came from."""
    stdlib = stdlib_modules()
    on_disk = {str(p.relative_to(PACKAGE_DIR).with_suffix("")).replace("\\", "/")
               for p in PACKAGE_DIR.rglob("*.py") if p.name != "__init__.py"} - NOT_AMALGAMATED
    stray = on_disk - set(LAYERS)
    if stray:
        raise BuildError(f"modules not in LAYERS (add them in their layer): {', '.join(sorted(stray))}")
    for package in sorted({p.parent for p in PACKAGE_DIR.rglob("*.py")}):
        marker = package / "__init__.py"
        if not marker.is_file():
            raise BuildError(f"{package.relative_to(ROOT)} has no __init__.py")
        body = ast.parse(marker.read_text(encoding="utf-8")).body
        if package != PACKAGE_DIR and any(not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
                                          for node in body):
            raise BuildError(f"{marker.relative_to(ROOT)}: a subpackage's __init__.py holds a docstring only "
                             f"(its code would not reach coffer.py)")
    init_path = PACKAGE_DIR / "__init__.py"
    init = ast.parse(init_path.read_text(encoding="utf-8"))
    package_doc = ast.get_docstring(init, clean=True)
    version = next((node.value.value for node in init.body if isinstance(node, ast.Assign)
                    and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
                    and isinstance(node.value, ast.Constant)), None)
    if not package_doc or not isinstance(version, str):
        raise BuildError(f"src/{PACKAGE}/__init__.py needs the package docstring and __version__ = '...'")
    modules = [Module(layer) for layer in LAYERS]
    order = {m.layer: i for i, m in enumerate(modules)}
    defined_by = {m.layer: m.defined for m in modules}
    owner: dict[str, Module] = {}
    for module in modules:
        check_tokens(module)
        for name, line in module.defined.items():
            if name in owner:
                first = owner[name]
                raise BuildError(f"{module.rel}:{line}: {name} is also defined in {first.rel}:"
                                 f"{first.defined[name]}; in one namespace the later would silently win")
            owner[name] = module
    plain: set[str] = set()
    froms: dict[str, set[str]] = {}
    bodies = []
    for module in modules:
        drop, module_plain, module_froms = check_imports(module, order, defined_by, stdlib)
        plain |= module_plain
        for name, names in module_froms.items():
            froms.setdefault(name, set()).update(names)
        bodies.append(rewritten_lines(module, drop))
    early = sorted(name for name in froms if name in LAZY_STDLIB)
    if early:
        raise BuildError(f"`from {early[0]} import ...` loads {early[0]} at start-up; it is imported on first use "
                         f"(LAZY_STDLIB): write `import {early[0]}` and use {early[0]}.<name>")
    bound_by: dict[str, str] = {}
    for source, names in sorted(froms.items()):
        for name in names:
            bound = name.split(" as ")[-1]
            if bound in bound_by and bound_by[bound] != source:
                raise BuildError(f"{bound} is imported from both {bound_by[bound]} and {source}; in one namespace "
                                 f"one would silently replace the other")
            bound_by[bound] = source
    imported = {name.split(" as ")[-1].split(".")[0] for name in plain}
    imported |= {name.split(" as ")[-1] for names in froms.values() for name in names}
    clash = imported & set(owner)
    if clash:
        name = sorted(clash)[0]
        raise BuildError(f"{owner[name].rel}: {name} is also a hoisted import's name")

    head = ["#!/usr/bin/env python3",
            f"# GENERATED by tools/amalgamate.py from src/{PACKAGE}/ ({len(modules)} modules): do not edit this",
            "# file; edit the module named in the banner above the line you want to change, then regenerate.",
            '"""' + package_doc.replace("\\", "\\\\"), "",
            "Contents: the line of coffer.py where each module starts, the module, what it holds.", ""]
    toc_at = len(head)
    head += [""] * len(modules)  # filled in once the start lines are known
    head += ['"""', "", "from __future__ import annotations", ""]
    lazy = sorted(name for name in plain if name in LAZY_STDLIB)
    eager = sorted(name for name in plain if name not in LAZY_STDLIB) + (["importlib"] if lazy else [])
    head += [f"import {name}" for name in sorted(set(eager))]
    head += [f"from {name} import {', '.join(sorted(names))}" for name, names in sorted(froms.items())]
    if lazy:
        head += LAZY_HELPER.split("\n")
        head += [f"{name} = _ImportedOnFirstUse({name!r})" for name in lazy]
    head += ["", f"__version__ = {version!r}"]
    lines: list[str] = list(head)
    origin: list[tuple[int, str, int]] = [(i + 1, "(generated)", 0) for i in range(len(head))]
    starts = []
    for module, body in zip(modules, bodies):
        banner = ["", "", RULE, f"# {module.rel}", f"# {module.summary}", RULE]
        rest = module.doc.splitlines()[1:]
        while rest and not rest[0].strip():
            rest.pop(0)
        banner += [f"# {text}".rstrip() for text in rest]
        banner.append("")
        for text in banner:
            lines.append(text)
            origin.append((len(lines), module.rel, 0))
        starts.append(len(lines) - len(banner) + 4)
        for src_line, text in body:
            lines.append(text)
            origin.append((len(lines), module.rel, src_line))
    width = max(len(m.dotted) for m in modules)
    for i, (module, start) in enumerate(zip(modules, starts)):
        lines[toc_at + i] = f"    {start:>6}  {module.dotted:<{width}}  {module.summary}"
    text = "\n".join(lines) + "\n"
    compile(text, str(OUTPUT), "exec")
    return text, origin


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if coffer.py is not what would be written")
    parser.add_argument("--where", type=int, metavar="LINE", help="the source file and line behind a coffer.py line")
    args = parser.parse_args(argv)
    try:
        text, origin = build()
    except BuildError as exc:
        print(f"amalgamate: {exc}", file=sys.stderr)
        return 2
    if args.where is not None:
        if not 1 <= args.where <= len(origin):
            print(f"amalgamate: coffer.py has {len(origin)} lines", file=sys.stderr)
            return 2
        _, path, line = origin[args.where - 1]
        print(f"{path}:{line}" if line else f"{path} (banner or generated text)")
        return 0
    current = OUTPUT.read_bytes() if OUTPUT.exists() else b""
    wanted = text.encode("utf-8")
    if args.check:
        if current != wanted:
            print("amalgamate: coffer.py is not what src/ generates; run `python3 tools/amalgamate.py` and commit "
                  "both", file=sys.stderr)
            return 1
        return 0
    if current != wanted:
        OUTPUT.write_bytes(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())

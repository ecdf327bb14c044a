"""Terminal and logging: text safe for a terminal, secret redaction, the log's format."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading

# -- what reaches a terminal or a log --------------------------------------------------------------------------
# Every diagnostic goes to stderr through Python's logging (each module has its logger, named after it):
# stdout belongs to the JSON-RPC stream.  Text an upstream wrote (its stderr, tool descriptions, error messages)
# passes through printable() before a terminal sees it, and every known secret value is replaced by *** before
# anything is printed, logged or stored.
log = logging.getLogger("coffer")  # the old shared logger, for modules not yet on their own: new code never uses it
terminal_log = logging.getLogger(__name__)

_UNPRINTABLE_RE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def _visible(match) -> str:
    char = match.group()
    return "\ufffd" if "\ud800" <= char <= "\udfff" else f"\\x{ord(char):02x}"


def printable(text) -> str:
    """``text`` made safe for a terminal: C0/C1 control characters (ESC, BEL, CR, OSC 52 clipboard writes...) shown
    as visible \\xNN, lone surrogates as U+FFFD; newlines and tabs stay."""
    text = str(text)
    return _UNPRINTABLE_RE.sub(_visible, text) if _UNPRINTABLE_RE.search(text) else text


_JSON_UNSAFE_RE = re.compile("[\x7f-\x9f\ud800-\udfff\u2028\u2029]")


ELLIPSIS = "..."  # ASCII: a cut line must print on any console encoding, like the text it stands for


def clip(text, limit: int) -> str:
    """``text`` cut for display to at most ``limit`` characters, ending in "..." when something was cut (so a
    reader knows there is more).  Only for what a person reads: stored values and protocol fields are bounded
    by plain slices, since an ellipsis there would be taken for content."""
    text = str(text)
    if len(text) <= limit or limit <= len(ELLIPSIS):
        return text[:max(0, limit)]
    return text[:limit - len(ELLIPSIS)] + ELLIPSIS


def terminal_json(value) -> str:
    """Pretty JSON for a terminal: json escapes C0 itself; DEL, C1 and lone surrogates are escaped here too."""
    text = json.dumps(value, indent=2, ensure_ascii=False, default=str)
    return _JSON_UNSAFE_RE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


class Redactor:
    """Every secret value this process knows: the secret store's values and what ${VAR} references expanded to.

    ``redact(text)`` replaces each with *** — applied to every log record, to stored stderr and status details, and
    to CLI output; ``redact.scrub(message)`` does the same to what goes to a client (results, errors, notifications:
    an upstream that echoes its environment must not hand a token to the agent, and through it to the model's
    provider).  Values shorter than MIN_LENGTH are not redacted (they would blank out ordinary words).
    """

    MIN_LENGTH = 4

    def __init__(self):
        self._values: tuple[str, ...] = ()
        self._search = None   # one compiled alternation of every value: a string is looked at once, in C
        self._lock = threading.Lock()

    def add(self, *values) -> None:
        """Register values, with the forms JSON and repr() give them (a secret holding a quote, a backslash or a
        newline is printed escaped by --json output and %r log arguments)."""
        forms = set()
        for value in values:
            if isinstance(value, str) and len(value) >= self.MIN_LENGTH:
                forms.update({value, json.dumps(value, ensure_ascii=False)[1:-1], json.dumps(value)[1:-1],
                              repr(value)[1:-1]})
        fresh = forms - set(self._values)
        if fresh:
            with self._lock:  # longest first, so a secret containing another is replaced whole
                self._values = tuple(sorted(set(self._values) | fresh, key=len, reverse=True))
                self._search = re.compile("|".join(map(re.escape, self._values))).search

    def add_named(self, pairs) -> None:
        """Register (name, value) pairs from the secret store or expanded ${NAME} references: a value counts as a
        secret when its name says so (KEY, TOKEN, SECRET, PASSWORD, AUTH...) or it looks like a credential.  So a
        setting that went to the store as a literal (MODE=enabled, DEBUG=true) is not blanked out of every line
        Coffer prints."""
        self.add(*(value for name, value in pairs if isinstance(value, str) and looks_secret(name, value)))

    def __call__(self, text: str) -> str:
        for value in self._values:
            if value in text:
                text = text.replace(value, "***")
        return text

    def scrub(self, value):
        """A JSON value (a message for a client) with every known secret in its strings and keys replaced: the
        same object, untouched, when none holds one -- the usual case, which costs one look at each string."""
        search = self._search
        if search is None or not _holds_secret(value, search, self._values, 0):
            return value
        return _scrubbed(value, self, 0)


def _holds_secret(value, search, values: tuple[str, ...], depth: int) -> bool:
    if isinstance(value, str):
        return search(value) is not None
    if depth > 200:
        return False
    if isinstance(value, dict):
        text = getattr(value, "json", None)  # a result that carries the JSON text it is written as (EncodedResult)
        if isinstance(text, str):
            # That text is what the client receives.  JSON escapes a string character by character, so a string
            # holding a secret holds the secret's JSON form there, one of the forms add() registered; a match
            # across two strings only costs the walk that follows.  One long text: a substring test per form.
            return any(form in text for form in values)
        for key, item in value.items():
            if search(key) is not None or _holds_secret(item, search, values, depth + 1):
                return True
        return False
    if isinstance(value, list):
        for item in value:
            if _holds_secret(item, search, values, depth + 1):
                return True
    return False


def _scrubbed(value, redactor: Redactor, depth: int):
    if isinstance(value, str):
        return redactor(value)
    if depth > 200:
        return value
    if isinstance(value, dict):
        return {redactor(key) if isinstance(key, str) else key: _scrubbed(item, redactor, depth + 1)
                for key, item in value.items()}
    if isinstance(value, list):
        return [_scrubbed(item, redactor, depth + 1) for item in value]
    return value


redact = Redactor()

_SECRET_NAME_RE = re.compile(r"(?i)key|token|secret|passw|pwd|auth|cred|cookie|session|private|signature|bearer")
_TOKEN_PREFIXES = ("sk-", "pk-", "ghp_", "gho_", "ghs_", "ghu_", "github_pat_", "xox", "glpat-", "AKIA", "ASIA",
                   "AIza", "ya29.", "eyJ", "shpat_", "sq0", "rk_", "whsec_", "npm_", "pypi-")
_PLAIN_VALUE_RE = re.compile(r"(?i)^(?:-?\d+(?:\.\d+)?|true|false|yes|no|on|off|none|null|enabled|disabled|"
                             r"debug|info|warn|warning|error|v?\d+(?:\.\d+)+(?:[-+.][\w.]+)?)$")
_PATH_RE = re.compile(r"^(?:[/~]|\.{1,2}[/\\]|[A-Za-z]:[/\\]|\\\\|file:)")
_TOKEN_ALPHABET_RE = re.compile(r"^[A-Za-z0-9_\-.+/=~]+$")
_HEX_RE = re.compile(r"^[0-9a-fA-F]+$")


def plainly_not_secret(value: str) -> bool:
    """A value no credential looks like: empty, a number, a version, a boolean or level word, a file path, or a
    URL that carries no user:password@."""
    if not value or _PLAIN_VALUE_RE.match(value) or _PATH_RE.match(value):
        return True
    scheme, sep, rest = value.partition("://")
    return bool(sep) and scheme.isalpha() and "@" not in rest.partition("/")[0]


def looks_secret(name: str, value: str) -> bool:
    """Whether a named value is a credential, by the one rule Coffer uses everywhere (what --env, --header, a
    command's arguments and an import move to the secret store; which resolved ${NAME} values are redacted): by
    its name (KEY, TOKEN, SECRET, PASSWORD, AUTH...) unless the value is plainly something else (a path, a number,
    a plain URL...), or by its shape (a known token prefix, a URL holding user:password@, or a long
    random-looking string)."""
    if not isinstance(value, str) or plainly_not_secret(value):
        return False
    if _SECRET_NAME_RE.search(name or ""):
        return True
    if len(value) < 8 or any(c.isspace() for c in value):
        return False
    if value.startswith(_TOKEN_PREFIXES) or ":" in value.partition("://")[2].partition("/")[0].rpartition("@")[0]:
        return True
    if len(value) < 20 or not _TOKEN_ALPHABET_RE.match(value) or "==" in value.rstrip("="):
        return False
    classes = sum(any(test(c) for c in value) for test in (str.islower, str.isupper, str.isdigit))
    return classes == 3 or (len(value) >= 32 and _HEX_RE.match(value) is not None)


class _TerminalFormatter(logging.Formatter):
    """``coffer: message``, redacted and printable; a traceback when COFFER_LOG=debug or stderr is not a terminal
    (a client's log file), else one line naming the exception, so a user never faces a traceback."""

    def __init__(self, tracebacks: bool):
        super().__init__()
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        text = f"coffer: {record.getMessage()}"
        if record.exc_info and record.exc_info[1] is not None:
            if self.tracebacks:
                text += "\n" + self.formatException(record.exc_info)
            else:
                exc = record.exc_info[1]
                text += f" [{exc.__class__.__name__}: {exc}; COFFER_LOG=debug shows the traceback]"
        return printable(redact(text))


class ServerLog(logging.LoggerAdapter):
    """A module's logger for lines about one upstream server: each reads ``[name] message``."""

    def __init__(self, logger: logging.Logger, server: str):
        super().__init__(logger, {"server": server})

    def process(self, msg, kwargs):
        return f"[{self.extra['server']}] {msg}", kwargs


def configure_logging(default: str = "info") -> None:
    """Log to stderr at COFFER_LOG's level (debug traces every message), else at ``default``: info for
    `serve` (whose stderr is the client's log of it), warning for commands a person reads.  Idempotent.

    The handler sits on the root logger: coffer is the program here (this runs from its command line), and each
    module's logger is named after the module, which differs between coffer.py and the development package."""
    root = logging.getLogger()
    if any(isinstance(handler.formatter, _TerminalFormatter) for handler in root.handlers):
        return
    level = (os.environ.get("COFFER_LOG") or default).strip().upper()
    root.setLevel(getattr(logging, level) if level in ("DEBUG", "INFO", "WARNING", "ERROR") else logging.INFO)
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_TerminalFormatter(tracebacks=root.level <= logging.DEBUG or not tty))
    root.addHandler(handler)

    def excepthook(args):  # a thread that dies says so, with its traceback, through the same redaction
        if args.exc_type is not SystemExit:
            terminal_log.error("thread %s died", getattr(args.thread, "name", "?"),
                               exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

    threading.excepthook = excepthook


def say(text="") -> None:
    """Print for a human: known secrets redacted, terminal control characters made visible."""
    print(printable(redact(str(text))))


def say_json(value) -> None:
    print(redact(terminal_json(value)))


def _print_table(rows: list[list], headers: list[str]) -> None:
    cells = [[printable(redact(str(cell))).replace("\n", " ") for cell in row] for row in [headers] + rows]
    widths = [max(len(cell) for cell in column) for column in zip(*cells)]
    for row in cells:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())

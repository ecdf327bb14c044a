"""Secrets: ${VAR} references, the secret store, private files, upstream environments."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import urllib.parse

from coffer_src.digests import sha256
from coffer_src.errors import CofferError
from coffer_src.jsonrpc import decode_json
from coffer_src.names import ENV_KEY_RE, ENV_NAME_PATTERN
from coffer_src.terminal import looks_secret, plainly_not_secret, redact

secret_store_log = logging.getLogger(__name__)

# -- private files ----------------------------------------------------------------------------------------------


def private_temporary_file(directory: str, prefix: str, suffix: str) -> tuple[int, str]:
    """A new file in ``directory``, created 0600 and exclusively (never an existing file or a link followed),
    opened for writing: its descriptor and path.  tempfile.mkstemp's guarantees, without importing tempfile,
    which brings shutil and random into a long-running service that has no other use for them."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        path = os.path.join(directory, f"{prefix}{os.urandom(6).hex()}{suffix}")
        try:
            return os.open(path, flags, 0o600), path
        except FileExistsError:
            continue  # another writer's name: draw again
    raise FileExistsError(f"no free temporary name in {directory}")


def write_private_file(path: str, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` atomically and durably: a reader sees the old file or the new one, never
    half of either, and after a crash the new one is there whole or not at all.

    The data goes to a temporary file beside ``path`` (created 0600, so it is never readable by others, even for
    a moment), is flushed to disk, gets ``mode``, and is renamed over ``path``; then the directory is flushed
    too, so the rename itself survives a power cut (POSIX; Windows has no directory handle to flush).  OSError
    on failure, with the temporary file removed.  The one way Coffer writes a file it owns or a client config.
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, temporary = private_temporary_file(directory, ".coffer-", ".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if os.name != "nt":
            os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    if os.name != "nt":
        try:
            directory_fd = os.open(directory, os.O_RDONLY)
        except OSError:
            return  # the file is in place; only its durability across a power cut is not confirmed
        try:
            os.fsync(directory_fd)
        except OSError:
            pass  # some filesystems cannot flush a directory; the rename is still atomic
        finally:
            os.close(directory_fd)


# -- ${VAR} references and the secret store ------------------------------------------------------------------

#: ``${NAME}`` or ``${NAME:-default}``: the one reference syntax (group 1 the name, group 2 the default or None).
ENV_REF_RE = re.compile(rf"\$\{{({ENV_NAME_PATTERN})(?::-([^}}]*))?\}}")
SECRET_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,127}$")
SECRET_MAX_CHARS = 64 << 10  # a secret value's longest text (`coffer secret set` reads no more)


def whole_reference(value: str) -> str | None:
    """NAME when ``value`` is exactly one ``${NAME}`` (no default, nothing around it), else None."""
    match = ENV_REF_RE.fullmatch(value) if isinstance(value, str) else None
    return match.group(1) if match and match.group(2) is None else None


def references(config: dict) -> list[tuple[str, bool]]:
    """(NAME, has a default) for every ${NAME} in what Coffer expands when it starts a server: its URL, working
    directory, command, env and header values."""
    texts = [config.get("url") or "", config.get("cwd") or "", *(config.get("command") or ()),
             *(config.get("env") or {}).values(), *(config.get("headers") or {}).values()]
    return [(match.group(1), match.group(2) is not None) for text in texts for match in ENV_REF_RE.finditer(text)]


def expand_vars(value: str, environ=None, missing=None, secrets: SecretStore | None = None,
                substituted: list | None = None) -> str:
    """Expand ``${VAR}`` and ``${VAR:-default}``: from the environment first, then from the secret store.

    Values are stored unexpanded, so a secret only ever exists in the gateway's and the upstream's memory.
    Names found nowhere (and without a default) are appended to ``missing``; the values put in place of a
    reference, as (name, value), to ``substituted`` (what may then need redacting wherever it shows up).
    """
    environ = os.environ if environ is None else environ

    def replace(match):
        name, default = match.group(1), match.group(2)
        current = environ.get(name)
        if current is None and secrets is not None:
            current = secrets.get(name)
        if current is None or (current == "" and default is not None):
            if default is None and missing is not None:
                missing.append(name)
            return default or ""
        if substituted is not None:
            substituted.append((name, current))
        return current

    return ENV_REF_RE.sub(replace, value)


class SecretStore:
    """Named secret values, in COFFER_HOME/secrets.json (0600 inside the 0700 home), never in coffer.db.

    Why a file rather than an OS keychain: none is reachable from the standard library on all three systems
    (macOS needs the `security` tool, Windows DPAPI needs ctypes, Linux's Secret Service needs a D-Bus session that
    a headless or SSH agent host usually lacks), and the agent host must work air-gapped and unattended.  A private
    file is what ssh, aws and gh use; it is as safe as the user's account.

    Any thread, any process: a read re-parses the file only when its mtime or size changed; a write replaces it
    atomically (write a private temporary file, then rename), so no reader ever sees half of it.  Every value read
    (but a plain number, word or path a user kept there) is registered with the redactor, so it never reaches a
    log, the terminal or a client.
    """

    MAX_BYTES = 1 << 20

    def __init__(self, home: str):
        self.path = os.path.join(home, "secrets.json")
        self._values: dict[str, str] = {}
        self._stamp = None
        self._problem: str | None = None
        self._lock = threading.Lock()

    def _read(self) -> dict[str, str]:
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise CofferError(f"cannot read the secret store {self.path}: {exc.strerror or exc}") from None
        stamp = (info.st_mtime_ns, info.st_size, info.st_ino)
        with self._lock:
            if stamp == self._stamp:
                if self._problem:
                    raise CofferError(self._problem)
                return self._values
        problem, values = None, {}
        try:
            if info.st_size > self.MAX_BYTES:
                raise ValueError(f"larger than {self.MAX_BYTES} bytes")
            with open(self.path, "rb") as handle:
                data = decode_json(handle.read(self.MAX_BYTES + 1))
            if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in data.items()):
                raise ValueError("not an object of names to text values")
            values = data
        except (OSError, ValueError) as exc:
            problem = f"the secret store {self.path} is damaged ({exc}); fix or remove it"
        redact.add(*(value for value in values.values() if not plainly_not_secret(value)))
        with self._lock:
            self._values, self._stamp, self._problem = values, stamp, problem
        if problem:
            raise CofferError(problem)
        return values

    def get(self, name: str) -> str | None:
        """The value, or None when absent (a damaged store is logged once and treated as empty)."""
        try:
            return self._read().get(name)
        except CofferError as exc:
            if self._problem != getattr(self, "_reported", None):
                self._reported = self._problem
                secret_store_log.warning("%s", exc)
            return None

    def names(self) -> list[str]:
        return sorted(self._read())

    def values(self) -> list[str]:
        try:
            return list(self._read().values())
        except CofferError:
            return []

    def set(self, name: str, value: str) -> None:
        if not SECRET_NAME_RE.match(name or ""):
            raise CofferError(f"invalid secret name {name!r}: use letters, digits and _ (start with a letter)")
        if not isinstance(value, str) or "\x00" in value or len(value) > SECRET_MAX_CHARS:
            raise CofferError(f"a secret value must be text without NUL bytes, at most {SECRET_MAX_CHARS >> 10} KiB")
        values = dict(self._read())
        values[name] = value
        self._write(values)

    def delete(self, name: str) -> bool:
        values = dict(self._read())
        if values.pop(name, None) is None:
            return False
        self._write(values)
        return True

    def _write(self, values: dict[str, str]) -> None:
        try:
            write_private_file(self.path, json.dumps(values, indent=1, sort_keys=True).encode("utf-8"))
        except OSError as exc:
            raise CofferError(f"cannot write the secret store {self.path}: {exc.strerror or exc}") from None
        redact.add(*(value for value in values.values() if not plainly_not_secret(value)))
        with self._lock:
            self._stamp = None  # re-read on next use, whoever wrote last


_AUTH_SCHEME_RE = re.compile(r"^(Bearer|Basic|Token|Bot|Digest)\s+(\S.*)$", re.I | re.S)


def secret_name_for(server: str, key: str) -> str:
    """The store name a literal value of ``key`` gets: ``<SERVER>_<KEY>`` (GITHUB_TOKEN of server github stays
    GITHUB_TOKEN), a legal ${NAME}."""
    prefix = re.sub(r"[^A-Z0-9]+", "_", server.upper()).strip("_")
    key = re.sub(r"[^A-Z0-9]+", "_", key.upper()).strip("_") or "VALUE"
    name = key if key.startswith(prefix + "_") else f"{prefix}_{key}"
    return name if not name[0].isdigit() else f"S_{name}"


def plan_literals(server: str, values: dict[str, str], secrets: SecretStore, header: bool = False,
                  overwrite: bool = False, planned: dict | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """The one rule for literal --env/--header values (add, import): each that looks like a credential
    (terminal.looks_secret, by its name or its shape) goes to the secret store and the definition keeps a ${NAME}
    reference; a path, a mode, a number stays as it is, readable in `coffer show`.  Returns (the mapping with
    references, {name: value} to store), and writes nothing: the caller stores them only once the definition is
    accepted (``save_secrets``).

    For an Authorization-style header only the credential moves ("Bearer ${NAME}"), so the stored definition still
    reads as what it is.  A name already holding another value gets a numbered twin, unless ``overwrite`` (the
    server's definition is being replaced).  ``planned`` shares names across calls of one run (an import of many
    servers).
    """
    planned = {} if planned is None else planned
    result, mine = {}, {}
    for key, value in values.items():
        scheme, credential = "", value
        match = _AUTH_SCHEME_RE.match(value) if header else None
        if match:
            scheme, credential = match.group(1) + " ", match.group(2)
        if value == "" or ENV_REF_RE.search(value) or not looks_secret(key, credential):
            result[key] = value
            continue
        base = secret_name_for(server, key)
        name, n = base, 1
        while True:
            held = planned.get(name)
            held = secrets.get(name) if held is None else held
            if held is None or held == credential or (overwrite and name not in planned):
                break
            n += 1
            name = f"{base}_{n}"
        planned[name] = mine[name] = credential
        result[key] = f"{scheme}${{{name}}}"
    return result, mine


_ARGUMENT_ASSIGNMENT_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.-]{0,127})(=|:\s*)(.+)$", re.S)


def plan_argument_literals(server: str, argv: list[str], secrets: SecretStore, overwrite: bool = False,
                           planned: dict | None = None) -> tuple[list[str], dict[str, str]]:
    """A command line with the credentials among its arguments moved to the store, by the rule of --env values:
    ``--token VALUE``, ``--token=VALUE``, ``-e NAME=VALUE`` (docker), ``--header 'Authorization: Bearer VALUE'`` and
    a bare argument shaped like a token become ${NAME} references (Coffer expands them when it starts the server).
    Returns (the new argv, {name: value} to store); writes nothing.  The program itself (argv[0]) is left alone."""
    planned = {} if planned is None else planned
    result, moved = list(argv[:1]), {}
    for index, arg in enumerate(argv[1:], 1):
        previous = argv[index - 1] if index > 1 else ""
        flag = previous.lstrip("-") if previous.startswith("-") and "=" not in previous else ""
        key, separator, value = "", "", arg
        if arg.startswith("-") and "=" in arg:
            key, _, value = arg.partition("=")
            separator, key = "=", key.lstrip("-")
        elif (assignment := _ARGUMENT_ASSIGNMENT_RE.match(arg)) and not arg.startswith("-") and "://" not in arg:
            key, separator, value = assignment.groups()  # NAME=VALUE, or a header line "Name: value"
        name = key or flag or "ARG"
        refs, found = ({name: value}, {}) if ENV_REF_RE.search(value) else plan_literals(
            server, {name: value}, secrets, header=True, overwrite=overwrite, planned=planned)
        if not found:
            result.append(arg)
            continue
        moved.update(found)
        result.append(arg[:len(arg) - len(value)] + refs[name])
    return result, moved


_SECRET_QUERY_RE = re.compile(r"(?i)^(?:.*[_-])?(?:key|token|secret|password|passwd|pwd|auth|signature|sig|"
                              r"credential|apikey|access[_-]?token)$")


def plan_url_literals(server: str, url: str, secrets: SecretStore, overwrite: bool = False,
                      planned: dict | None = None) -> tuple[str, dict[str, str]]:
    """A URL with its credentials moved to the store like --env values: the password of user:password@ and query
    parameters named like keys and tokens (?api_key=...) become ${NAME} references."""
    parts = urllib.parse.urlsplit(url)
    moved: dict[str, str] = {}
    netloc = parts.netloc
    if parts.password and "${" not in parts.password:
        refs, found = plan_literals(server, {"URL_PASSWORD": parts.password}, secrets, overwrite=overwrite,
                                    planned=planned)
        moved.update(found)
        netloc = netloc.replace(":" + parts.password + "@", ":" + refs["URL_PASSWORD"] + "@", 1)
    query = []
    for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if _SECRET_QUERY_RE.match(key) and value and "${" not in value:
            refs, found = plan_literals(server, {f"URL_{key}": value}, secrets, overwrite=overwrite, planned=planned)
            moved.update(found)
            value = refs[f"URL_{key}"]
        query.append(f"{urllib.parse.quote(key, safe='')}={value if '${' in value else urllib.parse.quote(value)}")
    if not moved:
        return url, moved
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "&".join(query), parts.fragment)), moved


def save_secrets(secrets: SecretStore, values: dict[str, str]) -> None:
    for name, value in values.items():
        if secrets.get(name) != value:
            secrets.set(name, value)


def resolution_digest(config: dict, secrets: SecretStore | None) -> str:
    """A digest of what a server's ${NAME} references resolve to now: when `coffer secret set` changes one, a
    running gateway restarts that server with the new value (and only that server)."""
    names = sorted({name for name, _ in references(config)})
    values = [f"{name}={os.environ[name] if name in os.environ else (secrets.get(name) if secrets else None)}"
              for name in names]
    return sha256("\0".join(values).encode("utf-8", "surrogatepass")).hexdigest()


# -- an upstream's environment -------------------------------------------------------------------------------
# A stdio upstream gets what a program needs to run and to reach the user's package registry through the
# user's proxy and certificates, plus its own --env; never the rest of Coffer's environment, where other
# servers' tokens and the user's cloud keys live.  --inherit-env NAME (or '*') passes more, explicitly.

SAFE_ENV_NAMES = frozenset("""
PATH HOME USER LOGNAME USERNAME SHELL TERM COLORTERM LANG LANGUAGE TZ TMPDIR TMP TEMP PWD
HTTP_PROXY HTTPS_PROXY NO_PROXY ALL_PROXY FTP_PROXY SSL_CERT_FILE SSL_CERT_DIR REQUESTS_CA_BUNDLE CURL_CA_BUNDLE
NODE_EXTRA_CA_CERTS GIT_SSL_CAINFO JAVA_HOME GOPATH GOROOT GOPROXY CARGO_HOME RUSTUP_HOME DENO_DIR BUN_INSTALL
PNPM_HOME COREPACK_HOME
SYSTEMROOT SYSTEMDRIVE WINDIR COMSPEC PATHEXT APPDATA LOCALAPPDATA PROGRAMDATA PROGRAMFILES PROGRAMFILES(X86)
PROGRAMW6432 COMMONPROGRAMFILES COMMONPROGRAMFILES(X86) USERPROFILE HOMEDRIVE HOMEPATH PUBLIC ALLUSERSPROFILE
NUMBER_OF_PROCESSORS PROCESSOR_ARCHITECTURE OS __CF_USER_TEXT_ENCODING
""".split())
SAFE_ENV_PREFIXES = ("LC_", "NPM_CONFIG_", "PIP_", "UV_", "PIPX_", "PYENV_", "NVM_", "VOLTA_", "XDG_")


def upstream_environment(own: dict[str, str], inherit=(), environ=None) -> dict[str, str]:
    """The environment a stdio upstream starts with: the safe subset of ``environ``, what ``inherit`` names (or
    all of it for '*'), then the server's own --env on top."""
    environ = os.environ if environ is None else environ
    wanted = {name.upper() for name in inherit}
    everything = "*" in wanted
    env = {key: value for key, value in environ.items()
           if everything or key.upper() in SAFE_ENV_NAMES or key.upper().startswith(SAFE_ENV_PREFIXES)
           or key.upper() in wanted}
    env.update(own)
    return env


def parse_env_assignment(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not ENV_KEY_RE.match(key):
        raise CofferError(f"bad --env {text!r}: expected KEY=VALUE with KEY a valid variable name")
    return key, value

"""The vault's boundary and the rules kept in one place: SQLite's errors reach a user as one actionable line,
`coffer doctor` checks every table Coffer keeps in coffer.db and its fix repairs a damaged one, hidden settings,
the sealed claims' record, the invocation log's rows, the one atomic private write, and the shared limits."""

import json
import os
import sqlite3
import stat
import subprocess
import threading
import time

import pytest
from conftest import COFFER, FAKE, PY, cli

from coffer_src.errors import CofferError, VaultError
from coffer_src.invocations import InvocationLog
from coffer_src.modern import RequestClaims, RequestStateSealer
from coffer_src.names import NAME_MAX_LENGTH_MIN, SERVER_NAME_MAX, SERVER_NAME_RULE, check_server_name, is_success
from coffer_src.secret_store import SECRET_MAX_CHARS, SecretStore, references, whole_reference, write_private_file
from coffer_src.settings import DEFAULTS, HIDDEN_SETTINGS
from coffer_src.terminal import clip
from coffer_src.vault import Invocation, Vault


@pytest.fixture
def user(tmp_path, monkeypatch):
    """A user with an empty home (no client configs) and an empty Coffer home; the environment the CLI runs in."""
    home = tmp_path / "user"
    home.mkdir()
    env = {"HOME": str(home), "USERPROFILE": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
           "COFFER_HOME": str(tmp_path / "coffer-home")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return tmp_path / "coffer-home"


def vault_report(*, check_ok=None):
    report = json.loads(cli("doctor", "--json", check=False).stdout)["vault"]
    if check_ok is not None:
        assert report["ok"] is check_ok, report
    return report


# -- SQLite's errors at the boundary ----------------------------------------------------------------------------
def test_a_damaged_vault_file_is_one_line_saying_what_to_do(user):
    user.mkdir(mode=0o700)
    (user / "coffer.db").write_bytes(b"this is not a database, just text " * 200)
    proc = cli("list", check=False)
    assert proc.returncode == 1
    line = proc.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith(f"coffer: error: the vault {user / 'coffer.db'}: file is not a database")
    assert "restore it from a backup" in line


def test_vault_methods_raise_vault_errors_not_sqlite_ones(user):
    vault = Vault(str(user))
    try:
        vault.db.execute("DROP TABLE capabilities")
        with pytest.raises(VaultError) as caught:
            vault.capability_states()
        assert isinstance(caught.value, CofferError) and isinstance(caught.value.__cause__, sqlite3.Error)
        assert "no such table: capabilities" in str(caught.value) and "coffer doctor" in str(caught.value)
        with pytest.raises(VaultError):  # raised inside a transaction the caller holds, too
            with vault.transaction() as db:
                db.execute("INSERT INTO capabilities(server) VALUES ('x')")
        assert not vault.db.in_transaction
    finally:
        vault.close()


def test_a_vault_locked_by_another_process_is_a_vault_error_that_says_try_again(user):
    vault = Vault(str(user))
    holder = sqlite3.connect(vault.path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        vault.db.execute("PRAGMA busy_timeout=50")
        with pytest.raises(VaultError) as caught:
            vault.add_server("a", command=["x"])
        assert "locked" in str(caught.value) and "try again" in str(caught.value)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
        vault.close()


# -- coffer doctor checks every table, and its fix repairs it ------------------------------------------------------
def test_doctor_finds_a_damaged_log_and_its_fix_repairs_it(user):
    cli("add", "a", "--", *FAKE)
    vault_report(check_ok=True)
    db = sqlite3.connect(user / "coffer.db")
    db.executescript("DROP TABLE invocations; CREATE TABLE invocations (id INTEGER PRIMARY KEY, ts TEXT);")
    db.close()
    report = vault_report(check_ok=False)
    [problem] = report["problems"]
    assert problem["problem"].startswith("the invocation and audit logs in coffer.db: table invocations lacks ")
    assert "capability" in problem["problem"] and "drop the damaged logs" in problem["fix"]
    subprocess.run(problem["fix"].split(": ", 1)[1], shell=True, check=True)
    cli("list")  # the next command creates the logs again
    vault_report(check_ok=True)
    assert "a" in cli("list").stdout  # the servers were never touched


def test_doctor_checks_the_knowledge_tables_and_its_fix_then_reindex_rebuilds_them(user, tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "tea.md").write_text("# Tea\n\nGreen tea steeps at eighty degrees for two minutes.\n")
    cli("knowledge", "add", str(notes), "--name", "notes")
    vault_report(check_ok=True)
    db = sqlite3.connect(user / "coffer.db")
    db.execute("DROP TABLE knowledge_files")
    db.close()
    [problem] = vault_report(check_ok=False)["problems"]
    assert problem["problem"] == "the knowledge index in coffer.db: table knowledge_files is missing"
    assert "coffer knowledge reindex" in problem["fix"]
    subprocess.run(problem["fix"].split(": ", 1)[1], shell=True, check=True)
    cli("knowledge", "reindex")
    vault_report(check_ok=True)
    [source] = json.loads(cli("knowledge", "list", "--json").stdout)["sources"]
    assert source["name"] == "notes" and source["files"] == 1 and source["passages"] >= 1
    db = sqlite3.connect(user / "coffer.db")
    try:  # the full-text index was rebuilt with the passages, row for row
        passages = db.execute("SELECT count(*) FROM knowledge_passages").fetchone()[0]
        if "knowledge_fts" in {row[0] for row in db.execute("SELECT name FROM sqlite_master")}:
            assert db.execute("SELECT count(*) FROM knowledge_fts").fetchone()[0] == passages
    finally:
        db.close()


def test_a_damaged_settings_table_fails_commands_with_a_pointer_to_doctor_which_names_the_fix(user):
    cli("add", "a", "--", *FAKE)
    db = sqlite3.connect(user / "coffer.db")
    db.executescript("ALTER TABLE settings RENAME TO old_settings; CREATE TABLE settings (key TEXT PRIMARY KEY);")
    db.close()
    failed = cli("config", check=False)
    assert failed.returncode == 1 and "no such column: value" in failed.stderr and "coffer doctor" in failed.stderr
    proc = cli("doctor", "--json", check=False)
    assert proc.returncode == 1
    [problem] = json.loads(proc.stdout)["vault"]["problems"]
    assert problem["problem"] == "the servers, choices and settings in coffer.db: table settings lacks value"
    assert problem["fix"].startswith(f"restore {user / 'coffer.db'} from a backup")
    assert "settings lacks value" in cli("doctor", check=False).stdout


def test_an_unused_optional_part_is_not_a_problem(user):
    cli("list")
    db = sqlite3.connect(user / "coffer.db")
    assert not {row[0] for row in db.execute("SELECT name FROM sqlite_master")} & {"embeddings", "knowledge_files"}
    db.close()
    assert vault_report()["problems"] == []


# -- hidden settings -------------------------------------------------------------------------------------------
def test_a_hidden_setting_works_by_name_but_is_not_listed(user):
    assert DEFAULTS["restart_backoff"] == 0.5 and "restart_backoff" in HIDDEN_SETTINGS
    assert "restart_backoff" not in cli("config").stdout
    assert "restart_backoff" not in json.loads(cli("config", "--json").stdout)
    assert cli("config", "restart_backoff").stdout.strip() == "restart_backoff = 0.5"
    cli("config", "restart_backoff", "0.01")
    assert json.loads(cli("config", "restart_backoff", "--json").stdout) == {"restart_backoff": 0.01}
    assert "restart_backoff" not in json.loads(cli("config", "--json").stdout)
    refused = cli("config", "restart_backoff", "0", check=False)
    assert refused.returncode == 1 and "restart_backoff must be positive" in refused.stderr
    unknown = cli("config", "restart_backof", "1", check=False)
    assert unknown.returncode == 1 and "restart_backoff" not in unknown.stderr  # never suggested nor listed
    vault = Vault(str(user))
    try:
        assert vault.settings()["restart_backoff"] == 0.01  # what the upstream supervisor reads
    finally:
        vault.close()


# -- the sealed claims: named fields, the same wire encoding ---------------------------------------------------
@pytest.mark.parametrize("claims, record", [
    ({"s": "github", "u": "upstream-state"}, RequestClaims(upstream="github", upstream_state="upstream-state")),
    ({"s": "github", "u": None}, RequestClaims(upstream="github")),
    ({"x": "x17"}, RequestClaims(exchange="x17")),
    ({"ask": 1, "q": ["tea temperature"], "t0": 1767225600}, RequestClaims(ask_stage=1, queries=("tea temperature",),
                                                                          first_asked=1767225600)),
])
def test_request_claims_seal_exactly_as_the_gateways_dicts_did(claims, record):
    params = {"name": "github__search", "arguments": {"q": "x"}}
    sealer = RequestStateSealer(key=b"k" * 32, clock=lambda: 1000.0)
    token = sealer.seal("tools/call", params, record)
    assert token == sealer.seal("tools/call", params, claims)  # byte for byte: old states still unseal
    assert sealer.unseal_claims(token, "tools/call", params) == record
    assert RequestClaims.from_wire(sealer.unseal(token, "tools/call", params)) == record


def test_the_handshake_deadline_is_never_sealed():
    record = RequestClaims(ask_stage=0, queries=("a",), deadline=time.monotonic())
    assert "sync" not in record.to_wire() and record.is_ask_round and not record.is_upstream_round


# -- the invocation log's rows ---------------------------------------------------------------------------------
def test_invocation_rows_are_written_as_named_columns_redacted_and_bounded(user):
    vault = Vault(str(user))
    log = InvocationLog(vault.path)
    try:
        log.record("client\ud800", "srv", "srv__tool", "tool", time.monotonic(), "error", "x" * 900)
        log.flush()
        [row] = vault.invocations()
        assert list(row) == list(Invocation._fields)
        assert row["client"] == "client?" and row["server"] == "srv" and row["status"] == "error"
        assert len(row["error"]) == 500 and row["ts"].endswith("Z")
    finally:
        log.close()
        vault.close()


def test_a_flush_returns_once_the_rows_before_it_are_written(user):
    vault = Vault(str(user))
    log = InvocationLog(vault.path)
    try:
        for n in range(50):
            log.record("c", "s", f"s__t{n}", "tool", time.monotonic(), "ok")
        log.flush()
        assert len(vault.invocations(100)) == 50
    finally:
        log.close()
        vault.close()


# -- the one atomic private write ------------------------------------------------------------------------------
@pytest.mark.skipif(os.name == "nt", reason="POSIX modes")
def test_the_private_write_replaces_whole_files_privately_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "secrets.json"
    target.write_text("old")
    target.chmod(0o644)
    write_private_file(str(target), b"new")
    assert target.read_bytes() == b"new" and stat.S_IMODE(target.stat().st_mode) == 0o600
    write_private_file(str(target), b"kept mode", 0o640)
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secrets.json"]
    with pytest.raises(OSError):
        write_private_file(str(tmp_path / "no-such-dir" / "x"), b"y")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secrets.json"]


@pytest.mark.skipif(os.name == "nt", reason="POSIX modes")
def test_concurrent_secret_writes_never_leave_a_half_written_store(tmp_path):
    store = SecretStore(str(tmp_path))
    errors = []

    def writer(n):
        try:
            for i in range(20):
                SecretStore(str(tmp_path)).set(f"K{n}", f"value-{n}-{i}" * 50)
        except CofferError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert json.loads((tmp_path / "secrets.json").read_text())  # whole JSON, whoever wrote last
    assert stat.S_IMODE((tmp_path / "secrets.json").stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["secrets.json"]
    assert store.names()


# -- rules kept in one place -----------------------------------------------------------------------------------
def test_the_server_name_limit_is_one_number_everywhere(user):
    check_server_name("x" * SERVER_NAME_MAX)
    with pytest.raises(CofferError, match=SERVER_NAME_RULE):
        check_server_name("x" * (SERVER_NAME_MAX + 1))
    assert SERVER_NAME_RULE in cli("add", "--help").stdout.replace("\n", " ").replace("  ", " ")
    assert NAME_MAX_LENGTH_MIN == SERVER_NAME_MAX + len("__") + len("x_") + 6
    refused = cli("config", "name_max_length", str(NAME_MAX_LENGTH_MIN - 1), check=False)
    assert f"between {NAME_MAX_LENGTH_MIN} and 64" in refused.stderr


def test_the_secret_size_limit_is_the_same_for_the_store_and_the_cli(user, tmp_path):
    with pytest.raises(CofferError, match="at most 64 KiB"):
        SecretStore(str(tmp_path)).set("BIG", "x" * (SECRET_MAX_CHARS + 1))
    SecretStore(str(tmp_path)).set("FITS", "x" * SECRET_MAX_CHARS)
    proc = subprocess.run([PY, COFFER, "secret", "set", "BIG"], input="y" * (SECRET_MAX_CHARS + 10),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "at most 64 KiB" in proc.stderr


def test_references_and_whole_references():
    server = {"command": ["run", "${A}"], "url": "https://h/${B:-x}", "cwd": "${C}", "env": {"K": "${D}"},
              "headers": {"H": "Bearer ${E}"}}
    assert sorted(references(server)) == [("A", False), ("B", True), ("C", False), ("D", False), ("E", False)]
    assert whole_reference("${TOKEN}") == "TOKEN"
    assert whole_reference("${TOKEN:-x}") is None and whole_reference("Bearer ${TOKEN}") is None
    assert whole_reference("${TOKEN}\n") is None


def test_display_clipping_and_success_statuses():
    assert clip("short", 10) == "short"
    assert clip("a" * 20, 10) == "a" * 7 + "..." and len(clip("a" * 20, 10)) == 10
    assert clip("abcdef", 2) == "ab"
    assert [is_success(code) for code in (199, 200, 204, 299, 300, 404)] == [False, True, True, True, False, False]

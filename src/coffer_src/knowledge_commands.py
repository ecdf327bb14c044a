"""Knowledge commands: `coffer knowledge` and `coffer memory`.

A command embeds new passages in the foreground (embed_now), so the first question after `coffer knowledge add`
is ranked by meaning too; a running gateway notices the change and answers from it within a second.
"""

from __future__ import annotations

import os
import sys

from coffer_src.errors import CofferError
from coffer_src.knowledge.base import KnowledgeBase
from coffer_src.knowledge.documents import KNOWLEDGE_DEFAULT_GLOBS
from coffer_src.search.semantic import Embedder, EmbedderError
from coffer_src.terminal import _print_table, clip, printable, say, say_json
from coffer_src.vault import Vault


def vault_audit(vault: Vault, action: str, target: str, detail: str | None = None) -> None:
    """An audit row for a change made outside coffer.db (the secret store): the name, never the value."""
    try:
        vault.audit(action, target, detail)
    except CofferError:
        pass  # a read-only vault cannot record it; the change itself was made


def open_knowledge(vault: Vault) -> KnowledgeBase:
    """The knowledge base for a CLI command, with the configured embedder (if any) but no background thread:
    `knowledge add` and `reindex` embed in the foreground (embed_now), `list` counts the vectors."""
    embedder = Embedder.from_settings(vault.settings(), vault.secrets)
    return KnowledgeBase(vault.path, vault.home, embedder=embedder, background_embedding=False)


def embed_now(kb: KnowledgeBase) -> None:
    """Embed the passages that have no vector yet, now, with a progress bar on a terminal: the first session then
    answers with hybrid ranking instead of lexically while vectors are built in the background."""
    if kb.embedder is None:
        return
    interactive = sys.stderr.isatty()
    shown = [0]

    def progress(done: int, total: int) -> None:
        shown[0] = total
        if interactive:
            bar = "#" * (30 * done // max(total, 1))
            print(f"\rembedding passages [{bar:<30}] {done}/{total}", end="", file=sys.stderr, flush=True)

    try:
        kb.ensure_vectors(progress)
    except (EmbedderError, CofferError) as exc:
        if interactive and shown[0]:
            print(file=sys.stderr)
        say(f"could not embed the passages now ({clip(printable(str(exc)), 200)}); a running gateway embeds them "
            "in the background, and coffer__ask answers lexically until then")
        return
    if interactive and shown[0]:
        print(file=sys.stderr)
    if shown[0]:
        say(f"embedded {shown[0]} passages with {kb.embedder.model or kb.embedder.url} (coffer__ask ranks them "
            "hybrid from the first question)")


def cmd_knowledge(vault: Vault, args) -> int:
    if vault.read_only and args.action != "list":
        vault.transaction()  # says why
    kb = open_knowledge(vault)
    try:
        if args.action == "add":
            if not args.target:
                raise CofferError("coffer knowledge add PATH [--name NAME] [--glob PATTERN]...")
            stats = kb.add_source(args.target, args.name, args.glob or None)
            vault_audit(vault, "knowledge-add", stats.source, os.path.abspath(os.path.expanduser(args.target)))
            say(f"added knowledge source {stats.source}: {stats.passages_added} passages from {stats.files_seen} files"
                + (f" (skipped: {', '.join(f'{n} {why}' for why, n in stats.skipped.items())})" if stats.skipped
                   else ""))
            embed_now(kb)
            if vault.setting("memory") != "on":
                say("agents find it with coffer__ask (memory notes too, after: coffer config memory on)")
        elif args.action == "remove":
            if not args.target:
                raise CofferError("coffer knowledge remove NAME")
            kb.remove_source(args.target)
            vault_audit(vault, "knowledge-remove", args.target)
            say(f"removed knowledge source {args.target}")
        elif args.action == "reindex":
            for stats in kb.reindex(args.target):
                say(f"{stats.source}: {stats.files_seen} files, {stats.files_added} added, {stats.files_changed} "
                    f"changed, {stats.files_removed} removed, {stats.files_unchanged} unchanged ({stats.seconds:g}s)")
            embed_now(kb)
        else:
            rows = [source._asdict() for source in kb.sources()]
            vectors = kb.vector_counts() if kb.embedder is not None else None
            for row in rows:
                row["vectors"] = vectors.get(row["name"], 0) if vectors is not None else None
            if args.json:
                say_json({"sources": rows})
            elif not rows:
                say("no knowledge sources yet: coffer knowledge add PATH")
            else:
                _print_table([[r["name"], r["files"], r["passages"],
                               *([r["vectors"]] if vectors is not None else []), r["indexed_at"] or "", r["root"]]
                              for r in rows],
                             ["NAME", "FILES", "PASSAGES", *(["VECTORS"] if vectors is not None else []), "INDEXED",
                              "ROOT"])
                if vectors is None:
                    say("(no embedder configured: coffer__ask ranks lexically; see coffer config embedder_url)")
    finally:
        kb.close()
    return 0


def cmd_memory(vault: Vault, args) -> int:
    if vault.read_only and args.action == "rm":
        vault.transaction()
    kb = open_knowledge(vault)
    try:
        if args.action == "list":
            notes = kb.memories()
            if args.json:
                say_json({"memories": [note._asdict() for note in notes]})
            elif not notes:
                say("no memories yet" + ("" if vault.setting("memory") == "on" else
                                         " (agents can keep some after: coffer config memory on)"))
            else:
                _print_table([[n.id, n.time, n.client, ",".join(n.tags), clip(n.text.splitlines()[0], 60)
                               if n.text else ""] for n in notes], ["ID", "CREATED", "CLIENT", "TAGS", "TEXT"])
            return 0
        if not args.id:
            raise CofferError(f"coffer memory {args.action} ID (coffer memory list shows them)")
        if args.action == "show":
            note = kb.memory(args.id)
            say_json(note._asdict()) if args.json else say(note.text)
        elif not kb.forget(args.id):
            raise CofferError(f"no memory {args.id!r}")
        else:
            vault_audit(vault, "memory-remove", args.id)
            say(f"forgot {args.id}")
    finally:
        kb.close()
    return 0


def add_knowledge_commands(command) -> None:
    """Wire `coffer knowledge` and `coffer memory` into build_parser."""
    p = command("knowledge", cmd_knowledge, "folders of notes and docs agents search with coffer__ask: "
                                            "add PATH [--name N] [--glob G]..., list, remove NAME, reindex [NAME]")
    p.add_argument("action", choices=("add", "list", "remove", "reindex"))
    p.add_argument("target", nargs="?", metavar="PATH|NAME")
    p.add_argument("--name", help="the source's name (default: the folder's name)")
    p.add_argument("--glob", action="append", metavar="PATTERN",
                   help=f"which files (default: {' '.join(KNOWLEDGE_DEFAULT_GLOBS)}); repeatable")
    p.add_argument("--json", action="store_true")
    p = command("memory", cmd_memory, "facts agents kept with coffer__remember (coffer config memory on): "
                                      "list, show ID, rm ID")
    p.add_argument("action", choices=("list", "show", "rm"))
    p.add_argument("id", nargs="?")
    p.add_argument("--json", action="store_true")

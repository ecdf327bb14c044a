"""Web activity: calls per hour, latency and errors from the invocation log.

The invocation log holds who called what, when, for how long and how it ended (never arguments or results), one
row per call; this module reads it through a connection of its own and aggregates it by hour and by server or
client.  A report is cached until the log grows or the hour turns, so a page polling every few seconds costs one
indexed query.  ``lock`` guards the connection and the cache; it is a leaf.
"""

from __future__ import annotations

import collections
import math
import sqlite3
import threading
import time
from datetime import datetime, timedelta, timezone

from coffer_src.errors import CofferError, VaultError
from coffer_src.names import RESERVED_SERVER
from coffer_src.vault import connect_vault_db

#: The ranges a report covers, in hours.
ACTIVITY_RANGES = {"day": 24, "week": 24 * 7}
ACTIVITY_GROUPS = ("server", "client")
#: Series drawn separately on the calls chart; the rest are summed as "others".
ACTIVITY_SERIES = 6
ACTIVITY_LATEST_ERRORS = 25
#: Statuses that are not failures: a call answered, or one its own client cancelled.
NOT_FAILED = ("ok", "cancelled")


def percentile(ordered: list[float], share: float) -> float | None:
    """The nearest-rank percentile of sorted values (None for none): the smallest value with at least ``share`` of
    the values at or below it, so p95 of 20 calls is the 19th."""
    if not ordered:
        return None
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def hour_of(ts: str) -> str:
    """The hour an invocation's timestamp (2026-11-30T12:34:56.789Z) falls in: 2026-11-30T12."""
    return ts[:13]


def hours_back(now: float, count: int) -> list[str]:
    """The last ``count`` hours up to and including the current one (UTC), oldest first, as hour_of keys."""
    current = datetime.fromtimestamp(now, timezone.utc).replace(minute=0, second=0, microsecond=0)
    return [(current - timedelta(hours=back)).strftime("%Y-%m-%dT%H") for back in range(count - 1, -1, -1)]


class _Bucket:
    """Calls, failures and durations of one group in one hour (or over the whole range)."""

    __slots__ = ("calls", "errors", "durations", "last")

    def __init__(self):
        self.calls = 0
        self.errors = 0
        self.durations: list[float] = []
        self.last = ""

    def add(self, ts: str, duration, failed: bool) -> None:
        self.calls += 1
        self.errors += failed
        if isinstance(duration, (int, float)):
            self.durations.append(float(duration))
        if ts > self.last:
            self.last = ts

    def summary(self) -> dict:
        ordered = sorted(self.durations)
        return {"calls": self.calls, "errors": self.errors,
                "error_rate": round(self.errors / self.calls, 4) if self.calls else None,
                "p50_ms": percentile(ordered, 0.5), "p95_ms": percentile(ordered, 0.95)}


class ActivityLog:
    """Reports over the invocation log of one coffer.db (see the module docstring)."""

    def __init__(self, path: str):
        self.path = path
        self.lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._cache: dict[tuple, tuple[tuple, dict]] = {}

    def close(self) -> None:
        with self.lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def _query(self, sql: str, args: tuple = ()) -> list:
        try:
            if self._db is None:
                self._db = connect_vault_db(self.path)
            return self._db.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise VaultError.wrap(exc, self.path) from exc

    def report(self, span: str = "day", group: str = "server", only: str | None = None,
               now: float | None = None) -> dict:
        """Calls per hour (by the top groups), p50/p95 duration and error rate per hour, a row per group, and
        the latest failures, over the last day or week.  ``only`` narrows everything to one server or client."""
        if span not in ACTIVITY_RANGES:
            raise CofferError(f"range must be one of {', '.join(ACTIVITY_RANGES)}")
        if group not in ACTIVITY_GROUPS:
            raise CofferError(f"group must be one of {', '.join(ACTIVITY_GROUPS)}")
        now = time.time() if now is None else now
        hours = hours_back(now, ACTIVITY_RANGES[span])
        since = hours[0] + ":00:00.000Z"
        with self.lock:
            (last_id,), = self._query("SELECT coalesce(max(id), 0) FROM invocations")
            key = (span, group, only)
            stamp = (last_id, hours[-1])
            cached = self._cache.get(key)
            if cached is not None and cached[0] == stamp:
                return cached[1]
            rows = self._query("SELECT ts, client, server, capability, kind, duration_ms, status, error FROM"
                               " invocations WHERE ts >= ? ORDER BY id", (since,))
            report = self._aggregate(rows, hours, group, only)
            report.update(range=span, group=group, only=only, since=since, generated_at=now)
            if len(self._cache) > 32:
                self._cache.clear()
            self._cache[key] = (stamp, report)
            return report

    @staticmethod
    def _name(row, group: str) -> str:
        value = row[group]
        if group == "server" and not value:
            return "(unknown)"
        return value if isinstance(value, str) and value else "(unknown)"

    def _aggregate(self, rows: list, hours: list[str], group: str, only: str | None) -> dict:
        slot = {hour: position for position, hour in enumerate(hours)}
        per_hour = [_Bucket() for _ in hours]
        per_group: dict[str, _Bucket] = collections.defaultdict(_Bucket)
        group_hours: dict[str, list[int]] = collections.defaultdict(lambda: [0] * len(hours))
        names = collections.Counter()
        failures = []
        for row in rows:
            name = self._name(row, group)
            if only is not None and name != only:
                continue
            position = slot.get(hour_of(row["ts"]))
            if position is None:
                continue
            failed = row["status"] not in NOT_FAILED
            per_hour[position].add(row["ts"], row["duration_ms"], failed)
            per_group[name].add(row["ts"], row["duration_ms"], failed)
            group_hours[name][position] += 1
            names[name] += 1
            if failed:
                failures.append(row)
        top = [name for name, _ in names.most_common(ACTIVITY_SERIES)]
        series = [{"name": name, "calls": group_hours[name]} for name in top]
        rest = [name for name in names if name not in top]
        if rest:
            series.append({"name": f"{len(rest)} others", "others": True,
                           "calls": [sum(group_hours[name][i] for name in rest) for i in range(len(hours))]})
        hourly = [bucket.summary() for bucket in per_hour]
        total = _Bucket()
        for bucket in per_group.values():
            total.calls += bucket.calls
            total.errors += bucket.errors
            total.durations += bucket.durations
            total.last = max(total.last, bucket.last)
        table = [{"name": name, **bucket.summary(), "last": bucket.last,
                  "builtin": group == "server" and name == RESERVED_SERVER}
                 for name, bucket in sorted(per_group.items(), key=lambda item: (-item[1].calls, item[0]))]
        return {"hours": [hour + ":00:00Z" for hour in hours], "series": series,
                "calls": [bucket["calls"] for bucket in hourly], "errors": [bucket["errors"] for bucket in hourly],
                "error_rate": [bucket["error_rate"] for bucket in hourly],
                "p50_ms": [bucket["p50_ms"] for bucket in hourly], "p95_ms": [bucket["p95_ms"] for bucket in hourly],
                "total": total.summary(), "table": table,
                "latest_errors": [{"ts": row["ts"], "client": row["client"], "server": row["server"],
                                   "capability": row["capability"], "kind": row["kind"],
                                   "duration_ms": row["duration_ms"], "status": row["status"],
                                   "error": row["error"]} for row in failures[-ACTIVITY_LATEST_ERRORS:][::-1]]}

    def last_calls(self) -> dict[str, str]:
        """server -> the time of its latest call in the log (kept 30 days by default)."""
        with self.lock:
            (last_id,), = self._query("SELECT coalesce(max(id), 0) FROM invocations")
            cached = self._cache.get(("last",))
            if cached is not None and cached[0] == last_id:
                return cached[1]
            found = {row[0]: row[1] for row in self._query(
                "SELECT server, max(ts) FROM invocations WHERE server IS NOT NULL GROUP BY server")}
            self._cache[("last",)] = (last_id, found)
            return found

    def choices(self, days: int = 7) -> dict[str, list[str]]:
        """The servers and clients seen in the log over the last ``days``: what the page offers to narrow to."""
        since = (datetime.now(timezone.utc) - timedelta(days=days)).strftime("%Y-%m-%dT%H:%M:%S.000Z")
        with self.lock:
            servers = [row[0] for row in self._query("SELECT DISTINCT server FROM invocations WHERE ts >= ? AND"
                                                     " server IS NOT NULL AND server != '' ORDER BY 1", (since,))]
            clients = [row[0] for row in self._query("SELECT DISTINCT client FROM invocations WHERE ts >= ? AND"
                                                     " client IS NOT NULL AND client != '' ORDER BY 1", (since,))]
        return {"server": servers, "client": clients}

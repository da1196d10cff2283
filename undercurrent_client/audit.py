"""`undercurrent audit`: read a verdict log, replay its aborts, report how
shadow versions agree with the serving ones.

    undercurrent audit list   [--since T] [--until T] [--probe P] [--caller C] [--verdict KIND]
    undercurrent audit show   REQUEST_ID
    undercurrent audit replay REQUEST_ID
    undercurrent audit report [--since T] [--until T] [--probe P]

The log is --log (an SQLite file or a postgresql:// URL), default
$UNDERCURRENT_VERDICT_LOG. Times are ISO 8601 (UTC unless they say) or an age
such as 30m, 6h, 2d.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from contextlib import closing
from datetime import datetime, timezone
from typing import TextIO

from common.verdict_log.records import KINDS, ShadowOutcome, VerdictRecord
from common.verdict_log.store import Query, Store, StoreError, open_store

LOG_ENV = "UNDERCURRENT_VERDICT_LOG"
_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class AuditError(Exception):
    """Bad input or a failed look-up; exit 2 for usage, 1 for the rest (`status`)."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def add_commands(commands) -> None:
    """Adds `audit` and its actions to the `undercurrent` command's subparsers."""
    log = argparse.ArgumentParser(add_help=False)
    log.add_argument("--log", default=os.environ.get(LOG_ENV), metavar="PATH|URL",
                     help=f"the verdict log: an SQLite file or a postgresql:// URL (default: ${LOG_ENV})")
    window = argparse.ArgumentParser(add_help=False)
    window.add_argument("--since", metavar="TIME", help="from this time (ISO 8601 or an age: 30m, 6h, 2d)")
    window.add_argument("--until", metavar="TIME", help="before this time")
    window.add_argument("--probe", metavar="NAME")
    audit = commands.add_parser("audit", help="query the routers' verdict log, replay aborts, report shadows")
    actions = audit.add_subparsers(dest="audit_action", required=True, metavar="ACTION",
                                   parser_class=type(audit))
    listing = actions.add_parser("list", parents=[log, window], help="list verdicts and aborts")
    listing.add_argument("--caller", metavar="NAME")
    listing.add_argument("--verdict", choices=KINDS, help="only records of this kind")
    listing.add_argument("--limit", type=int, default=1000, metavar="N", help="at most N records (default 1000)")
    listing.set_defaults(run=_at_now(run_list))
    show = actions.add_parser("show", parents=[log], help="every record of one request, in full")
    show.add_argument("request_id", metavar="REQUEST_ID")
    show.set_defaults(run=_at_now(run_show))
    again = actions.add_parser("replay", parents=[log],
                               help="re-score a request's logged aborts with the logged probe versions")
    again.add_argument("request_id", metavar="REQUEST_ID")
    again.set_defaults(run=_at_now(run_replay))
    report = actions.add_parser("report", parents=[log, window],
                                help="how each shadow version agreed with its serving version")
    report.set_defaults(run=_at_now(run_report))


def _at_now(action):
    """The action as the `undercurrent` command runs one: (args, out, err) -> status."""
    return lambda args, out, err: action(args, out, time.time())


def parse_time(text: str | None, now: float) -> float | None:
    """Unix seconds of an ISO 8601 time or an age before `now`."""
    if text is None:
        return None
    if match := _AGE.match(text.strip()):
        return now - float(match[1]) * _SECONDS[match[2]]
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise AuditError(f"{text!r} is not a time: give ISO 8601 (2026-12-07T06:00) or an age (30m, 6h, 2d)",
                         status=2) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def _open(args) -> Store:
    if not args.log:
        raise AuditError(f"--log PATH|URL is required (or set ${LOG_ENV})", status=2)
    try:
        return open_store(args.log, create=False)
    except StoreError as err:
        raise AuditError(str(err)) from None


def _query(args, now: float, **fields) -> Query:
    since, until = parse_time(args.since, now), parse_time(args.until, now)
    return Query(since=since, until=until, probe=args.probe, **fields)


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() + "\n")


def run_list(args, out: TextIO, now: float) -> int:
    if args.limit <= 0:
        raise AuditError(f"--limit {args.limit} must be > 0", status=2)
    with closing(_open(args)) as store:
        found = store.records(_query(args, now, caller=args.caller, kind=args.verdict, limit=args.limit))
    if not found:
        out.write("no records\n")
        return 0
    header = ["ID", "TIME", "KIND", "REQUEST", "CALLER", "PROBE", "VERSION", "ROLE", "TOKEN", "LAYER", "SCORE",
              "THRESHOLD", "ROUTER"]
    _table([header, *([str(r.id), _when(r.time), r.kind, r.request_id, r.caller or "-", r.probe, r.version,
                       r.role, str(r.token_position), str(r.layer), f"{r.score:.6g}", f"{r.threshold:g}",
                       r.router] for r in found)], out)
    return 0


def run_show(args, out: TextIO, now: float) -> int:
    with closing(_open(args)) as store:
        found = store.records(Query(request_id=args.request_id))
    if not found:
        raise AuditError(f"request {args.request_id!r}: no records in the log")
    for r in found:
        out.write(_describe(r))
    return 0


def _describe(r: VerdictRecord) -> str:
    lines = [f"record {r.id}: {r.kind} at {_when(r.time)} by router {r.router}",
             f"  request {r.request_id}, caller {r.caller or '(anonymous)'}",
             f"  probe {r.probe} version {r.version} ({r.role}), digest {r.digest}",
             f"  score {r.score:.9g} (threshold {r.threshold:g}) at token {r.token_position}, layer {r.layer}"]
    if r.reference_score is not None:
        lines.append(f"  the serving version scored {r.reference_score:.9g} on that row")
    if r.rows is not None:
        lines.append(f"  input rows kept: {r.rows.shape[0]} x {r.rows.shape[1]} (token, layer): "
                     + ", ".join(f"({p}, {l})" for p, l in zip(r.row_positions, r.row_layers)))
    return "\n".join(lines) + "\n"


def run_replay(args, out: TextIO, now: float) -> int:
    # The scoring code (numpy, scipy) loads only for a replay: `undercurrent` starts fast.
    from common.verdict_log.replay import ReplayError, replay

    with closing(_open(args)) as store:
        found = [r for r in store.records(Query(request_id=args.request_id)) if r.rows is not None]
        if not found:
            raise AuditError(f"request {args.request_id!r}: no logged abort with input rows to replay")
        status = 0
        for record in found:
            try:
                result = replay(record, store.probe_version(record.digest))
            except ReplayError as err:
                out.write(f"record {record.id}: cannot replay: {err}\n")
                status = 1
                continue
            verdict = "fires" if result.fired else "does not fire"
            out.write(f"record {record.id}: {record.kind} by {record.probe} version {record.version} at token "
                      f"{record.token_position}, layer {record.layer}\n"
                      f"  stored score   {record.score:.9g}\n  replayed score {result.score:.9g}\n"
                      f"  threshold {record.threshold:g}: {verdict}; "
                      + ("the same score and verdict\n" if result.matches else "DIFFERS from the log\n"))
            if result.note:
                out.write(f"  note: {result.note}\n")
            status = status or (0 if result.matches else 1)
    return status


def run_report(args, out: TextIO, now: float) -> int:
    query = _query(args, now)
    with closing(_open(args)) as store:
        outcomes = store.outcomes(query)
    window = (f"from {_when(query.since) if query.since is not None else 'the start'} "
              f"until {_when(query.until) if query.until is not None else 'now'}")
    if not outcomes:
        out.write(f"no shadow outcomes {window}\n")
        return 0
    out.write(f"shadow versions {window}\n")
    header = ["PROBE", "SERVING", "SHADOW", "REQUESTS", "AGREE", "DISAGREE", "SERVING ONLY", "SHADOW ONLY",
              "ROWS", "MEAN DELTA", "MAX |DELTA|"]
    rows = [header]
    for (probe, serving, shadow), group in sorted(_grouped(outcomes).items()):
        compared = sum(o.rows for o in group)
        serving_only = sum(o.serving_fired and not o.shadow_fired for o in group)
        shadow_only = sum(o.shadow_fired and not o.serving_fired for o in group)
        rows.append([probe, serving, shadow, str(len(group)), str(sum(o.agrees for o in group)),
                     str(serving_only + shadow_only), str(serving_only), str(shadow_only), str(compared),
                     f"{sum(o.delta_sum for o in group) / compared:.4g}" if compared else "-",
                     f"{max(o.delta_max for o in group):.4g}" if compared else "-"])
    _table(rows, out)
    return 0


def _grouped(outcomes: list[ShadowOutcome]) -> dict[tuple[str, str, str], list[ShadowOutcome]]:
    groups: dict[tuple[str, str, str], list[ShadowOutcome]] = {}
    for o in outcomes:
        groups.setdefault((o.probe, o.serving_version, o.shadow_version), []).append(o)
    return groups


"""What ``celery semaphore why TASK_ID`` prints: the answer of ``why()`` (``_celery/why.py``) in
words, a line per fact. ``--json`` prints that answer as it is."""

from __future__ import annotations

from typing import Any

from .reports import duration

_BLOCKED = {
    "pause": "the key is paused",
    "limit": "no free slot",
    "rate": "the rate: its window allows no start yet",
    "spacing": "the spacing since the last start",
    "line": "the line ahead of it",
    "tenant_cap": "its tenant's cap: it holds as many slots as the key allows one tenant",
}


def _seconds(value: float | None) -> str:
    return "unknown" if value is None else duration(value)


def why_lines(answer: dict[str, Any]) -> list[str]:
    task = f" ({answer['task']})" if answer.get("task") else ""
    lines = [f"task {answer['task_id']}{task}: {answer['state']}"]
    for slot in answer.get("slots", []):
        lines.append(
            f"  holds a slot of {slot['key']} for {duration(slot['held_for'])}, "
            f"lease {duration(slot['lease_left'])} left (renewed while it runs); worker {slot['worker'] or '?'}"
        )
    for entry in answer.get("keys", []):
        limit = "no limit" if entry["limit"] is None else f"limit {entry['limit']}"
        free = "" if entry["free"] is None else f", {entry['free']} free"
        lines.append(
            f"  {entry['key']}: place {entry['position'] + 1} of {entry['waiter_count']} in line, "
            f"held back by {_BLOCKED.get(entry['blocked_by'], entry['blocked_by'])}"
        )
        lines.append(f"    {limit}: {entry['held']} held, {entry['offered']} offered{free}")
        rules = entry["rules"]
        if rules["paused"]:
            length = "until resumed" if rules["paused_for"] is None else f"for {duration(rules['paused_for'])}"
            lines.append(f"    paused {length}")
        if rules["rate"]:
            lines.append(f"    rate {rules['rate']}: next start allowed in {duration(rules['rate_opens_in'])}")
        if rules["spacing"]:
            lines.append(
                f"    spacing {duration(rules['spacing'])}: next start allowed in {duration(rules['spacing_opens_in'])}"
            )
        if entry["slot_offered"]:
            lines.append("    a slot is offered to it: it starts when its copy claims it")
        estimate = entry["estimated_start_in"]
        if estimate is not None:
            lines.append(f"    estimated start in ~{duration(estimate)} (an estimate, from hold times and the rules)")
        for holder in entry["holders_ahead"]:
            lines.append(
                f"    holder {holder['worker'] or '?'}: held {duration(holder['held_for'])}, "
                f"lease {duration(holder['lease_left'])} left"
            )
        if entry["waited"] is not None:
            lines.append(f"    waiting for {duration(entry['waited'])}; place kept {duration(entry['place_kept_for'])}")
    parked = answer.get("parked")
    if parked:
        lines.append(f"  parked: {parked['wake']}")
        lines.append(f"    backstop copy due in about {_seconds(parked['backstop_due_in'])}")
        if parked.get("record_due_in") is not None:
            lines.append(f"    a sweep sends its wake copy in {duration(parked['record_due_in'])} if no copy asks")
    result = answer.get("result")
    if result:
        done = f" at {result['date_done']}" if result.get("date_done") else ""
        lines.append(f"  result backend: {result['state']}{done}")
    if answer["state"] == "unknown":
        looked = ", ".join(answer["looked_at"]) or "none"
        lines.append(f"  keys looked at: {looked}")
    lines.extend(f"  note: {note}" for note in answer.get("notes", []))
    return lines

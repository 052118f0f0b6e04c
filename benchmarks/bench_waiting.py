"""What a task waiting on one key costs while it waits: N tasks placed at send behind a pause.

    .venv/bin/python -m benchmarks.bench_backlog --scenario waiting [--tasks 100000] [--quick]
        [--limit 10] [--hold 0.1] [--drain-seconds 60] [--full-drain] [--workers 3]
        [--concurrency 4] [--json PATH]

(``python -m benchmarks.bench_waiting`` takes the same options.) The target it measures: 100,000
tasks waiting on one key cost at most 1 KB of Redis memory each, their stored messages included,
with nothing held by the workers, and drain at the limit's pace once they may start.

W real workers (``--workers``, 3) of C prefork children (``--concurrency``, 4) of the backlog
app (benchmarks/bench_backlog_app.py) are started on a throwaway broker Redis, with the
semaphore in a throwaway Redis of its own and the probes in a third, and warmed up on a key of
their own. The key is then **paused** (``celery semaphore pause``, as an operator would) and N
tasks (``--tasks``, 100,000; 10,000 with ``--quick``) are sent through the task's
``apply_async`` in a producer app that declares it (``producer_task``): each is placed at send,
its backstop copy stored in the broker's Redis and its parked record, wake copy and place in line
in the semaphore's. A pause, not a limit taken by long holds: every task waits from the first
send, no holder runs and no start, release or hand-off happens while the memory is read, so the
growth is the waiting tasks' alone; and the holds stay short, so that the drain's pace is
measurable in a minute.

With all N waiting (``used_memory`` growth over a baseline read after the pause, just before the
first send, divided by N):

* each Redis's memory per waiting task, and its split by key (``MEMORY USAGE key SAMPLES 0``
  growth / N for every key over 4 KB; the rest of the growth is what no key accounts for);
* the size of one stored copy (a value of ``semaphore-backstops:packed:copies``: packed, its
  fills; and the stencils, once per task and queue), of one wake copy (a value of a bucket of
  the parked records, ``semaphore:{parked-tasks}:records:<n>``) and of the message Celery
  itself writes for the same call without the semaphore (``bench.backlog.plain`` sent to a
  queue nobody consumes: its list's one entry), read after the memory figures;
* the messages held by workers (HLEN ``unacked``), the queue lists (the task queue, its wake and
  backstop lists: empty), deliveries so far (none: nothing was delivered), and the workers' RSS
  growth since the baseline.

Then the key is resumed (``celery semaphore resume``, which sends the wake copies of the first
starts it offers; each release after that sends the next one's) and the drain is watched for
``--drain-seconds`` (60): body starts per second (the bodies' own records, worker clock) against
the limit's pace, ``--limit`` (10) / ``--hold`` (0.1 s): 100/s. A full drain of 100,000 is not
waited for (about 17 minutes at that pace): the workers are stopped and the servers thrown away
with the rest still waiting, and the output says so. ``--full-drain`` (the default with
``--quick``) waits for every body and checks that each task ran exactly once; it gives up after a
minute without a start, and lists each task that never ran with when its stored copy is due.

A figure read on the way: the slots taken while paused (the holders of the key: the start the
pause reserves for the head of the line, offered to that parked task, which the resume wakes).

Redis broker only: on RabbitMQ the backstop copies wait in backstop queues held by the workers'
main processes, whose memory ``rabbitmqctl`` reports per queue, not per key; ``bench_backlog
--broker amqp`` shows that side.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import redis

from benchmarks.bench_backlog import (
    APP,
    PER_ROUND_RECORDS,
    SEND_CHUNK,
    STEADY,
    TASK,
    Round,
    Sampler,
    Settings,
    _name,
    backlog_lab,
    backlog_workers,
    drain,
    key_size,
    log_dir,
    per_second,
    producer_task,
    redis_broker_view,
    timeline,
    used_memory,
    workers_rss_kb,
)
from benchmarks.bench_celery import ROOT, Lab, RoundFailed, git, send_through_task, table, versions
from benchmarks.bench_rates import most_in_any_window

PLAIN = "bench.backlog.plain"
TARGET_BYTES = 1024  # Redis memory per waiting task, both Redis servers, its stored message included
MIN_PACE_RATIO = 0.95
# keys smaller than this are not listed in the split (the key's counters, the pause, the epoch)
LISTED_KEY_BYTES = 4096
# a bucket of the parked-task records or of their due times (parked_records.RECORD_BUCKETS), or of
# the stored copies' due times (due_copies.DUE_BUCKETS)
BUCKET_KEY = re.compile(r"^(.*(?:\{parked-tasks\}:(?:records|record-due)|semaphore-backstops:packed:due)):\d+$")
# seconds after the last send before the memory is read: the sender stows each copy itself, so
# this only lets a sample or a sweep in flight finish
SETTLE_S = 2.0
# a full drain gives up after this long without a body start
STALL_S = 60.0


def semaphore_cli(lab: Lab, broker_url: str, queue: str, settings: Settings, *words: str) -> str:
    """``celery -A <backlog app> semaphore <words>`` as an operator runs it, against this run's
    servers; its output. RoundFailed if it fails."""
    env = {
        **os.environ,
        **lab.env,
        **settings.env,
        "PROJ_BROKER_URL": broker_url,
        "PROJ_QUEUE": queue,
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "semaphore", *words],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise RoundFailed(f"semaphore {' '.join(words)} failed: {done.stderr.strip()[-2000:]}")
    return done.stdout.strip()


def key_memory(client: redis.Redis) -> dict[str, dict[str, Any]]:
    """Every key of a Redis: its type, entries and ``MEMORY USAGE key SAMPLES 0`` (every element
    counted, not sampled); the buckets of the parked-task records and their due times summed as
    one key each, ``<name>:<bucket>``."""
    found: dict[str, dict[str, Any]] = {}
    for raw in client.scan_iter(count=1000):
        name = _name(raw)
        size = client.memory_usage(raw, samples=0)
        if size is None:  # gone meanwhile
            continue
        bucketed = BUCKET_KEY.match(name)
        listed = f"{bucketed.group(1)}:<bucket>" if bucketed else name
        kept = found.setdefault(listed, {"type": _name(client.type(raw)), "entries": 0, "bytes": 0})
        kept["entries"] += key_size(client, name)
        kept["bytes"] += int(size)
    return found


def one_record(client: redis.Redis) -> tuple[str, int] | None:
    """A parked-task record (from a bucket with one) and its value's size in bytes."""
    for raw in client.scan_iter(match="semaphore:{parked-tasks}:records:*", count=1000):
        found = one_value(client, _name(raw))
        if found is not None:
            return found
    return None


def split(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]], tasks: int) -> dict[str, Any]:
    """The growth of each key over ``LISTED_KEY_BYTES`` per task, largest first."""
    rows = []
    for name, now in after.items():
        if now["bytes"] < LISTED_KEY_BYTES:
            continue
        growth = now["bytes"] - before.get(name, {}).get("bytes", 0)
        rows.append({"key": name, **now, "growth": growth, "per_task": growth / tasks})
    rows.sort(key=lambda row: -row["growth"])
    return {"keys": rows, "listed_per_task": sum(row["per_task"] for row in rows)}


def one_value(client: redis.Redis, key: str) -> tuple[str, int] | None:
    """A random field of a hash and its value's size in bytes."""
    found = client.hrandfield(key, 1, withvalues=True)
    if not found:
        return None
    field, value = found[0], found[1]
    assert isinstance(field, bytes | str) and isinstance(value, bytes | str)
    return _name(field), len(value)


def plain_message(lab: Lab, broker_url: str, settings: Settings, broker: redis.Redis, queue: str) -> dict[str, int]:
    """What Celery itself writes for the same call without the semaphore: ``PLAIN`` sent by
    name (same arguments, same producer kind) to a queue nobody consumes, its one list entry's
    size and the list's ``MEMORY USAGE``; the list is deleted again."""
    probe_queue = f"{queue}-plain-probe"
    app = producer_task(lab, broker_url, settings).app
    with app.producer_or_acquire() as producer:
        app.send_task(PLAIN, (settings.tasks - 1, queue.removeprefix("bb-")), queue=probe_queue, producer=producer)
    try:
        message = broker.lindex(probe_queue, 0)
        usage = broker.memory_usage(probe_queue, samples=0)
        return {"message": len(message or b""), "list": int(usage or 0)}
    finally:
        broker.delete(probe_queue)


def waiting_round(lab: Lab, settings: Settings, drain_seconds: float, full_drain: bool) -> dict[str, Any]:
    """One run: pause, send N placed, read what they cost, resume, watch the drain."""
    broker_url = lab.redis_broker
    key = f"redis-waiting-{lab.nonce}"
    semaphore_key = f"bb:{key}"
    r = Round("redis", broker_url, queue=f"bb-{key}", key=key)
    broker = r.broker_client = redis.Redis.from_url(broker_url)
    semaphore = redis.Redis.from_url(lab.env["PROJ_SEMAPHORE_URL"])
    lab.clean(broker_url)
    calls = [(seq, key) for seq in range(settings.tasks)]
    ids: list[str] = []
    found: dict[str, Any] = {"key": semaphore_key}
    try:
        with backlog_workers(lab, broker_url, r.queue, settings) as group:
            found["packages"] = {_name(k): _name(v) for k, v in lab.probe.hgetall("bb:package").items()}
            warm = settings.workers * settings.concurrency * 2
            lab.send(broker_url, TASK, [(-1 - i, f"{key}-warm-up") for i in range(warm)], r.queue)
            drain(lab, group, warm, 120)
            time.sleep(1.0)
            lab.probe.delete(*PER_ROUND_RECORDS)
            found["paused"] = semaphore_cli(lab, broker_url, r.queue, settings, "pause", semaphore_key)
            through = producer_task(lab, broker_url, settings)  # its imports and connections are not the sends'
            base_keys = {"broker": key_memory(broker), "semaphore": key_memory(semaphore)}
            base_memory = {"broker": used_memory(broker), "semaphore": used_memory(semaphore)}
            base_rss = workers_rss_kb(group)
            sampler = Sampler(lab, r, group, settings)
            with sampler:
                r.began = time.time()
                for first in range(0, settings.tasks, SEND_CHUNK):
                    ids += send_through_task(through, calls[first : first + SEND_CHUNK], r.queue)
                    r.sent = min(settings.tasks, first + SEND_CHUNK)
                found["send_s"] = time.time() - r.began
                found["sends_per_s"] = settings.tasks / found["send_s"]
                time.sleep(SETTLE_S)
                found.update(measure_waiting(lab, settings, r, broker, semaphore, group, base_memory, base_keys))
                found["rss_base_kb"], found["rss_main_base_kb"] = base_rss
                found["plain"] = plain_message(lab, broker_url, settings, broker, r.queue)
                resumed = time.time()
                found["resumed"] = semaphore_cli(lab, broker_url, r.queue, settings, "resume", semaphore_key)
                found["resume_at_s"] = resumed - r.began
                time.sleep(max(0.0, resumed + drain_seconds - time.time()))
                found["drained_in_window"] = int(lab.probe.llen("bb:starts"))
                if full_drain:
                    deadline = resumed + 3 * settings.ideal + 180
                    found["full_drain_incomplete"] = finish(lab, group, settings.tasks, deadline)
                    found["not_run"] = not_run(lab, broker, ids)
            end = sampler.sample()
            found["rss_end_kb"], found["rss_main_end_kb"] = end["rss_kb"], end["rss_main_kb"]
    finally:
        broker.close()
        semaphore.close()
    found.update(drain_figures(lab, settings, ids, resumed, drain_seconds, full_drain))
    found["samples"] = sampler.samples
    found["sample_errors"] = sampler.errors
    found["rss_peak_kb"] = max(s["rss_kb"] for s in sampler.samples)
    return found


def finish(lab: Lab, group: Sequence[Any], tasks: int, deadline: float) -> str | None:
    """Until ``tasks`` bodies have ended; why not, else None: a failure, a dead worker, no start
    for ``STALL_S`` (a task woken by nothing: its stored copy may be due hours later, see
    ``not_run``) or ``deadline`` (time.time())."""
    seen, progress = -1, time.monotonic()
    while (ended := int(lab.probe.get("bb:ends") or 0)) < tasks:
        if lab.failures():
            return f"a task failed: {lab.failures()[0]}"
        dead = [w.name for w in group if w.process is not None and w.process.poll() is not None]
        if dead:
            return f"worker(s) died: {', '.join(dead)}"
        started = int(lab.probe.llen("bb:starts"))
        if started != seen:
            seen, progress = started, time.monotonic()
        if time.monotonic() - progress > STALL_S or time.time() > deadline:
            return f"{tasks - ended} of {tasks} bodies not run; no start for {time.monotonic() - progress:.0f} s"
        time.sleep(0.5)
    return None


def not_run(lab: Lab, broker: redis.Redis, ids: Sequence[str], most: int = 5) -> list[dict[str, Any]]:
    """The first ``most`` tasks whose body never ran, and when their stored copy (the one way
    back of a task that nothing wakes) is due, in seconds from now."""
    execs = lab.probe.hmget("bb:execs", list(ids))
    found: list[dict[str, Any]] = []
    now, micros = (float(part) for part in broker.time())
    for seq, task_id in enumerate(ids):
        if execs[seq] or len(found) >= most:
            continue
        due = [score for _, score in broker.zscan_iter("semaphore-backstops:due", match=f"{task_id}#*")]
        found.append({"seq": seq, "copy_due_in_s": min(due) / 1000 - now - micros / 1e6 if due else None})
    return found


def measure_waiting(
    lab: Lab,
    settings: Settings,
    r: Round,
    broker: redis.Redis,
    semaphore: redis.Redis,
    group: Sequence[Any],
    base_memory: dict[str, int],
    base_keys: dict[str, dict[str, dict[str, Any]]],
) -> dict[str, Any]:
    """Everything read while all N wait (nothing has been resumed)."""
    n = settings.tasks
    memory = {"broker": used_memory(broker), "semaphore": used_memory(semaphore)}
    keys = {"broker": key_memory(broker), "semaphore": key_memory(semaphore)}
    per_task = {name: (memory[name] - base_memory[name]) / n for name in memory}
    view = redis_broker_view(broker, r.queue)
    line = next((k for k in keys["semaphore"] if k.endswith(f"{{bb:{r.key}}}:queue")), None)
    stored = one_value(broker, "semaphore-backstops:packed:copies")
    stencils = broker.hvals("semaphore-backstops:packed:stencils")
    wake = one_record(semaphore)
    # the index of the due buckets holds each bucket's first due time (no later than it)
    due = broker.zrange("semaphore-backstops:packed:due-buckets", 0, 0, withscores=True)
    seconds, micros = (float(part) for part in broker.time())
    rss, main = workers_rss_kb(group)
    return {
        "memory_base": base_memory,
        "memory_waiting": memory,
        "per_task": per_task,
        "per_task_total": sum(per_task.values()),
        "split": {name: split(base_keys[name], keys[name], n) for name in keys},
        "in_line": key_size(semaphore, line) if line else None,
        # slots taken while nothing runs: the head's start, reserved for the end of the pause
        "holders": key_size(semaphore, line.removesuffix(":queue") + ":holders") if line else None,
        "stored_message": stored,
        "stencils": [len(stencil) for stencil in stencils],
        "wake_copy": wake,
        "first_backstop_due_s": (float(due[0][1]) / 1000 - (seconds + micros / 1e6)) if due else None,
        "queue_lists": view["queue"],
        "derived_lists": {name: size for name, size in view["semaphore_keys"].items() if size},
        "unacked": view["unacked"],
        "received_while_waiting": int(lab.probe.get("bb:received:total") or 0),
        "started_while_waiting": int(lab.probe.llen("bb:starts")),
        "rss_waiting_kb": rss,
        "rss_main_waiting_kb": main,
    }


def drain_figures(
    lab: Lab, settings: Settings, ids: Sequence[str], resumed: float, window: float, full: bool
) -> dict[str, Any]:
    """Body starts after the resume: over the window, and over the full drain where waited for."""
    starts = sorted(
        (float(at), int(seq))
        for seq, at, _ in (_name(raw).split() for raw in lab.probe.lrange("bb:starts", 0, -1))
        if int(seq) >= 0
    )
    moments = [at for at, _ in starts]
    pace = settings.limit / settings.hold
    inside = [at for at in moments if at < resumed + window]
    found: dict[str, Any] = {"pace": pace, "started": len(moments), "window_s": window}
    if len(inside) > 2:
        lo, hi = math.floor(STEADY[0] * (len(inside) - 1)), math.ceil(STEADY[1] * (len(inside) - 1))
        steady = (hi - lo) / (inside[hi] - inside[lo]) if inside[hi] > inside[lo] else float("nan")
        seconds = per_second(inside, inside[0], inside[-1])
        found.update(
            {
                "resume_to_first_start_s": inside[0] - resumed,
                "window_starts": len(inside),
                "window_rate": len(inside) / window,
                "steady_rate": steady,
                "steady_over_pace": steady / pace,
                "per_second_min": min(seconds, default=0),
                "per_second_median": statistics.median(seconds) if seconds else 0,
                "max_any_1s": most_in_any_window(inside, 1.0),
            }
        )
    # starts that came long after the rest (more than 5 s after the one before): a task that was
    # not woken by the resume and its releases, but came back by its stored copy
    found["late"] = [
        {"seq": seq, "after_resume_s": at - resumed}
        for (before, _), (at, seq) in itertools.pairwise(starts)
        if at - before > 5.0
    ]
    by_seq = [ids[seq] for _, seq in starts]
    received = [int(v or 0) for v in lab.probe.hmget("bb:received", by_seq)] if by_seq else []
    found["deliveries_per_started"] = sum(received) / len(received) if received else None
    found["deliveries_histogram"] = dict(sorted(Counter(received).items()))
    found["max_concurrency"] = int(lab.probe.get("bb:conc:max") or 0)
    if full:
        execs = [int(v or 0) for v in lab.probe.hmget("bb:execs", list(ids))]
        found["never"] = sum(1 for e in execs if not e)
        found["twice"] = sum(1 for e in execs if e > 1)
        found["execs_per_task"] = sum(execs) / len(ids)
        if len(moments) == len(ids):
            found["drain_s"] = moments[-1] - resumed
            found["drain_over_ideal"] = found["drain_s"] / settings.ideal
    return found


def kb(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} B ({value / 1024:.2f} KB)"


def report(f: dict[str, Any], settings: Settings, full: bool) -> list[str]:
    n = settings.tasks
    rss_growth = (f["rss_waiting_kb"] - f["rss_base_kb"]) / 1024
    main_growth = (f["rss_main_waiting_kb"] - f["rss_main_base_kb"]) / 1024
    stored, wake, plain = f["stored_message"], f["wake_copy"], f["plain"]
    rows = [
        ["figure", "measured"],
        ["sending (placed at send, paused key)", f"{f['send_s']:.1f} s, {f['sends_per_s']:.0f} sends/s"],
        ["in line when read (ZCARD of the key's queue)", str(f["in_line"])],
        ["slots taken while paused (ZCARD holders: the head's start, reserved)", str(f["holders"])],
        ["broker Redis per waiting task", kb(f["per_task"]["broker"])],
        ["semaphore Redis per waiting task", kb(f["per_task"]["semaphore"])],
        ["both, per waiting task", kb(f["per_task_total"])],
        ["one stored copy (packed: its fills)", f"{stored[1]:,} B" if stored else "-"],
        ["stencils (kept once per task and queue)", ", ".join(f"{size:,} B" for size in f["stencils"]) or "none"],
        ["one wake copy (parked record)", f"{wake[1]:,} B" if wake else "-"],
        ["Celery's own message, same call, no semaphore", f"{plain['message']:,} B (its list: {plain['list']:,} B)"],
        ["messages held by workers (unacked)", str(f["unacked"])],
        ["queue lists (queue, wake, backstop list)", f"{f['queue_lists']} queued; others {f['derived_lists'] or 0}"],
        ["deliveries / bodies started while waiting", f"{f['received_while_waiting']} / {f['started_while_waiting']}"],
        ["workers' RSS growth while sending", f"{rss_growth:+.1f} MB (main processes {main_growth:+.1f} MB)"],
        [
            "first backstop copy due in",
            "-" if f["first_backstop_due_s"] is None else f"{f['first_backstop_due_s']:.0f} s",
        ],
    ]
    out = [table(rows)]
    for name in ("broker", "semaphore"):
        s = f["split"][name]
        rest = f["per_task"][name] - s["listed_per_task"]
        split_rows = [["key", "type", "entries", "MEMORY USAGE", "B / waiting task"]]
        split_rows += [
            [row["key"], row["type"], f"{row['entries']:,}", f"{row['bytes']:,}", f"{row['per_task']:.0f}"]
            for row in s["keys"]
        ]
        split_rows.append(["(used_memory growth in no key above)", "", "", "", f"{rest:.0f}"])
        out.append(f"\n{name} Redis: where each waiting task's {f['per_task'][name]:.0f} B are")
        out.append(table(split_rows, left=2))
    pace = f["pace"]
    drain_rows = [["drain after resume", "measured"]]
    if "window_starts" in f:
        drain_rows += [
            ["resume command to first body start", f"{f['resume_to_first_start_s']:.1f} s"],
            [f"body starts in the first {f['window_s']:g} s", f"{f['window_starts']:,} ({f['window_rate']:.1f}/s)"],
            ["steady starts/s (5th-95th percentile)", f"{f['steady_rate']:.1f}"],
            [
                f"/ pace (limit {settings.limit} / hold {settings.hold:g} s = {pace:g}/s)",
                f"{f['steady_over_pace']:.3f}",
            ],
            ["min / median starts per 1 s", f"{f['per_second_min']} / {f['per_second_median']:g}"],
            ["most starts in any 1 s", str(f["max_any_1s"])],
        ]
    drain_rows += [
        ["most bodies running at once", f"{f['max_concurrency']} (limit {settings.limit})"],
        [
            "deliveries per started task",
            "-" if f["deliveries_per_started"] is None else f"{f['deliveries_per_started']:.3f}",
        ],
        ["workers' RSS at the end, growth over the baseline", f"{(f['rss_end_kb'] - f['rss_base_kb']) / 1024:+.1f} MB"],
    ]
    if full:
        drain_rows.append(
            ["bodies run per task (never / twice)", f"{f['execs_per_task']:.3f} ({f['never']}/{f['twice']})"]
        )
        if "drain_s" in f:
            drain_rows.append(
                [
                    "full drain (resume to last start) / ideal N x hold / limit",
                    f"{f['drain_s']:.1f} s / {f['drain_over_ideal']:.3f}",
                ]
            )
        for late in f["late"]:
            drain_rows.append(
                ["started long after the rest", f"seq {late['seq']}, {late['after_resume_s']:.0f} s after resume"]
            )
        if f.get("full_drain_incomplete"):
            drain_rows.append(["full drain INCOMPLETE", f["full_drain_incomplete"]])
        for task in f.get("not_run", []):
            due = "none" if task["copy_due_in_s"] is None else f"due in {task['copy_due_in_s']:,.0f} s"
            drain_rows.append(["never ran", f"seq {task['seq']}: its stored copy {due}"])
    else:
        drain_rows.append(["not drained (servers discarded)", f"{n - f['started']:,} of {n:,}"])
    out.append("")
    out.append(table(drain_rows))
    out.append("\nwhere the backlog lives (about 12 samples):")
    out.append(timeline("redis", f["samples"]))
    return out


def verdicts(f: dict[str, Any], settings: Settings, full: bool) -> list[list[str]]:
    rows = [["figure", "measured", "target", "met"]]

    def add(figure: str, measured: str, target: str, met: bool) -> None:
        rows.append([figure, measured, target, "yes" if met else "NO"])

    total = f["per_task_total"]
    add("Redis memory per waiting task (both)", f"{total:,.0f} B", f"<= {TARGET_BYTES} B", total <= TARGET_BYTES)
    add("messages held by workers while waiting", str(f["unacked"]), "0", f["unacked"] == 0)
    queued = f["queue_lists"] + sum(f["derived_lists"].values())
    add("messages in the queue lists while waiting", str(queued), "0", queued == 0)
    if "steady_over_pace" in f:
        ratio = f["steady_over_pace"]
        add("drain: steady starts/s / pace", f"{ratio:.3f}", f">= {MIN_PACE_RATIO}", ratio >= MIN_PACE_RATIO)
    else:
        add("drain: steady starts/s / pace", "no starts", f">= {MIN_PACE_RATIO}", False)
    most = f["max_concurrency"]
    add("most bodies running at once", str(most), f"<= {settings.limit}", most <= settings.limit)
    if full:
        once = f["never"] == 0 and f["twice"] == 0 and not f.get("full_drain_incomplete")
        add("bodies run per task, full drain", f"{f['execs_per_task']:.3f}", "exactly 1", once)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=("waiting",), default="waiting", help=argparse.SUPPRESS)
    parser.add_argument("--tasks", type=int, help="tasks sent to the paused key (100000; 10000 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a tenth of the tasks, and a full drain")
    parser.add_argument("--limit", type=int, default=10, help="the key's concurrency limit (10)")
    parser.add_argument("--hold", type=float, default=0.1, help="seconds each body takes (0.1): pace = limit / hold")
    parser.add_argument("--drain-seconds", type=float, default=60.0, help="seconds of the drain measured (60)")
    parser.add_argument(
        "--full-drain",
        action=argparse.BooleanOptionalAction,
        help="wait for every body and check each task ran once (default: with --quick only)",
    )
    parser.add_argument("--workers", type=int, default=3, help="celery worker processes (3)")
    parser.add_argument("--concurrency", type=int, default=4, help="prefork children per worker (4)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples (1)")
    parser.add_argument("--json", help="also write the figures, the samples, versions and the commit here")
    args = parser.parse_args(argv)
    full = args.quick if args.full_drain is None else args.full_drain
    settings = Settings(
        scenario="waiting",
        tasks=args.tasks or (10_000 if args.quick else 100_000),
        rate=None,
        workers=args.workers,
        concurrency=args.concurrency,
        limit=args.limit,
        hold=args.hold,
        interval=args.interval,
        ctl_every=5.0,
        timeout=0.0,
    )
    command = " ".join(["python -m benchmarks.bench_backlog --scenario waiting", *(argv or sys.argv[1:])])
    command = command.replace("--scenario waiting --scenario waiting", "--scenario waiting")
    began = time.monotonic()
    meta: dict[str, Any] = {
        "commit": git("log", "--oneline", "-1") or "unknown (not a git checkout)",
        "library_changes_not_committed": git("status", "--porcelain", "--", "celery_semaphore").splitlines(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": command,
        "load_at_start": os.getloadavg(),
        **versions(),
    }
    with backlog_lab() as lab:
        print(f"waiting: {settings.tasks} tasks ...", file=sys.stderr, flush=True)
        figures = waiting_round(lab, settings, args.drain_seconds, full)
    meta["seconds"] = time.monotonic() - began
    meta["load_at_end"] = os.getloadavg()
    dirty = meta["library_changes_not_committed"]
    print(f"\n{command}   ({meta['started']})")
    print(
        f"commit {meta['commit'][:72]}{' + uncommitted changes in celery_semaphore/' if dirty else ''}; "
        f"celery {meta['celery']}, kombu {meta['kombu']}, redis-py {meta['redis-py']}, "
        f"redis-server {meta['redis-server']}, Python {meta['python']}, {meta['cpus']} CPUs; "
        f"ran {meta['seconds']:.0f} s; load average {meta['load_at_start'][0]:.2f} at the start, "
        f"{meta['load_at_end'][0]:.2f} at the end; worker logs in {log_dir()}; "
        f"imported celery_semaphore from {', '.join(sorted(set(figures['packages'].values())))}"
    )
    print(
        f"\n{settings.tasks:,} tasks sent through apply_async (placed at send) to key {figures['key']!r}, paused; "
        f"limit {settings.limit}, {settings.hold * 1000:g} ms bodies, {settings.workers} workers x "
        f"{settings.concurrency} prefork, Redis broker (RabbitMQ not measured here)"
    )
    print("\n".join(report(figures, settings, full)))
    found = verdicts(figures, settings, full)
    print("\ntargets")
    print(table(found, left=1))
    met = found[1][3] == "yes"
    print(
        f"\nverdict: {figures['per_task_total']:,.0f} B of Redis per waiting task "
        f"(broker {figures['per_task']['broker']:,.0f} B + semaphore {figures['per_task']['semaphore']:,.0f} B; "
        f"Celery's own message for the call {figures['plain']['message']:,} B) against <= {TARGET_BYTES} B: "
        f"{'met' if met else 'NOT met'}"
        + ("" if full else f"; drain measured over {args.drain_seconds:g} s, not to the end")
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"meta": meta, "settings": settings.__dict__, "figures": figures}, out, indent=2, default=str)


if __name__ == "__main__":
    main()

"""What benchmarks/syncer/load.py reports: the window's figures from what the syncers, the monitor and the client
processes measured, and the summary of one line per figure."""

from __future__ import annotations

import math
import statistics
from collections import Counter

from benchmarks.syncer.load_clients import Plan


def rounds_open_in_window(before: dict[str, float], after: dict[str, float]) -> dict:
    """The rounds a syncer closed between two of its histograms: how many, their mean seconds open (first push to
    close), and the bucket [above, at most] that holds the longest (at most None: past the last bound)."""
    count = after.get("count", 0.0) - before.get("count", 0.0)
    if count <= 0:
        return {"rounds": 0}
    bounds = sorted((float(le), le) for le in after if le not in ("count", "sum"))
    lower = 0.0
    for bound, le in bounds:
        if after[le] - before.get(le, 0.0) >= count:
            break
        lower = bound
    return {"rounds": int(count), "mean_seconds": (after["sum"] - before.get("sum", 0.0)) / count,
            "longest_in_seconds": [lower, bound if math.isfinite(bound) else None]}


def quantiles_ms(seconds: list[float]) -> dict:
    if not seconds:
        return {"count": 0}
    s = sorted(seconds)
    return {"count": len(s), "p50_ms": 1e3 * statistics.median(s), "p99_ms": 1e3 * s[int(0.99 * (len(s) - 1))],
            "max_ms": 1e3 * s[-1]}


def merged(figures: list[dict]) -> dict:
    """The client processes' figures as one."""
    counts: Counter = Counter()
    for f in figures:
        counts.update(f["counts"])
    return {"counts": dict(counts), "heartbeats": [h for f in figures for h in f["heartbeats"]],
            "pushes": [p for f in figures for p in f["pushes"]],
            "events": sorted(e for f in figures for e in f["events"])}


def push_report(pushes: list, start: float, end: float) -> dict:
    """Pushes sent in the window: how many per second had a reply, the push-to-publish latency of the accepted
    ones answered by the window's end, and how many accepted ones were not."""
    sent = [p for p in pushes if start <= p[0] <= end]
    accepted = [p for p in sent if p[1]]
    answered = [p[2] - p[0] for p in accepted if p[2] is not None and p[2] <= end]
    return {"pushes_per_second": sum(p[1] is not None for p in sent) / (end - start),
            "pushes_sent_in_window": len(sent), "push_to_publish": quantiles_ms(answered),
            "pushes_unanswered_at_end": len(accepted) - len(answered)}


def shape_report(plans: list[Plan], events: list, absences: list, statuses: list[dict], start: float) -> dict:
    """Who was slow, churned and killed, what happened to them, and what the syncers made of it."""
    killed_at = {name: at for at, name, kind in events if kind == "killed"}
    ours = {p.name for p in plans}
    states = [Counter(x["state"] for x in st["learners"] if x["id"] in ours) for st in statuses]
    absent_at_end = [{x["id"] for x in st["learners"] if x["state"] == "absent"} for st in statuses]

    def noticed(name: str) -> float | None:  # until every shard showed it absent
        seen = [min((at for at, shard, who in absences if who == name and shard == i and at >= killed_at[name]),
                    default=None) for i in range(len(statuses))]
        return None if None in seen else round(max(seen) - killed_at[name], 3)
    return {
        "slow": [p.name for p in plans if p.slow],
        "churned": [p.name for p in plans if p.leave_at is not None],
        "killed": [p.name for p in plans if p.kill_at is not None],
        "events": [[round(at - start, 3), name, kind] for at, name, kind in events],
        "churned_rejoined": sum(kind == "rejoined" for _, _, kind in events),
        "killed_noticed_absent_seconds": {name: noticed(name) for name in killed_at},
        "killed_absent_at_end": sum(all(name in a for a in absent_at_end) for name in killed_at),
        "absent_seen_not_killed": sorted({who for at, _, who in absences
                                          if at >= start and who in ours and who not in killed_at}),
        "learner_states_at_end": [dict(s) for s in states],
    }


def window_report(before: dict, after: dict, start: float, end: float) -> dict:
    elapsed = end - start
    rounds = sum(st["rounds"] for st in after["statuses"]) - sum(st["rounds"] for st in before["statuses"])
    return {
        "seconds": elapsed, "rounds_per_second": rounds / elapsed,
        "syncer_peak_rss_bytes": [peak for _, peak, _ in after["proc"]],
        # the largest lag of each syncer's event loop before the window (joins) and over the whole run
        "syncer_loop_lag_max_ms_joins": [1e3 * st["loop_lag_max_seconds"] for st in before["statuses"]],
        "syncer_loop_lag_max_ms": [1e3 * st["loop_lag_max_seconds"] for st in after["statuses"]],
        "syncer_cpu_per_second": [(cpu - cpu0) / elapsed for (_, _, cpu), (_, _, cpu0) in zip(after["proc"],
                                                                                               before["proc"])],
        "round_open_metric": [rounds_open_in_window(b, a) for b, a in zip(before["open_histograms"],
                                                                          after["open_histograms"])],
        # over the whole run: pushes refused by reason, and answers sent as full values instead of changes
        "refusals": [st["refusals"] for st in after["statuses"]],
        "full_answers": [st["full_answers"] for st in after["statuses"]],
    }


def memory_at_peak(rss_over_time: list, memory_over_time: list) -> list[dict]:
    """Each syncer's memory by part and RSS (its /status) at the sample of its highest RSS that has them."""
    parts, rss = dict(memory_over_time), dict(rss_over_time)
    out = []
    for shard in range(len(rss_over_time[0][1]) if rss_over_time else 0):
        t = max((t for t in rss if t in parts), key=lambda t: rss[t][shard], default=None)
        if t is not None:
            out.append({"seconds": t, **parts[t][shard]})
    return out


def ms(q: dict) -> str:
    if not q.get("count"):
        return "none"
    return f"p50 {q['p50_ms']:.1f} ms, p99 {q['p99_ms']:.1f} ms, max {q['max_ms']:.1f} ms ({q['count']})"


def seen_open(longest: dict | None) -> str:
    if longest is None:
        return "no round open on any poll of /status"
    return (f"at least {longest['at_least_seconds']:.1f} s (shard {longest['shard']}, fragment {longest['fragment']}"
            f"{', still open at the end' if longest['still_open_at_end'] else ''}; polls of /status)")


def closed_rounds(metric: dict) -> str:
    if not metric["rounds"]:
        return "no round closed"
    above, at_most = metric["longest_in_seconds"]
    return (f"{metric['rounds']} rounds, mean {metric['mean_seconds']:.3f} s open, the longest over {above:g} s and "
            + (f"at most {at_most:g} s" if at_most is not None else "past the last bucket"))


def summary(r: dict) -> list[str]:
    lines = [f"learners joined       {r.get('joined', 0)} of {r['learners']} over {r['processes']} processes"
             + (f" in {r['join_seconds_all']:.1f} s" if "join_seconds_all" in r else "")]
    if "seconds" in r:
        lines += [
            f"window                {r['seconds']:.1f} s",
            f"rounds per second     {r['rounds_per_second']:.2f}",
            f"pushes per second     {r['pushes_per_second']:.2f} ({r['counts'].get('accepted', 0)} accepted, "
            f"{r['counts'].get('refused', 0)} refused over the run)",
            f"push to publish       {ms(r['push_to_publish'])}; {r['pushes_unanswered_at_end']} of "
            f"{r['pushes_sent_in_window']} sent unanswered at the end",
            f"learner heartbeats    {ms(r['learner_heartbeat'])}",
            f"probe heartbeats      {ms(r['probe_heartbeat'])}",
            f"slow                  {len(r['slow'])}",
            f"churned               {len(r['churned'])}, rejoined {r['churned_rejoined']}",
            f"killed                {len(r['killed'])}, absent at the end {r['killed_absent_at_end']}, seen absent "
            f"after {list(r['killed_noticed_absent_seconds'].values())} s",
            f"absent, not killed    {r['absent_seen_not_killed'] or 'none'}",
            f"states at the end     {r['learner_states_at_end']}",
            f"round open longest    {seen_open(r['round_open_longest_seen'])}",
            f"round open (metrics)  {'; '.join(closed_rounds(m) for m in r['round_open_metric'])}",
            f"refused, full answers {r['refusals']}, {r['full_answers']} (by reason, over the run)",
            f"syncer peak RSS       {[f'{b / 2**30:.2f} GiB' for b in r['syncer_peak_rss_bytes']]} = "
            f"{[f'{x:.1f}x' for x in r['syncer_peak_rss_over_model']]} the model",
            f"syncer CPU            {[f'{x:.2f}' for x in r['syncer_cpu_per_second']]} s per s",
            f"syncer loop lag max   {[f'{x:.0f}' for x in r['syncer_loop_lag_max_ms']]} ms",
        ]
    for shard, m in enumerate(r.get("memory_at_peak", [])):
        held = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in m.items() if k not in ("seconds", "rss") and v)
        lines.append(f"memory at RSS peak    shard {shard}: RSS {m['rss'] / 2**20:.0f} MiB at {m['seconds']} s: {held} "
                     f"MiB")
    lines.append(f"RSS samples           {len(r['rss_over_time'])}")
    if "stopped_early" in r:
        lines.append(f"stopped early         {r['stopped_early']}")
    return lines

"""scale.py's report: the JSON report written out as OUT/gpu_scale.md's tables and notes."""

from __future__ import annotations

import json
import math

from benchmarks.gpu.setup import OVERHEAD_GOAL


# ---- the report ----------------------------------------------------------------------------------------------------
def fmt(x, spec: str, none: str = "–") -> str:
    return none if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def markdown(report: dict) -> str:
    lines = [f"# Decoupled DiLoCo at scale: {report['device']}", "",
             f"torch {report['torch']}; budget {report['budget_seconds']:.0f} s, used {report['seconds']:.0f} s; "
             f"corpus {report['corpus']['train_tokens']:,} training tokens (vocabulary {report['corpus']['vocab']:,})"
             + ("; **smoke run (CPU scale): no figure here means anything**" if report["smoke"] else ""), ""]
    q = report["quality"]
    lines += ["## Quality at equal tokens", "",
              f"{q['model']['parameters'] / 1e6:.1f}M parameters, sequence {q['model']['seq_len']}, dp's batch "
              f"{q['batch']} sequences, {q['tokens']:,} tokens per run, seed {q['seed']}. Gap = final held-out loss "
              f"− dp's ({fmt(q['dp']['final_loss'], '.4f')}); published: Scaling Laws for DiLoCo, Table 4 (tuned, "
              "20 tokens per parameter).", "",
              "| run | M | preset | final loss | gap (nats) | published gap 35M / 180M | tokens to dp's final ÷ dp's "
              "| dp's tokens to this final ÷ these |", "|---|---|---|---|---|---|---|---|"]
    for r in q["rows"]:
        pub = r["published_gap_nats"]
        published = f"+{pub['35M']:.3f} / +{pub['180M']:.3f}" if pub else "–"
        lines.append(f"| {r['run']} | {r['learners']} | {r['preset']} | {fmt(r['final_loss'], '.4f')} | "
                     f"{fmt(r['gap_nats'], '+.4f')} | {published} | "
                     f"{fmt(r['tokens_to_dp_final_ratio'], '.2f', 'not reached')}"
                     f"{'×' if r['tokens_to_dp_final_ratio'] else ''} | "
                     f"{fmt(r['dp_tokens_to_this_final_ratio'], '.2f')} |")
    lines += notes(q)
    o = report["overhead"]
    lines += ["", "## Learner overhead", "",
              f"The same loop with and without `Learner.step` (gRPC to a syncer process, decoupled defaults); medians "
              f"of alternating phases. Goal: tokens/s within {OVERHEAD_GOAL:.0%}; no synchronisation with the device "
              "on the training thread from the Learner.", "",
              "| model | parameters | batch | plain tokens/s | with Learner | ratio | meets goal | Learner.step host ms "
              "(median / max) | training-thread waits: plain loop / with Learner | waits on other threads |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in o["rows"]:
        sp, sl, host = r.get("syncs_plain", {}), r.get("syncs_learner", {}), r.get("learner_step_host_ms", {})
        lines.append(f"| {r['model']} | {r['parameters'] / 1e6:.1f}M | {r['batch'][0]}×{r['batch'][1]} | "
                     f"{fmt(r.get('plain_tokens_per_second'), ',.0f')} | "
                     f"{fmt(r.get('learner_tokens_per_second'), ',.0f')}"
                     f" | {fmt(r.get('tokens_per_second_ratio'), '.3f')} | {'yes' if r.get('meets_goal') else 'no'} | "
                     f"{fmt(host.get('median'), '.2f')} / {fmt(host.get('max'), '.1f')} | "
                     f"{sp.get('training_thread', '–')} / {sl.get('training_thread', '–')} "
                     f"{json.dumps(sl.get('training_thread_calls', {}))} | {sl.get('other_threads', '–')} "
                     f"{json.dumps(sl.get('other_thread_calls', {}))} |")
    lines += notes(o)
    m = report["mixed"]
    lines += ["", "## Mixed hardware", "",
              f"Three learners, {m['tokens']:,} tokens per run, default settings.", "",
              "| run | precisions | speeds | final loss | − equal's | steps per learner | rounds |",
              "|---|---|---|---|---|---|---|"]
    for r in m["runs"]:
        lines.append(f"| {r['name']} | {', '.join(r.get('dtypes', []))} | {', '.join(map(str, r.get('speeds', [])))} | "
                     f"{fmt(r['final_loss'], '.4f')} | {fmt(r.get('minus_equal'), '+.4f')} | "
                     f"{', '.join(map(str, r.get('steps', [])))} | {r.get('rounds', '–')} |")
    lines += notes(m)
    return "\n".join(lines) + "\n"


def notes(part: dict) -> list[str]:
    return [""] + [f"- {n}" for n in part.get("notes", [])] if part.get("notes") else []

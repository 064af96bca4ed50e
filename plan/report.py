"""What `tessera plan` prints: the ranked candidates as a table, the best one's memory and time
breakdown, the measured ranking beside the predicted one, the serving options; and the one JSON
object `--json` prints instead (its keys are documented in `tessera plan --help`)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from tessera.core.units import human_count
from tessera.plan.search import MODEL_ERROR, within_model_error

# Candidate columns: header, and the text of one cell.
_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("layout", lambda c: c.layout),
    ("micro-batch", lambda c: f"{c.micro_batch} x {c.micro_batches}"),
    ("recompute", lambda c: _recompute_text(c)),
    ("GiB/GPU", lambda c: f"{c.memory_gib:.1f} / {c.memory_capacity_gib:.0f}"),
    ("step s", lambda c: figure(c.step_time_s)),
    ("TFLOP/s/GPU", lambda c: figure(c.tflops_per_gpu, 1000)),
    ("MFU", lambda c: f"{100 * c.mfu:.1f}%"),
    ("tokens/s", lambda c: human_count(c.tokens_per_s, digits=1)),
)


def _recompute_text(c: Any) -> str:
    if c.recompute == "full" and c.recompute_layers is not None:
        return f"full ({c.recompute_layers}/stage)"
    return c.recompute


def _duration(days: float) -> str:
    """Days as days, else hours, minutes or seconds (a short run is not "0.0 days")."""
    for unit, size in (("days", 1.0), ("hours", 1 / 24), ("minutes", 1 / 1440)):
        if days >= size:
            return f"{days / size:.1f} {unit}"
    return f"{days * 86400:.1f} seconds"


def figure(x: float, whole_from: float = 100) -> str:
    """Three significant digits, trailing zeros kept so a column reads evenly (0.0200 beside
    0.0203, not 0.02); whole numbers (never 1.15e+03) from `whole_from` up."""
    return f"{x:#.3g}".rstrip(".") if x < whole_from else f"{x:,.0f}"


def table(rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
    """Aligned text columns (a header row, a rule, the rows); `right` aligns a column right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, row in enumerate(rows):
        cells = [cell.rjust(w) if r else cell.ljust(w) for cell, w, r in zip(row, widths, right)]
        out.append("  " + "  ".join(cells).rstrip())
        if n == 0:
            out.append("  " + "  ".join("-" * w for w in widths))
    return out


def tie_mark() -> str:
    """The mark of a candidate within the model's error of the best: `≈`, or `~` where stdout
    cannot encode it (a Latin-1 terminal)."""
    try:
        "\u2248".encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return "~"
    return "\u2248"


def _rank_text(i: int, candidates: Sequence[Any]) -> str:
    if i == 0:
        return "1*"
    return f"{i + 1}{tie_mark() if within_model_error(candidates[0], candidates[i]) else ''}"


def candidates_table(candidates: Sequence[Any], days: bool) -> list[str]:
    """Rank, the `_COLUMNS` and (with `days`) the predicted training days; `*` marks the best,
    `tie_mark()` those within the model's error of it (`search.within_model_error`)."""
    head = ["#", *(h for h, _ in _COLUMNS)] + (["days"] if days else [])
    rows = [head]
    for i, c in enumerate(candidates):
        row = [_rank_text(i, candidates), *(cell(c) for _, cell in _COLUMNS)]
        if days:
            row.append(f"{c.days:.1f}" if c.days is not None else "-")
        rows.append(row)
    return table(rows, [True] + [False] * 3 + [True] * (len(head) - 4))


def breakdown(c: Any) -> list[str]:
    """The best candidate in words: its schedule, where its memory goes and its time goes."""
    m, t = c.memory, c.time
    sched = "interleaved 1F1B" if c.virtual_stages > 1 else "1F1B" if c.pp > 1 else \
        "gradient accumulation"
    lines = [f"best: {c.layout}, micro-batch {c.micro_batch} x {c.micro_batches} per step "
             f"({sched}), recompute {_recompute_text(c)}, "
             f"{'sharded (zero1)' if c.sharded_optimizer else 'replicated'} optimizer state",
             f"  memory per GPU  {m.total:.2f} GiB of {c.memory_capacity_gib:.1f}: weights "
             f"{m.weights:.2f}, gradients {m.gradients:.2f}, optimizer {m.optimizer:.2f}, "
             f"activations {m.activations:.2f}, overhead {m.overhead:.2f}"]
    parts = [("compute", t.compute), ("bubble", t.bubble), ("tp comm", t.tp),
             ("pp comm", t.pp), ("dp comm (exposed)", t.dp), ("cp comm", t.cp),
             ("ep comm", t.ep), ("optimizer", t.optimizer)]
    text = ", ".join(f"{name} {figure(v)}" + (f" (of which recompute {figure(t.recompute)})"
                                                 if name == "compute" and t.recompute else "")
                     for name, v in parts if v > 0)
    lines.append(f"  step time       {figure(t.total)} s: {text}")
    return lines


def tie_legend(ties: int, fitting: int, cpu: bool = False, measuring: bool = False) -> str:
    """The line under the table explaining `tie_mark()`: `ties` of the `fitting`
    configurations (the best included) are within the model's error of the best. `cpu`: the
    error was validated on GPU runs; on CPU ranks it is larger (README, `--measure`).
    `measuring`: the measured ranking follows (`--measure`), so it points there."""
    runs = "published GPU runs; larger on CPU ranks" if cpu else "published runs"
    decide = ("the measured ranking below decides" if measuring
              else "measure them (--measure) to decide")
    return (f"  {tie_mark()} #1 is predicted at most {100 * MODEL_ERROR:.1f}% faster, within the "
            f"model's error on {runs} ({ties:,} of the {fitting:,} configurations, #1 "
            f"included): too close to call, {decide}")


def plan_text(header: str, candidates: Sequence[Any], fitting: int, why: str | None,
              tokens: float | None, ties: int | None = None, cpu: bool = False,
              measuring: bool = False) -> str:
    """The whole plain-text answer of a training plan. `ties`: how many of the `fitting`
    configurations are within the model's error of the best (default: count the shown);
    `cpu`: planned for CPU ranks (the legend says the error there is larger); `measuring`:
    the measured ranking is printed next (the legend points to it)."""
    shown = len(candidates)
    lines = [header, (f"{fitting:,} configurations fit; the {shown} fastest, best (*) first:"
                      if fitting > 1 else "1 configuration fits:"), ""]
    lines += candidates_table(candidates, days=tokens is not None)
    if any(within_model_error(candidates[0], c) for c in candidates[1:]):
        if ties is None:
            ties = sum(within_model_error(candidates[0], c) for c in candidates)
        lines.append(tie_legend(ties, fitting, cpu, measuring))
    lines.append("")
    if why:
        lines += [f"why #1: {why}", ""]
    lines += breakdown(candidates[0])
    if tokens is not None and candidates[0].days is not None:
        lines.append(f"  training time   {_duration(candidates[0].days)} for "
                     f"{human_count(tokens, digits=1)} tokens")
    return "\n".join(lines)


def measured_text(candidates: Sequence[Any], measured: Sequence[Any], rho: float | None,
                  setting: str) -> str:
    """The predicted and the measured ranking side by side, and their rank correlation."""
    ok = [i for i, m in enumerate(measured) if m.ok]
    order = sorted(ok, key=lambda i: measured[i].step_time_s)
    measured_rank = {i: r + 1 for r, i in enumerate(order)}
    rows = [["predicted #", "layout", "micro-batch", "recompute", "predicted s", "measured #",
             "measured s", "tokens/s", "peak GiB"]]
    for i, (c, m) in enumerate(zip(candidates, measured)):
        rows.append([str(i + 1), c.layout, f"{c.micro_batch} x {c.micro_batches}",
                     _recompute_text(c), f"{c.step_time_s:.4f}",
                     str(measured_rank[i]) if m.ok else "failed",
                     f"{m.step_time_s:.4f}" if m.ok else "-",
                     f"{m.tokens_per_s:,.0f}" if m.ok else "-",
                     f"{m.peak_memory_gib:.2f}" if m.ok and m.peak_memory_gib else "-"])
    lines = [f"measured: {setting}", ""]
    lines += table(rows, [True, False, False, False, True, True, True, True, True])
    for i, m in enumerate(measured):
        if not m.ok:
            lines.append(f"  #{i + 1} failed: {m.error}")
    lines.append("")
    if order:
        best = order[0]
        lines.append(f"measured best: predicted #{best + 1} ({candidates[best].layout}, "
                     f"micro-batch {candidates[best].micro_batch}, recompute "
                     f"{_recompute_text(candidates[best])})")
    lines.append("Spearman rank correlation, predicted vs measured step time: "
                 + (f"{rho:+.2f}" if rho is not None else "n/a (fewer than 2 measured)")
                 + f" over {len(ok)} candidates")
    return "\n".join(lines)


def plan_json(candidates: Sequence[Any], measured: Sequence[Any] | None = None,
              rho: float | None = None) -> dict[str, Any]:
    """`{"candidates": [...], "training_days": D or null}` (plus "spearman" with measurements):
    candidates best first, each `Candidate.to_dict()` with its `rank`, `layout`,
    `within_model_error` (`search.within_model_error` against the best; true for the best)
    and, with measurements, `measured`."""
    out = []
    for i, c in enumerate(candidates):
        row = {"rank": i + 1, "layout": c.layout, **c.to_dict(),
               "within_model_error": within_model_error(candidates[0], c)}
        if measured is not None:
            row["measured"] = measured[i].to_dict()
        out.append(row)
    result: dict[str, Any] = {"candidates": out,
                              "training_days": candidates[0].days if candidates else None}
    if measured is not None:
        result["spearman"] = rho
    return result


def serving_text(plan: Any, top: int) -> str:
    """The serving verdict, then the options (fastest fitting first)."""
    lines = [plan.message, ""]
    rows = [["tp", "pp", "replicas", "weights GiB", "KV GiB", "GiB/GPU", "max batch",
             "ms/token", "tokens/s", "fits"]]
    for o in plan.options[:top]:
        rows.append([str(o.tp), str(o.pp), str(o.replicas), f"{o.weights_gib:.1f}",
                     f"{o.kv_cache_gib:.1f}", f"{o.memory_gib:.1f} / {o.capacity_gib:.0f}",
                     str(o.max_batch), f"{o.time_per_token_s * 1e3:.2f}",
                     f"{o.tokens_per_s:,.0f}", "yes" if o.fits else "no"])
    lines += table(rows, [True] * 9 + [False])
    return "\n".join(lines)


def serving_json(plan: Any) -> dict[str, Any]:
    def option(o: Any) -> dict[str, Any]:
        return {**dataclasses.asdict(o), "memory_gib": o.memory_gib}

    return {"model": plan.model, "precision": plan.precision, "gpus": plan.gpus,
            "hardware": plan.hardware, "fits": plan.fits, "message": plan.message,
            "recommended": option(plan.recommended) if plan.recommended else None,
            "options": [option(o) for o in plan.options]}

"""From lm-eval's results to one side-by-side table, the per-item shifts and the verdict.

Each evaluated model becomes a `Summary`, computed from lm-eval's logged items: per task the mean score
(accuracy, exact match) with its standard error, the word perplexity of the prose task with a standard
error of its own (lm-eval gives none), and the per-item scores and log-likelihoods (the right answer's, a
whole paragraph's) by item id.
A model is compared with the source Llama on the same items; it is *worse* where

- an accuracy or exact-match rate is more than one of the source's standard errors below the source's;
- the median per-item log-likelihood shift (model minus source) is below `SHIFT_FLOOR` nats;
- the word perplexity is more than `PPL_TOLERANCE` above the source's.
"""

import math
import statistics
from dataclasses import dataclass, field

MC_TASK = "attnres_capitals_mc"
GEN_TASK = "attnres_countries_gen"
PPL_TASK = "attnres_alice_ppl"
TASKS = (MC_TASK, GEN_TASK, PPL_TASK)
SHIFT_FLOOR = -0.05      # nats: the median per-item log-likelihood shift a model may show
PPL_TOLERANCE = 0.01     # relative: 1 % more perplexity at most


@dataclass
class Score:
    """A task's headline number and its standard error (`None` where there is none)."""

    value: float
    stderr: float | None


@dataclass
class Summary:
    """What one model scored: headline scores by task, per-item log-likelihoods by task and item id."""

    label: str
    scores: dict[str, Score] = field(default_factory=dict)
    item_scores: dict[str, dict[str, float]] = field(default_factory=dict)
    item_logliks: dict[str, dict[str, float]] = field(default_factory=dict)
    items: dict[str, int] = field(default_factory=dict)


def ratio_stderr(numerators: list[float], denominators: list[float]) -> float:
    """Standard error of the ratio estimator sum(x) / sum(w) over items (the delta method): the spread of
    the residuals x_i - r w_i, scaled by the total weight."""
    n = len(numerators)
    if n < 2:
        return float("nan")
    total = sum(denominators)
    ratio = sum(numerators) / total
    residuals = [x - ratio * w for x, w in zip(numerators, denominators)]
    return math.sqrt(n / (n - 1) * sum(r * r for r in residuals)) / total


def perplexity_score(logliks: list[float], words: list[int]) -> Score:
    """Word perplexity exp(-sum(loglik) / sum(words)) and its standard error (delta method on the log)."""
    log_ppl = -sum(logliks) / sum(words)
    ppl = math.exp(log_ppl)
    return Score(ppl, ppl * ratio_stderr([-x for x in logliks], words))


def mean_score(values: list[float]) -> Score:
    """The mean of per-item scores and its standard error (sample standard deviation / sqrt(n), as lm-eval
    computes it for a mean)."""
    n = len(values)
    return Score(statistics.fmean(values), statistics.stdev(values) / math.sqrt(n) if n > 1 else float("nan"))


def first_loglik(resp) -> float:
    """The log-likelihood of one filtered response: `[loglik, is_greedy]` or `loglik`."""
    return float(resp[0] if isinstance(resp, list | tuple) else resp)


def summarize(label: str, results: dict) -> Summary:
    """A `Summary` of `lm_eval.simple_evaluate(..., log_samples=True)`'s logged items of the three tasks."""
    summary = Summary(label)
    samples = results["samples"]
    for task, metric in ((MC_TASK, "acc"), (GEN_TASK, "exact_match")):
        if task in samples:
            summary.item_scores[task] = {s["doc"]["id"]: float(s[metric]) for s in samples[task]}
            summary.scores[task] = mean_score(list(summary.item_scores[task].values()))
    if MC_TASK in samples:
        summary.item_logliks[MC_TASK] = {s["doc"]["id"]: first_loglik(s["filtered_resps"][s["doc"]["answer"]])
                                         for s in samples[MC_TASK]}
    if PPL_TASK in samples:
        rows = samples[PPL_TASK]
        logliks = [first_loglik(s["filtered_resps"]) for s in rows]
        words = [int(s["word_perplexity"][1]) for s in rows]          # lm-eval's own count, logged per item
        summary.scores[PPL_TASK] = perplexity_score(logliks, words)
        summary.item_logliks[PPL_TASK] = {s["doc"]["id"]: ll for s, ll in zip(rows, logliks)}
    summary.items = {task: len(rows) for task, rows in samples.items()}
    return summary


def median_shift(model: Summary, source: Summary, task: str) -> float | None:
    """Median over the items both scored of (model's log-likelihood - source's), in nats."""
    mine, theirs = model.item_logliks.get(task, {}), source.item_logliks.get(task, {})
    shared = sorted(set(mine) & set(theirs))
    return statistics.median(mine[i] - theirs[i] for i in shared) if shared else None


def flips(model: Summary, source: Summary, task: str) -> tuple[int, int] | None:
    """`(lost, gained)`: items the source scores right and the model wrong, and the other way round."""
    mine, theirs = model.item_scores.get(task), source.item_scores.get(task)
    if not mine or not theirs:
        return None
    shared = set(mine) & set(theirs)
    return (sum(theirs[i] > mine[i] for i in shared), sum(mine[i] > theirs[i] for i in shared))


@dataclass
class Check:
    """One criterion for one model against the source: what was measured, the bound, and whether it holds."""

    what: str
    measured: str
    bound: str
    holds: bool


def checks(model: Summary, source: Summary) -> list[Check]:
    """Every criterion of the module docstring that both summaries have numbers for."""
    found = []
    for task, name in ((MC_TASK, "capitals accuracy"), (GEN_TASK, "countries exact match")):
        if task in model.scores and task in source.scores:
            mine, theirs = model.scores[task], source.scores[task]
            # One item has no standard error (NaN): then the bound is the source's score itself.
            known = theirs.stderr is not None and math.isfinite(theirs.stderr)
            se = theirs.stderr if known else 0.0
            found.append(Check(name, f"{mine.value - theirs.value:+.3f}",
                               f">= -{se:.3f} (one SE)" if known else ">= 0 (no SE: one item)",
                               mine.value >= theirs.value - se))
    for task, name in ((MC_TASK, "capitals: median shift of the right answer"),
                       (PPL_TASK, "Alice: median shift per paragraph")):
        shift = median_shift(model, source, task)
        if shift is not None:
            found.append(Check(name, f"{shift:+.3f} nats", f">= {SHIFT_FLOOR} nats", shift >= SHIFT_FLOOR))
    if PPL_TASK in model.scores and PPL_TASK in source.scores:
        change = model.scores[PPL_TASK].value / source.scores[PPL_TASK].value - 1
        found.append(Check("Alice word perplexity", f"{100 * change:+.2f} %", f"<= +{100 * PPL_TOLERANCE:.0f} %",
                           change <= PPL_TOLERANCE))
    return found


def verdict(model: Summary, source: Summary) -> str:
    """One line: not worse than the source on every criterion, or the criteria on which it is worse."""
    failed = [c for c in checks(model, source) if not c.holds]
    if not failed:
        return f"{model.label}: not worse than {source.label} on any criterion"
    return f"{model.label}: WORSE than {source.label} on " + "; ".join(
        f"{c.what} ({c.measured}, bound {c.bound})" for c in failed)


def fmt_score(score: Score | None, digits: int = 3) -> str:
    if score is None:
        return "—"
    if score.stderr is None or math.isnan(score.stderr):
        return f"{score.value:.{digits}f}"
    return f"{score.value:.{digits}f} ± {score.stderr:.{digits}f}"


def fmt_shift(shift: float | None) -> str:
    return "—" if shift is None else f"{shift:+.3f}"


def fmt_flips(changed: tuple[int, int] | None) -> str:
    return "—" if changed is None else f"{changed[0]} / {changed[1]}"


def table(summaries: list[Summary]) -> str:
    """The side-by-side markdown table; the first summary is the source every shift is measured from."""
    source = summaries[0]
    rows = [
        (MC_TASK, "capitals, multiple choice: accuracy", [fmt_score(s.scores.get(MC_TASK)) for s in summaries]),
        (MC_TASK, "capitals: right → wrong / wrong → right vs the source",
         [fmt_flips(flips(s, source, MC_TASK)) for s in summaries]),
        (MC_TASK, "capitals: median shift of the right answer's log-likelihood (nats)",
         [fmt_shift(median_shift(s, source, MC_TASK)) for s in summaries]),
        (GEN_TASK, "countries, generated: exact match", [fmt_score(s.scores.get(GEN_TASK)) for s in summaries]),
        (GEN_TASK, "countries: right → wrong / wrong → right vs the source",
         [fmt_flips(flips(s, source, GEN_TASK)) for s in summaries]),
        (PPL_TASK, "Alice paragraphs: word perplexity", [fmt_score(s.scores.get(PPL_TASK), 2) for s in summaries]),
        (PPL_TASK, "Alice: median shift of a paragraph's log-likelihood (nats)",
         [fmt_shift(median_shift(s, source, PPL_TASK)) for s in summaries]),
    ]
    counts = {task: max((s.items.get(task, 0) for s in summaries), default=0) for task in TASKS}
    lines = ["| " + " | ".join(["task (items)", *[s.label for s in summaries]]) + " |",
             "|---|" + "---:|" * len(summaries)]
    lines += [f"| {name} ({counts[task]}) | " + " | ".join(cells) + " |" for task, name, cells in rows]
    return "\n".join(lines)


__all__ = ["GEN_TASK", "MC_TASK", "PPL_TASK", "TASKS", "Check", "Score", "Summary", "checks", "flips", "mean_score",
           "median_shift", "perplexity_score", "ratio_stderr", "summarize", "table", "verdict"]

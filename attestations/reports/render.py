"""Auditors' reports of a proof: one template rendered as an HTML page and as a PDF.

The report shows the experiment and its declared spec, the verdict, every claim with its
evidence level and the limits the run broke, a chart of cumulative compute against the
declared FLOP budget, a timeline of steps with the trainer's self-checks and the
platform's challenges, and the certificate with how to verify it offline.

Charts are SVG drawn here, on the server, from the claims' cumulative series: inline in
the HTML page, and handed to xhtml2pdf as an ``image/svg+xml`` data URI for the PDF,
which draws it as vector graphics through svglib (so the chart's labels stay text in
the PDF). The same body template (``attestations/report_body.html``) renders both.
"""

from __future__ import annotations

import base64
import io
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from html import escape
from typing import TYPE_CHECKING, Any

from django.db.models import QuerySet
from django.http import HttpResponse
from django.template.loader import render_to_string
from django.urls import NoReverseMatch, reverse
from django.utils import timezone

from attestations.accounts.models import Access, Capability
from attestations.certificates.claims import ClaimSet, Series, Violation, compute_claims
from dvbench.attest import Claim, Evidence

if TYPE_CHECKING:
    from django.http import HttpRequest

    from attestations.challenges.models import Challenge
    from attestations.proofs.models import Proof

log = logging.getLogger(__name__)

__all__ = [
    "CLAIM_LABELS",
    "EVIDENCE_LABELS",
    "ClaimRow",
    "compute_chart_svg",
    "human_number",
    "learning_rate_svg",
    "pdf_response",
    "render_report_html",
    "render_report_pdf",
    "report_claims",
    "report_context",
    "svg_data_uri",
    "timeline_svg",
    "visible_proofs",
]

EVIDENCE_LABELS = {
    Evidence.REPLAYED: "Verified by replay",
    Evidence.COMMITTED: "Committed in transcript",
    Evidence.REPORTED: "Reported by trainer",
}
CLAIM_LABELS = {
    "steps": "Training steps",
    "tokens": "Tokens",
    "flops": "Compute (FLOPs)",
    "gpu_hours": "GPU-hours",
    "optimizer": "Optimizer and hyperparameters",
    "regime": "Training regime",
    "program_digest": "Program digest (one throughout)",
    "dataset_commitment": "Dataset commitment",
    "final_parameter_root": "Final parameter root",
}
#: Which declared limit bounds which claim.
CLAIM_LIMITS = {
    "tokens": "max_tokens",
    "flops": "max_flops",
    "gpu_hours": "max_gpu_hours",
    "optimizer": "optimizer",
    "regime": "allowed_regimes",
    "program_digest": "program",
}
PLURALS = {"step": "steps", "token": "tokens", "FLOP": "FLOPs"}
CHART_WIDTH, CHART_HEIGHT = 720, 300
TIMELINE_WIDTH, TIMELINE_HEIGHT = 720, 120
RATE_WIDTH, RATE_HEIGHT = 720, 200
#: One colour per optimizer group in the learning-rate chart (cycled).
GROUP_COLORS = ("#2456d6", "#b7791f", "#1b7f3b", "#8e44ad", "#c62828", "#5b6675")
FONT = "Helvetica, Arial, sans-serif"
COLORS = {
    "line": "#2456d6",
    "budget": "#c62828",
    "axis": "#5b6675",
    "grid": "#e3e8ef",
    "check": "#1b7f3b",
    "snapshot": "#9aa8b8",
    "passed": "#1b7f3b",
    "failed": "#c62828",
    "pending": "#b7791f",
}


# --- Numbers ----------------------------------------------------------------------------


def human_number(value: float | int | Decimal | None, unit: str = "") -> str:
    """A number people can read: grouped digits below a million, else three digits and
    an exponent (``1.23e+21``)."""
    if value is None:
        return "—"
    number = float(value)
    if not math.isfinite(number):
        return str(value)
    if abs(number) < 1e6:
        text = f"{number:,.0f}" if number == int(number) else f"{number:,.6g}"
    else:
        text = f"{number:.4g}".replace("e+0", "e+").replace("e-0", "e-")
    return f"{text} {unit}".strip()


def nice_ceiling(value: float) -> float:
    """The smallest 1, 2, 2.5 or 5 times a power of ten at or above ``value`` (axis ends)."""
    if value <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= value * (1 - 1e-12))


# --- Claims as rows ---------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimRow:
    """One claim as a report lists it."""

    name: str
    label: str
    value: str
    evidence: str
    evidence_label: str
    limit: str
    violated: bool


def _claim_text(claim: Claim) -> str:
    value = claim.value
    if claim.name in ("steps", "tokens", "flops"):
        return human_number(value, PLURALS.get(claim.unit or "", claim.unit or ""))
    if claim.name == "gpu_hours":
        return f"{float(value):.6g} GPU-hours"
    if claim.name == "optimizer" and isinstance(value, dict):
        family = value.get("contract") or value.get("family") or "undetermined"
        match = {True: "matches the spec", False: "differs from the spec", None: "not comparable"}
        text = f"{family} ({match[value.get('matches_declared')]}: {value.get('declared')!s})"
        hyper = value.get("hyperparameters")
        return f"{text}; options {hyper}" if hyper else text
    if claim.name == "regime" and isinstance(value, dict):
        declared = value.get("declared_by_trainer") or "not declared in the transcript"
        return f"{declared}; {value.get('program_phases')} program phase(s)"
    if claim.name == "dataset_commitment" and isinstance(value, dict):
        state = "matches" if value.get("matches_declared") else "does not match"
        return (
            f"batch sequence {value.get('batch_sequence_digest')} ({state} the declared "
            f"{value.get('declared') or 'nothing'})"
        )
    if value is None:
        return "—"
    return str(value)


def _limit_text(name: str, limits: dict[str, Any]) -> str:
    key = CLAIM_LIMITS.get(name)
    if key is None:
        return ""
    declared = limits.get(key)
    if key == "allowed_regimes":
        return ", ".join(declared) if declared else "any"
    if key in ("optimizer", "program"):
        return str(declared) if declared else ""
    return human_number(declared) if declared is not None else "undeclared"


def claim_rows(claims: ClaimSet, limits: dict[str, Any]) -> list[ClaimRow]:
    broken = {violation.limit for violation in claims.violations}
    return [
        ClaimRow(
            name=claim.name,
            label=CLAIM_LABELS.get(claim.name, claim.name),
            value=_claim_text(claim),
            evidence=claim.evidence.value,
            evidence_label=EVIDENCE_LABELS[claim.evidence],
            limit=_limit_text(claim.name, limits),
            violated=CLAIM_LIMITS.get(claim.name) in broken,
        )
        for claim in claims.claims
    ]


# --- Charts -----------------------------------------------------------------------------


def _svg(width: int, height: int, title: str, body: Sequence[str]) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}" '
        f'font-family="{FONT}"><title>{escape(title)}</title>' + "".join(body) + "</svg>"
    )


def _text(
    x: float, y: float, text: str, *, size: int = 11, fill: str = "#333", anchor: str = "start"
) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" fill="{fill}" '
        f'text-anchor="{anchor}">{escape(text)}</text>'
    )


def _line(
    x1: float, y1: float, x2: float, y2: float, color: str, *, width: float = 1, dash: str = ""
) -> str:
    dashed = f' stroke-dasharray="{dash}"' if dash else ""
    return (
        f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{color}" '
        f'stroke-width="{width}"{dashed}/>'
    )


#: Above this ratio of budget to total the chart switches to a log axis: on a linear one
#: the run would lie flat along the bottom of the plot.
LOG_AXIS_RATIO = 10.0


@dataclass(frozen=True)
class _ComputeFrame:
    """The compute chart's plot area and scales: ``x`` of a step, ``y`` of a FLOP count."""

    left: int
    top: int
    width: int
    height: int
    last_step: int
    y: Callable[[float], float]

    def x(self, step: float) -> float:
        return self.left + self.width * step / self.last_step


def compute_chart_svg(
    series: Series, budget: Decimal | float | None, *, violation_step: int | None = None
) -> str:
    """Cumulative FLOPs by step, with the declared budget as a dashed line.

    When the budget exceeds the run's total more than :data:`LOG_AXIS_RATIO` times, the
    FLOP axis is logarithmic (decades from the first step's compute to the budget), so
    the curve and the budget line are both readable; the title says how much of the
    budget was used.

    Args:
        series: the claims' cumulative series.
        budget: the declared maximum FLOPs (None: undeclared, no line).
        violation_step: the step at which the budget was passed, marked on the curve.
    """
    left, right, top, bottom = 78, 20, 28, 44
    plot_w, plot_h = CHART_WIDTH - left - right, CHART_HEIGHT - top - bottom
    steps, flops = series.steps, series.flops
    total = flops[-1] if flops else 0.0
    limit = float(budget) if budget is not None else None
    logarithmic = bool(limit and total > 0 and limit / total > LOG_AXIS_RATIO)
    if logarithmic:
        assert limit is not None
        y, ticks = _log_flop_axis(flops, limit, total, top, plot_h)
    else:
        y, ticks = _linear_flop_axis(flops, limit, top, plot_h)
    frame = _ComputeFrame(left, top, plot_w, plot_h, max(steps[-1] if steps else 0, 1), y)
    body = [f'<rect x="0" y="0" width="{CHART_WIDTH}" height="{CHART_HEIGHT}" fill="#ffffff"/>']
    body += _compute_axes(frame, ticks, logarithmic)
    body += _budget_line(frame, budget, limit)
    if steps:
        body += _flop_curve(frame, series, limit)
    if violation_step is not None and violation_step in steps:
        body += _over_budget_mark(frame, series, violation_step)
    return _svg(CHART_WIDTH, CHART_HEIGHT, "Cumulative compute against the declared budget", body)


def _log_flop_axis(
    flops: Sequence[float], limit: float, total: float, top: int, height: int
) -> tuple[Callable[[float], float], list[tuple[float, str]]]:
    """Decades from the smallest positive count to the budget, at most about eight labelled."""
    smallest = min((value for value in flops if value > 0), default=1.0)
    low = math.floor(math.log10(smallest))
    high = math.ceil(math.log10(max(limit, total) * 1.0001))
    high = max(high, low + 1)

    def y(value: float) -> float:
        position = (math.log10(max(value, 10.0**low)) - low) / (high - low)
        return top + height * (1 - position)

    ticks = [(10.0**k, human_number(10.0**k)) for k in range(low, high + 1)]
    if len(ticks) > 9:  # at most about eight labelled decades
        stride = math.ceil(len(ticks) / 8)
        ticks = ticks[::stride]
    return y, ticks


def _linear_flop_axis(
    flops: Sequence[float], limit: float | None, top: int, height: int
) -> tuple[Callable[[float], float], list[tuple[float, str]]]:
    """From zero to a round number above the run and the budget, four gridlines."""
    peak = max([*flops, limit or 0.0, 1.0])
    ymax = 4 * nice_ceiling(peak * 1.04 / 4)  # four gridlines at round numbers

    def y(value: float) -> float:
        return top + height * (1 - value / ymax)

    return y, [(ymax * k / 4, human_number(ymax * k / 4)) for k in range(5)]


def _compute_axes(
    frame: _ComputeFrame, ticks: Sequence[tuple[float, str]], logarithmic: bool
) -> list[str]:
    left, top, right, base = (
        frame.left,
        frame.top,
        frame.left + frame.width,
        frame.top + frame.height,
    )
    body = []
    for value, label in ticks:
        body.append(_line(left, frame.y(value), right, frame.y(value), COLORS["grid"]))
        body.append(_text(left - 6, frame.y(value) + 4, label, size=10, anchor="end"))
    for k in range(5):
        step = round(frame.last_step * k / 4)
        body.append(_text(frame.x(step), base + 16, f"{step:,}", size=10, anchor="middle"))
    body.append(_line(left, top, left, base, COLORS["axis"]))
    body.append(_line(left, base, right, base, COLORS["axis"]))
    body.append(_text(left + frame.width / 2, CHART_HEIGHT - 8, "Step", size=11, anchor="middle"))
    title = "Cumulative FLOPs" + (" (log scale)" if logarithmic else "")
    body.append(_text(left, 16, title, size=12, fill="#1f2933"))
    return body


def _budget_line(
    frame: _ComputeFrame, budget: Decimal | float | None, limit: float | None
) -> list[str]:
    right = frame.left + frame.width
    if limit is None:
        return [_text(right, 16, "No FLOP budget declared", size=11, fill="#5b6675", anchor="end")]
    level = frame.y(limit)
    label = f"Declared budget {human_number(budget)} FLOP"
    return [
        _line(frame.left, level, right, level, COLORS["budget"], width=1.5, dash="6 4"),
        _text(right, level - 6, label, size=11, fill=COLORS["budget"], anchor="end"),
    ]


def _flop_curve(frame: _ComputeFrame, series: Series, limit: float | None) -> list[str]:
    """The cumulative curve (from the origin for a one-step run) and the run's total."""
    steps, flops = series.steps, series.flops
    x, y = frame.x, frame.y
    points = " ".join(f"{x(s):.1f},{y(f):.1f}" for s, f in zip(steps, flops, strict=True))
    if len(steps) == 1:
        points = f"{x(0):.1f},{y(0):.1f} {points}"
    total = flops[-1]
    total_text = f"Total {human_number(total)} FLOP at step {steps[-1]:,}"
    if limit:
        total_text += f": {_percent(total / limit)} of the declared budget"
    return [
        f'<polyline points="{points}" fill="none" stroke="{COLORS["line"]}" stroke-width="2"/>',
        _text(
            frame.left + 8, frame.top + frame.height - 10, total_text, size=11, fill=COLORS["line"]
        ),
    ]


def _over_budget_mark(frame: _ComputeFrame, series: Series, violation_step: int) -> list[str]:
    at = series.steps.index(violation_step)
    cx, cy = frame.x(series.steps[at]), frame.y(series.flops[at])
    label = f"Over budget at step {violation_step:,}"
    anchor = "end" if cx > frame.left + frame.width / 2 else "start"
    offset = -8 if anchor == "end" else 8
    return [
        f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="5" fill="{COLORS["budget"]}"/>',
        _text(cx + offset, cy + 16, label, size=11, fill=COLORS["budget"], anchor=anchor),
    ]


def _percent(fraction: float) -> str:
    """``3.4%``, ``0.0021%``, ``250%``: two significant digits below 10 %."""
    value = fraction * 100
    return f"{value:.2g}%" if value < 10 else f"{value:,.0f}%"


def learning_rate_svg(series: Series) -> str:
    """Each optimizer group's learning rate by step, as the step records commit it.

    Returns:
        The SVG, or "" when the run commits no per-step learning rate (a JAX run, whose
        schedule is part of its program).
    """
    steps, rates = series.steps, series.learning_rate
    if not steps or not rates:
        return ""
    groups = len(rates[0])
    left, right, top, bottom = 78, 20, 28, 40
    plot_w, plot_h = RATE_WIDTH - left - right, RATE_HEIGHT - top - bottom
    last_step = max(steps[-1], 1)
    values = [rate for row in rates for rate in row if rate is not None]
    ymax = 4 * nice_ceiling(max([*values, 0.0]) * 1.04 / 4) if values else 1.0

    def x(step: float) -> float:
        return left + plot_w * step / last_step

    def y(value: float) -> float:
        return top + plot_h * (1 - value / ymax)

    body = [f'<rect x="0" y="0" width="{RATE_WIDTH}" height="{RATE_HEIGHT}" fill="#ffffff"/>']
    for k in range(5):
        value = ymax * k / 4
        body.append(_line(left, y(value), left + plot_w, y(value), COLORS["grid"]))
        body.append(_text(left - 6, y(value) + 4, f"{value:.3g}", size=10, anchor="end"))
    for k in range(5):
        step = round(last_step * k / 4)
        body.append(_text(x(step), top + plot_h + 16, f"{step:,}", size=10, anchor="middle"))
    body.append(_line(left, top, left, top + plot_h, COLORS["axis"]))
    body.append(_line(left, top + plot_h, left + plot_w, top + plot_h, COLORS["axis"]))
    body.append(_text(left + plot_w / 2, RATE_HEIGHT - 6, "Step", size=11, anchor="middle"))
    body.append(_text(left, 16, "Learning rate (committed per step)", size=12, fill="#1f2933"))
    for group in range(groups):
        color = GROUP_COLORS[group % len(GROUP_COLORS)]
        points = " ".join(
            f"{x(step):.1f},{y(rate):.1f}"
            for step, row in zip(steps, rates, strict=True)
            if group < len(row) and (rate := row[group]) is not None
        )
        if points:
            body.append(
                f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"/>'
            )
        if groups > 1:
            label = f"group {group}"
            body.append(
                _text(left + plot_w - 70 * (groups - group), 16, label, size=11, fill=color)
            )
    return _svg(RATE_WIDTH, RATE_HEIGHT, "Learning rate by step", body)


@dataclass(frozen=True)
class _Mark:
    step: int
    through: int
    status: str


def timeline_svg(
    steps: int,
    checked: Sequence[int],
    snapshots: Sequence[int],
    challenges: Sequence[_Mark],
) -> str:
    """Steps on one axis: the trainer's self-checks, snapshots and the platform's challenges."""
    left, right = 20, 20
    width = TIMELINE_WIDTH - left - right
    last = max(steps - 1, 1)
    rows = {"Self-checks": 34, "Snapshots": 58, "Challenges": 84}

    def x(step: float) -> float:
        return left + width * min(max(step, 0), last) / last

    body = [
        f'<rect x="0" y="0" width="{TIMELINE_WIDTH}" height="{TIMELINE_HEIGHT}" fill="#ffffff"/>'
    ]
    for label, row in rows.items():
        body.append(_line(left, row, left + width, row, COLORS["grid"]))
        body.append(_text(left, row - 8, label, size=10, fill="#5b6675"))
    # One mark per pixel column is all a reader can see; long runs are thinned to that.
    for steps_of, row, color in (
        (checked, rows["Self-checks"], COLORS["check"]),
        (snapshots, rows["Snapshots"], COLORS["snapshot"]),
    ):
        columns = sorted({round(x(step)) for step in steps_of})
        body.extend(_line(c, row - 5, c, row + 5, color, width=1.5) for c in columns)
    for mark in challenges:
        color = (
            COLORS["passed"]
            if mark.status == "passed"
            else COLORS["failed"]
            if mark.status in ("failed", "expired", "error")
            else COLORS["pending"]
        )
        x1, x2 = x(mark.step), x(mark.through)
        if x2 - x1 >= 4:
            body.append(
                f'<rect x="{x1:.1f}" y="{rows["Challenges"] - 5}" width="{x2 - x1:.1f}" height="10" fill="{color}"/>'
            )
        else:
            body.append(f'<circle cx="{x1:.1f}" cy="{rows["Challenges"]}" r="4.5" fill="{color}"/>')
    body.append(_text(left, TIMELINE_HEIGHT - 6, "step 0", size=10, fill="#5b6675"))
    body.append(
        _text(
            left + width,
            TIMELINE_HEIGHT - 6,
            f"step {max(steps - 1, 0):,}",
            size=10,
            fill="#5b6675",
            anchor="end",
        )
    )
    return _svg(
        TIMELINE_WIDTH, TIMELINE_HEIGHT, "Timeline of steps, self-checks and challenges", body
    )


def svg_data_uri(svg: str) -> str:
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode("utf-8")).decode("ascii")


# --- The report -------------------------------------------------------------------------


def _challenges(proof: Proof) -> list[Challenge]:
    from attestations.challenges.models import Challenge

    return list(Challenge.objects.filter(proof=proof).order_by("step", "through"))


def _url(name: str, pk: int) -> str | None:
    try:
        return reverse(name, args=[pk])
    except NoReverseMatch:
        return None


def certificate_info(proof: Proof) -> dict[str, Any] | None:
    """What the report says about the proof's certificate, or None when it has none.

    Besides the searchable columns, what the signed statement says that an auditor
    checks by hand: the sha256 subjects, the challenge seed and tolerance, the detection
    guarantee, the regulatory thresholds and the final model.
    """
    # A missing related row raises an AttributeError subclass, so getattr covers it (and
    # a platform without the certificate models).
    certificate = getattr(proof, "certificate", None)
    if certificate is None:
        return None
    try:
        statement = certificate.statement()
    except (AttributeError, ValueError, KeyError):
        statement = {}
    predicate = statement.get("predicate") or {}
    claims = {claim.get("name"): claim for claim in predicate.get("claims") or []}
    replay = predicate.get("replay") or {}
    subjects = [
        {"name": subject.get("name"), "sha256": (subject.get("digest") or {}).get("sha256")}
        for subject in statement.get("subject") or []
        if (subject.get("digest") or {}).get("sha256")
    ]
    return {
        "subjects": subjects,
        "challenge_seed": replay.get("challengeSeed"),
        "tolerance": replay.get("tolerance") or {},
        "bounds": replay.get("gradientBounds"),
        "guarantee": (claims.get("detection_guarantee") or {}).get("value"),
        "thresholds": _threshold_rows(claims.get("regulatory_thresholds")),
        "model": (claims.get("final_model") or {}).get("value"),
        "result": getattr(certificate, "result", ""),
        "issued": getattr(certificate, "issued", None),
        "keyid": getattr(certificate, "keyid", ""),
        "log_index": getattr(certificate, "log_index", None),
        "trust_root_version": getattr(certificate, "trust_root_version", None),
        "transcript_digest": getattr(certificate, "transcript_digest", ""),
        "final_parameter_root": getattr(certificate, "final_parameter_root", ""),
        "filings": predicate.get("filings"),
    }


def _threshold_rows(claim: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not claim:
        return []
    evidence = claim.get("evidence")
    return [
        {
            **row,
            "threshold_text": human_number(row.get("threshold"), "FLOP"),
            "flops_text": human_number(row["flops"], "FLOP")
            if row.get("flops") is not None
            else "",
            "evidence": evidence,
            "evidence_label": EVIDENCE_LABELS.get(Evidence(evidence), evidence)
            if evidence in {level.value for level in Evidence}
            else evidence,
        }
        for row in claim.get("value") or []
        if isinstance(row, dict)
    ]


def _replay_facts(proof: Proof) -> dict[str, Any]:
    """The challenge seed (once revealed), the transcript's comparison tolerance and, for
    a run that commits its gradients, its gradient bounds."""
    report = proof.report or {}
    config = (report.get("root") or {}).get("config") or {}
    return {
        "seed": proof.revealed_seed,
        "seed_commitment": proof.challenge_seed_commitment or None,
        "tolerance": config.get("tolerance") or {},
        "bounds": config.get("bounds"),
    }


def _violation_row(violation: Violation) -> dict[str, Any]:
    def text(value: Any) -> str:
        if isinstance(value, int | float | Decimal) and not isinstance(value, bool):
            return human_number(value)
        if isinstance(value, list):
            return ", ".join(map(str, value))
        return str(value)

    return {
        "limit": violation.limit,
        "declared": text(violation.declared),
        "actual": text(violation.actual),
        "step": violation.step,
        "message": violation.message,
    }


def _limits(proof: Proof) -> dict[str, Any]:
    spec = proof.spec
    return {
        "max_flops": spec.max_flops,
        "max_tokens": spec.max_tokens,
        "max_gpu_hours": spec.max_gpu_hours,
        "allowed_regimes": list(spec.allowed_regimes or []),
        "optimizer": spec.optimizer,
    }


def report_claims(proof: Proof) -> ClaimSet | None:
    """The proof's claims, or None when they cannot be computed (logged)."""
    return _claims(proof)[0]


def _claims(proof: Proof) -> tuple[ClaimSet | None, str | None]:
    try:
        return compute_claims(proof), None
    except Exception as error:  # a missing blob must not take the report down with it
        log.exception("claims of proof %s could not be computed", proof.pk)
        return None, f"{type(error).__name__}: {error}"


def report_context(proof: Proof, *, pdf: bool = False) -> dict[str, Any]:
    """Everything the report template shows, for the HTML page and the PDF alike."""
    claims, claims_error = _claims(proof)
    limits = _limits(proof)
    challenges = _challenges(proof)
    chart = timeline = rates = ""
    if claims is not None:
        rates = learning_rate_svg(claims.series)
        flop_violation = next((v for v in claims.violations if v.limit == "max_flops"), None)
        chart = compute_chart_svg(
            claims.series,
            proof.spec.max_flops,
            violation_step=flop_violation.step if flop_violation else None,
        )
        timeline = timeline_svg(
            int(claims.value("steps") or 0),
            claims.timeline.get("checked_steps", []),
            claims.timeline.get("snapshot_steps", []),
            [
                _Mark(c.step, c.through if c.through is not None else c.step, c.status)
                for c in challenges
            ],
        )
    return {
        "proof": proof,
        "experiment": proof.experiment,
        "spec": proof.spec,
        "limits": limits,
        "claims": claims,
        "claims_error": claims_error,
        "claim_rows": claim_rows(claims, limits) if claims is not None else [],
        "violations": [_violation_row(v) for v in claims.violations] if claims else [],
        "chart_svg": chart,
        "chart_uri": svg_data_uri(chart) if chart else "",
        "timeline_svg": timeline,
        "timeline_uri": svg_data_uri(timeline) if timeline else "",
        "rate_svg": rates,
        "rate_uri": svg_data_uri(rates) if rates else "",
        "challenges": challenges,
        "certificate": certificate_info(proof),
        "replay_facts": _replay_facts(proof),
        "bundle_url": _url("api:proof-bundle", proof.pk),
        "sigstore_url": _url("api:proof-sigstore-bundle", proof.pk),
        "certificate_url": _url("api:proof-certificate", proof.pk),
        "trust_root_url": _trust_root_url(),
        "claims_url": _url("api:proof-claims", proof.pk),
        "pdf": pdf,
        "generated": timezone.now(),
        "evidence_labels": {level.value: label for level, label in EVIDENCE_LABELS.items()},
    }


def _trust_root_url() -> str | None:
    try:
        return reverse("api:trust-root")
    except NoReverseMatch:
        return None


def render_report_html(proof: Proof, request: HttpRequest | None = None) -> str:
    """The standalone HTML report (what the API serves and the PDF is made from)."""
    return render_to_string(
        "attestations/report_document.html", report_context(proof), request=request
    )


def render_report_pdf(proof: Proof) -> bytes:
    """The PDF report: the same body template, laid out by xhtml2pdf.

    Raises:
        RuntimeError: xhtml2pdf reported errors.
    """
    from xhtml2pdf import pisa

    html = render_to_string("attestations/report_document.html", report_context(proof, pdf=True))
    out = io.BytesIO()
    status = pisa.CreatePDF(html, dest=out, encoding="utf-8")
    if status.err:
        raise RuntimeError(f"xhtml2pdf could not lay out the report of proof {proof.pk}")
    return out.getvalue()


def visible_proofs(access: Access) -> QuerySet[Proof]:
    """Proofs whose claims and report ``access`` may read, with what a report reads."""
    from attestations.proofs.models import Proof

    return Proof.objects.filter(
        access.orgs(Capability.READ, "experiment__owner_id")
    ).select_related("experiment__owner", "spec", "transcript")


def pdf_response(proof: Proof) -> HttpResponse:
    """The report as a PDF download, named after the experiment and the proof."""
    response = HttpResponse(render_report_pdf(proof), content_type="application/pdf")
    name = f"{proof.experiment.owner.slug}-{proof.experiment.name}-proof-{proof.pk}-report.pdf"
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    return response

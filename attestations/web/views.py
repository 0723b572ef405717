"""Server-rendered pages: sign in, dashboard, experiments, proofs, API keys, audit trail.

Same scope rules as the API: an object outside the user's sight is a 404, a visible
object their role may not act on is a 403 (see :mod:`attestations.http.permissions`).
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Q
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods, require_POST
from rest_framework.exceptions import Throttled

from attestations.accounts.models import (
    LAB_ROLE_CHOICES,
    Access,
    ApiKey,
    Capability,
    Invitation,
    InvitationStatus,
    Membership,
    Organization,
)
from attestations.audit.models import AuditEvent
from attestations.challenges.models import Challenge
from attestations.challenges.verdicts import expire_if_due
from attestations.core.conf import client_ip
from attestations.core.errors import DVBenchError
from attestations.experiments.models import Experiment
from attestations.http import sudo
from attestations.http.permissions import get_access
from attestations.proofs.models import Job, Proof, ProofStatus
from attestations.web.forms import (
    ApiKeyForm,
    ConfirmPasswordForm,
    ExperimentForm,
    InviteForm,
    RoleForm,
    SpecForm,
)


def _user(request: HttpRequest) -> User:
    """The signed-in user (every caller is behind ``login_required``)."""
    assert isinstance(request.user, User)
    return request.user


def _require(access: Access, capability: str, organization_id: int) -> None:
    if not access.can_see(organization_id):
        raise Http404
    if not access.can(capability, organization_id):
        raise PermissionDenied(f"Your role does not allow '{capability}' here.")


def _experiment(request: HttpRequest, owner: str, name: str) -> Experiment:
    access = get_access(request)
    return get_object_or_404(
        Experiment.objects.visible_to(access).select_related("owner", "current_spec", "created_by"),
        owner__slug=owner,
        name=name,
    )


@login_required
def dashboard(request: HttpRequest) -> HttpResponse:
    access = get_access(request)
    orgs = Organization.objects.filter(pk__in=access.roles).order_by("slug")
    experiments = Experiment.objects.visible_to(access).select_related("owner", "current_spec")
    proofs = Proof.objects.filter(access.orgs(Capability.READ, "experiment__owner_id"))
    counts = dict(proofs.values_list("status").annotate(n=Count("pk")).values_list("status", "n"))
    events = AuditEvent.objects.filter(access.orgs(Capability.AUDIT)).select_related("organization")
    return render(
        request,
        "attestations/dashboard.html",
        {
            "memberships": [(org, access.roles[org.pk]) for org in orgs],
            "is_regulator": access.is_regulator,
            "experiments": experiments[:8],
            "experiment_count": experiments.count(),
            "proofs": proofs.select_related("experiment__owner", "spec")[:8],
            "counts": {status: counts.get(status, 0) for status in ProofStatus.values},
            "events": events[:10] if access.any(Capability.AUDIT) else None,
            "can_write": access.any(Capability.WRITE),
            "invitations": Invitation.pending_for(_user(request)),
        },
    )


@login_required
def experiment_list(request: HttpRequest) -> HttpResponse:
    access = get_access(request)
    experiments = (
        Experiment.objects.visible_to(access)
        .select_related("owner", "current_spec")
        .annotate(
            valid=Count("proofs", filter=Q(proofs__status=ProofStatus.VALID)),
            rejected=Count("proofs", filter=Q(proofs__status=ProofStatus.REJECTED)),
            pending=Count(
                "proofs",
                filter=Q(
                    proofs__status__in=[
                        ProofStatus.PENDING,
                        ProofStatus.VERIFYING,
                        ProofStatus.CHALLENGED,
                    ]
                ),
            ),
        )
    )
    owner = request.GET.get("owner", "")
    if owner:
        experiments = experiments.filter(owner__slug=owner)
    query = request.GET.get("q", "").strip()
    if query:
        experiments = experiments.filter(name__icontains=query)
    owners = Organization.objects.filter(access.orgs(Capability.READ, "pk")).order_by("slug")
    return render(
        request,
        "attestations/experiment_list.html",
        {
            "experiments": experiments[:200],
            "owners": owners,
            "owner": owner,
            "query": query,
            "can_write": access.any(Capability.WRITE),
        },
    )


@login_required
@require_http_methods(["GET", "POST"])
def experiment_new(request: HttpRequest) -> HttpResponse:
    access = get_access(request)
    if not access.any(Capability.WRITE):
        raise PermissionDenied("Only trainers and admins register experiments.")
    owners = Organization.objects.filter(access.orgs(Capability.WRITE, "pk")).order_by("slug")
    form = ExperimentForm(request.POST or None, owners=owners, access=access)
    if request.method == "POST" and form.is_valid():
        owner = form.cleaned_data["owner"]
        experiment = Experiment.register(
            owner,
            form.cleaned_data["name"],
            form.spec(),
            user=_user(request),
            ip=client_ip(request.META),
        )
        messages.success(request, f"Registered {experiment.full_name}.")
        return redirect("experiment", owner=owner.slug, name=experiment.name)
    return render(request, "attestations/experiment_form.html", {"form": form, "mode": "new"})


@login_required
def experiment_detail(request: HttpRequest, owner: str, name: str) -> HttpResponse:
    experiment = _experiment(request, owner, name)
    access = get_access(request)
    # Every proof ever filed, whatever its verdict (rejected, abandoned, still open): a lab
    # cannot re-file until a draw suits it without auditors seeing each try. Bounded by
    # DVBENCH_MAX_PROOFS_PER_EXPERIMENT (verifier errors aside).
    proofs = list(
        experiment.proofs.select_related("spec", "transcript")
        .prefetch_related("jobs", "refilings")
        .order_by("-created")
    )
    for proof in proofs:
        jobs = sorted(proof.jobs.all(), key=lambda job: job.created, reverse=True)
        proof.latest_job = jobs[0] if jobs else None  # type: ignore[attr-defined]
    events = None
    if access.can(Capability.AUDIT, experiment.owner_id):
        events = AuditEvent.objects.filter(
            Q(target_type="experiment", target_id=str(experiment.pk))
            | Q(detail__experiment=experiment.full_name)
        ).order_by("-created")[:50]
    can_artifacts = access.can(Capability.ARTIFACTS, experiment.owner_id)
    uploads = (
        experiment.uploads.select_related("blob").prefetch_related("parts")[:20]
        if can_artifacts
        else None
    )
    return render(
        request,
        "attestations/experiment_detail.html",
        {
            "uploads": uploads,
            "experiment": experiment,
            "spec": experiment.current_spec,
            "specs": experiment.specs.all(),
            "proofs": proofs,
            "events": events,
            "can_write": access.can(Capability.WRITE, experiment.owner_id),
            "can_artifacts": access.can(Capability.ARTIFACTS, experiment.owner_id),
            "in_progress": any(not p.is_final for p in proofs),
        },
    )


@login_required
@require_http_methods(["GET", "POST"])
def experiment_spec(request: HttpRequest, owner: str, name: str) -> HttpResponse:
    experiment = _experiment(request, owner, name)
    _require(get_access(request), Capability.WRITE, experiment.owner_id)
    spec = experiment.current_spec
    assert spec is not None
    initial = {key: getattr(spec, key) for key in SpecForm.base_fields}
    form = SpecForm(request.POST or None, initial=initial, access=get_access(request))
    if request.method == "POST" and form.is_valid():
        new, changed = experiment.revise_spec(
            form.spec(), user=_user(request), ip=client_ip(request.META)
        )
        if changed:
            versioned = new.pk != spec.pk
            messages.success(
                request,
                f"Spec version {new.version} created (version {spec.version} is frozen)."
                if versioned
                else f"Spec version {new.version} updated.",
            )
        else:
            messages.info(request, "Nothing changed.")
        return redirect("experiment", owner=owner, name=name)
    return render(
        request,
        "attestations/experiment_form.html",
        {"form": form, "mode": "spec", "experiment": experiment, "spec": spec},
    )


@login_required
def proof_detail(request: HttpRequest, pk: int) -> HttpResponse:
    access = get_access(request)
    proof = get_object_or_404(
        Proof.objects.filter(access.orgs(Capability.READ, "experiment__owner_id")).select_related(
            "experiment__owner", "spec", "transcript"
        ),
        pk=pk,
    )
    if expire_if_due(proof):
        proof.refresh_from_db()
    job = Job.objects.filter(proof=proof).order_by("-created").first()
    challenges = list(proof.challenges.order_by("step", "through"))
    filings = list(proof.experiment.proofs.order_by("pk").values_list("pk", flat=True))
    return render(
        request,
        "attestations/proof_detail.html",
        {
            "proof": proof,
            "experiment": proof.experiment,
            "job": job,
            "can_artifacts": access.can(Capability.ARTIFACTS, proof.experiment.owner_id),
            "challenges": challenges,
            "timeline": challenge_timeline(proof, challenges),
            "rate_svg": _learning_rates(proof),
            "filings": filings,
            "filing_number": filings.index(proof.pk) + 1,
        },
    )


def _learning_rates(proof: Proof) -> str:
    """The learning-rate chart of a verified run that commits one per step (Torch)."""
    if proof.verified is None or proof.prover != "whitebox-torch":
        return ""
    from attestations.reports.render import learning_rate_svg, report_claims

    claims = report_claims(proof)
    return "" if claims is None else learning_rate_svg(claims.series)


def challenge_timeline(proof: Proof, challenges: list[Challenge]) -> dict[str, Any]:
    """Positions (0-1000 SVG units) and counts for the proof page's challenge timeline."""
    report = proof.report or {}
    last = max(proof.steps - 1, 1)

    def x(step: int) -> str:
        return f"{10 + 980 * min(step, last) / last:.1f}"

    counts = {key: 0 for key in ("passed", "failed", "expired", "error", "unreplayed", "open")}
    marks = []
    for challenge in challenges:
        counts[challenge.status if challenge.is_final else "open"] += 1
        evidence = (challenge.evidence or {}).get("evidence") or []
        challenge.exact = bool(evidence) and all(e.get("exact") for e in evidence)  # type: ignore[attr-defined]
        marks.append(
            {
                "x": x(challenge.step),
                "step": challenge.step,
                "status": challenge.status,
                "reason": challenge.reason,
            }
        )
    done = sum(c.steps_total for c in challenges if c.is_final)
    total = sum(c.steps_total for c in challenges)
    return {
        "last": max(proof.steps - 1, 0),
        "snapshots": [x(int(s)) for s in report.get("snapshots") or []],
        "self_checks": [{"x": x(int(s)), "step": int(s)} for s in report.get("sampled") or []],
        "challenges": marks,
        "counts": counts,
        "steps_done": done,
        "steps_total": total,
        "done_percent": round(100 * done / total) if total else 0,
    }


@never_cache
@login_required
@require_http_methods(["GET", "POST"])
def api_keys(request: HttpRequest) -> HttpResponse:
    """The user's keys; creating one needs a recent password confirmation (sudo mode).

    A POST with ``action=confirm`` checks the password (``attestations/http/sudo.py``);
    any other POST creates a key, if the session is in sudo mode.
    """
    confirming = request.method == "POST" and request.POST.get("action") == "confirm"
    form = ApiKeyForm(request.POST if request.method == "POST" and not confirming else None)
    confirm_form = ConfirmPasswordForm(request.POST if confirming else None)
    created: tuple[ApiKey, str] | None = None
    status = 200
    if confirming and confirm_form.is_valid():
        try:
            if sudo.confirm(request, confirm_form.cleaned_data["password"]):
                return redirect("api-keys")
            confirm_form.add_error("password", "That is not your password.")
            status = 400
        except Throttled as error:
            confirm_form.add_error("password", str(error.detail))
            status = 429
    elif request.method == "POST" and not confirming:
        if sudo.seconds_left(request) <= 0:
            # An old tab, or a confirmation that ran out: nothing is created.
            messages.error(request, "Confirm your password first; then create the key.")
            status = 403
        elif form.is_valid():
            created = ApiKey.issue(
                _user(request),
                form.cleaned_data["name"],
                days=form.cleaned_data["days"],
                ip=client_ip(request.META),
            )
            # Rendered, not redirected: the raw key exists only in this response.
            form = ApiKeyForm()
    keys = ApiKey.objects.filter(user=request.user)  # type: ignore[misc]
    context: dict[str, Any] = {
        "form": form,
        "confirm_form": confirm_form,
        "sudo_seconds": sudo.seconds_left(request),
        "keys": keys,
        "created": created,
    }
    return render(request, "attestations/api_keys.html", context, status=status)


@login_required
@require_POST
def api_key_revoke(request: HttpRequest, pk: int) -> HttpResponse:
    key = get_object_or_404(ApiKey, pk=pk, user=request.user)
    if key.revoke(actor=_user(request), ip=client_ip(request.META)):
        messages.success(request, f"Revoked {key.prefix}….")
    return redirect("api-keys")


@login_required
def audit_log(request: HttpRequest) -> HttpResponse:
    access = get_access(request)
    if not access.any(Capability.AUDIT):
        raise PermissionDenied("Your role has no audit trail to read.")
    events = AuditEvent.objects.filter(access.orgs(Capability.AUDIT)).select_related("organization")
    action = request.GET.get("action", "").strip()
    if action:
        events = events.filter(action__startswith=action)
    return render(request, "attestations/audit.html", {"events": events[:200], "action": action})


def _manage(request: HttpRequest, slug: str) -> Organization:
    org = get_object_or_404(Organization, slug=slug)
    _require(get_access(request), Capability.MANAGE, org.pk)
    return org


@login_required
@require_http_methods(["GET", "POST"])
def organization(request: HttpRequest, slug: str) -> HttpResponse:
    """Members and roles of one organisation; its admins invite, change roles and remove.

    A new member is invited and joins by accepting (from their dashboard); nobody is put
    in a lab without consenting. The regulator role is not offered: agencies and their
    regulators are the platform operator's (``manage.py agency``).
    """
    access = get_access(request)
    org = get_object_or_404(Organization, slug=slug)
    _require(access, Capability.AUDIT, org.pk)
    can_manage = access.can(Capability.MANAGE, org.pk)
    form = InviteForm(request.POST or None)
    if request.method == "POST":
        if not can_manage:
            raise PermissionDenied("Only the organisation's admins manage its members.")
        if form.is_valid():
            username = form.cleaned_data["username"]
            try:
                invitation, created = Invitation.offer(
                    org,
                    username,
                    form.cleaned_data["role"],
                    actor=_user(request),
                    ip=client_ip(request.META),
                )
            except DVBenchError as error:
                form.add_error("role" if error.field == "role" else "username", error.message)
            else:
                messages.success(
                    request,
                    f"Invited {username} as {invitation.role}; they join {org.slug} when they "
                    "accept."
                    if created
                    else f"The invitation of {username} now offers {invitation.role}.",
                )
                return redirect("organization", slug=slug)
    members = Membership.objects.filter(organization=org).select_related("user")
    experiments = Experiment.objects.filter(owner=org).select_related("current_spec")[:50]
    invitations = (
        Invitation.objects.filter(
            organization=org, status=InvitationStatus.PENDING, expires__gt=timezone.now()
        ).select_related("invited_by")
        if can_manage
        else None
    )
    return render(
        request,
        "attestations/organization.html",
        {
            "org": org,
            "members": members,
            "experiments": experiments,
            "form": form,
            "invitations": invitations,
            "roles": LAB_ROLE_CHOICES,
            "can_manage": can_manage and not org.is_agency,
        },
    )


@login_required
@require_POST
def organization_role(request: HttpRequest, slug: str, username: str) -> HttpResponse:
    org = _manage(request, slug)
    membership = get_object_or_404(Membership, organization=org, user__username=username)
    form = RoleForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Choose one of the roles offered.")
        return redirect("organization", slug=slug)
    try:
        Membership.change_role(
            org,
            membership.user,
            form.cleaned_data["role"],
            actor=_user(request),
            ip=client_ip(request.META),
        )
    except DVBenchError as error:
        messages.error(request, error.message)
    else:
        messages.success(request, f"{username} is now {form.cleaned_data['role']} in {org.slug}.")
    return redirect("organization", slug=slug)


@login_required
@require_POST
def organization_remove(request: HttpRequest, slug: str, username: str) -> HttpResponse:
    """Remove a member (admins), or leave (a member, for themselves)."""
    leaving = username == request.user.get_username()
    access = get_access(request)
    org = get_object_or_404(Organization, slug=slug)
    _require(access, Capability.READ if leaving else Capability.MANAGE, org.pk)
    membership = get_object_or_404(Membership, organization=org, user__username=username)
    try:
        membership.remove(actor=_user(request), ip=client_ip(request.META))
    except DVBenchError as error:
        messages.error(request, error.message)
        return redirect("organization", slug=slug)
    if leaving:
        messages.success(request, f"You left {org.slug}.")
        return redirect("dashboard")
    messages.success(request, f"Removed {username} from {org.slug}.")
    return redirect("organization", slug=slug)


@login_required
@require_POST
def invitation_revoke(request: HttpRequest, slug: str, pk: str) -> HttpResponse:
    org = _manage(request, slug)
    invitation = get_object_or_404(Invitation, organization=org, pk=pk)
    try:
        invitation.revoke(actor=_user(request), ip=client_ip(request.META))
    except DVBenchError as error:
        messages.error(request, error.message)
    else:
        messages.success(request, f"Revoked the invitation of {invitation.username}.")
    return redirect("organization", slug=slug)


@login_required
@require_POST
def invitation_answer(request: HttpRequest, pk: str, answer: str) -> HttpResponse:
    """The invitee accepts or declines (only theirs exist for them: 404 otherwise)."""
    if answer not in ("accept", "decline"):
        raise Http404
    invitation = get_object_or_404(
        Invitation.objects.select_related("organization"), pk=pk, user=request.user
    )
    try:
        if answer == "accept":
            membership = invitation.accept(ip=client_ip(request.META))
            messages.success(
                request, f"You joined {invitation.organization.slug} as {membership.role}."
            )
        else:
            invitation.decline(ip=client_ip(request.META))
            messages.info(request, f"You declined to join {invitation.organization.slug}.")
    except DVBenchError as error:
        messages.error(request, error.message)
    return redirect("dashboard")

"""The end-to-end demo, as the platform's users would drive it: client side only.

``./scripts/demo`` (``manage.py demo``) prepares and serves the platform, then calls
:func:`run` with the demo accounts' API keys. Everything here goes through the public
surface a lab, an auditor and a regulator have: the REST API (``dvbench.Client``), the
SDK in a separate training process (``examples/<framework>/digits.py``) and the
``dvbench`` command line. Nothing imports Django, so what the demo shows is exactly
what works over HTTP; ``tests/test_demo_flow.py`` runs the same function against a live
server (and, in CI, a real Celery worker).

A step the platform does not offer yet (an endpoint that answers "No API endpoint", a
CLI command that is not installed) is reported as not available, never imitated.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from dvbench import APIError, Client, NotFoundError, spec_digest

__all__ = [
    "TOTAL_STEPS",
    "Account",
    "Outcome",
    "Steps",
    "declared_spec",
    "experiment_name",
    "run",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Step 1 is the install (scripts/demo), 2-4 prepare and serve (manage.py demo), the
#: rest is :func:`run`.
TOTAL_STEPS = 12
FIRST_FLOW_STEP = 5
FRAMEWORKS = ("jax", "torch")
FINAL_STATUSES = ("valid", "rejected", "error")
#: Seconds to wait for each stage; generous for a 2-core laptop, and a stage that runs
#: past them is reported with the state it was left in.
TRAIN_TIMEOUT = 600.0
VERDICT_TIMEOUT = 600.0
CERTIFICATE_TIMEOUT = 180.0
POLL_INTERVAL = 0.5


@dataclass(frozen=True)
class Account:
    """A demo user: the role it plays, where, and its credentials."""

    username: str
    password: str
    role: str
    organization: str
    api_key: str


@dataclass
class Outcome:
    """What :func:`run` did, for the summary and the test."""

    experiment: str
    report_dir: Path
    proof_id: int | None = None
    status: str | None = None
    reason: str = ""
    accuracy: float | None = None
    certificate: str | None = None
    verified: bool | None = None
    files: dict[str, Path] = field(default_factory=dict)
    #: claim name -> evidence level, as the platform computed them
    claims: dict[str, str] = field(default_factory=dict)
    unavailable: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every available step succeeded (unavailable ones are listed apart)."""
        return not self.failures and self.status == "valid"


class Steps:
    """Numbered progress lines with timings: ``[6/12] Train ... 14.2 s``."""

    def __init__(self, write: Callable[[str], None], *, first: int, total: int = TOTAL_STEPS):
        self.write = write
        self.number = first - 1
        self.total = total

    @contextlib.contextmanager
    def step(self, title: str) -> Iterator[None]:
        self.number += 1
        self.write(f"[{self.number}/{self.total}] {title}")
        started = time.monotonic()
        try:
            yield
        finally:
            self.write(f"      ({time.monotonic() - started:.1f} s)")

    def note(self, text: str) -> None:
        self.write(f"      {text}")


class StepUnavailableError(Exception):
    """The platform (or this installation) does not offer a step yet."""


class StepFailedError(Exception):
    """A step ran and failed; the message says how."""


def experiment_name(framework: str) -> str:
    return f"demo/digits-{framework}"


def declared_spec(framework: str, dataset_commitment: str) -> dict[str, Any]:
    """The experiment's spec: what the run is, and the limits it declares in advance."""
    model = "2-layer perceptron 64-32-10 (ReLU), handwritten digits 0-9"
    return {
        "framework": framework,
        "model_description": model,
        "optimizer": "Adam(lr=0.01), 60 steps of 50 examples",
        "dataset_commitment": dataset_commitment,
        "max_flops": 10**9,
        "max_tokens": 10**6,
        "max_gpu_hours": 0.1,
        "allowed_regimes": ["pretraining"],
    }


def _missing_endpoint(error: APIError) -> bool:
    """Whether a 404 says the route does not exist (rather than the object)."""
    return isinstance(error, NotFoundError) and error.field == "path"


def _get_optional(client: Client, path: str, what: str) -> Any:
    try:
        return client.get(path)
    except APIError as error:
        if _missing_endpoint(error):
            raise StepUnavailableError(
                f"{what}: this platform has no /api/v1/{path} yet"
            ) from error
        raise


def _download(client: Client, path: str, target: Path, what: str) -> Path:
    try:
        response = client.request("GET", path, headers={"Accept": "*/*"})
    except APIError as error:
        if _missing_endpoint(error):
            raise StepUnavailableError(
                f"{what}: this platform has no /api/v1/{path} yet"
            ) from error
        raise StepFailedError(f"{what}: {error}") from error
    target.write_bytes(response.content)
    return target


def _dvbench(*arguments: str) -> list[str]:
    """The ``dvbench`` command of this interpreter's environment."""
    script = Path(sys.executable).parent / "dvbench"
    if script.exists():
        return [str(script), *arguments]
    return [sys.executable, "-m", "dvbench._cli", *arguments]


class Flow:
    """One run of the demo; each method is one numbered step."""

    def __init__(
        self,
        base_url: str,
        accounts: Mapping[str, Account],
        report_dir: Path,
        framework: str,
        steps: Steps,
        *,
        environment: Mapping[str, str] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.accounts = accounts
        self.framework = framework
        self.steps = steps
        self.environment = dict(os.environ if environment is None else environment)
        self.outcome = Outcome(experiment_name(framework), report_dir)
        self.proof_dir = report_dir / "proof"
        self.clients = {
            role: Client(self.base_url, api_key=account.api_key, max_retries=2)
            for role, account in accounts.items()
        }

    def close(self) -> None:
        for client in self.clients.values():
            client.close()

    # --- 5: experiment ------------------------------------------------------------------
    def _example(self) -> Path:
        return REPO_ROOT / "examples" / self.framework / "digits.py"

    def dataset_commitment(self) -> str:
        """What the trainer declares for its data: the example computes it, as a lab would."""
        computed = subprocess.run(
            [sys.executable, str(self._example()), "--dataset-commitment"],
            cwd=REPO_ROOT,
            env=self.environment,
            capture_output=True,
            text=True,
            timeout=TRAIN_TIMEOUT,
            check=False,
        )
        lines = computed.stdout.split()
        if computed.returncode != 0 or not lines:
            raise StepFailedError(
                f"{self._example().name} --dataset-commitment exited with status "
                f"{computed.returncode}: {computed.stderr.strip()[-2000:]}"
            )
        return lines[-1]

    def register_experiment(self) -> None:
        name = self.outcome.experiment
        spec = declared_spec(self.framework, self.dataset_commitment())
        client = self.clients["trainer"]
        experiment = client.experiment(name, spec=spec)
        if experiment.spec_digest != spec_digest(name, spec):
            # Registered earlier with other limits: declare these as a new version.
            client.post(f"experiments/{name}/specs/", spec)
            experiment.refresh()
        limits = ", ".join(
            f"{key} {spec[key]}" for key in ("max_flops", "max_tokens", "max_gpu_hours")
        )
        self.steps.note(f"{name}, registered by user {self.accounts['trainer'].username!r}")
        self.steps.note(f"declared: {limits}, regimes {spec['allowed_regimes']}")
        self.steps.note(f"dataset commitment {spec['dataset_commitment']} (batch roots, in order)")
        self.steps.note(f"spec digest {experiment.spec_digest}")

    # --- 6: training --------------------------------------------------------------------
    def train(self) -> None:
        script = self._example()
        log_path = self.outcome.report_dir / "training.log"
        environment = {
            **self.environment,
            "DVBENCH_BASE_URL": self.base_url,
            "DVBENCH_API_KEY": self.accounts["trainer"].api_key,
            "DVBENCH_CACHE_DIR": str(self.outcome.report_dir / "cache"),
            "DIGITS_PROOF_DIR": str(self.proof_dir),
            # The final weights, signed with model_signing; uploaded with the proof.
            "DIGITS_MODEL_DIR": str(self.outcome.report_dir / "model"),
            "PYTHONUNBUFFERED": "1",
        }
        environment.pop("DVBENCH_MODE", None)
        self.steps.note(f"{script.relative_to(REPO_ROOT)} (log: {log_path})")
        with log_path.open("w") as log:
            finished = subprocess.run(
                [sys.executable, str(script), self.outcome.experiment],
                cwd=REPO_ROOT,
                env=environment,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                timeout=TRAIN_TIMEOUT,
                check=False,
            )
            log.write(finished.stdout)
        lines = finished.stdout.strip().splitlines()
        if finished.returncode != 0 or not lines:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
            raise StepFailedError(
                f"training exited with status {finished.returncode}:\n        "
                + "\n        ".join(tail)
            )
        result = json.loads(lines[-1])
        self.outcome.proof_id = result.get("proof_id")
        self.outcome.accuracy = float(result["accuracy"])
        for line in lines[:-1]:
            self.steps.note(line)
        if self.outcome.proof_id is None:
            raise StepFailedError("the training run filed no proof (see the log)")
        self.steps.note(
            f"proof {self.outcome.proof_id} filed: {self.base_url}/proofs/{self.outcome.proof_id}/"
        )

    # --- 7: structural verification -----------------------------------------------------
    def _proof(self) -> dict[str, Any]:
        assert self.outcome.proof_id is not None
        return self.clients["auditor"].get_proof(self.outcome.proof_id)

    def wait_for(self, statuses: tuple[str, ...], timeout: float) -> dict[str, Any]:
        """Poll the proof (as the auditor) until its status is one of ``statuses``."""
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while True:
            proof = self._proof()
            status = str(proof.get("status"))
            if not seen or seen[-1] != status:
                seen.append(status)
            if status in statuses or time.monotonic() > deadline:
                if len(seen) > 1:
                    self.steps.note("status: " + " -> ".join(seen))
                if status not in statuses:
                    raise StepFailedError(
                        f"proof {self.outcome.proof_id} is still {status!r} after {timeout:.0f} s"
                    )
                return proof
            time.sleep(POLL_INTERVAL)

    def verify_transcript(self) -> None:
        proof = self.wait_for(("challenged", *FINAL_STATUSES), VERDICT_TIMEOUT)
        self._record(proof)
        if proof.get("status") in FINAL_STATUSES:
            # finish() waits for the challenges and answers them before it returns, and
            # in-process tasks replay them there and then: what follows is the record.
            self.steps.note(f"already {proof.get('status')} when finish() returned")
        self.steps.note(
            f"{proof.get('steps')} steps, {proof.get('checks')} sampled self-checks, "
            f"prover {proof.get('prover')}; transcript digest {proof.get('transcript_digest')}"
        )
        if proof.get("status") in ("rejected", "error"):
            raise StepFailedError(
                f"proof {self.outcome.proof_id} {proof.get('status')}: "
                f"{proof.get('reason')} {proof.get('message')}"
            )

    def _record(self, proof: Mapping[str, Any]) -> None:
        self.outcome.status = str(proof.get("status"))
        self.outcome.reason = str(proof.get("reason") or "")

    # --- 8: challenges ------------------------------------------------------------------
    def challenges(self) -> list[dict[str, Any]]:
        """The platform's challenges for the proof (as the trainer, who answers them)."""
        path = f"proofs/{self.outcome.proof_id}/challenges/"
        try:
            return [dict(item) for item in self.clients["trainer"].paginate(path)]
        except APIError as error:
            if _missing_endpoint(error):
                raise StepUnavailableError(
                    f"challenges: this platform has no /api/v1/{path} yet"
                ) from error
            raise

    def answer_challenges(self) -> None:
        items = self.challenges()
        if not items:
            raise StepFailedError("the platform drew no challenges")
        self.steps.note(f"{len(items)} challenge(s) drawn: {_describe(items)}")
        if any(_pending(item) for item in items):
            # finish() answers what it can; `dvbench sync` answers the rest from the
            # proof directory the example kept.
            synced = subprocess.run(
                _dvbench("sync", "--no-progress", str(self.proof_dir)),
                env={
                    **self.environment,
                    "DVBENCH_BASE_URL": self.base_url,
                    "DVBENCH_API_KEY": self.accounts["trainer"].api_key,
                },
                capture_output=True,
                text=True,
                timeout=TRAIN_TIMEOUT,
                check=False,
            )
            self.steps.note(f"dvbench sync: {(synced.stdout + synced.stderr).strip()}")
            items = self.challenges()
        answered = sum(not _pending(item) for item in items)
        self.steps.note(f"answered by the SDK: {answered} of {len(items)}")

    # --- 9: replay ----------------------------------------------------------------------
    def replay(self) -> None:
        proof = self.wait_for(FINAL_STATUSES, VERDICT_TIMEOUT)
        self._record(proof)
        items = self.challenges()
        verdicts: dict[str, int] = {}
        for item in items:
            verdict = str(item.get("verdict") or item.get("status") or "?")
            verdicts[verdict] = verdicts.get(verdict, 0) + 1
        self.steps.note(
            "replayed on the platform: "
            + ", ".join(f"{n} {verdict}" for verdict, n in sorted(verdicts.items()))
            + f"; {sum(int(item.get('steps_replayed') or 0) for item in items)} transitions"
            + _span(items)
        )
        self.steps.note(f"proof {self.outcome.proof_id}: {proof.get('status')}")
        if proof.get("status") != "valid":
            raise StepFailedError(
                f"{proof.get('status')}: {proof.get('reason')} {proof.get('message')}"
            )

    # --- 10: certificate ----------------------------------------------------------------
    def certificate(self) -> None:
        path = f"proofs/{self.outcome.proof_id}/certificate/"
        deadline = time.monotonic() + CERTIFICATE_TIMEOUT
        while True:
            try:
                certificate = _get_optional(self.clients["auditor"], path, "certificate")
                break
            except NotFoundError:
                # The route exists; the certificate is not signed yet.
                if time.monotonic() > deadline:
                    raise StepFailedError(
                        f"no certificate for proof {self.outcome.proof_id} after "
                        f"{CERTIFICATE_TIMEOUT:.0f} s"
                    ) from None
                time.sleep(POLL_INTERVAL)
        self.outcome.certificate = str(certificate.get("result"))
        self.steps.note(
            f"certificate {certificate.get('id')}: {certificate.get('result')}, "
            f"{certificate.get('flops'):,} FLOPs claimed, signed by key "
            f"{str(certificate.get('keyid'))[:16]}..., log entry {certificate.get('log_index')}"
        )
        self.claims()
        # The regulator's view: found by searching, across organisations, by the API.
        found = self.clients["regulator"].get(
            "certificates/", params={"organization": "demo", "result": "PASSED"}
        )
        ids = [item.get("id") for item in found.get("results", [])]
        self.steps.note(
            f"the regulator finds it: GET /api/v1/certificates/?organization=demo&result=PASSED "
            f"-> {len(ids)} certificate(s){'' if certificate.get('id') in ids else ' (NOT this one)'}"
        )
        if certificate.get("id") not in ids:
            raise StepFailedError("the regulator's search does not list the certificate")

    def claims(self) -> None:
        """The claims the certificate carries, by evidence level, and the limits' fate."""
        data = self.clients["auditor"].get(f"proofs/{self.outcome.proof_id}/claims/")
        by_evidence: dict[str, list[str]] = {}
        for claim in data.get("claims", []):
            self.outcome.claims[str(claim.get("name"))] = str(claim.get("evidence"))
            if claim.get("name") == "limit_violations":
                continue  # the last line below
            text = f"{claim.get('name')} {_claim_value(claim)}".rstrip()
            by_evidence.setdefault(str(claim.get("evidence")), []).append(text)
        for evidence, texts in by_evidence.items():
            self.steps.note(f"{evidence.replace('_', ' ')}: {'; '.join(texts)}")
        violations = data.get("violations") or []
        self.steps.note(
            "declared limits: all held"
            if not violations
            else "declared limits broken: " + "; ".join(str(v.get("message")) for v in violations)
        )

    # --- 11: report ---------------------------------------------------------------------
    def report(self) -> None:
        folder, proof = self.outcome.report_dir, self.outcome.proof_id
        bundle, trust_root = folder / "bundle.json", folder / "trust-root.json"
        # The auditor's download, with the CLI: the bundle and the trust root to pin.
        # Run in the report folder with relative names: the line shown can be pasted.
        sigstore = folder / "certificate.sigstore.json"
        # The same trust root in Sigstore's format, for Sigstore's own verifiers.
        trusted = folder / "trusted_root.json"
        command: tuple[str, ...] = ("download-report", str(proof), "-o", bundle.name)
        command += ("--trust-root-out", trust_root.name, "--sigstore-out", sigstore.name)
        command += ("--trusted-root-out", trusted.name)
        downloaded = subprocess.run(
            _dvbench(*command),
            cwd=folder,
            env={
                **self.environment,
                "DVBENCH_BASE_URL": self.base_url,
                "DVBENCH_API_KEY": self.accounts["auditor"].api_key,
            },
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        output = (downloaded.stdout + downloaded.stderr).strip()
        if downloaded.returncode == 2 and "not available in this installation" in output:
            raise StepUnavailableError(output)
        if downloaded.returncode != 0:
            raise StepFailedError(f"dvbench download-report: {output}")
        self.steps.note(f"$ cd {folder} && dvbench {' '.join(command)}")
        self.outcome.files.update(
            {
                "bundle": bundle,
                "trust root": trust_root,
                "sigstore": sigstore,
                "trusted root": trusted,
            }
        )
        if (folder / "model" / "model.safetensors").is_file():
            self.outcome.files["model"] = folder / "model" / "model.safetensors"
        for what, path, filename in (
            ("html", f"proofs/{proof}/report.html", "report.html"),
            ("pdf", f"proofs/{proof}/report.pdf", "report.pdf"),
        ):
            try:
                self.outcome.files[what] = _download(
                    self.clients["auditor"], path, folder / filename, what
                )
            except StepUnavailableError as missing:
                self.outcome.unavailable.append(str(missing))
                self.steps.note(f"not available on this platform yet: {missing}")
        for what, target in self.outcome.files.items():
            self.steps.note(f"{what:10s} {target} ({target.stat().st_size:,} bytes)")

    # --- 12: offline verification -------------------------------------------------------
    def verify_offline(self) -> None:
        files = self.outcome.files
        if "bundle" not in files or "trust root" not in files:
            raise StepUnavailableError("offline verification needs the bundle and the trust root")
        folder = self.outcome.report_dir
        arguments = (
            "verify-report",
            str(files["bundle"].relative_to(folder)),
            "--trust-root",
            str(files["trust root"].relative_to(folder)),
            "--transcript",
            str((self.proof_dir / "records.cborl").relative_to(folder)),
        )
        command = _dvbench(*arguments)
        # No platform address in its environment: the check uses local files only.
        environment = {
            key: value for key, value in self.environment.items() if not key.startswith("DVBENCH_")
        }
        checked = subprocess.run(
            command,
            cwd=folder,
            env=environment,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        output = (checked.stdout + checked.stderr).strip()
        if checked.returncode == 2 and "not available in this installation" in output:
            raise StepUnavailableError(output)
        self.steps.note("$ dvbench " + " ".join(arguments))
        for line in output.splitlines():
            self.steps.note(f"  {line}")
        self.outcome.verified = checked.returncode == 0
        if not self.outcome.verified:
            raise StepFailedError(f"dvbench verify-report exited with status {checked.returncode}")
        self.verify_model(folder, environment)

    def verify_model(self, folder: Path, environment: Mapping[str, str]) -> None:
        """The Sigstore bundle and the final model, as an auditor checks them."""
        files = self.outcome.files
        if "sigstore" not in files or "model" not in files:
            return
        model = files["model"].parent.relative_to(folder)
        # With the Sigstore trusted root, which also names the timestamp authority.
        sigstore: tuple[str, ...] = ("verify-report", files["sigstore"].name, "--trust-root")
        sigstore += (files["trusted root"].name, "--model", str(model))
        signature: tuple[str, ...] = ("verify", "key", str(model / "model.safetensors"))
        signature += ("--signature",)
        signature += (str(model / "model.sig"), "--public_key", str(model / "model-signing.pub"))
        tool = Path(sys.executable).parent / "model_signing"
        checks = [
            ("dvbench " + " ".join(sigstore), _dvbench(*sigstore)),
            ("model_signing " + " ".join(signature), [str(tool), *signature]),
        ]
        for shown, command in checks:
            if not Path(command[0]).exists():
                self.outcome.unavailable.append(f"{shown.split()[0]} is not installed")
                continue
            done = subprocess.run(
                command,
                cwd=folder,
                env=dict(environment),
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            self.steps.note(f"$ {shown}")
            for line in (done.stdout + done.stderr).strip().splitlines():
                self.steps.note(f"  {line}")
            if done.returncode != 0:
                self.outcome.verified = False
                raise StepFailedError(f"{shown.split()[0]} exited with status {done.returncode}")


def _pending(challenge: Mapping[str, Any]) -> bool:
    """Whether a challenge still waits for the trainer's files."""
    return str(challenge.get("status", "")) == "pending"


def _describe(challenges: list[dict[str, Any]]) -> str:
    """``genesis 0; self_checked 9, 18; random 3, 4, ...`` (windows as ``10-19``)."""
    origins: dict[str, list[str]] = {}
    for item in challenges:
        step, through = item.get("step"), item.get("through")
        label = f"{step}-{through}" if through not in (None, step) else str(step)
        origins.setdefault(str(item.get("origin") or "step"), []).append(label)
    return "; ".join(
        f"{origin} {', '.join(labels[:6])}{f' (+{len(labels) - 6} more)' if len(labels) > 6 else ''}"
        for origin, labels in origins.items()
    )


def _claim_value(claim: Mapping[str, Any]) -> str:
    """A claim's value in a few words (digests shortened, dictionaries summarised)."""
    value, name = claim.get("value"), claim.get("name")
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        return f"{value[:12]}..." if len(value) > 16 else value
    if isinstance(value, Mapping):
        if "matches_declared" in value and name == "dataset_commitment":
            return (
                "matches the declared" if value["matches_declared"] else "differs from the declared"
            )
        if name == "optimizer":
            same = " (as declared)" if value.get("matches_declared") else ""
            return f"{value.get('family')}{same}"
        if name == "regime":
            return str(value.get("declared_by_trainer"))
    return ""


def _span(challenges: list[dict[str, Any]]) -> str:
    """`` in 4.7 s (platform clock)``: from the first answer to the last verdict."""
    try:
        starts = [
            datetime.fromisoformat(str(c["answered"])) for c in challenges if c.get("answered")
        ]
        ends = [datetime.fromisoformat(str(c["finished"])) for c in challenges if c.get("finished")]
    except ValueError:
        return ""
    if not starts or not ends:
        return ""
    return f" in {(max(ends) - min(starts)).total_seconds():.1f} s (platform clock)"


def run(
    base_url: str,
    accounts: Mapping[str, Account],
    report_dir: Path,
    *,
    framework: str = "jax",
    write: Callable[[str], None] = print,
    first_step: int = FIRST_FLOW_STEP,
    environment: Mapping[str, str] | None = None,
) -> Outcome:
    """Drive the whole flow against a running platform; returns what happened.

    Args:
        base_url: the platform, e.g. ``http://127.0.0.1:8000``.
        accounts: by role (``trainer``, ``auditor``, ``regulator``, ``admin``).
        report_dir: emptied, then filled with the proof directory, the training log,
            the bundle, the HTML and PDF reports and the trust root.
        framework: ``jax`` or ``torch``.
        write: where progress lines go.
        first_step: the number of the first step printed here.
        environment: the training process's environment (default: this process's).

    A step that fails stops the flow (the platform keeps running for a look); a step
    the platform does not offer yet is reported and skipped.
    """
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework {framework!r} must be one of {', '.join(FRAMEWORKS)}")
    if report_dir.exists():
        shutil.rmtree(report_dir)
    report_dir.mkdir(parents=True)
    steps = Steps(write, first=first_step)
    flow = Flow(base_url, accounts, report_dir, framework, steps, environment=environment)
    label = "JAX" if framework == "jax" else "PyTorch"
    plan: list[tuple[str, Callable[[], None]]] = [
        ("Register the experiment with declared limits", flow.register_experiment),
        (f"Train the {label} digits classifier with a ZKDV proof, upload", flow.train),
        ("Verify the transcript: chain, sampled self-checks, identity", flow.verify_transcript),
        ("Challenges: drawn by the platform, answered by the SDK", flow.answer_challenges),
        ("Replay the challenged steps on the platform's workers", flow.replay),
        ("Certificate: signed and appended to the transparency log", flow.certificate),
        (f"Write the report to {report_dir}", flow.report),
        ("Verify the bundle offline (dvbench verify-report)", flow.verify_offline),
    ]
    try:
        for title, action in plan:
            with steps.step(title):
                try:
                    action()
                except StepUnavailableError as missing:
                    flow.outcome.unavailable.append(str(missing))
                    steps.note(f"not available on this platform yet: {missing}")
                except (StepFailedError, APIError, subprocess.TimeoutExpired) as error:
                    flow.outcome.failures.append(f"{title}: {error}")
                    steps.note(f"FAILED: {error}")
                    break
    finally:
        flow.close()
    return flow.outcome

"""What each kind of upload means, said by the app that owns the kind.

The proofs app files a completed transcript as a proof: it registers its
:class:`KindRules` for the kind (in its ``AppConfig.ready``), and the upload services call
each hook at the point its docstring names, so this app imports nothing above it.
"""

from __future__ import annotations

from pathlib import Path

from django.contrib.auth.models import User

from attestations.experiments.models import Experiment
from attestations.uploads.models import Upload


class KindRules:
    """What the app owning a kind of upload checks and does; every hook may refuse.

    A hook refuses by raising a domain error (``attestations.core.errors``), which the
    upload call raises in turn. The default rules accept everything and do nothing.
    """

    def before_open(self, experiment: Experiment, sha256: str) -> None:
        """Called before an upload of this kind is opened (said before any byte is sent)."""

    def before_complete(self, upload: Upload) -> None:
        """Called when completion starts, before the parts are assembled."""

    def check_file(self, upload: Upload, path: Path) -> None:
        """Called with the assembled file once its digest matched, before it is stored.

        A domain error fails the upload: its parts are removed.
        """

    def completed(self, upload: Upload, *, user: User, ip: str | None) -> None:
        """Called in the completion's transaction, once the blob is stored.

        A domain error rolls the completion back and fails the upload.
        """


_RULES: dict[str, KindRules] = {}
_DEFAULT_RULES = KindRules()


def register_kind(kind: str, rules: KindRules) -> None:
    """Give uploads of ``kind`` their owner's rules (call from ``AppConfig.ready``)."""
    _RULES[kind] = rules


def rules_for(kind: str) -> KindRules:
    return _RULES.get(kind, _DEFAULT_RULES)

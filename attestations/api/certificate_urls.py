"""API routes for certificates, the transparency log, the trust root and regulator search.

Mounted under ``/api/v1/`` before the catch-all; a trailing slash is optional.

======  ===============================================  =================================
GET     trust-root/ (?version=)                          the trust root (public)
GET     trust-root/versions/                             every version and digest (public)
GET     trusted-root/                                    Sigstore TrustedRoot v0.1 (public)
GET     log/checkpoint/                                  latest signed checkpoint (public)
GET     log/verifier-key/                                signed-note verifier keys (public)
GET     log/entries/{index}/                             one entry's envelope (its readers)
GET     log/proof/inclusion/?index=&tree_size=           inclusion proof (public)
GET     log/proof/consistency/?first=&second=            consistency proof (public)
GET     proofs/{id}/certificate/                         the proof's certificate
GET     proofs/{id}/bundle/                              its offline report bundle
GET     proofs/{id}/sigstore-bundle/                     the same as a Sigstore bundle v0.3
GET     certificates/ · certificates/{id}/               search (regulators: every org)
======  ===============================================  =================================
"""

from __future__ import annotations

from django.urls import URLPattern, re_path

from attestations.api import certificates as views

urlpatterns: list[URLPattern] = [
    re_path(r"^trust-root/?$", views.TrustRootView.as_view(), name="trust-root"),
    re_path(
        r"^trust-root/versions/?$",
        views.TrustRootVersionList.as_view(),
        name="trust-root-versions",
    ),
    re_path(r"^trusted-root/?$", views.TrustedRootView.as_view(), name="trusted-root"),
    re_path(r"^log/checkpoint/?$", views.LogCheckpointView.as_view(), name="log-checkpoint"),
    re_path(r"^log/verifier-key/?$", views.LogVerifierKeyView.as_view(), name="log-verifier-key"),
    re_path(
        r"^log/entries/(?P<index>[0-9]{1,18})/?$", views.LogEntryView.as_view(), name="log-entry"
    ),
    re_path(r"^log/proof/inclusion/?$", views.InclusionProofView.as_view(), name="log-inclusion"),
    re_path(
        r"^log/proof/consistency/?$",
        views.ConsistencyProofView.as_view(),
        name="log-consistency",
    ),
    re_path(
        r"^proofs/(?P<pk>[0-9]{1,18})/certificate/?$",
        views.ProofCertificateView.as_view(),
        name="proof-certificate",
    ),
    re_path(
        r"^proofs/(?P<pk>[0-9]{1,18})/bundle/?$",
        views.ProofBundleView.as_view(),
        name="proof-bundle",
    ),
    re_path(
        r"^proofs/(?P<pk>[0-9]{1,18})/sigstore-bundle/?$",
        views.ProofSigstoreBundleView.as_view(),
        name="proof-sigstore-bundle",
    ),
    re_path(r"^certificates/?$", views.CertificateList.as_view(), name="certificates"),
    re_path(
        r"^certificates/(?P<pk>[0-9]{1,18})/?$",
        views.CertificateDetail.as_view(),
        name="certificate",
    ),
]

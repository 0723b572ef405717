"""The final model a trainer attaches to a proof: where its files go, and the weights check.

A proof directory keeps the final model under ``model/`` (dvbench's ``proof.save_model``):
safetensors files, and optionally a model_signing signature and its public key. The
weights must hold exactly the transcript's final parameters; that is checked when they
are attached (``attestations.challenges.answers``) and again when the certificate is
issued (``attestations.certificates.subjects``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.files.storage import default_storage

from attestations.proofs.models import Proof
from dvbench import (
    MODEL_DIR,
    PUBLIC_KEY_FILE,
    SIGNATURE_FILE,
    ModelMismatchError,
    SafetensorsError,
    check_final_parameters,
)

__all__ = ["check_weights", "final_parameters", "model_names"]


def model_names(name: str) -> bool:
    """Whether ``name`` is where a proof directory keeps the final model's files."""
    folder, separator, base = name.partition("/")
    if folder != MODEL_DIR or not separator or not base or "/" in base:
        return False
    if base in (SIGNATURE_FILE, PUBLIC_KEY_FILE):
        return True
    return base.endswith(".safetensors") and len(base) > len(".safetensors")


def final_parameters(proof: Proof) -> tuple[list[dict[str, Any]], int, str] | None:
    """The parameter schema, chunk size and final parameter root, once verified."""
    report: Mapping[str, Any] = proof.report or {}
    root = report.get("root") or {}
    final = report.get("final") or {}
    specs = (root.get("schema") or {}).get("params")
    config = root.get("config") or {}
    parameter_root = final.get("p") if isinstance(final, Mapping) else None
    if not isinstance(specs, list) or not isinstance(parameter_root, str):
        return None
    from zkdv.config import ZKDVConfig

    return specs, ZKDVConfig.from_dict(dict(config)).chunk_bytes, parameter_root


def check_weights(proof: Proof, name: str, storage_name: str, size: int) -> str | None:
    """Check one attached safetensors file against the transcript's final parameters.

    Returns:
        None when it holds exactly the final parameters, else why not. Also None when the
        proof is not verified yet (the certificate checks again when it is issued).
    """
    final = final_parameters(proof)
    if final is None:
        return None
    specs, chunk, parameter_root = final
    try:
        with default_storage.open(storage_name, "rb") as handle:
            check_final_parameters(
                handle, size, specs=specs, chunk_bytes=chunk, final_root=parameter_root
            )
    except (SafetensorsError, ModelMismatchError) as error:
        return f"{name}: {error}"
    return None

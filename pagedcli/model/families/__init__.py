"""The architectures pagedcli runs: Llama's decoder and the families that differ from it by a little,
one module each saying what it adds (family.py's Family). The next family is one more module here
and one more entry below."""

from __future__ import annotations

from pagedcli.core.errors import RunError
from pagedcli.model.families import llama, mistral, qwen2, qwen3
from pagedcli.model.families.family import Family

FAMILIES: dict[str, Family] = {f.architecture: f for f in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, mistral.FAMILY)}
SUPPORTED = ", ".join(FAMILIES)


def family_of(d: dict, source: str) -> Family:
    """The family config.json `d` names (its `architectures`, else its `model_type`); one line
    naming the supported ones for any other."""
    archs = d.get("architectures") or []
    for arch in archs:
        if arch in FAMILIES:
            return FAMILIES[arch]
    if archs:
        raise RunError(f"{source}: architecture {', '.join(archs)} is not supported", f"pagedcli runs {SUPPORTED}")
    by_type = {f.model_type: f for f in FAMILIES.values()}
    model_type = d.get("model_type")
    if model_type in by_type:
        return by_type[model_type]
    raise RunError(f"{source}: model_type {model_type!r} is not supported",
                   f"pagedcli runs the model types {', '.join(by_type)}")

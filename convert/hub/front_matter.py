"""A model card's front matter (YAML, emitted without a YAML library so that the bytes never change
with a library's version: a re-publish of the same artifact is then a no-op), what it is built
from (:class:`CardInputs`), and reading it back from a card (``model_card.py`` renders the body).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from hetquant.formats import HetquantError
from hetquant.formats.families import family_for_config

from ..recipes import RECIPES

__all__ = [
    "PIPELINE_TAG",
    "REQUIRED_KEYS",
    "CardInputs",
    "base_model_from",
    "card_metadata",
    "license_from_text",
    "model_tags",
    "parse_front_matter",
    "yaml_front_matter",
]

PIPELINE_TAG = "text-generation"
REQUIRED_KEYS = ("license", "library_name", "pipeline_tag", "tags")

_KNOWN_LICENSES = (  # repo id prefix → license of its model card, when the card can't be read
    ("deepseek-ai/DeepSeek-V3", "mit"),
    ("deepseek-ai/DeepSeek-R1", "mit"),
)
_PLAIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./-]*$")
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"}
_HF_CACHE_PATH = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)/snapshots/[0-9a-f]{40}/?$")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class CardInputs:
    """Everything the card says, gathered by the caller (files, options) before rendering."""

    def __init__(
        self,
        manifest: Mapping[str, Any],
        repo_id: str,
        *,
        license: str,
        base_model: str | None,
        base_model_note: str | None = None,
        config: Mapping[str, Any] | None = None,
        recipe_summary: str | None = None,
    ) -> None:
        self.manifest = manifest
        self.repo_id = repo_id
        self.license = license
        self.base_model = base_model
        self.base_model_note = base_model_note
        self.config = config or {}
        self.recipe_summary = recipe_summary

    @property
    def recipe(self) -> str:
        return str(self.manifest["recipe"]["name"])


# what the card is built from -----------------------------------------------------------------------
def base_model_from(
    manifest: Mapping[str, Any], config: Mapping[str, Any] | None
) -> tuple[str | None, str | None]:
    """``(repo id, None)`` of the source model, or ``(None, why not)``.

    In order: the repo id recorded in the manifest (a Hub SOURCE); the repo an HF-cache snapshot
    path belongs to; config.json's ``_name_or_path`` when it is a repo id.
    """
    src = manifest.get("source") or {}
    repo = src.get("repo_id")
    if isinstance(repo, str) and _REPO_ID.match(repo):
        return repo, None
    m = _HF_CACHE_PATH.search(str(src.get("path") or "").replace("\\", "/"))
    if m:
        return f"{m[1]}/{m[2]}", None
    name = (config or {}).get("_name_or_path")
    if isinstance(name, str) and _REPO_ID.match(name) and not name.startswith((".", "/")):
        return name, None
    return None, (
        "The source was a local directory whose config.json names no Hub repository, so the "
        "card names no base model; pass `--base-model org/name` to `hetquant publish` to set it."
    )


def parse_front_matter(text: str) -> dict[str, Any]:
    """The YAML front matter of a model card as a dict (empty when absent or unreadable)."""
    if not text.startswith("---"):
        return {}
    try:
        import yaml  # huggingface_hub depends on PyYAML

        end = text.index("\n---", 3)
        doc = yaml.safe_load(text[3:end])
    except Exception:
        return {}
    return doc if isinstance(doc, dict) else {}


def license_from_text(
    card_text: str | None, license_text: str | None, base_model: str | None
) -> str | None:
    """The license id: the source card's ``license:``, else a recognised LICENSE file, else what
    the base model's card is known to say (DeepSeek-V3 / R1: mit)."""
    if card_text:
        lic = parse_front_matter(card_text).get("license")
        if isinstance(lic, str) and lic.strip():
            return lic.strip()
    if license_text:
        head = license_text.lstrip()[:200].lower()
        if head.startswith("mit license") or "permission is hereby granted, free of charge" in (
            license_text.lower()
        ):
            return "mit"
        if "apache license" in head and "version 2.0" in license_text[:400].lower():
            return "apache-2.0"
    for prefix, lic in _KNOWN_LICENSES:
        if base_model and base_model.startswith(prefix):
            return lic
    return None


# rendering ----------------------------------------------------------------------------------------
def card_metadata(inp: CardInputs) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    if inp.base_model:
        meta["base_model"] = inp.base_model
        meta["base_model_relation"] = "quantized"
    meta["license"] = inp.license
    recipe = RECIPES.get(inp.recipe)  # None: a recipe this hetquant does not know
    meta["library_name"] = recipe.library if recipe else "vllm"
    meta["pipeline_tag"] = PIPELINE_TAG
    tags = model_tags(inp.config)
    tags += ["hetquant", "quantized", inp.recipe, *(recipe.tags if recipe else ())]
    meta["tags"] = list(dict.fromkeys(tags))
    return meta


def model_tags(config: Mapping[str, Any]) -> list[str]:
    """The model family's name and config.json's ``model_type`` (Kimi K2: ``deepseek_v3``,
    ``kimi_k2``); just the model type when no registered family claims it."""
    model_type = config.get("model_type")
    tags = [model_type] if isinstance(model_type, str) and model_type else []
    try:
        return list(dict.fromkeys([family_for_config(config).name, *tags]))
    except HetquantError:
        return tags


def yaml_front_matter(meta: Mapping[str, Any]) -> str:
    """``---\\n…\\n---\\n`` for a mapping of strings and lists of strings."""
    lines = ["---"]
    for key, value in meta.items():
        if isinstance(value, (list, tuple)):
            lines.append(f"{key}:")
            lines += [f"- {_scalar(v)}" for v in value]
        else:
            lines.append(f"{key}: {_scalar(value)}")
    lines.append("---")
    return "\n".join(lines) + "\n"


def _scalar(value: Any) -> str:
    s = str(value)
    if _PLAIN.match(s) and s.lower() not in _YAML_WORDS and not _looks_numeric(s):
        return s
    return json.dumps(s, ensure_ascii=False)  # a JSON string is a YAML double-quoted scalar


def _looks_numeric(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True

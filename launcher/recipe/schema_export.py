"""The JSON Schema of recipe files, for editors (yaml-language-server) and tests."""

from __future__ import annotations

from typing import Any

from launcher import catalog
from launcher.recipe.schema import RecipeSpec

SCHEMA_ID = "https://launcher.dev/schemas/recipe.json"


def recipe_json_schema() -> dict[str, Any]:
    schema = RecipeSpec.model_json_schema()
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID, **schema}
    schema["title"] = "launcher recipe"
    # Offer the catalog's names as completions without forbidding other strings: a model
    # name's validity is checked against the catalog by `launcher validate`, with a clear message.
    props = schema["properties"]
    props["model"]["examples"] = sorted(catalog.models())
    schema["$defs"]["Cluster"]["properties"]["instance_type"]["examples"] = sorted(catalog.instance_types())
    # A file with `extends` may leave required keys to its parent, so the required keys apply
    # only to files without it.
    root_required = schema.pop("required")
    training_required = schema["$defs"]["Training"].pop("required")
    schema["if"] = {"not": {"required": ["extends"]}}
    schema["then"] = {"required": root_required, "properties": {"training": {"required": training_required}}}
    return schema

"""Recipes: schema, loading (extends, overrides, line-numbered errors) and validation rules."""

from launcher.recipe.loader import parse_set_options
from launcher.recipe.recipe import Recipe
from launcher.recipe.schema import RecipeSpec

__all__ = ["Recipe", "RecipeSpec", "parse_set_options"]

"""A single LayoutPlan shows in a notebook as a table of what the plan predicts."""

from __future__ import annotations

from launcher import api
from tests.backends.helpers import recipe_path
from tests.test_notebook import Page


def test_one_layout_plan_shows_its_layout_speed_memory_and_cost():
    best = api.plan(recipe_path("llama3-8b-8k"), top=1).best
    page = Page(best._repr_html_())
    assert page.row("layout") == best.describe()
    assert page.row("tokens/s/GPU") == f"{best.tokens_per_s_per_gpu:,.0f}"
    assert page.row("peak memory").endswith(f"({best.memory.utilization:.0%})")
    assert page.row("$/run") == f"{best.throughput.usd_per_run:,.0f}"

"""What a notebook shows: `_repr_html_` of every value the API returns, the memory SVG, the
plots, and their errors (one line each).

HTML is parsed with html.parser and the SVG with xml.etree, and the key numbers are looked for
in the text a reader would see.
"""

from __future__ import annotations

import builtins
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest

from launcher import api
from launcher.backends.base import JobStatus
from launcher.errors import UsageError
from launcher.estimate import format_bytes
from launcher.jobs import Job
from launcher.registry import JobRef
from tests.backends.helpers import recipe_path

PNG = b"\x89PNG\r\n\x1a\n"
SVG = "{http://www.w3.org/2000/svg}"


class Page(HTMLParser):
    """The visible text of an HTML fragment, its links, and its <svg> as source."""

    def __init__(self, markup: str):
        super().__init__()
        self.text: list[str] = []
        self.links: dict[str, str] = {}
        self._href: str | None = None
        self.feed(markup)
        start = markup.find("<svg")
        self.svg = markup[start : markup.find("</svg>") + 6] if start >= 0 else None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs)["href"]

    def handle_endtag(self, tag):
        if tag == "a":
            self._href = None

    def handle_data(self, data):
        if data.strip():
            self.text.append(data.strip())
            if self._href:
                self.links[data.strip()] = self._href

    def row(self, key: str) -> str:
        """The cell after a key cell."""
        return self.text[self.text.index(key) + 1]


# --- recipe, estimate, plans ---------------------------------------------------------------------


def test_a_recipe_shows_its_model_sequence_layout_and_cluster():
    page = Page(api.load(recipe_path("llama70b-128k"))._repr_html_())
    assert page.text[0] == "Recipe llama70b-128k"
    assert page.row("model") == "llama3.1-70b (70.6 B parameters)"
    assert page.row("sequence") == "131,072 tokens"
    assert page.row("layout") == "dp_shard4xcp8"
    assert page.row("cluster") == "4 x ml.p5e.48xlarge: 32 x h200-141gb"


def test_an_estimate_shows_its_numbers_and_a_bar_per_stage_against_capacity_and_the_threshold():
    recipe = api.load(recipe_path("llama70b-128k"), set_options=["parallel.pipeline=4", "parallel.context=2"])
    estimate = api.estimate(recipe)
    page = Page(estimate._repr_html_())
    assert page.row("verdict") == estimate.verdict == "oom"
    peak, capacity = format_bytes(estimate.per_gpu_peak_bytes), format_bytes(estimate.gpu_memory_bytes)
    assert page.row("peak per GPU") == f"{peak} of {capacity} ({estimate.utilization:.0%})"
    assert page.row("suggestion") == estimate.suggestion

    svg = ET.fromstring(page.svg)
    segments = svg.findall(f"{SVG}rect[@class='segment']")
    per_stage = [sum(int(r.get("data-bytes")) for r in segments if float(r.get("y")) == y) for y in _bar_rows(segments)]
    assert per_stage == [s.peak_bytes for s in estimate.stages] and len(per_stage) == 4
    assert {r.get("data-component") for r in segments} <= set(estimate.breakdown)
    capacity_x = float(svg.find(f"{SVG}line[@class='capacity']").get("x1"))
    threshold_x = float(svg.find(f"{SVG}line[@class='threshold']").get("x1"))
    bar_start = min(float(r.get("x")) for r in segments)
    # The dashed line sits at 80% of the way to the capacity line.
    assert (threshold_x - bar_start) / (capacity_x - bar_start) == pytest.approx(0.8, abs=0.002)
    texts = ["".join(t.itertext()) for t in svg.iter(f"{SVG}text")]
    assert f"capacity {capacity}" in texts and "80%" in texts and peak in texts


def _bar_rows(segments) -> list[float]:
    return sorted({float(r.get("y")) for r in segments})


def test_plans_are_a_list_with_a_best_a_table_and_a_plot(tmp_path):
    plans = api.plan(recipe_path("llama70b-128k"), top=3)
    assert isinstance(plans, list) and len(plans) == 3 and plans.best is plans[0]
    page = Page(plans._repr_html_())
    assert page.text[0] == "3 layouts that fit, best first"
    best = plans.best
    assert page.text[page.text.index("1") + 1] == best.describe()
    assert f"{best.tokens_per_s_per_gpu:,.0f}" in page.text and f"{best.throughput.mfu:.1%}" in page.text
    drawn = plans.plot(tmp_path / "plans.png")
    assert drawn.read_bytes()[:8] == PNG and drawn.stat().st_size > 10_000


def test_the_cli_draws_the_estimate_and_every_layout_that_fits(cli, tmp_path):
    estimate = cli("estimate", recipe_path("llama70b-128k"), "--plot", tmp_path / "memory.png")
    assert estimate.code == 0, estimate.err
    plan = cli("plan", recipe_path("llama70b-128k"), "--top", "2", "--plot", tmp_path / "plans.png")
    assert plan.code == 0, plan.err
    for name in ("memory.png", "plans.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG and (tmp_path / name).stat().st_size > 10_000
    assert estimate.err_lines[-1] == f"plot: {tmp_path / 'memory.png'}"


def test_without_matplotlib_a_plot_is_one_line_naming_the_extra(cli, tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    result = cli("estimate", recipe_path("tiny-cpu"), "--plot", tmp_path / "m.png")
    assert (result.code, result.err_lines) == (2, ["plotting needs matplotlib: pip install 'launcher[plot]'"])


def test_a_plot_that_cannot_be_written_is_one_line(tmp_path):
    with pytest.raises(UsageError, match="^cannot write the plot to .*no-such-dir/m.png: No such file or directory$"):
        api.estimate(recipe_path("tiny-cpu")).plot(tmp_path / "no-such-dir" / "m.png")


@pytest.mark.parametrize(
    ("name", "problem"),
    [("", "is a directory"), ("memory", "has no image suffix"), ("memory.txt", "has no image suffix")],
)
def test_a_plot_path_savefig_would_change_or_refuse_is_one_line_and_nothing_is_written(cli, tmp_path, name, problem):
    """matplotlib's savefig writes `memory` as memory.png and a directory as DIR.png, and raises
    its own ValueError for .txt: each is refused before anything is written."""
    (tmp_path / "plots").mkdir()
    target = tmp_path / "plots" / name if name else tmp_path / "plots"
    result = cli("estimate", recipe_path("tiny-cpu"), "--plot", target)
    line = f"cannot write the plot to {target}: it {problem}; name a .png, .svg or .pdf file"
    assert (result.code, result.err_lines) == (2, [line])
    assert list(tmp_path.rglob("*")) == [tmp_path / "plots"]
    assert api.estimate(recipe_path("tiny-cpu")).plot(tmp_path / "m.svg").read_bytes().startswith(b"<?xml")


# --- submission, spec, job, status ---------------------------------------------------------------


def test_a_dry_run_submission_shows_its_job_memory_and_resources(home, fake_bundle):
    submission = api.submit(recipe_path("llama70b-128k"), dry_run=True)
    page = Page(submission._repr_html_())
    assert page.row("job") == submission.spec.name
    assert page.row("submitted") == "no (dry run)"
    peak = format_bytes(submission.estimate.per_gpu_peak_bytes)
    assert page.row("memory") == f"fits, {peak} per GPU ({submission.estimate.utilization:.0%})"
    assert page.row("resources") == "4 x ml.p5e.48xlarge, world 32"
    spec = Page(submission.spec._repr_html_())
    assert spec.text[0] == f"JobSpec {submission.spec.name}"
    assert spec.row("resources") == "4 x ml.p5e.48xlarge, 8 x h200-141gb each"


def test_a_sagemaker_status_and_job_link_to_the_console_and_the_log_streams(home):
    status = JobStatus(name="ft-1", backend="sagemaker", state="InProgress", secondary="Training",
                       metrics={"train:loss": 2.5}, details={"region": "eu-west-1"})  # fmt: skip
    page = Page(status._repr_html_())
    assert page.row("state") == "InProgress (Training)" and page.row("loss") == "2.5"
    console = "https://eu-west-1.console.aws.amazon.com"
    assert page.links == {
        "SageMaker console": f"{console}/sagemaker/home?region=eu-west-1#/jobs/ft-1",
        "CloudWatch logs": f"{console}/cloudwatch/home?region=eu-west-1#logStream:group=/aws/sagemaker/TrainingJobs;"
        "prefix=ft-1;streamFilter=typeLogStreamPrefix",
    }
    job = Job(JobRef(name="ft-1", backend="sagemaker", region="eu-west-1"))
    assert job.links == status.links
    assert Job(JobRef(name="x", backend="local")).links == []


def test_a_job_whose_engine_cannot_answer_still_shows_with_the_reason(home):
    page = Page(Job(JobRef(name="gone-job", backend="local"))._repr_html_())
    assert page.text[0] == "Job gone-job"
    assert page.row("status") == f"unknown: no local job named gone-job in {home / 'jobs'}"
    assert page.links == {}


def test_a_local_status_shows_its_last_step_with_unmeasured_values_blank():
    status = JobStatus(name="j", backend="local", state="Completed", exit_code=0,
                       metrics={"step": 20, "loss": 4.24138, "mfu": None})  # fmt: skip
    page = Page(status._repr_html_())
    assert (page.row("step"), page.row("loss"), page.row("exit code")) == ("20", "4.241", "0")
    assert page.text[-1] == "mfu"  # the last row, its cell empty: MFU is not measured on a CPU


def test_text_from_a_recipe_or_the_cloud_is_escaped():
    status = JobStatus(name="<b>x</b>", backend="local", state="Failed", failure_reason="<script>alert(1)</script>")
    markup = status._repr_html_()
    assert "<script>" not in markup and "<b>x" not in markup
    assert Page(markup).row("failure") == "<script>alert(1)</script>"  # shown as text

"""Validation loss and perplexity, from the lines and files the entrypoints write to what a user
reads: the metrics history, `launcher metrics` (and its plot), `status` and the notebook views."""

from __future__ import annotations

import json
import math
import re

from launcher.backends.base import JobStatus
from launcher.backends.history import MetricsHistory
from launcher.backends.tail import last_metrics
from launcher.contract.metrics import METRIC_KEYS, metrics_line, summary_line
from launcher.display.text import metrics_text, result_text


def row(step: int, loss: float, val_loss: float | None = None) -> dict:
    values = dict.fromkeys(METRIC_KEYS, 0.5) | {"step": step, "loss": loss, "mfu": math.nan}
    if val_loss is not None:
        values |= {"val_loss": val_loss, "val_perplexity": math.exp(val_loss)}
    return values


LINES = [
    metrics_line(row(1, 3.0)),
    metrics_line(row(2, 2.8, 2.9)),
    metrics_line(row(3, 2.6)),
    metrics_line(row(4, 2.4, 2.5)),
]


def test_the_history_reads_validation_from_the_lines_of_the_steps_that_evaluated():
    assert LINES[1].endswith(" val_loss=2.9 val_perplexity=18.1741")
    history = MetricsHistory.from_lines("job", LINES)
    assert history.column("val_loss")[1::2] == [2.9, 2.5]
    assert all(math.isnan(v) for v in history.column("val_loss")[0::2])
    assert history.to_dict()["rows"][1]["val_perplexity"] == 18.1741
    assert "val_loss" in history._repr_html_() and "val_perplexity" in history._repr_html_()


def test_launcher_metrics_adds_validation_columns_only_for_a_job_that_evaluates():
    header, *rows = metrics_text(MetricsHistory.from_lines("job", LINES)).splitlines()
    assert header.split() == ["STEP", "LOSS", "VAL_LOSS", "VAL_PPL", "TOKENS/S/GPU", "MFU", "STEP_S", "MEM_GIB"]
    assert [r.split()[:4] for r in rows[1::2]] == [["2", "2.8", "2.9", "18.17"], ["4", "2.4", "2.5", "12.18"]]
    assert len(rows[0].split()) == len(header.split()) - 3  # blank validation cells (and MFU) on steps 1 and 3
    plain = metrics_text(MetricsHistory.from_lines("job", [metrics_line(row(1, 3.0))]))
    assert plain.splitlines()[0].split() == ["STEP", "LOSS", "TOKENS/S/GPU", "MFU", "STEP_S", "MEM_GIB"]


def test_the_plot_draws_validation_on_the_loss_panel(tmp_path, monkeypatch):
    from launcher.display import plots

    drawn = {}
    save = plots._save

    def keep(figure, path):
        drawn["loss panel"] = [(line.get_label(), list(line.get_xdata())) for line in figure.axes[0].lines]
        return save(figure, path)

    monkeypatch.setattr(plots, "_save", keep)
    path = MetricsHistory.from_lines("job", LINES).plot(tmp_path / "m.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    labels = dict(drawn["loss panel"][1:])
    assert labels["validation"] == [2.0, 4.0]  # the evaluated steps only


def test_status_shows_the_newest_validation_loss_while_later_steps_log_without_one(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "mfu"}) + "\n" for r in map(
        lambda args: row(*args), [(1, 3.0), (2, 2.8, 2.9), (3, 2.6)])))  # fmt: skip
    last = last_metrics(metrics)
    assert (last["step"], last["loss"], last["val_loss"]) == (3, 2.6, 2.9)
    status = _status(metrics=last)
    assert result_text(status) == "loss 2.6, validation loss 2.9, tokens/s/GPU 0.5, step 3"
    assert re.search(r">val_loss</th><td[^>]*>2\.9</td>", status._repr_html_())


def test_status_of_a_sagemaker_job_reads_its_validation_metric_and_the_summary_its_final_value():
    sagemaker = _status(metrics={"train:loss": 2.4, "validation:loss": 2.5, "train:step": 4})
    assert result_text(sagemaker) == "loss 2.4, validation loss 2.5, step 4"
    summary = {"steps": 4, "final_loss": 2.4, "mean_tokens_per_s_per_gpu": 9.0, "mean_mfu": math.nan}
    line = summary_line({**dict.fromkeys(_summary_keys(), 1.0), **summary, "final_val_loss": 2.5})
    assert line.endswith(" final_val_loss=2.5")
    finished = _status(metrics={}, summary={**summary, "final_val_loss": 2.5})
    assert result_text(finished).startswith("loss 2.4, validation loss 2.5, tokens/s/GPU 9")


def _summary_keys():
    from launcher.contract.metrics import SUMMARY_KEYS

    return SUMMARY_KEYS


def _status(*, metrics: dict, summary: dict | None = None) -> JobStatus:
    return JobStatus(
        name="job",
        backend="local",
        state="InProgress",
        secondary=None,
        transitions=(),
        failure_reason=None,
        exit_code=None,
        created=None,
        ended=None,
        metrics=metrics,
        details={"summary": summary or {}},
    )

"""tracking.tensorboard and tracking.mlflow: the recipe keys, the SageMaker request, and the MLflow
client of the entrypoints against real HTTP servers on 127.0.0.1 (the real jobs that feed both
dashboards are in test_local_e2e.py)."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from entrypoints import mlflow_sink
from launcher import api
from launcher.backends import get_backend
from launcher.backends.sagemaker.aws_model import validate
from launcher.contract.config import ConfigError, JobConfig
from launcher.errors import RecipeError
from launcher.recipe import Recipe
from launcher.registry import JobRef, save

from .helpers import REPO, spec_for
from .sagemaker_stubs import NAME, description, stub

ARN = "arn:aws:sagemaker:us-west-2:111122223333:mlflow-tracking-server/team-runs"
TINY = REPO / "recipes" / "tiny-cpu.yaml"


# --- recipe keys -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "uri", ["ftp://host/x", "127.0.0.1:5000", "arn:aws:sagemaker:us-west-2:1:mlflow-tracking-server/x"]
)
def test_rejects_an_mlflow_uri_that_is_no_tracking_server(uri):
    with pytest.raises(RecipeError, match=rf"tracking\.mlflow\.uri: '{uri}' is not an MLflow tracking server; use"):
        Recipe.load(TINY, {"tracking.mlflow": {"uri": uri}})


@pytest.mark.parametrize("uri", ["http://127.0.0.1:5000", "https://mlflow.example.com/team", ARN])
def test_allows_an_http_server_or_a_sagemaker_tracking_server_arn(uri):
    assert Recipe.load(TINY, {"tracking.mlflow": {"uri": uri}}).tracking.mlflow.uri == uri


def test_the_entrypoints_refuse_a_resolved_config_with_another_uri(home):
    data = api.submit(TINY, backend="local", dry_run=True, set_options=[f"tracking.mlflow.uri={ARN}"]).spec.resolved
    data["tracking"]["mlflow"]["uri"] = "file:///tmp/mlruns"
    with pytest.raises(ConfigError, match=r"^tracking\.mlflow\.uri: 'file:///tmp/mlruns' is neither an http"):
        JobConfig.from_dict(data)


def test_a_resumed_job_keeps_its_lineage_and_so_its_mlflow_run(home):
    """The run is found by its launcher.lineage tag: a `--resume` names the first job's lineage."""
    options = ["tracking.mlflow.uri=http://127.0.0.1:5000", "tracking.mlflow.experiment=long-runs"]
    first = api.submit(TINY, backend="local", dry_run=True, set_options=options).spec
    save(JobRef(name=first.name, backend="local"), first)
    resumed = api.submit(TINY, backend="local", dry_run=True, set_options=options, resume=first.name).spec
    tracking = resumed.resolved["tracking"]
    assert (tracking["job_name"], tracking["backend"], tracking["lineage"]) == (resumed.name, "local", first.name)
    assert tracking["mlflow"] == {"uri": "http://127.0.0.1:5000", "experiment": "long-runs", "run_name": resumed.name}
    assert first.resolved["tracking"]["lineage"] == first.name


# --- SageMaker ---------------------------------------------------------------------------------


def test_tensorboard_sets_tensorboard_output_config_and_ships_the_writer(fake_bundle, home):
    spec = spec_for("llama3-8b-8k", "sagemaker", **{"tracking.tensorboard": True})
    rendering = get_backend("sagemaker").render(spec)
    request = rendering.data["request"]
    assert validate("sagemaker", "CreateTrainingJob", request) == []
    uri = f"s3://sagemaker-us-west-2-111122223333/launcher/llama3-8b-8k/tensorboard/{spec.lineage}"
    assert request["TensorBoardOutputConfig"] == {"S3OutputPath": uri, "LocalPath": "/opt/ml/output/data/tensorboard"}
    # The image lacks tensorboard (and the absl it imports): the wheel channel installs both offline.
    assert rendering.data["wheels"]["files"] == [
        "tensorboard-2.21.0-py3-none-any.whl",
        "absl_py-2.5.1-py3-none-any.whl",
    ]
    assert request["Environment"]["LAUNCHER_REQUIREMENTS"] == "tensorboard==2.21.0 absl-py==2.5.1"
    plain = get_backend("sagemaker").render(spec_for("llama3-8b-8k", "sagemaker")).data
    assert "TensorBoardOutputConfig" not in plain["request"] and "wheels" not in plain


def test_submit_prints_the_tensorboard_path(fake_bundle, home, cli):
    recipe = REPO / "recipes" / "llama3-8b-8k.yaml"
    result = cli("submit", recipe, "--dry-run", "--set", "tracking.tensorboard=true")
    assert result.code == 0, result.err
    # Once as submit's note (stderr), once among the rendering's notes (the dry run's JSON on stdout).
    (line,) = [line for line in result.err.splitlines() if "tensorboard: s3://" in line]
    assert line[line.index("tensorboard: s3://") :] in json.loads(result.out)["notes"]
    assert "/launcher/llama3-8b-8k/tensorboard/llama3-8b-8k-" in line
    assert "synced from /opt/ml/output/data/tensorboard while the job runs (TensorBoardOutputConfig)" in line


def test_status_prints_the_tensorboard_path(registered, cli):
    sm = stub("sagemaker")
    running = description("InProgress", "Training")
    running["TensorBoardOutputConfig"] = {"S3OutputPath": "s3://b/launcher/r/tensorboard/lineage-1"}
    sm.add_response("describe_training_job", running, {"TrainingJobName": NAME})
    result = cli("status", NAME)
    assert result.code == 0, result.err
    assert "\n  tensorboard s3://b/launcher/r/tensorboard/lineage-1\n" in result.out
    sm.assert_no_pending_responses()


# --- the entrypoints' MLflow client ------------------------------------------------------------


class Recorder(ThreadingHTTPServer):
    """An HTTP server on 127.0.0.1 that records each request and answers an empty experiment."""

    def __init__(self):
        self.requests: list[dict] = []

        class Handler(BaseHTTPRequestHandler):
            def _answer(handler):
                body = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
                self.requests.append(
                    {"method": handler.command, "path": handler.path, "headers": dict(handler.headers), "body": body}
                )
                payload = json.dumps({"experiment": {"experiment_id": "7", "name": "x"}}).encode()
                handler.send_response(200)
                handler.send_header("Content-Type", "application/json")
                handler.send_header("Content-Length", str(len(payload)))
                handler.end_headers()
                handler.wfile.write(payload)

            do_GET = do_POST = _answer

            def log_message(handler, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def recorder(monkeypatch):
    server = Recorder()
    monkeypatch.setenv("SAGEMAKER_MLFLOW_CUSTOM_ENDPOINT", server.url)  # the plugin's own override
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    yield server
    server.shutdown()
    server.server_close()


def signature_fields(authorization: str) -> dict[str, str]:
    algorithm, _, rest = authorization.partition(" ")
    return {"algorithm": algorithm, **dict(part.strip().split("=", 1) for part in rest.split(","))}


def test_an_arn_uri_is_reached_as_the_sagemaker_mlflow_plugin_reaches_it(recorder, monkeypatch):
    """The same call through MLflow's own client with the sagemaker-mlflow plugin, then through the
    entrypoints' client: same path, routing header and credential scope, and a SigV4 signature that
    botocore, given what reached the server, computes again."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", ARN)  # the plugin signs for the global URI (auth_provider.py)
    MlflowClient().get_experiment_by_name("x")
    mlflow_sink.MlflowRest(ARN).call("GET", "experiments/get-by-name", query={"experiment_name": "x"})
    plugin, ours = recorder.requests
    assert ours["path"] == plugin["path"] == "/api/2.0/mlflow/experiments/get-by-name?experiment_name=x"
    for request in (plugin, ours):
        headers = {k.lower(): v for k, v in request["headers"].items()}
        assert headers["x-mlflow-sm-tracking-server-arn"] == ARN
        assert headers["x-amz-content-sha256"] == hashlib.sha256(request["body"]).hexdigest()
        fields = signature_fields(headers["authorization"])
        assert fields["algorithm"] == "AWS4-HMAC-SHA256"
        assert fields["Credential"].endswith("/us-west-2/sagemaker-mlflow/aws4_request")
        assert {"host", "x-amz-date", "x-amz-content-sha256", "x-mlflow-sm-tracking-server-arn"} <= set(
            fields["SignedHeaders"].split(";")
        )
    headers = {k.lower(): v for k, v in ours["headers"].items()}
    fields = signature_fields(headers["authorization"])
    signed = {name: headers[name] for name in fields["SignedHeaders"].split(";")}
    again = AWSRequest(method="GET", url=recorder.url + ours["path"], data=b"", headers=signed)
    again.context["timestamp"] = headers["x-amz-date"]
    auth = SigV4Auth(
        Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"), "sagemaker-mlflow", "us-west-2"
    )
    assert auth.signature(auth.string_to_sign(again, auth.canonical_request(again)), again) == fields["Signature"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_config(home, uri: str) -> JobConfig:
    resolved = api.submit(TINY, backend="local", dry_run=True, set_options=[f"tracking.mlflow.uri={uri}"]).spec.resolved
    return JobConfig.from_dict(resolved)


def test_a_server_that_is_gone_gives_one_warning_and_never_blocks_a_step(home, capsys):
    sink = mlflow_sink.MlflowSink.start(job_config(home, f"http://127.0.0.1:{closed_port()}"))
    began = time.monotonic()
    for step in range(1, 1001):
        sink.add({"step": step, "loss": 1.0 / step})
    assert time.monotonic() - began < 1.0
    sink.close("FINISHED")
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: mlflow")]
    assert len(warnings) == 1, warnings
    assert warnings[0].endswith("Connection refused; training goes on without MLflow logging"), warnings[0]


def test_a_server_that_dies_mid_answer_gives_one_warning_not_a_traceback(home, capsys):
    """The server killed while it answers (tests/backends/test_local_e2e.py kills a real one with
    SIGKILL): the body ends short of its Content-Length, http.client raises IncompleteRead, which
    is no OSError. Found as a thread traceback in a job's log, with no warning."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()

        def answer_short():
            for _ in range(3):  # the sink's first request, and any retry
                try:
                    connection, _ = server.accept()
                except OSError:  # the test closed the socket
                    return
                with connection:
                    connection.recv(65536)
                    connection.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 64\r\n\r\n{}"
                    )

        threading.Thread(target=answer_short, daemon=True).start()
        sink = mlflow_sink.MlflowSink.start(job_config(home, f"http://127.0.0.1:{server.getsockname()[1]}"))
        sink.add({"step": 1, "loss": 1.0})
        sink.close("FINISHED")
        sink.thread.join(mlflow_sink.REQUEST_TIMEOUT_S + 5)
    assert not sink.thread.is_alive() and sink.failed.is_set()
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (warning,) = [line for line in err.splitlines() if line.startswith("warning: mlflow")]
    assert "IncompleteRead" in warning and warning.endswith("; training goes on without MLflow logging"), warning


def test_a_server_that_never_answers_fills_the_bounded_queue_without_blocking(home, capsys, monkeypatch):
    monkeypatch.setattr(mlflow_sink, "QUEUE_RECORDS", 10)
    monkeypatch.setattr(mlflow_sink, "CLOSE_TIMEOUT_S", 0.2)
    with socket.socket() as silent:  # listens, and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        sink = mlflow_sink.MlflowSink.start(job_config(home, f"http://127.0.0.1:{silent.getsockname()[1]}"))
        began = time.monotonic()
        for step in range(1, 101):
            sink.add({"step": step, "loss": 1.0})
        assert time.monotonic() - began < 1.0
        assert sink.dropped >= 90
        sink.close("FINISHED")
    sink.thread.join(mlflow_sink.REQUEST_TIMEOUT_S + 5)  # the closed socket ends its request: no warning leaks on
    assert not sink.thread.is_alive()
    err = capsys.readouterr().err
    assert err.count("is behind by 10 records; dropping steps until it catches up") == 1
    assert "did not take the last records within 0 s" in err

"""An MLflow run fed from the metrics log, over MLflow's REST API, from a thread of its own.

Training only puts records on a bounded queue (`add` never waits; a full queue drops the record
and says so once). The thread creates or continues the run, then sends what the queue holds in
`runs/log-batch` calls. What it logs:
- the resolved config, flattened to dotted keys, as params, and as the artifact resolved.json;
- every metric of every record, at its step;
- tags launcher.job, launcher.backend, launcher.lineage and launcher.recipe.
A resumed lineage (a `submit --resume`, or torchrun restarting the workers) continues the run
that carries its launcher.lineage tag: params it already has are kept, new keys are added.

A server that fails (refused, timed out, an HTTP error) gives one warning line on stderr, and the
thread then drops what comes: training goes on. At the end the run is marked FINISHED, KILLED
(SIGTERM) or FAILED (any other exit, through atexit), waiting at most CLOSE_TIMEOUT_S.

A SageMaker managed MLflow URI is the tracking server's ARN. The sagemaker-mlflow plugin
(aws/sagemaker-mlflow: sagemaker_mlflow/mlflow_sagemaker_helpers.py, auth.py,
mlflow_sagemaker_request_header_provider.py) reaches it so, and so does this module: the endpoint
https://<region>.experiments.sagemaker.aws (or $SAGEMAKER_MLFLOW_CUSTOM_ENDPOINT), the header
x-mlflow-sm-tracking-server-arn, X-Amz-Content-SHA256 of the body, and a SigV4 signature for the
service sagemaker-mlflow in the ARN's region with the job's credentials (botocore, which the
training image ships). Artifacts of such a server live in S3; they are put there with botocore.
"""

from __future__ import annotations

import atexit
import hashlib
import http.client
import json
import os
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from entrypoints.tracking import scalars, warn
from launcher.contract.config import MLFLOW_ARN_RE, JobConfig

QUEUE_RECORDS = 10_000
"""Records held for the thread; at one per step that is hours of a slow server."""
BATCH_RECORDS = 100
"""Records per log-batch call: MLflow takes at most 1000 metrics in one."""
REQUEST_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 15.0
MAX_PARAMS_PER_CALL = 100
MAX_PARAM_CHARS = 6000
"""MLflow 3's limit on a param value."""
_END = object()


class MlflowError(Exception):
    """A request the tracking server refused or never answered."""


def flatten(data, prefix: str = "") -> dict[str, str]:
    """{"training": {"lr": 1}} as {"training.lr": "1"}: the config as params."""
    if isinstance(data, dict):
        items: dict[str, str] = {}
        for key, value in data.items():
            items.update(flatten(value, f"{prefix}{key}."))
        return items
    text = data if isinstance(data, str) else json.dumps(data)
    return {prefix.removesuffix("."): text[:MAX_PARAM_CHARS]}


class SageMakerSigner:
    """SigV4 for a SageMaker MLflow tracking server, as the sagemaker-mlflow plugin signs (auth.py)."""

    def __init__(self, arn: str):
        import botocore.session  # the training image's; only for an ARN URI
        from botocore.auth import SigV4Auth

        self.arn, self.region = arn, arn.split(":")[3]
        credentials = botocore.session.get_session().get_credentials()
        if credentials is None:
            raise MlflowError("no AWS credentials to sign requests to the SageMaker MLflow tracking server")
        self.auth = SigV4Auth(credentials, "sagemaker-mlflow", self.region)

    @property
    def endpoint(self) -> str:
        return os.environ.get("SAGEMAKER_MLFLOW_CUSTOM_ENDPOINT") or f"https://{self.region}.experiments.sagemaker.aws"

    def headers(self, method: str, url: str, body: bytes, headers: dict[str, str]) -> dict[str, str]:
        from botocore.awsrequest import AWSRequest

        headers = {**headers, "x-mlflow-sm-tracking-server-arn": self.arn}
        headers["X-Amz-Content-SHA256"] = hashlib.sha256(body).hexdigest()
        request = AWSRequest(method=method, url=url, data=body, headers=headers)
        self.auth.add_auth(request)
        return dict(request.headers.items())


class MlflowRest:
    """The few REST calls of one tracking server that a training run needs."""

    def __init__(self, uri: str):
        self.signer = SageMakerSigner(uri) if MLFLOW_ARN_RE.fullmatch(uri) else None
        self.host = (self.signer.endpoint if self.signer else uri).rstrip("/")

    def call(self, method: str, path: str, body: dict | None = None, query: dict | None = None) -> dict:
        url = f"{self.host}/api/2.0/mlflow/{path}"
        if query:
            url += "?" + urllib.parse.urlencode(query, quote_via=urllib.parse.quote)
        data = json.dumps(body).encode() if body is not None else b""
        return json.loads(self.send(method, url, data, {"Content-Type": "application/json"}) or b"{}")

    def send(self, method: str, url: str, data: bytes, headers: dict[str, str]) -> bytes:
        if self.signer:
            headers = self.signer.headers(method, url, data, headers)
        request = urllib.request.Request(url, data=data if method != "GET" else None, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return response.read()
        except urllib.error.HTTPError as error:
            detail = error.read()[:300].decode(errors="replace")
            raise MlflowError(f"{method} {url.split('?')[0]}: HTTP {error.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise MlflowError(f"{method} {url.split('?')[0]}: {reason}") from None
        except http.client.HTTPException as error:  # a server gone mid-answer: IncompleteRead, BadStatusLine
            raise MlflowError(f"{method} {url.split('?')[0]}: {type(error).__name__}: {error!r}") from None

    def error_code(self, error: MlflowError) -> str:
        return next((c for c in ("RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS") if c in str(error)), "")


class MlflowSink:
    """A run of the job's experiment; `add` from the training loop, `close` at the end."""

    def __init__(self, cfg: JobConfig):
        self.cfg, self.settings = cfg, cfg.tracking.mlflow
        self.queue: queue.Queue = queue.Queue(maxsize=QUEUE_RECORDS)
        self.failed = threading.Event()
        self.dropped = 0
        self.closed = False
        self.status = "FAILED"
        self.run_id: str | None = None
        self.thread = threading.Thread(target=self._work, name="mlflow", daemon=True)

    @classmethod
    def start(cls, cfg: JobConfig) -> MlflowSink:
        sink = cls(cfg)
        sink.thread.start()
        atexit.register(sink.close, "FAILED")  # any exit that did not close it first: the run failed
        return sink

    def add(self, record: dict) -> None:
        if self.failed.is_set():
            return
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                warn(
                    f"mlflow: {self.settings.uri} is behind by {QUEUE_RECORDS} records; dropping steps until it catches up"
                )

    def close(self, status: str) -> None:
        if self.closed:
            return
        self.closed, self.status = True, status
        if self.failed.is_set():
            return
        try:
            self.queue.put(_END, timeout=CLOSE_TIMEOUT_S)
        except queue.Full:
            pass
        self.thread.join(CLOSE_TIMEOUT_S)
        if self.thread.is_alive() and not self.failed.is_set():
            warn(f"mlflow: {self.settings.uri} did not take the last records within {CLOSE_TIMEOUT_S:.0f} s")

    # --- the thread ----------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            rest = MlflowRest(self.settings.uri)
            self.run_id = self._open_run(rest)
            while True:
                batch, end = self._next_batch()
                if batch:
                    self._log_metrics(rest, batch)
                if end:
                    break
            rest.call("POST", "runs/update", {"run_id": self.run_id, "status": self.status, "end_time": _now_ms()})
        except (MlflowError, ImportError, ValueError) as error:
            self.failed.set()
            warn(f"mlflow: {error}; training goes on without MLflow logging")

    def _next_batch(self) -> tuple[list[dict], bool]:
        """Records to send together: at least one (waiting for it), at most BATCH_RECORDS."""
        batch = []
        item = self.queue.get()
        while item is not _END:
            batch.append(item)
            if len(batch) == BATCH_RECORDS:
                return batch, False
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return batch, False
        return batch, True

    def _log_metrics(self, rest: MlflowRest, records: list[dict]) -> None:
        now = _now_ms()
        metrics = [
            {"key": key, "value": value, "step": record["step"], "timestamp": now}
            for record in records
            for key, value in scalars(record).items()
        ]
        rest.call("POST", "runs/log-batch", {"run_id": self.run_id, "metrics": metrics})

    def _open_run(self, rest: MlflowRest) -> str:
        """The lineage's run, continued, or a new one; with its tags, params and resolved.json."""
        experiment_id = self._experiment(rest)
        tracking = self.cfg.tracking
        run = self._lineage_run(rest, experiment_id) if tracking.lineage else None
        if run is None:
            body = {"experiment_id": experiment_id, "run_name": self.settings.run_name, "start_time": _now_ms()}
            run = rest.call("POST", "runs/create", body)["run"]
        else:
            rest.call("POST", "runs/update", {"run_id": run["info"]["run_id"], "status": "RUNNING"})
        run_id = run["info"]["run_id"]
        tags = {"launcher.job": tracking.job_name, "launcher.backend": tracking.backend}
        tags |= {"launcher.lineage": tracking.lineage, "launcher.recipe": self.cfg.name}
        known = {p["key"] for p in run.get("data", {}).get("params", [])}
        params = [{"key": k, "value": v} for k, v in flatten(self.cfg.to_dict()).items() if k not in known]
        tag_list = [{"key": k, "value": v} for k, v in tags.items() if v]
        rest.call("POST", "runs/log-batch", {"run_id": run_id, "tags": tag_list})
        for start in range(0, len(params), MAX_PARAMS_PER_CALL):
            rest.call(
                "POST", "runs/log-batch", {"run_id": run_id, "params": params[start : start + MAX_PARAMS_PER_CALL]}
            )
        try:
            self._put_artifact(rest, run["info"].get("artifact_uri", ""), "resolved.json")
        except MlflowError as error:  # the run itself is fine: log its metrics all the same
            warn(f"mlflow: resolved.json not logged: {error}")
        return run_id

    def _experiment(self, rest: MlflowRest) -> str:
        name = self.settings.experiment
        try:
            return rest.call("GET", "experiments/get-by-name", query={"experiment_name": name})["experiment"][
                "experiment_id"
            ]
        except MlflowError as error:
            if rest.error_code(error) != "RESOURCE_DOES_NOT_EXIST":
                raise
        try:
            return rest.call("POST", "experiments/create", {"name": name})["experiment_id"]
        except MlflowError as error:  # another job of the recipe created it meanwhile
            if rest.error_code(error) != "RESOURCE_ALREADY_EXISTS":
                raise
            return rest.call("GET", "experiments/get-by-name", query={"experiment_name": name})["experiment"][
                "experiment_id"
            ]

    def _lineage_run(self, rest: MlflowRest, experiment_id: str) -> dict | None:
        # A lineage is a job name (letters, digits, hyphens): safe inside the quoted filter.
        body = {
            "experiment_ids": [experiment_id],
            "filter": f"tags.`launcher.lineage` = '{self.cfg.tracking.lineage}'",
            "max_results": 1,
            "order_by": ["attributes.start_time DESC"],
        }
        runs = rest.call("POST", "runs/search", body).get("runs", [])
        return runs[0] if runs else None

    def _put_artifact(self, rest: MlflowRest, artifact_uri: str, name: str) -> None:
        """resolved.json where the run's artifacts go: the server's proxy, S3, or a local directory."""
        data = (json.dumps(self.cfg.to_dict(), indent=2) + "\n").encode()
        parsed = urllib.parse.urlparse(artifact_uri)
        if parsed.scheme == "mlflow-artifacts":
            url = f"{rest.host}/api/2.0/mlflow-artifacts/artifacts/{parsed.path.strip('/')}/{name}"
            rest.send("PUT", url, data, {"Content-Type": "application/json"})
        elif parsed.scheme == "s3":
            _put_s3(parsed.netloc, f"{parsed.path.strip('/')}/{name}", data)
        elif parsed.scheme in ("", "file"):
            directory = Path(urllib.parse.unquote(parsed.path))
            try:
                directory.mkdir(parents=True, exist_ok=True)
                (directory / name).write_bytes(data)
            except OSError as error:
                warn(f"mlflow: resolved.json not logged: cannot write {directory} here ({error.strerror})")
        else:
            warn(f"mlflow: resolved.json not logged: artifact store {parsed.scheme}:// is not supported")


def _put_s3(bucket: str, key: str, data: bytes) -> None:
    import botocore.exceptions
    import botocore.session

    try:
        botocore.session.get_session().create_client("s3").put_object(Bucket=bucket, Key=key, Body=data)
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as error:
        raise MlflowError(f"put s3://{bucket}/{key}: {error}") from None


def _now_ms() -> int:
    return int(time.time() * 1000)

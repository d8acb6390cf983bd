"""The SageMaker backend, on boto3 directly.

One function, `create_training_job_request`, builds the CreateTrainingJob request; `--dry-run`
prints its result and `submit` sends that same dict, so what you review is what runs. The
container unpacks the code bundle (the `code` channel) and runs entrypoints/bootstrap.py, which
installs the `wheels` channel offline, picks the static rendezvous from resourceconfig.json and
runs torchrun (docs/sagemaker.md). The resolved recipe is `resolved.json` inside the bundle,
never hyperparameters.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from launcher.backends.base import Allowance, Backend, JobRef, JobStatus, Rendering, ResumePoint, Transition, utc_now
from launcher.backends.history import MetricsHistory
from launcher.backends.images import training_image
from launcher.backends.sagemaker import aws, aws_model, quotas
from launcher.backends.sagemaker.cloudwatch import LOG_GROUP, console_links, log_lines
from launcher.backends.sagemaker.s3_checkpoints import newest_complete_step
from launcher.backends.sagemaker.settings import SageMakerSettings
from launcher.backends.wheelhouse import Wheel, bootstrap_environment, ensure, job_wheels, wheelhouse_key
from launcher.bundle import ARCHIVE_NAME, ENV_BUNDLE_SHA256, Bundle, unpack_entrypoint
from launcher.catalog import instance_types
from launcher.contract.metrics import METRIC_REGEXES, SAGEMAKER_METRIC_NAMES, TENSORBOARD_DIR, VALIDATION_REGEXES
from launcher.contract.text import terminal_safe
from launcher.errors import EngineError, LauncherError, UsageError
from launcher.recipe.region import default_region
from launcher.recipe.rules import placeholder_role
from launcher.spec import JobSpec, Placement

CHECKPOINT_DIR = "/opt/ml/checkpoints"
CHECKPOINT_PREFIX_ENV = "LAUNCHER_CHECKPOINT_S3"  # what entrypoints/checkpoint_mirror.py reads
OUTPUT_DIR = "/opt/ml/output/data"
# SageMaker uploads /opt/ml/model as the job's model artifact (ModelArtifacts.S3ModelArtifacts);
# with OutputDataConfig.CompressionType NONE it is uploaded file by file, not gzipped into a tar.
MODEL_DIR = "/opt/ml/model"
CHANNELS_DIR = "/opt/ml/input/data"
CODE_DIR = "/opt/ml/code"
WHEELS_CHANNEL = "wheels"
# The DLC's own ENTRYPOINT (CUDA forward-compatibility setup, then exec "$@"); a ContainerEntrypoint
# replaces it, so the bootstrap runs through it where the image has it.
IMAGE_ENTRYPOINT = "/usr/local/bin/entrypoint.sh"
ROLE_EXAMPLE = "arn:aws:iam::<account>:role/<SageMakerExecutionRole>"
# The tag whose value identifies one submission, so a retried create recognises its own job.
SUBMISSION_TAG = "launcher:submission"

# SageMaker reads these from the job's log lines (launcher.contract.metrics) into CloudWatch metrics.
METRIC_DEFINITIONS = [
    {"Name": SAGEMAKER_METRIC_NAMES[key], "Regex": regex}
    for key, regex in {**METRIC_REGEXES, **VALIDATION_REGEXES}.items()
]


# --- where things go ---------------------------------------------------------------------------


def settings(spec: JobSpec) -> SageMakerSettings:
    """The spec's SageMaker part; a spec built for another backend has none."""
    if not isinstance(spec.engine, SageMakerSettings):
        raise UsageError(
            f"{spec.name} is a {spec.backend} spec with no SageMaker settings; build it with backend='sagemaker'"
        )
    return spec.engine


def role_account(role_arn: str) -> str:
    return role_arn.split(":")[4]


def check_role(spec: JobSpec, caller: str | None = None) -> None:
    """Refuse a role that cannot be the caller's: a documentation placeholder (before any AWS call),
    or, once `caller` (STS) is known, a role of another account, which iam:PassRole never passes
    ("Grant a user permissions to pass a role to an AWS service", IAM User Guide). So the default
    bucket, named in the request for the role's account, is always the caller's own."""
    role = settings(spec).role_arn or ""
    if placeholder := placeholder_role(role):
        raise UsageError(f"{placeholder}; nothing was submitted")
    if caller is not None and role_account(role) != caller:
        raise UsageError(
            f"sagemaker.role_arn: the role is in account {role_account(role)}, but these credentials are of "
            f"account {caller} (STS GetCallerIdentity), and SageMaker can be passed only a role of the caller's own "
            "account; use one of its roles, or credentials of the role's account; nothing was submitted"
        )


@dataclass(frozen=True)
class Locations:
    """The job's S3 locations: outputs, checkpoints (per recipe and lineage: a `--resume` continues
    its lineage, a fresh run never mixes with an older one) and code."""

    bucket: str
    default_bucket: bool
    output: str
    checkpoints: str
    code_prefix: str
    wheels_prefix: str
    owner: str | None = None
    """The account that must own the default bucket (ExpectedBucketOwner on every call to it):
    the caller's, known at submit; None for a bucket the recipe names, which may be another
    account's on purpose (as the SageMaker SDK does for a bucket that is not its default)."""

    @classmethod
    def of(cls, spec: JobSpec) -> Locations:
        cloud = settings(spec)
        if cloud.output_uri:
            root = cloud.output_uri.rstrip("/")
            bucket, default = root.removeprefix("s3://").split("/", 1)[0], False
        else:
            # The SageMaker SDK's default bucket, sagemaker-<region>-<the caller's account>. Named
            # here for the role's account, so dry-run needs no AWS call; submit asks STS and
            # refuses a role of another account (check_role), so the two are always the same.
            bucket, default = f"sagemaker-{cloud.region}-{role_account(cloud.role_arn)}", True
            root = f"s3://{bucket}/launcher"
        checkpoints = f"{(cloud.checkpoint_uri or f'{root}/{spec.recipe_name}/checkpoints').rstrip('/')}/{spec.lineage}"
        output = f"{root}/{spec.recipe_name}"
        return cls(bucket, default, output, checkpoints.rstrip("/"), f"{root}/code", f"{root}/wheels")

    def owned_by(self, account: str) -> Locations:
        """These locations, with the default bucket required to be `account`'s."""
        return dataclasses.replace(self, owner=account) if self.default_bucket else self

    def owner_args(self) -> dict[str, str]:
        return {"ExpectedBucketOwner": self.owner} if self.owner else {}

    def code_uri(self, bundle: Bundle) -> str:
        return f"{self.code_prefix}/{bundle.sha256}/{ARCHIVE_NAME}"

    def tensorboard_uri(self, spec: JobSpec) -> str:
        """Where SageMaker syncs the event files: one prefix per lineage, so TensorBoard draws a
        resumed chain of jobs as one run."""
        return f"{self.output}/tensorboard/{spec.lineage}"

    def wheels_uri(self, wheels: tuple[Wheel, ...]) -> str:
        """Content-addressed prefix holding exactly these wheel files (the `wheels` channel)."""
        return f"{self.wheels_prefix}/{wheelhouse_key(wheels)}/"


# --- the request ---------------------------------------------------------------------------------


def _channel(name: str, uri: str, mode: str) -> dict:
    source = {"S3DataType": "S3Prefix", "S3Uri": uri, "S3DataDistributionType": "FullyReplicated"}
    return {"ChannelName": name, "DataSource": {"S3DataSource": source}, "InputMode": mode}


def local_nvme(instance_type: str) -> bool:
    instance = instance_types().get(instance_type)
    return bool(instance and instance.local_nvme)


def request_warnings(spec: JobSpec) -> list[str]:
    """What the request leaves out of the recipe, and what it needs that it cannot check (printed
    by dry-run and submit)."""
    cloud, resources = settings(spec), spec.resources
    instance = resources.instance_type
    warnings = [f"{placeholder}; submit refuses it"] if (placeholder := placeholder_role(cloud.role_arn)) else []
    if cloud.kms_key_id and local_nvme(instance):
        warnings.append(
            f"sagemaker.kms_key_id: not used for the training volumes: {instance} stores them on local NVMe, "
            "which its hardware encrypts, and SageMaker rejects VolumeKmsKeyId for it; the key still encrypts "
            "the output and the code upload"
        )
    if cloud.networking.subnets and resources.instance_count > 1:
        # EC2 User Guide, "Prepare an EFA-enabled security group"; SageMaker's "Give SageMaker
        # Training Jobs Access to Resources in Your Amazon VPC". Only a real account can check it.
        carries = "EFA and NCCL traffic" if resources.has_efa else "NCCL traffic"
        warnings.append(
            f"sagemaker.security_group_ids: the {resources.instance_count} instances' {carries} flows through "
            f"{', '.join(cloud.networking.security_group_ids)}: a group must allow all traffic in from and out to "
            "itself, or the job stalls at its first collective (docs/sagemaker.md, 'Security groups for EFA')"
        )
    return warnings


def checkpoint_note(spec: JobSpec, locations: Locations) -> str:
    """Where the job's checkpoints go, for dry-run and submit to say."""
    if settings(spec).per_host_checkpoints:
        return (
            f"checkpoints: {locations.checkpoints}, written to {spec.checkpoint_dir} and copied there by each host, "
            "which reads back only its own files (no CheckpointConfig: it would copy every checkpoint to every host)"
        )
    return f"checkpoints: {locations.checkpoints}, synced with {spec.checkpoint_dir} on every host (CheckpointConfig)"


def tensorboard_config(spec: JobSpec, locations: Locations) -> dict | None:
    """TensorBoardOutputConfig for a job with tracking.tensorboard: the entrypoints write the event
    files to <output_dir>/tensorboard, which SageMaker uploads to S3 while the job runs."""
    if not spec.resolved.get("tracking", {}).get("tensorboard"):
        return None
    return {"S3OutputPath": locations.tensorboard_uri(spec), "LocalPath": f"{spec.output_dir}/{TENSORBOARD_DIR}"}


def tensorboard_note(config: dict) -> str:
    return (
        f"tensorboard: {config['S3OutputPath']}, synced from {config['LocalPath']} while the job runs "
        f"(TensorBoardOutputConfig); open it in SageMaker's TensorBoard app or `tensorboard --logdir {config['S3OutputPath']}`"
    )


def create_training_job_request(
    spec: JobSpec, *, code_uri: str, bundle_sha256: str, locations: Locations, wheels: tuple[Wheel, ...] = ()
) -> dict:
    """The CreateTrainingJob request for `spec`: what dry-run prints and submit sends."""
    cloud, resources = settings(spec), spec.resources
    environment = {
        **spec.env,
        "LAUNCHER_BUNDLE": f"{CHANNELS_DIR}/code/{ARCHIVE_NAME}",
        # The container entrypoint runs nothing from a bundle with other bytes (launcher.bundle).
        ENV_BUNDLE_SHA256: bundle_sha256,
        "LAUNCHER_CODE": CODE_DIR,
        "LAUNCHER_JOB_NAME": spec.name,
        # Every SageMaker job has hosts and an S3 prefix of its own: no other job shares the
        # checkpoint directory, and a lease synced through S3 would only delay a resume.
        "LAUNCHER_CHECKPOINT_LEASE": "0",
    }
    channels = [_channel("code", code_uri, "File")]
    for data in spec.inputs:
        # Long-context corpora are large: stream them instead of copying them first.
        channels.append(_channel(data.name, data.source, "FastFile"))
    if wheels:
        # entrypoints/bootstrap.py installs these with pip --no-index: no network needed.
        channels.append(_channel(WHEELS_CHANNEL, locations.wheels_uri(wheels), "File"))
        environment.update(bootstrap_environment(wheels, f"{CHANNELS_DIR}/{WHEELS_CHANNEL}"))
    request: dict = {
        "TrainingJobName": spec.name,
        "RoleArn": cloud.role_arn,
        "AlgorithmSpecification": {
            "TrainingImage": spec.image,
            "TrainingInputMode": "File",
            "ContainerEntrypoint": unpack_entrypoint(image_entrypoint=IMAGE_ENTRYPOINT),
            "ContainerArguments": list(spec.command),
            "MetricDefinitions": METRIC_DEFINITIONS,
            "EnableSageMakerMetricsTimeSeries": True,
        },
        "InputDataConfig": channels,
        # NONE: /opt/ml/model (an export_hf of hundreds of GB) and /opt/ml/output/data are
        # uploaded as they are, not gzipped into one tar while the whole cluster stays billed
        # (SageMaker developer guide, "Uncompressed model output").
        "OutputDataConfig": {"S3OutputPath": locations.output, "CompressionType": "NONE"},
        "ResourceConfig": {
            "InstanceType": resources.instance_type,
            "InstanceCount": resources.instance_count,
            "VolumeSizeInGB": cloud.volume_size_gb,
        },
        "StoppingCondition": {"MaxRuntimeInSeconds": spec.max_run_s},
        "EnableManagedSpotTraining": spec.spot,
        "EnableNetworkIsolation": cloud.networking.isolation,
        "EnableInterContainerTrafficEncryption": cloud.networking.encrypt_inter_node,
        "Environment": environment,
        "Tags": [{"Key": k, "Value": v} for k, v in (*spec.tags, ("launcher:recipe", spec.recipe_name))],
    }
    if tensorboard := tensorboard_config(spec, locations):
        request["TensorBoardOutputConfig"] = tensorboard
    if cloud.per_host_checkpoints:
        environment[CHECKPOINT_PREFIX_ENV] = locations.checkpoints  # entrypoints/checkpoint_mirror.py
    else:
        request["CheckpointConfig"] = {"S3Uri": locations.checkpoints, "LocalPath": spec.checkpoint_dir}
    if spec.spot:
        request["StoppingCondition"]["MaxWaitTimeInSeconds"] = cloud.max_wait_s
    if cloud.kms_key_id:
        request["OutputDataConfig"]["KmsKeyId"] = cloud.kms_key_id
        if not local_nvme(resources.instance_type):
            request["ResourceConfig"]["VolumeKmsKeyId"] = cloud.kms_key_id
    if cloud.training_plan_arn:
        request["ResourceConfig"]["TrainingPlanArn"] = cloud.training_plan_arn
    if cloud.networking.subnets:
        request["VpcConfig"] = {
            "Subnets": list(cloud.networking.subnets),
            "SecurityGroupIds": list(cloud.networking.security_group_ids),
        }
    if cloud.infra_check:
        request["InfraCheckConfig"] = {"EnableInfraCheck": True}
    if spec.retries:
        request["RetryStrategy"] = {"MaximumRetryAttempts": spec.retries}
    request["Tags"].append({"Key": SUBMISSION_TAG, "Value": submission_token(request)})
    return request


def submission_token(request: dict) -> str:
    """A digest of the request: the job that carries it in its tags is this submission's own."""
    return hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()[:32]


# --- the backend ---------------------------------------------------------------------------------


def resumes_within_the_job(instance_count: int, cloud: SageMakerSettings) -> bool:
    """Whether workers that torchrun restarts inside the job find its newest checkpoint.

    SageMaker reruns a job only after an InternalServerError (RetryStrategy in botocore's
    sagemaker service model), never after the job's own failure, so a stalled or crashed rank is
    resumed by torchrun's --max-restarts, on every host together (the bootstrap's c10d
    rendezvous). On one host every file of a checkpoint is local. On several, CheckpointConfig
    copies the other hosts' files from S3 only before the job starts ("Use Checkpoints in Amazon
    SageMaker" in the developer guide), so a restart finds none of this job's checkpoints
    complete; per-host checkpoints restore from S3 before every resume (checkpoint_mirror.py)."""
    return instance_count == 1 or cloud.per_host_checkpoints


def _max_restarts(command: tuple[str, ...]) -> int:
    flags = [a for a in command if a.startswith("--max-restarts=")]
    return int(flags[-1].split("=", 1)[1]) if flags else 0


class SageMakerBackend(Backend):
    name = "sagemaker"
    settings_type = SageMakerSettings
    checkpoint_setting = "sagemaker.checkpoint_uri"

    def links(self, ref: JobRef) -> list[tuple[str, str]]:
        return console_links(ref.name, ref.region) if ref.region else []

    def checkpoint_location(self, spec: JobSpec) -> str:
        """The S3 prefix SageMaker copies /opt/ml/checkpoints to and back (per recipe and lineage)."""
        return Locations.of(spec).checkpoints

    def resume_point(self, spec: JobSpec) -> ResumePoint | None:
        """The newest complete checkpoint under the job's S3 prefix (s3_checkpoints.py), which
        the job starts from; None without credentials to look with."""
        if spec.resolved["checkpoint"]["resume"] != "auto" or not aws.credentials_available():
            return None
        cloud, where = settings(spec), Locations.of(spec)
        owner = role_account(cloud.role_arn) if where.default_bucket and not cloud.checkpoint_uri else None
        return ResumePoint(where=where.checkpoints, step=newest_complete_step(where.checkpoints, cloud.region, owner))

    def placement(self, recipe, name: str, lineage: str | None = None) -> Placement:
        # entrypoints/bootstrap.py picks the rendezvous from resourceconfig.json on every host.
        return Placement(
            checkpoint_dir=CHECKPOINT_DIR,
            output_dir=OUTPUT_DIR,
            model_dir=MODEL_DIR,  # checkpoint.export_hf: the model artifact, not output.tar.gz
            s3_data_dir=f"{CHANNELS_DIR}/train",
            s3_model_dir=f"{CHANNELS_DIR}/model",  # model.init_from's channel
            image=training_image(recipe),
            bootstrap=True,
            max_restarts=1 if resumes_within_the_job(recipe.cluster.instance_count, self.settings(recipe)) else 0,
        )

    def problems(self, spec: JobSpec) -> list[str]:
        problems = super().problems(spec)
        if not settings(spec).role_arn:
            problems.append(
                f"sagemaker.role_arn: not set; the job runs as an IAM execution role: add it to the recipe's sagemaker "
                f"section or pass --set sagemaker.role_arn={ROLE_EXAMPLE}"
            )
        restarts = _max_restarts(spec.command)
        if restarts and not resumes_within_the_job(spec.resources.instance_count, settings(spec)):
            problems.append(
                f"cluster.max_restarts: {restarts} on {spec.resources.instance_count} SageMaker hosts would restart from "
                "the checkpoint the job started with: CheckpointConfig downloads the other hosts' files only when the "
                "job starts; set sagemaker.checkpoint_copy: per_host (each host restores its files from S3) or "
                "cluster.max_restarts: 0"
            )
        return problems

    def allowance(self, recipe) -> Allowance:
        cloud = self.settings(recipe)
        needs = quotas.Needs(
            region=cloud.region,
            instance_type=recipe.cluster.instance_type,
            instance_count=recipe.cluster.instance_count,
            spot=cloud.spot,
            # A training plan's reserved capacity is the plan's, not the account's instance quota.
            check_instances=cloud.training_plan_arn is None,
            max_run_s=recipe.cluster.max_run,
            recipe_name=recipe.name,
        )
        checked = quotas.check(needs)
        return Allowance(longest_run_s=min(checked.longest_run_s, self.capabilities.max_run_s), lines=checked.lines)

    def _render(self, spec: JobSpec) -> Rendering:
        bundle = Bundle.of(spec)
        locations = Locations.of(spec)
        code_uri = locations.code_uri(bundle)
        wheels = job_wheels(spec.resolved)
        request = create_training_job_request(
            spec, code_uri=code_uri, bundle_sha256=bundle.sha256, locations=locations, wheels=wheels
        )
        problems = aws_model.validate("sagemaker", "CreateTrainingJob", request)
        if problems:
            raise UsageError(
                "\n".join(f"the CreateTrainingJob request breaks the SageMaker API: {p}" for p in problems)
            )
        data = {"request": request, "bundle": bundle.describe(code_uri), "notes": [checkpoint_note(spec, locations)]}
        if "TensorBoardOutputConfig" in request:
            data["notes"].append(tensorboard_note(request["TensorBoardOutputConfig"]))
        if wheels:
            data["wheels"] = {"uri": locations.wheels_uri(wheels), "files": [w.file for w in wheels]}
        if warnings := request_warnings(spec):
            data["warnings"] = warnings
        return Rendering(
            spec=spec,
            data=data,
            text=json.dumps(data, indent=2),
            payload={"bundle": bundle, "locations": locations, "code_uri": code_uri, "wheels": wheels},
        )

    def _submit(self, rendering: Rendering) -> JobRef:
        spec = rendering.spec
        region = settings(spec).region
        check_role(spec)
        caller = aws.caller_account(region)
        check_role(spec, caller)
        locations: Locations = rendering.payload["locations"].owned_by(caller)
        upload_bundle(rendering.payload["bundle"], rendering.payload["code_uri"], locations, spec)
        if rendering.payload["wheels"]:
            upload_wheels(rendering.payload["wheels"], locations, spec)
        sm = aws.client("sagemaker", region)
        request = rendering.data["request"]
        try:
            sm.create_training_job(**request)
        except Exception as error:
            if _already_exists(error) and self._is_ours(sm, request):
                # The create succeeded but its answer was lost (botocore retried it): adopt that job.
                return JobRef(name=spec.name, backend=self.name, region=region, created=utc_now())
            message = str(getattr(error, "response", {}).get("Error", {}).get("Message", ""))
            raise aws.explain(
                error,
                action=f"CreateTrainingJob {spec.name}",
                region=region,
                job=spec.name,
                quota_hint=quotas.exceeded_quota_name(
                    message, instance_type=spec.resources.instance_type, spot=spec.spot
                ),
            ) from None
        return JobRef(name=spec.name, backend=self.name, region=region, created=utc_now())

    @staticmethod
    def _is_ours(sm, request: dict) -> bool:
        """Whether the job of this name carries this request's submission token."""
        token = next(t["Value"] for t in request["Tags"] if t["Key"] == SUBMISSION_TAG)
        try:
            arn = sm.describe_training_job(TrainingJobName=request["TrainingJobName"])["TrainingJobArn"]
            tags = sm.list_tags(ResourceArn=arn).get("Tags", [])
        except Exception:
            return False  # cannot tell: report the collision rather than guess
        return {"Key": SUBMISSION_TAG, "Value": token} in tags

    def pending_ref(self, spec: JobSpec) -> JobRef:
        return JobRef(name=spec.name, backend=self.name, region=settings(spec).region, created=utc_now())

    def _describe(self, ref: JobRef) -> dict:
        client = aws.client("sagemaker", self._region(ref))
        try:
            description = client.describe_training_job(TrainingJobName=ref.name)
        except Exception as error:
            raise aws.explain(
                error, action=f"DescribeTrainingJob {ref.name}", region=self._region(ref), job=ref.name
            ) from None
        # botocore turns a 200 answer that is not JSON (a proxy's or captive portal's HTML page) into
        # {}: only the job's own name and a status of the model's enum make it SageMaker's answer.
        statuses = client.meta.service_model.shape_for("TrainingJobStatus").enum
        if description.get("TrainingJobName") != ref.name or description.get("TrainingJobStatus") not in statuses:
            raise EngineError(
                f"DescribeTrainingJob {ref.name} in {self._region(ref)}: the answer is not a description of "
                f"this job (no TrainingJobName {ref.name!r} with a status of {', '.join(statuses)}); "
                "is a proxy answering for SageMaker? Check AWS_ENDPOINT_URL and HTTPS_PROXY"
            )
        return description

    @staticmethod
    def _region(ref: JobRef) -> str:
        return ref.region or default_region()

    def _status(self, ref: JobRef) -> JobStatus:
        return status_from_description(self._describe(ref), region=self._region(ref))

    def _logs(self, ref: JobRef, *, follow: bool, poll_s: float) -> Iterator[str]:
        region = self._region(ref)
        description = self._describe(ref)
        logs = aws.client("logs", region)

        def is_done() -> bool:
            return self._describe(ref)["TrainingJobStatus"] in ("Completed", "Failed", "Stopped")

        try:
            yield from log_lines(
                logs,
                ref.name,
                follow=follow,
                is_done=is_done,
                poll_s=poll_s,
                label_hosts=description["ResourceConfig"].get("InstanceCount", 1) > 1,
                no_streams=lambda: NoLogStreams(status_from_description(description, region=region)),
            )
        except LauncherError:
            raise
        except Exception as error:
            raise aws.explain(error, action=f"reading {LOG_GROUP}/{ref.name}", region=region, job=ref.name) from None

    def _metrics(self, ref: JobRef) -> MetricsHistory:
        try:
            return super()._metrics(ref)
        except NoLogStreams:  # no line yet: no step yet
            return MetricsHistory.from_lines(ref.name, [])

    def _stop(self, ref: JobRef, *, grace_s: float) -> JobStatus:
        """StopTrainingJob, unless the job has already ended: SageMaker would refuse that."""
        status = self._status(ref)
        if status.terminal:
            return _already_ended(status)
        region = self._region(ref)
        try:
            aws.client("sagemaker", region).stop_training_job(TrainingJobName=ref.name)
        except Exception as error:
            # It may have ended between the two calls, and SageMaker then refuses to stop it.
            status = self._status(ref)
            if status.terminal:
                return _already_ended(status)
            raise aws.explain(error, action=f"StopTrainingJob {ref.name}", region=region, job=ref.name) from None
        return self._status(ref)

    def _list(self, *, region: str | None, limit: int) -> list[JobStatus]:
        region = region or default_region()
        sm = aws.client("sagemaker", region)
        kwargs = {"SortBy": "CreationTime", "SortOrder": "Descending", "MaxResults": min(limit, 100)}
        summaries: list[dict] = []
        try:
            while len(summaries) < limit:
                page = sm.list_training_jobs(**kwargs)
                summaries += page.get("TrainingJobSummaries", [])
                if not page.get("NextToken"):
                    break
                kwargs["NextToken"] = page["NextToken"]
        except Exception as error:
            raise aws.explain(error, action="ListTrainingJobs", region=region) from None
        return [
            JobStatus(
                name=s["TrainingJobName"],
                backend=self.name,
                state=s["TrainingJobStatus"],
                secondary=s.get("SecondaryStatus"),
                created=_iso(s.get("CreationTime")),
                ended=_iso(s.get("TrainingEndTime")),
                details={"region": region},
            )
            for s in summaries[:limit]
        ]


class NoLogStreams(LauncherError):
    """`logs` of a job whose hosts have not written a log stream (yet)."""

    def __init__(self, status: JobStatus):
        where = f"{LOG_GROUP}/{status.name}"
        state = status.state + (
            f", {status.secondary}" if status.secondary and status.secondary != status.state else ""
        )
        if status.terminal:
            super().__init__(
                f"{status.name}: no log streams in {where}: the job ended ({state}) before any host wrote one; "
                f"`launcher status {status.name}` shows why"
            )
        else:
            super().__init__(
                f"{status.name}: no log streams yet in {where} (the job is {state}): each host opens one when "
                f"its container starts; `launcher logs {status.name} --follow` waits for them"
            )


def _already_ended(status: JobStatus) -> JobStatus:
    """The status of a job that had ended before `stop`, saying that no stop was sent."""
    when = f" at {status.ended}" if status.ended else ""
    note = f"not sent: the job had already ended ({status.state}{when})"
    return dataclasses.replace(status, details={**status.details, "stop": note})


def _already_exists(error: Exception) -> bool:
    response = getattr(error, "response", None) or {}
    code = response.get("Error", {}).get("Code", "")
    message = str(response.get("Error", {}).get("Message", ""))
    return code == "ResourceInUse" or "already exists" in message or "must be unique" in message


def status_from_description(d: dict, *, region: str) -> JobStatus:
    state = d["TrainingJobStatus"]
    resources = d.get("ResourceConfig", {})
    details = {
        "region": region,
        "arn": d.get("TrainingJobArn"),
        "instance": f"{resources.get('InstanceCount')} x {resources.get('InstanceType')}",
        "log_group": f"{LOG_GROUP}/{d['TrainingJobName']}",
        "billable_seconds": d.get("BillableTimeInSeconds"),
        "model_artifacts": d.get("ModelArtifacts", {}).get("S3ModelArtifacts"),
        "tensorboard": d.get("TensorBoardOutputConfig", {}).get("S3OutputPath"),
    }
    return JobStatus(
        name=d["TrainingJobName"],
        backend="sagemaker",
        state=state,
        secondary=terminal_safe(d.get("SecondaryStatus") or "", one_line=True) or None,
        transitions=tuple(
            Transition(
                status=t["Status"],
                start=_iso(t.get("StartTime")),
                end=_iso(t.get("EndTime")),
                message=terminal_safe(t.get("StatusMessage", ""), one_line=True),
            )
            for t in d.get("SecondaryStatusTransitions", [])
        ),
        # Text from the cloud reaches a terminal: no escapes or line breaks that could forge lines.
        failure_reason=terminal_safe(d["FailureReason"], one_line=True) if d.get("FailureReason") else None,
        exit_code={"Completed": 0, "Failed": 1}.get(state),
        created=_iso(d.get("CreationTime")),
        ended=_iso(d.get("TrainingEndTime")),
        metrics={m["MetricName"]: m["Value"] for m in d.get("FinalMetricDataList", [])},
        details={k: v for k, v in details.items() if v is not None},
    )


def _iso(value) -> str | None:
    return value.isoformat() if hasattr(value, "isoformat") else value


# --- the upload ---------------------------------------------------------------------------------


def upload_bundle(bundle: Bundle, code_uri: str, locations: Locations, spec: JobSpec) -> None:
    """Put the bundle at its content-addressed key, unless an identical object is already there."""
    _put_once(bundle.data, code_uri, bundle.sha256, "application/gzip", "the code bundle", locations, spec)


def upload_wheels(wheels: tuple[Wheel, ...], locations: Locations, spec: JobSpec) -> None:
    """Fetch the pinned wheels once (cached under $LAUNCHER_HOME) and put them under the wheels prefix."""

    prefix = locations.wheels_uri(wheels)
    for wheel in wheels:
        data = ensure(wheel).read_bytes()
        _put_once(
            data, prefix + wheel.file, wheel.sha256, "application/zip", f"the {wheel.name} wheel", locations, spec
        )


def _put_once(data: bytes, uri: str, sha256: str, content_type: str, what: str, locations: Locations, spec) -> None:
    """Upload to a content-addressed key, unless the object there is this one by content: the
    SHA-256 that S3 itself checked on upload (ChecksumSHA256; S3 refuses a put whose bytes do not
    match it) equals ours. The object's own metadata is not asked: whoever can write the bucket can
    write it. Anything else at the key (a torn, foreign or forged upload) is replaced."""
    from boto3.s3.transfer import TransferConfig
    from botocore.exceptions import ClientError

    region = settings(spec).region
    s3 = aws.client("s3", region)
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    owner = locations.owner_args()
    try:
        if locations.default_bucket:
            _ensure_bucket(s3, bucket, region, owner)
        try:
            head = s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED", **owner)
            # A multipart object's ChecksumSHA256 is a digest of part digests ("...-N"): never equal.
            if head.get("ChecksumSHA256") == base64.b64encode(bytes.fromhex(sha256)).decode():
                return
        except ClientError as error:
            if error.response["Error"]["Code"] not in ("404", "NoSuchKey", "NotFound"):
                raise
        extra = {"ContentType": content_type, "ChecksumAlgorithm": "SHA256", **owner}
        kms_key_id = settings(spec).kms_key_id
        if kms_key_id:
            extra.update(ServerSideEncryption="aws:kms", SSEKMSKeyId=kms_key_id)
        with _progress(len(data), f"uploading {what} to {uri}") as advance:
            # One PUT, never multipart, so S3 keeps the whole object's SHA-256 (at most 64 MiB here).
            single = TransferConfig(multipart_threshold=max(len(data) + 1, 8 * 2**20))
            s3.upload_fileobj(io.BytesIO(data), bucket, key, ExtraArgs=extra, Callback=advance, Config=single)
    except LauncherError:
        raise
    except Exception as error:
        action = f"uploading {what} to bucket {bucket}"
        if owner and isinstance(error, ClientError) and error.response["Error"]["Code"] in ("403", "AccessDenied"):
            # What S3 answers when ExpectedBucketOwner is not the bucket's owner ("Verifying
            # bucket ownership with bucket owner condition", S3 User Guide): a name taken by another.
            raise UsageError(
                f"{action}: S3 refused it (403): the bucket is not your account {locations.owner}'s, or does not "
                "let you in; set sagemaker.output_uri to a bucket of yours; nothing was submitted"
            ) from None
        raise aws.explain(error, action=action, region=region) from None


def _ensure_bucket(s3, bucket: str, region: str, owner: dict[str, str]) -> None:
    """Create the default bucket on first use, as the SageMaker SDK does. CreateBucket takes no
    ExpectedBucketOwner; a bucket of this name that someone else created first answers
    BucketAlreadyExists, and the upload that follows checks the owner again."""
    from botocore.exceptions import ClientError

    try:
        s3.head_bucket(Bucket=bucket, **owner)
        return
    except ClientError as error:
        if error.response["Error"]["Code"] not in ("404", "NoSuchBucket", "NotFound"):
            raise
    config = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
    s3.create_bucket(Bucket=bucket, **config)


class _progress:
    """A rich progress bar on stderr while a transfer runs (silent when stderr is not a terminal)."""

    def __init__(self, total: int, description: str):
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

        self.total = total
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=Console(stderr=True),
            transient=True,
            disable=not sys.stderr.isatty(),
        )
        self.task = self.progress.add_task(description, total=total)

    def __enter__(self):
        self.progress.start()
        return lambda sent: self.progress.advance(self.task, sent)

    def __exit__(self, *exc) -> None:
        self.progress.stop()

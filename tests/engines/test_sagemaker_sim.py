"""The job `launcher submit --backend sagemaker` creates, run as SageMaker runs it on two hosts.

Each scenario submits tiny-cpu (2 instances x 2 CPU processes) to moto, takes the exact
CreateTrainingJob request that was sent, and runs it in the simulation (sagemaker_sim.py):
hostnames that are not algo-N and resolve to nothing (only algo-N do), an interface named as
resourceconfig.json says (not eth0), /opt/ml per host, checkpoints synced with moto's S3, no route out.
The first two tests check the harness itself with a hand-written request, so a failure in the
scenarios below them is the job's, not the simulation's.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest

from .conftest import DATA_BUCKET, RANKS_PER_HOST
from .s3sync import list_keys, split_uri

# Each stage waits on progress with a generous limit of its own: a loaded 2-core machine slows the
# start-up (torch imported by 4 processes; for FP8, torchao installed from the wheelhouse) and
# every step, sometimes to minutes, but a job that keeps making progress is never failed as slow.
STARTUP_LIMIT_S = 300.0
STEP_LIMIT_S = 180.0
STEPS = 8
STALLED_STEPS = 12  # saves at 4 and 8 and two compute-only steps after step 9 (the stalled-rank scenario)
_METRICS = re.compile(r"^metrics step=(\d+) loss=(\S+)")
_RESUMED = re.compile(r"resumed_from_step=(\d+)")
_INTERRUPTED = re.compile(r"interrupted by SIGTERM after step (\d+)")

pytestmark = [pytest.mark.torchrun, pytest.mark.engines]


# --- reading what the job printed ----------------------------------------------------------------


def losses(stdouts: list[str]) -> dict[int, float]:
    found: dict[int, float] = {}
    for text in stdouts:
        for line in text.splitlines():
            match = _METRICS.match(line)
            if match:
                found[int(match.group(1))] = float(match.group(2))
    return found


def live_losses(attempt) -> dict[int, float]:
    return losses([host.stdout() for host in attempt.hosts])


def newest_step(attempt) -> int:
    return max(live_losses(attempt), default=0)


def wait_for_step(attempt, step: int) -> None:
    """Until a host has logged `step`: the first step within STARTUP_LIMIT_S, each next one
    within STEP_LIMIT_S of the one before."""
    while (seen := newest_step(attempt)) < step:
        attempt.wait_for(
            lambda a, seen=seen: newest_step(a) > seen,
            timeout_s=STARTUP_LIMIT_S if seen == 0 else STEP_LIMIT_S,
            what=f"a step after step {seen} (waiting for step {step})",
        )


def wait_to_the_end(attempt):
    """The attempt's outcome, waiting for each new step (or a container's exit) within its limit,
    then for the exit: after the last step only the final checkpoint is left."""
    while len(attempt.running()) == len(attempt.hosts):
        seen = newest_step(attempt)
        attempt.wait_for(
            lambda a, seen=seen: newest_step(a) > seen or len(a.running()) < len(a.hosts),
            timeout_s=STARTUP_LIMIT_S if seen == 0 else STEP_LIMIT_S,
            what=f"a step after step {seen}, or an exit",
        )
    return attempt.wait(timeout_s=STEP_LIMIT_S)


def outcome_losses(outcome) -> dict[int, float]:
    return losses([host.stdout for host in outcome.hosts])


def first_match(pattern: re.Pattern, outcome) -> int:
    for host in outcome.hosts:
        match = pattern.search(host.stdout)
        if match:
            return int(match.group(1))
    raise AssertionError(f"no line matches {pattern.pattern}\n{outcome.report()}")


def checkpoint_dirs(s3, request: dict) -> set[str]:
    uri = request["CheckpointConfig"]["S3Uri"].rstrip("/") + "/"
    _, prefix = split_uri(uri)
    return {key.removeprefix(prefix).split("/", 1)[0] for key in list_keys(s3, uri)}


def synced_markers(s3, request: dict, step: int) -> int:
    """The hosts' COMPLETE markers of checkpoint `step` that CheckpointConfig's sync has put in S3."""
    uri = request["CheckpointConfig"]["S3Uri"].rstrip("/") + f"/step-{step:08d}/"
    return sum("COMPLETE" in key.rsplit("/", 1)[-1] for key in list_keys(s3, uri))


def assert_same_losses(got: dict[int, float], want: dict[int, float], steps: range) -> None:
    assert sorted(got) == list(steps), f"logged steps {sorted(got)}, expected {list(steps)}"
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-5), f"step {step}: {got[step]} != {want[step]}"


@pytest.fixture(scope="module")
def uninterrupted() -> dict:
    """Losses of the uninterrupted run, recorded by the first scenario (computed on demand)."""
    return {}


@pytest.fixture
def reference(uninterrupted, submit, sim, train_data):
    def get(steps: int = STEPS) -> dict[int, float]:
        key = "losses" if steps == STEPS else f"losses of {steps} steps"
        if key not in uninterrupted:
            # Its own checkpoint prefix: the scenario's job must not find this run's checkpoints.
            own = f"sagemaker.checkpoint_uri=s3://{DATA_BUCKET}/reference-checkpoints-{steps}"
            with sim.start(submit(f"data.source={train_data}", own, f"training.steps={steps}")) as attempt:
                outcome = wait_to_the_end(attempt)
            assert outcome.status == "Completed", outcome.report()
            uninterrupted[key] = outcome_losses(outcome)
        return uninterrupted[key]

    return get


# --- the harness itself --------------------------------------------------------------------------

PROBE = textwrap.dedent(
    """
    import json, os, pathlib, signal, socket, sys, time
    config = json.loads(pathlib.Path("/opt/ml/input/config/resourceconfig.json").read_text())
    me = config["current_host"]
    peer = [h for h in config["hosts"] if h != me][0]
    print("hostname", socket.gethostname(), "pid", os.getpid(), "me", me, flush=True)
    print("resolve", socket.gethostbyname(me), socket.gethostbyname(peer), flush=True)
    try:
        print("own hostname resolves to", socket.gethostbyname(socket.gethostname()), flush=True)
    except OSError:
        print("own hostname resolves to nothing", flush=True)
    interfaces = sorted(name for _, name in socket.if_nameindex())
    print("interfaces", interfaces, "named", config["network_interface_name"], flush=True)
    print("code", sorted(os.listdir("/opt/ml/input/data/code")), flush=True)
    print("env", os.environ["TRAINING_JOB_NAME"], os.environ.get("SM_CURRENT_HOST"), flush=True)
    checkpoints = pathlib.Path("/opt/ml/checkpoints")
    print("downloaded", sorted(p.name for p in checkpoints.iterdir()), flush=True)
    (checkpoints / f"from-{me}").write_text(me)
    if me == "algo-1":
        (checkpoints / "old").unlink()
        server = socket.create_server(("0.0.0.0", 29400)); conn, _ = server.accept()
        print("peer says", conn.recv(64).decode(), flush=True)
    else:
        for _ in range(100):
            try:
                socket.create_connection((peer, 29400), timeout=1).sendall(b"hello from " + me.encode()); break
            except OSError:
                time.sleep(0.1)
    signal.signal(signal.SIGTERM, lambda *a: (print("SIGTERM as pid", os.getpid(), flush=True), sys.exit(3)))
    time.sleep(60)
    """
)


def probe_request(image_python: str, bucket: str) -> dict:
    return {
        "TrainingJobName": "probe",
        "RoleArn": "arn:aws:iam::111122223333:role/SageMakerTrainingRole",
        "AlgorithmSpecification": {
            "TrainingImage": "unused",
            "TrainingInputMode": "File",
            "ContainerEntrypoint": [image_python, "-c"],
            "ContainerArguments": [PROBE],
        },
        "InputDataConfig": [
            {
                "ChannelName": "code",
                "DataSource": {
                    "S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": f"s3://{bucket}/code/abc/code.tar.gz"}
                },
            }
        ],
        "ResourceConfig": {"InstanceType": "ml.c5.2xlarge", "InstanceCount": 2, "VolumeSizeInGB": 10},
        "CheckpointConfig": {"S3Uri": f"s3://{bucket}/ckpt", "LocalPath": "/opt/ml/checkpoints"},
        "Environment": {"PYTHONUNBUFFERED": "1"},
    }


def test_harness_gives_each_host_the_sagemaker_container_contract(sim, s3, image):
    bucket = "probe-bucket"
    s3.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    s3.put_object(Bucket=bucket, Key="code/abc/code.tar.gz", Body=b"bundle")
    s3.put_object(Bucket=bucket, Key="ckpt/old", Body=b"from an earlier attempt")
    request = probe_request(str(image / "bin" / "python"), bucket)
    with sim.start(request) as attempt:
        attempt.wait_for(
            lambda a: "peer says" in a.host("algo-1").stdout(), timeout_s=60, what="algo-2 reaching algo-1"
        )
        attempt.wait_for(lambda a: "from-algo-2" in checkpoint_dirs(s3, request), timeout_s=10, what="upload")
        routes = [
            subprocess.run(["ip", "-n", h.net.namespace, "route"], capture_output=True, text=True).stdout
            for h in attempt.hosts
        ]
        outcome = attempt.stop()
    one, two = (host.stdout for host in outcome.hosts)
    assert "hostname ip-10-213-7-11 pid 1 me algo-1" in one and "hostname ip-10-213-7-12 pid 1 me algo-2" in two
    assert "resolve 10.213.7.11 10.213.7.12" in one and "resolve 10.213.7.12 10.213.7.11" in two
    # As on SageMaker: only algo-N resolve, and the interface is the one resourceconfig.json names.
    assert "own hostname resolves to nothing" in one and "own hostname resolves to nothing" in two
    assert "interfaces ['ethwe', 'lo'] named ethwe" in one and "interfaces ['ethwe', 'lo'] named ethwe" in two
    assert "code ['code.tar.gz']" in one and "env probe None" in one  # no SM_* without the toolkit
    assert "downloaded ['old']" in one and "downloaded ['old']" in two
    assert "peer says hello from algo-2" in one
    assert [r.split()[0] for r in routes] == ["10.213.7.0/24", "10.213.7.0/24"] and all(
        len(r.splitlines()) == 1 for r in routes
    )
    # SIGTERM reached each container's PID 1, which exited within the grace period.
    assert all("SIGTERM as pid 1" in h.stdout and h.exit_code == 3 for h in outcome.hosts), outcome.report()
    # algo-1 deleted `old` and each host added a file: S3 follows.
    assert checkpoint_dirs(s3, request) == {"from-algo-1", "from-algo-2"}


def test_harness_reports_a_failed_host_and_stops_the_others(sim, s3, image):
    bucket = "probe-bucket"
    s3.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    s3.put_object(Bucket=bucket, Key="code/abc/code.tar.gz", Body=b"bundle")
    request = probe_request(str(image / "bin" / "python"), bucket)
    request["AlgorithmSpecification"]["ContainerArguments"] = [
        "import json, pathlib, time\n"
        "me = json.loads(pathlib.Path('/opt/ml/input/config/resourceconfig.json').read_text())['current_host']\n"
        "if me == 'algo-2':\n"
        "    pathlib.Path('/opt/ml/output/failure').write_text('ValueError: algo-2 broke')\n"
        "    raise SystemExit(5)\n"
        "time.sleep(60)\n"
    ]
    sim.grace_s = 3.0
    with sim.start(request) as attempt:
        outcome = attempt.wait(timeout_s=30)
    assert outcome.status == "Failed" and outcome.failure_reason == "ValueError: algo-2 broke"
    # algo-1 ignores SIGTERM as PID 1 without a handler (as in docker), so the grace ends in SIGKILL.
    assert [h.exit_code for h in outcome.hosts] == [137, 5]


# --- the scenarios -------------------------------------------------------------------------------


@pytest.mark.timeout(1800)  # a last resort: every wait below has its own limit on progress
def test_the_job_trains_to_the_end(submit, sim, s3, train_data, uninterrupted):
    request = submit(f"data.source={train_data}")
    assert [c["ChannelName"] for c in request["InputDataConfig"]] == ["code", "train"]
    with sim.start(request) as attempt:
        outcome = wait_to_the_end(attempt)
    assert outcome.status == "Completed", outcome.report()
    assert [h.exit_code for h in outcome.hosts] == [0, 0]
    assert first_match(_RESUMED, outcome) == 0
    found = outcome_losses(outcome)
    assert sorted(found) == list(range(1, STEPS + 1)) and all(math.isfinite(v) for v in found.values())
    assert found[STEPS] < found[1], f"the loss did not fall: {found}"
    assert len(outcome.lines("summary ")) == 1
    # Only the newest `keep` (2) checkpoints remain in S3: every host pruned its own part.
    assert checkpoint_dirs(s3, request) == {"step-00000006", "step-00000008"}
    uninterrupted["losses"] = found


@pytest.mark.timeout(3600)  # a last resort: four attempts with the reference run, each waiting on progress
def test_a_host_killed_mid_checkpoint_then_a_spot_interruption_each_resume_with_the_same_losses(
    submit, sim, s3, train_data, reference
):
    """One spot job, three attempts: the first loses a host while its part of a checkpoint is
    still uploading, the second ignores that torn checkpoint, resumes from the one before and is
    interrupted by a spot stop, and the third resumes from the stop's checkpoint on fresh hosts.
    Every attempt's losses are the uninterrupted run's."""
    want = reference()
    request = submit(f"data.source={train_data}", "sagemaker.spot=true", "sagemaker.max_wait=2d")
    assert request["EnableManagedSpotTraining"] is True

    # Every host writes the step-4 checkpoint, but algo-2's part is still on its way to S3 (a big
    # shard uploads for minutes) when algo-2 is lost, after step 5 and once both hosts' step-2
    # markers are synced (a busy machine can still be uploading them at step 5).
    torn_step = "step-00000004"
    with sim.start(request, hold_uploads={"algo-2": lambda path: path.startswith(torn_step + "/")}) as first:
        first.wait_for(
            lambda a: synced_markers(s3, request, 2) == 2,
            timeout_s=STARTUP_LIMIT_S + 3 * STEP_LIMIT_S,
            what="both hosts' markers of the step-2 checkpoint in S3",
        )
        wait_for_step(first, 5)
        first.kill("algo-2")
        torn = first.wait(timeout_s=STEP_LIMIT_S)
    assert torn.status == "Failed", torn.report()
    assert torn.hosts[1].exit_code == 137, torn.report()
    assert torn_step in checkpoint_dirs(s3, request), "algo-1's part of the torn checkpoint should be in S3"
    early = outcome_losses(torn)
    assert_same_losses({step: early[step] for step in range(1, 6)}, want, range(1, 6))

    # The torn checkpoint is ignored: the next attempt resumes from step 2. A spot stop after
    # its step 5 ends it, each container within the grace period with a checkpoint of the step
    # it was on.
    with sim.start(request) as second:
        wait_for_step(second, 5)
        interrupted = second.stop()
    assert first_match(_RESUMED, interrupted) == 2, interrupted.report()
    assert not any(h.exit_code == 137 for h in interrupted.hosts), interrupted.report()
    stopped_at = first_match(_INTERRUPTED, interrupted)
    assert stopped_at >= 5
    assert f"step-{stopped_at:08d}" in checkpoint_dirs(s3, request)
    assert_same_losses(outcome_losses(interrupted), want, range(3, stopped_at + 1))

    with sim.start(request) as third:
        outcome = wait_to_the_end(third)
    assert outcome.status == "Completed", outcome.report()
    assert first_match(_RESUMED, outcome) == stopped_at
    assert_same_losses(outcome_losses(outcome), want, range(stopped_at + 1, STEPS + 1))


def workers_of(host) -> dict[int, int]:
    """{global rank: pid on this machine} of the training processes inside `host`'s container:
    the descendants of its PID 1 that torchrun started (their environment names the rank)."""
    found: dict[int, int] = {}
    pending = [host.container_pid()] if host.container_pid() is not None else []
    while pending:
        pid = pending.pop()
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        except OSError:
            continue  # it exited meanwhile
        environment = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
        if "TORCHELASTIC_RUN_ID" in environment and "RANK" in environment:
            found[int(environment["RANK"])] = pid
        pending.extend(int(child) for child in children)
    return found


def sigterm_pending(pid: int) -> bool:
    """Whether a SIGTERM sent to the process `pid` waits undelivered (ShdPnd in /proc/PID/status,
    a bit per signal): a stopped process keeps it pending until it runs again or is killed."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False  # it exited
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return bool(int(fields["ShdPnd"], 16) & 1 << (signal.SIGTERM - 1))


@pytest.mark.timeout(2400)  # a last resort: every wait below has its own limit on progress
def test_a_stalled_rank_on_one_host_is_named_and_torchrun_restarts_every_host_with_the_same_losses(
    submit, sim, s3, train_data, reference
):
    """The only rank on algo-2 is stopped for good (SIGSTOP) once the step-4 checkpoint is in S3
    (per-host copies: CheckpointConfig would copy the other host's files only at the job's start,
    so a restart inside the job finds them only this way). The stop waits on progress alone: each
    host's save waits for its previous upload first (checkpoint_mirror.py `push`), so once step 9
    is logged both hosts' step-4 files are in S3, and steps 10 and 11 are left for the stop to
    land in a step's compute, the path this scenario is for (a stop in a save is caught by rank 0
    reading the heartbeats: tests/entrypoints/test_watchdog.py). Waiting for
    the markers in S3 instead raced the upload against the steps: on a busy machine the 8-step
    run logged its last step first. Rank 0's
    watchdog on algo-1 fires and names it; algo-1's torchrun restarts its worker, which rejoins
    the c10d rendezvous; algo-2's torchrun sees a host waiting and restarts its own: SIGTERM to
    the stopped worker, then SIGKILL 30 s later, whatever --shutdown-timeout says (torch 2.13:
    torch/distributed/elastic/agent/server/local_elastic_agent.py `_stop_workers` calls
    `_shutdown()` at its default timeout of 30, and multiprocessing/api.py
    `SubprocessContext._close` SIGKILLs what outlives it), which the test gives at once when the
    SIGTERM is pending (`sigterm_pending`); and both resume from
    the newest checkpoint and train to the end with the uninterrupted run's losses. SageMaker
    itself never reruns the job: RetryStrategy retries only after an InternalServerError
    (botocore's sagemaker service model)."""
    steps = STALLED_STEPS
    want = reference(steps)
    watchdog = ["training.watchdog.min_stall_s=10", "training.watchdog.stall_factor=5"]  # defaults: 60 s and 10
    saves = ["checkpoint.every_steps=4", f"training.steps={steps}"]
    request = submit(f"data.source={train_data}", "sagemaker.checkpoint_copy=per_host", *saves, *watchdog)
    assert "--max-restarts=1" in request["AlgorithmSpecification"]["ContainerArguments"]
    prefix = request["Environment"]["LAUNCHER_CHECKPOINT_S3"]
    with sim.start(request) as attempt:
        wait_for_step(attempt, 9)
        markers = sum("COMPLETE" in name for name in per_step_objects(s3, prefix).get(4, {}))
        assert markers == 2, f"step 9 ran before the step-4 upload finished: {markers} markers"
        stopped = workers_of(attempt.host("algo-2"))
        assert sorted(stopped) == [RANKS_PER_HOST], stopped
        assert newest_step(attempt) < steps, "the run reached its final save before the stop"
        os.kill(stopped[RANKS_PER_HOST], signal.SIGSTOP)
        # algo-2's torchrun stops its worker to rejoin (SIGTERM), which a stopped process never
        # acts on: the SIGKILL that torchrun sends 30 s later comes from here once the SIGTERM
        # waits at the worker, so the restart takes the same path without the wait.
        attempt.wait_for(
            lambda a: sigterm_pending(stopped[RANKS_PER_HOST]),
            timeout_s=STARTUP_LIMIT_S,
            what="algo-2's torchrun sending SIGTERM to the stopped worker",
        )
        assert workers_of(attempt.host("algo-2")) == stopped, "the stopped worker is no longer the one stopped"
        os.kill(stopped[RANKS_PER_HOST], signal.SIGKILL)
        outcome = wait_to_the_end(attempt)
    assert outcome.status == "Completed", outcome.report()
    assert [h.exit_code for h in outcome.hosts] == [0, 0], outcome.report()
    logs = "\n".join(h.stdout + h.stderr for h in outcome.hosts)
    stuck = f"stuck: rank {RANKS_PER_HOST} on {outcome.hosts[1].hostname}"
    assert "error: watchdog: no step completed for " in logs and stuck in logs, outcome.report()
    stacks = attempt.host("algo-1").opt_ml / "output" / "data" / "stacks" / "rank-0.txt"
    assert stuck in stacks.read_text() and "Thread 0x" in stacks.read_text()
    starts = [int(s) for s in _RESUMED.findall(outcome.hosts[0].stdout)]
    assert len(starts) == 2 and starts[0] == 0 and starts[1] >= 4, f"resumed_from_step per start: {starts}"
    restarted = outcome.hosts[0].stdout[outcome.hosts[0].stdout.rindex("resumed_from_step=") :]
    assert_same_losses(losses([restarted]), want, range(starts[1] + 1, steps + 1))


FP8_STEPS = 4


@pytest.mark.timeout(STARTUP_LIMIT_S + FP8_STEPS * STEP_LIMIT_S + 300)  # + set-up
def test_fp8_installs_torchao_offline_inside_the_namespace(submit, sim, s3, image, moto_server):
    request = submit(
        "precision.fp8=true",
        "sagemaker.network_isolation=true",
        "checkpoint.every_steps=0",
        f"training.steps={FP8_STEPS}",
    )
    assert request["EnableNetworkIsolation"] is True
    port = moto_server.rsplit(":", 1)[1]
    reach_moto = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"
    with sim.start(request) as attempt:
        # The hosts cannot reach anything outside the cluster, not even the S3 server on this machine.
        for host in attempt.hosts:
            probe = subprocess.run(
                ["ip", "netns", "exec", host.net.namespace, str(image / "bin" / "python"), "-c", reach_moto],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            assert probe.returncode != 0 and "ConnectionRefusedError" in probe.stderr, probe.stderr
        outcome = wait_to_the_end(attempt)
    assert outcome.status == "Completed", outcome.report()
    assert re.search(r"^start .* fp8=tensorwise ", "\n".join(h.stdout for h in outcome.hosts), re.M), outcome.report()
    found = outcome_losses(outcome)
    assert sorted(found) == list(range(1, FP8_STEPS + 1)) and all(math.isfinite(v) for v in found.values())
    # What the containers installed stayed in their own layers: the image still has no torchao.
    check = subprocess.run(
        [str(image / "bin" / "python"), "-c", "import importlib.util as u; print(u.find_spec('torchao'))"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert check.stdout.strip() == "None"


def test_a_bundle_replaced_in_s3_after_submit_is_refused_before_anything_of_it_runs(submit, sim, s3, tmp_path):
    """The bucket's writer swaps the object between submit and the job's download (the upload's
    checksum cannot see that): every host refuses it before unpacking, and its code never runs."""
    from launcher.bundle import Bundle

    request = submit()
    code = next(c for c in request["InputDataConfig"] if c["ChannelName"] == "code")
    bucket, key = split_uri(code["DataSource"]["S3DataSource"]["S3Uri"])
    source = tmp_path / "forged-entrypoints"
    source.mkdir()
    (source / "bootstrap.py").write_text('print("FORGED BUNDLE RAN", flush=True)\n')
    s3.put_object(Bucket=bucket, Key=key, Body=Bundle.build("{}\n", source).data)
    with sim.start(request) as attempt:
        outcome = wait_to_the_end(attempt)
    assert outcome.status == "Failed", outcome.report()
    assert outcome.failure_reason == (
        "bundle check: refused the code bundle /opt/ml/input/data/code/code.tar.gz: its sha256 is not the "
        "LAUNCHER_BUNDLE_SHA256 of the job's request (it was changed or damaged after upload); nothing from it ran"
    )
    assert 2 in [h.exit_code for h in outcome.hosts]
    assert not [h.name for h in outcome.hosts if "FORGED BUNDLE RAN" in h.stdout + h.stderr]


# --- per-host checkpoints: no CheckpointConfig, each host copies its own files -----------------

# What moto sends a host beyond the payload: HTTP headers (about 450 bytes a response; at most
# this much per request) and the prefix's listing, once.
HEADER_BYTES_PER_REQUEST = 1024
LISTING_BYTES = 64 * 1024
_READ_TO_RESUME = re.compile(r"checkpoint: read from S3 to resume \(bytes\): (.*)")


def per_step_objects(s3, prefix_uri: str) -> dict[int, dict[str, int]]:
    bucket, prefix = split_uri(prefix_uri.rstrip("/") + "/")
    found: dict[int, dict[str, int]] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            step_dir, _, relative = item["Key"].removeprefix(prefix).partition("/")
            found.setdefault(int(step_dir.removeprefix("step-")), {})[relative] = item["Size"]
    return found


def test_per_host_checkpoints_survive_a_spot_stop_and_each_host_downloads_only_its_own_share(
    submit, sim, s3, train_data, reference, tmp_path
):
    """sagemaker.checkpoint_copy: per_host (what the flagships get by size): a spot stop after
    step 5, then new hosts resume. Moto is reached through the hosts' bridge, and every byte it
    sends each host is counted there."""
    from tests.checkpoint_items import whole_items

    want = reference()
    request = submit(
        f"data.source={train_data}",
        "sagemaker.checkpoint_copy=per_host",
        "sagemaker.spot=true",
        "sagemaker.max_wait=2d",
    )
    assert "CheckpointConfig" not in request
    prefix = request["Environment"]["LAUNCHER_CHECKPOINT_S3"]
    with sim.start(request) as first:
        wait_for_step(first, 5)
        interrupted = first.stop()
    stopped_at = first_match(_INTERRUPTED, interrupted)
    assert not any(h.exit_code == 137 for h in interrupted.hosts), interrupted.report()
    stored = per_step_objects(s3, prefix)
    assert sorted(stored)[-1] == stopped_at and len(stored) == 2, sorted(stored)  # checkpoint.keep: 2, in S3

    with sim.start(request) as second:
        # What moto has sent each host once every rank has loaded (before the next save's traffic).
        second.wait_for(
            lambda a: _READ_TO_RESUME.search(a.hosts[0].stdout()), timeout_s=STARTUP_LIMIT_S, what="the resume"
        )
        sent = {name: second.s3_bytes_to(name) for name in ("algo-1", "algo-2")}
        outcome = wait_to_the_end(second)
    assert outcome.status == "Completed", outcome.report()
    assert first_match(_RESUMED, outcome) == stopped_at
    assert_same_losses(outcome_losses(outcome), want, range(stopped_at + 1, STEPS + 1))

    files = stored[stopped_at]
    bucket, key = split_uri(f"{prefix}/step-{stopped_at:08d}/.metadata")
    (tmp_path / "meta").mkdir()
    s3.download_file(bucket, key, str(tmp_path / "meta" / ".metadata"))
    shared = sum(
        size for name, size in files.items() if name in (".metadata", "train_state.json") or "COMPLETE" in name
    )
    printed = dict(re.findall(r"host(\d)=(\d+)", _READ_TO_RESUME.search(outcome.hosts[0].stdout).group(1)))
    for node, name in enumerate(("algo-1", "algo-2")):
        ranks = range(RANKS_PER_HOST * node, RANKS_PER_HOST * (node + 1))
        own = sum(
            size for f, size in files.items() if any(f in (f"__{r}_0.distcp", f"rng/rank-{r:05d}.pt") for r in ranks)
        )
        others = [f"__{r}_0.distcp" for r in range(2 * RANKS_PER_HOST) if r not in ranks]
        # Each of the host's ranks reads the items every rank holds whole from where DCP stored
        # them, one ranged GET each; the host's first rank downloads its files with one GET each.
        items = [whole_items(tmp_path / "meta", other) for other in others]
        replicated = sum(b for b, _ in items)
        reads = RANKS_PER_HOST * sum(c for _, c in items) + len(files)
        # The job's own count (payload) is what the bridge measured, less headers and the listing.
        headers = reads * HEADER_BYTES_PER_REQUEST + LISTING_BYTES
        assert int(printed[str(node)]) <= sent[name] <= int(printed[str(node)]) + headers, (name, sent, reads)
        assert own + shared <= int(printed[str(node)]) <= own + shared + RANKS_PER_HOST * replicated, (
            name,
            printed,
            own,
            shared,
        )
        assert sent[name] < sum(files.values())  # never the whole checkpoint, let alone every kept one

"""Recipe strings (and a strange $LAUNCHER_HOME) come out inert in every render.

Each render is parsed or run the way its user would: the docker command and the sbatch script
through bash with recording stand-ins for docker, srun and scontrol; manifests through a YAML
loader. A hostile value must arrive as exactly itself and run nothing.
"""

from __future__ import annotations

import csv
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from launcher.backends import get_backend
from launcher.errors import UsageError

from .helpers import spec_for
from .sagemaker_stubs import NAME, description, stub

HOSTILE = "x'; touch PWNED_QUOTE; echo \"$(touch PWNED_SUBST)`touch PWNED_TICK`\n---\nkind: Secret\n# ${HOME} \\"
IMAGE = "repo/img:1$(touch${IFS}PWNED_IMAGE)`touch${IFS}PWNED_IMAGE2`';\"&&"
TAG = "a'b\"c$(d)\n---\n: e"


@pytest.fixture
def hostile_home(tmp_path, monkeypatch, fake_bundle) -> Path:
    home = tmp_path / "home $(touch PWNED_HOME) 'q\"\n---"
    monkeypatch.setenv("LAUNCHER_HOME", str(home))
    return home


def hostile(recipe: str, backend: str, tmp_path: Path, **extra):
    data = tmp_path / f"data {HOSTILE}"
    data.mkdir(exist_ok=True)  # a job that runs here reads it here (Backend.problems checks it exists)
    checkpoints = tmp_path / f"ckpt {HOSTILE}"
    overrides = {
        "data.source": str(data),
        "checkpoint.dir": str(checkpoints),
        "sagemaker.tags": {"owner": TAG},
        **extra,
    }
    if backend in ("docker", "k8s"):
        overrides["cluster.image"] = IMAGE
    spec = spec_for(recipe, backend, **overrides)
    return spec, get_backend(backend).render(spec), data, checkpoints


def recorder(bin_dir: Path, name: str, out: Path, stdout: str = "") -> None:
    """An executable `name` that appends its argv (and PET_RDZV_ENDPOINT) as JSON to `out`."""
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / name
    script.write_text(
        "#!/usr/bin/env python3\nimport json, os, sys\n"
        f"open({str(out)!r}, 'a').write(json.dumps({{'argv': sys.argv[1:], "
        "'rdzv': os.environ.get('PET_RDZV_ENDPOINT'), 'cwd': os.getcwd()}) + '\\n')\n"
        f"print({stdout!r})\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def pwned(*roots: Path) -> list[Path]:
    return [p for root in roots for p in root.rglob("PWNED*")]


def test_docker_command_through_bash_gives_docker_exactly_its_argv(hostile_home, tmp_path):
    spec, rendering, data, checkpoints = hostile("tiny-cpu", "docker", tmp_path)
    calls = tmp_path / "calls.jsonl"
    recorder(tmp_path / "bin", "docker", calls)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    subprocess.run(["bash", "-c", rendering.text], cwd=tmp_path, env=env, check=True)
    (call,) = [json.loads(line) for line in calls.read_text().splitlines()]
    assert ["docker", *call["argv"]] == rendering.data["command"]
    assert IMAGE in call["argv"]
    mounts = [next(csv.reader([call["argv"][i + 1]])) for i, a in enumerate(call["argv"]) if a == "--mount"]
    sources = {field.removeprefix("source=") for m in mounts for field in m if field.startswith("source=")}
    assert {str(data), str(checkpoints)} <= sources
    assert pwned(tmp_path) == []


def test_sbatch_script_runs_srun_with_exactly_its_argv(hostile_home, tmp_path):
    spec, rendering, _, _ = hostile("llama70b-128k", "slurm", tmp_path)
    directory = Path(hostile_home) / "jobs" / spec.name
    (directory / "code").mkdir(parents=True)
    calls = tmp_path / "calls.jsonl"
    recorder(tmp_path / "bin", "srun", calls)
    recorder(tmp_path / "bin", "scontrol", tmp_path / "scontrol.jsonl", stdout="node-a\nnode-b")
    script = tmp_path / "job.sbatch"
    script.write_text(rendering.text)
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_JOB_ID": "7",
        "SLURM_CPUS_ON_NODE": "96",
    }
    subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, check=True)
    check, train = [json.loads(line) for line in calls.read_text().splitlines()]
    assert check["argv"][-2:] == [str(directory / "code" / "resolved.json"), str(hostile_home)]
    assert train["argv"] == ["--cpus-per-task=96", "--kill-on-bad-exit=1", "--ntasks-per-node=1", *spec.command]
    assert train["rdzv"] == "node-a:29500" and train["cwd"] == str(directory / "code")
    assert (directory / "exit_code").read_text() == "0\n"
    assert pwned(tmp_path) == []


def test_kubernetes_manifest_keeps_each_string_a_single_value(hostile_home, tmp_path):
    _, rendering, data, _ = hostile("llama70b-128k", "k8s", tmp_path)
    documents = list(yaml.safe_load_all(rendering.text))
    assert [d["kind"] for d in documents] == ["ConfigMap"] * 5 + ["PyTorchJob"]  # the code, torchao's 4 parts
    job = documents[-1]
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["containers"][0]["image"] == IMAGE
    assert {v["name"]: v for v in pod["volumes"]}["data-0"]["hostPath"]["path"] == str(data)
    assert "annotations" not in job["metadata"]  # sagemaker.tags are SageMaker's alone
    assert documents == rendering.data["manifest"]


def test_accelerate_config_carries_no_recipe_strings(hostile_home, tmp_path):
    _, rendering, _, _ = hostile("tiny-cpu", "accelerate", tmp_path)
    assert yaml.safe_load(rendering.text) == rendering.data["config"]
    assert "PWNED" not in rendering.text and "---" not in rendering.text


def test_local_command_is_one_shell_command_that_splits_back_into_its_argv(hostile_home, tmp_path):
    import shlex

    _, rendering, data, _ = hostile("tiny-cpu", "local", tmp_path)
    words = shlex.split(rendering.text)
    assert words[:3] == ["cd", rendering.data["cwd"], "&&"]
    assert words[-len(rendering.data["command"]) :] == rendering.data["command"]
    result = subprocess.run(["bash", "-n", "-c", rendering.text], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_hostile_strings_reach_the_trainer_unchanged_through_resolved_json(hostile_home, tmp_path):
    spec, _, data, checkpoints = hostile("tiny-cpu", "local", tmp_path)
    assert spec.resolved["data"]["source"] == str(data)
    assert spec.resolved["checkpoint"]["dir"] == str(checkpoints)


def test_sagemaker_json_round_trips_and_refuses_tags_sagemaker_would_reject(hostile_home, tmp_path):
    s3 = "s3://my-bucket/x'$(touch PWNED)\"`y`;--- #"
    spec = spec_for("llama70b-128k", "sagemaker", **{"data.source": s3, "checkpoint.dir": HOSTILE})
    rendering = get_backend("sagemaker").render(spec)
    assert json.loads(rendering.text)["request"]["InputDataConfig"][1]["DataSource"]["S3DataSource"]["S3Uri"] == s3
    tagged = spec_for("llama70b-128k", "sagemaker", **{"sagemaker.tags": {"owner": TAG}})
    with pytest.raises(UsageError, match=r"Tags\[0\]\.Value: .* does not match the pattern"):
        get_backend("sagemaker").render(tagged)


# --- text from a service or a file reaches the terminal inert ----------------------------------

FORGED = "x\x1b]0;pwned\x07\x1b[2K\rState: Completed\nexit 0\x9b31m\x1b[?1049h"
"""An OSC title, an erase-line, a carriage return, a forged second line, a C1 CSI, a screen switch."""
DRIVES_A_TERMINAL = ("\x1b", "\x07", "\r", "\x9b", "\x9d")


def inert(text: str) -> bool:
    return not any(c in text for c in DRIVES_A_TERMINAL)


@pytest.mark.usefixtures("registered")
def test_a_cloud_error_echoing_escape_sequences_prints_as_one_inert_line(cli):
    sm = stub("sagemaker")
    message = (
        f"Value '{FORGED}' at 'trainingJobName' failed to satisfy constraint: Member must satisfy regular expression"
    )
    for _ in range(2):  # `stop` asks for the job's state before and after a refused StopTrainingJob
        sm.add_response("describe_training_job", description("InProgress", "Training"), {"TrainingJobName": NAME})
        sm.add_client_error("stop_training_job", service_error_code="ValidationException", service_message=message)
        sm.add_response("describe_training_job", description("InProgress", "Training"), {"TrainingJobName": NAME})
    result = cli("stop", NAME)
    assert result.code == 3 and inert(result.err), repr(result.err)
    assert result.err_lines == [
        f"StopTrainingJob {NAME}: SageMaker rejected the request: Value 'xState: Completed exit 031m' at "
        "'trainingJobName' failed to satisfy constraint: Member must satisfy regular expression"
    ]
    as_json = cli("stop", NAME, "--json")
    assert as_json.code == 3 and inert(json.loads(as_json.out)["error"])


def test_a_recipe_value_with_escape_sequences_is_echoed_inert(tmp_path, cli):
    recipe = tmp_path / "r.yaml"
    training = {"seq_len": 256, "global_batch_size": 8, "steps": 10}
    recipe.write_text(json.dumps({"name": "t", "model": FORGED, "training": training}))
    for verb in ("validate", "estimate"):
        result = cli(verb, recipe)
        assert result.code == 2 and inert(result.err), (verb, repr(result.err))
        assert any(
            "model: 'xState: Completed" in line and "is not in the model catalog" in line for line in result.err_lines
        )


def test_status_and_list_print_what_a_job_wrote_inert(no_torchrun, cli):
    """A local job's status.json holds text from torchrun's error file and the log: it cannot
    recolour the terminal or forge a line in `status` or `list`."""
    from .helpers import submit

    name = submit(wait=True, poll_s=0.05).spec.name
    status_file = no_torchrun / "jobs" / name / "status.json"
    status = json.loads(status_file.read_text())
    forged = "boom\x1b[2J\x1b]0;owned\x07\r\nFAKE  local  Completed\x9b31m"
    status.update(state="Failed", secondary=forged, failure_reason=forged)
    status_file.write_text(json.dumps(status))
    for verb in (("status", name), ("list",)):
        out = cli(*verb).out
        assert not any(c in out for c in "\x1b\x07\r\x9b"), verb
        assert "\nFAKE" not in out, verb  # the forged row stays inside its own line
    assert "  failure  boom FAKE local Completed31m" in cli("status", name).out

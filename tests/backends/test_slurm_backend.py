"""The Slurm backend without a cluster: what the script asks Slurm for, and how Slurm's answers read.

Slurm's answers are real: tests/backends/slurm_outputs/ holds what slurm-wlm 22.05's scontrol
and sbatch printed on the test cluster (tests/engines/slurm_cluster.py). Stand-in tools on PATH
(the `tools` fixture) print them back. tests/engines/test_slurm_real.py runs the real thing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from launcher.backends import get_backend
from launcher.backends.slurm import exit_code_of, parse_scontrol, state_of

from . import test_engine_tools
from .helpers import recipe_path, spec_for

tools = test_engine_tools.tools  # the stand-in tools fixture

OUTPUTS = Path(__file__).resolve().parent / "slurm_outputs"
FSX = "/fsx/tokens/llama3-128k"


def captured(name: str) -> str:
    return (OUTPUTS / name).read_text()


def failing_tool(tools, name: str, stderr: str) -> None:
    """A stand-in `name` that prints `stderr` and exits 1, as the real tool did."""
    tools(name, "", exit_code=1)
    script = Path(os.environ["PATH"].split(os.pathsep)[0]) / name
    script.write_text(script.read_text().replace("sys.exit(1)", f"sys.stderr.write({stderr!r}); sys.exit(1)"))


def directives(script: str) -> dict[str, str]:
    """`#SBATCH --key=value` lines as {key: value} ("" for a flag), as sbatch reads them."""
    found = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line.removeprefix("#SBATCH ").partition("=")
            found[key] = value
    return found


def render(recipe: str = "tiny-cpu", **overrides):
    return get_backend("slurm").render(spec_for(recipe, "slurm", **overrides))


# --- the script ------------------------------------------------------------------------------------


def test_a_cpu_job_asks_for_a_core_per_process_and_a_gpu_job_for_whole_nodes(home, fake_bundle):
    cpu = directives(render(**{"cluster.instance_count": 2, "cluster.nproc_per_node": 2}).text)
    assert cpu == {
        "--job-name": "tiny-cpu-job",
        "--nodes": "2",
        "--ntasks-per-node": "1",
        "--cpus-per-task": "2",
        "--time": "1-00:00:00",
        "--signal": "B:USR1@600",
        "--requeue": "",
        "--open-mode": "append",
    }
    gpu = render("llama70b-128k", **{"data.source": FSX}).text
    assert sbatch_lines(gpu)[:6] == [
        "#SBATCH --job-name=llama70b-128k-job",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        "#SBATCH --mem=0",  # --exclusive alone grants only the memory asked for (sbatch man page)
        "#SBATCH --gpus-per-node=8",
    ]
    assert "--cpus-per-task" not in directives(gpu)


def sbatch_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH ")]


# tiny-cpu's model on one 8-GPU node: a GPU job whose checkpoint (10.4 MB) is quick to render.
TINY_GPU = {
    "cluster.device": "cuda",
    "cluster.instance_type": "ml.p5.48xlarge",
    "cluster.nproc_per_node": 8,
    "precision.dtype": "bf16",
}


@pytest.mark.parametrize(
    "request_, lines",
    [
        ("gpus-per-node", ["#SBATCH --exclusive", "#SBATCH --mem=0", "#SBATCH --gpus-per-node=8"]),
        ("gres", ["#SBATCH --exclusive", "#SBATCH --mem=0", "#SBATCH --gres=gpu:8"]),
        ("none", ["#SBATCH --exclusive", "#SBATCH --mem=0"]),  # AWS's samples: the node's GPUs come with it
    ],
)
def test_slurm_gpu_request_picks_how_a_gpu_job_asks_for_its_gpus(home, fake_bundle, request_, lines):
    script = render("tiny-cpu", **TINY_GPU, **{"slurm.gpu_request": request_}).text
    assert sbatch_lines(script)[3:-4] == lines
    assert sbatch_lines(script)[-4].startswith("#SBATCH --time=")
    cpu = render("tiny-cpu", **{"slurm.gpu_request": request_}).text  # a CPU job asks for cores only
    assert not {"--exclusive", "--mem", "--gpus-per-node", "--gres"} & directives(cpu).keys()


def test_an_unknown_gpu_request_is_one_line_naming_the_key_and_the_choices(home, cli):
    result = cli("validate", recipe_path("tiny-cpu"), "--set", "slurm.gpu_request=foo")
    assert result.code == 2
    assert result.err_lines == ["--set slurm.gpu_request: expected 'gpus-per-node', 'gres' or 'none', got 'foo'"]


def test_the_slurm_section_reaches_the_directives(home, fake_bundle):
    script = render(
        **{
            "cluster.max_run": "90m",
            "slurm.partition": "gpu-a",
            "slurm.account": "proj_7",
            "slurm.signal_before_end": "5m",
            "slurm.requeue": False,
        }
    ).text
    found = directives(script)
    assert (found["--time"], found["--partition"], found["--account"]) == ("0-01:30:00", "gpu-a", "proj_7")
    assert (found["--signal"], "--no-requeue" in found, "--requeue" in found) == ("B:USR1@300", True, False)
    assert "scontrol requeue" not in script


def test_sbatch_gets_the_paths_on_its_command_line_under_the_shared_dir(home, fake_bundle, tmp_path):
    shared = tmp_path / "fsx"
    rendering = render(**{"slurm.shared_dir": str(shared)})
    directory = shared / "jobs" / "tiny-cpu-job"
    assert rendering.data["command"] == [
        "sbatch",
        "--parsable",
        f"--output={directory / 'slurm-%j.out'}",
        f"--chdir={directory}",
        str(directory / "job.sbatch"),
    ]
    spec = rendering.spec
    assert spec.checkpoint_dir == str(shared / "checkpoints" / "tiny-cpu" / "tiny-cpu-job")
    assert spec.output_dir == str(directory)
    assert f"shared-dir-check {directory / 'code' / 'resolved.json'} {shared} || exit 1" in rendering.text


def test_a_resume_continues_the_earlier_jobs_checkpoints_on_the_shared_dir(home, fake_bundle, tmp_path):
    from launcher.api import load
    from launcher.resolve import resolve

    recipe = load(recipe_path("tiny-cpu"), backend="slurm", set_options=[f"slurm.shared_dir={tmp_path}"])
    spec = get_backend("slurm").spec(resolve(recipe).concrete, lineage="tiny-cpu-first")
    assert spec.checkpoint_dir == str(tmp_path / "checkpoints" / "tiny-cpu" / "tiny-cpu-first")
    assert spec.output_dir == str(tmp_path / "jobs" / spec.name)


def test_multi_node_rendezvous_is_the_first_nodes_address_as_slurm_knows_it(home, fake_bundle):
    script = render("llama70b-128k", **{"data.source": FSX}).text
    assert 'mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")' in script
    assert (
        "rdzv_host=$(scontrol show node \"${nodes[0]}\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p') || true" in script
    )
    assert 'export PET_RDZV_ENDPOINT="${rdzv_host:-${nodes[0]}}:29500"' in script
    assert "export FI_PROVIDER=efa" in script


def test_a_venv_is_activated_and_a_container_runs_through_pyxis_with_the_shared_dir_mounted(home, fake_bundle):
    script = render(
        **{"slurm.venv": "/shared/envs/torch 2.13", "slurm.container_image": "nvcr.io#nvidia/pytorch:25.01-py3"}
    ).text
    assert "source '/shared/envs/torch 2.13/bin/activate'" in script
    image = home / "images" / f"nvcr.io_nvidia_pytorch_25.01-py3-{NGC_NAME_HASH}.sqsh"
    (train,) = [line for line in script.splitlines() if line.startswith("srun --cpus-per-task")]
    assert train.startswith(
        'srun --cpus-per-task="$SLURM_CPUS_ON_NODE" --kill-on-bad-exit=1 --ntasks-per-node=1 '
        f"--container-image={image} "
        f"--container-mounts={home}:{home} --container-workdir={home}/jobs/tiny-cpu-job/code "
        "python3 entrypoints/bootstrap.py --exec torchrun "
    )


NGC = "nvcr.io#nvidia/pytorch:25.01-py3"
NGC_NAME_HASH = hashlib.sha256(NGC.encode()).hexdigest()[:12]  # two names never share a file


def test_the_batch_script_imports_the_image_once_to_a_squashfs_file_on_the_shared_dir(home, fake_bundle):
    script = render(**{"slurm.container_image": NGC}).text
    image = home / "images" / f"nvcr.io_nvidia_pytorch_25.01-py3-{NGC_NAME_HASH}.sqsh"
    start = script.index(f"image={image}\n")
    assert script[start:].splitlines()[:9] == [
        f"image={image}",
        'if [[ ! -e "$image" ]]; then',
        f"    echo 'launcher: importing docker://{NGC} to {image} once (enroot import); later jobs and requeues reuse it'",
        '    mkdir -p -- "${image%/*}"',
        '    partial="$image.$SLURM_JOB_ID.$$.partial"',
        f"    enroot import --output \"$partial\" 'docker://{NGC}' ||",
        f'        {{ rm -f -- "$partial"; echo \'launcher: enroot import of docker://{NGC} failed (its error is '
        "above); a private registry (ECR) needs its credentials in $ENROOT_CONFIG_PATH/.credentials (by default "
        "~/.config/enroot/.credentials) on the nodes: see docs/slurm.md' >&2; exit 1; }",
        '    mv -f -- "$partial" "$image"',
        "fi",
    ]
    assert script.index("enroot import") < script.index("srun --cpus-per-task")


@pytest.mark.parametrize(
    "given, container_image",
    [
        ("/fsx/images/pytorch.sqsh", "/fsx/images/pytorch.sqsh"),  # pyxis reads '/' or '.' as a squashfs path
        ("docker://nvcr.io#nvidia/pytorch@sha256:" + "ab" * 32, "{home}/images/sha256-" + "ab" * 32 + ".sqsh"),
    ],
)
def test_a_squashfs_path_is_used_as_it_is_and_a_pinned_digest_names_its_file(home, fake_bundle, given, container_image):
    script = render(**{"slurm.container_image": given}).text
    assert f"--container-image={container_image.format(home=home)} " in script
    assert ("enroot import" in script) == (not given.startswith("/"))


def test_an_fp8_job_installs_its_wheels_from_the_shared_dir_and_usr1_leads_by_the_stop_grace(home, fake_bundle):
    """70B: the step in progress (~4.7 min) and a save (~53 s) take a 442 s grace, inside the
    default 600 s lead; a 20-minute cluster.stop_grace raises the lead to it."""
    script = render("llama70b-128k", **{"data.source": FSX, "precision.fp8": True}).text
    found = directives(script)
    assert found["--signal"] == "B:USR1@600"  # the default lead already covers the 442 s grace
    (train,) = [line for line in script.splitlines() if line.startswith("srun --cpus-per-task")]
    grace = int(re.search(r"--shutdown-timeout=(\d+)", train)[1]) + 20
    assert 300 < grace < 600, train
    wheels = re.search(r"^export LAUNCHER_WHEELHOUSE=(\S+)$", script, re.M)[1]
    assert wheels.startswith(f"{home}/wheelhouse/") and "export LAUNCHER_REQUIREMENTS=torchao==0.18.0" in script
    longer = render("llama70b-128k", **{"data.source": FSX, "cluster.stop_grace": "20m"})
    assert directives(longer.text)["--signal"] == "B:USR1@1200"
    assert longer.data["notes"][0].startswith("slurm.signal_before_end: USR1 comes 1200 s before the time limit")
    assert "LAUNCHER_WHEELHOUSE" not in render().text  # no FP8, no wheels


def test_s3_data_is_staged_on_the_shared_dir_and_the_dry_run_says_where(home, fake_bundle, cli, tmp_path):
    result = cli(
        "submit", recipe_path("tiny-cpu"), "--backend", "slurm", "--dry-run", "--json",
        "--set", "data.source=s3://bucket/tokens/", "--set", f"slurm.shared_dir={tmp_path / 'fsx'}",
    )  # fmt: skip
    assert result.code == 0, result.err
    (note,) = json.loads(result.out)["notes"]
    assert "s3://bucket/tokens/" in note and str(tmp_path / "fsx" / "data") in note


def test_a_signal_earlier_than_slurm_can_send_is_refused_with_the_key(home, fake_bundle, cli):
    result = cli(
        "submit", recipe_path("tiny-cpu"), "--backend", "slurm", "--dry-run", "--set", "slurm.signal_before_end=20h"
    )
    assert result.code == 2
    assert result.err_lines[-1] == (
        "slurm.signal_before_end: Slurm can signal at most 65535 s before the time limit, not 72000 s; use a shorter one"
    )


def test_a_signal_not_before_the_time_limit_is_a_warning(home, fake_bundle, cli):
    sets = ["--set", "cluster.max_run=5m", "--set", "slurm.signal_before_end=10m"]
    result = cli("submit", recipe_path("tiny-cpu"), "--backend", "slurm", "--dry-run", *sets)
    assert result.code == 0
    assert (
        "warning: slurm.signal_before_end (600 s) is not shorter than cluster.max_run (300 s): "
        "Slurm sends USR1 as soon as the job starts"
    ) in result.err_lines


def test_data_missing_under_the_shared_dir_is_refused_and_elsewhere_is_a_warning(home, fake_bundle, cli, tmp_path):
    """Submit writes the job under slurm.shared_dir, which every node mounts at the same path: data
    missing there is missing on the nodes, refused before the job waits in the queue. A path
    elsewhere may be on the nodes' own disks: a warning."""
    shared = tmp_path / "fsx"
    shared.mkdir()
    base = ["submit", recipe_path("tiny-cpu"), "--backend", "slurm", "--dry-run", "--set", f"slurm.shared_dir={shared}"]
    missing = shared / "tokens" / "train"
    refused = cli(*base, "--set", f"data.source={missing}")
    assert refused.code == 2
    assert refused.err_lines[-1] == (
        f"data.source: {missing} does not exist under slurm.shared_dir {shared}, which every node mounts"
    )
    elsewhere = tmp_path / "scratch" / "tokens"
    warned = cli(*base, "--set", f"data.source={elsewhere}")
    assert warned.code == 0
    assert (
        f"warning: data.source: {elsewhere} does not exist on this machine; the nodes must have it" in warned.err_lines
    )
    (shared / "tokens").mkdir()
    missing.write_text("")
    assert cli(*base, "--set", f"data.source={missing}").code == 0


def gpu_submit(cli, *sets: str):
    """`launcher submit` of tiny-cpu's model as a GPU job on Slurm, as a dry run."""
    options = [arg for key, value in TINY_GPU.items() for arg in ("--set", f"{key}={value}")]
    return cli("submit", recipe_path("tiny-cpu"), "--backend", "slurm", "--dry-run", *options, *sets)


def test_a_gpu_job_refuses_a_shared_dir_under_home_whose_disk_cannot_hold_its_checkpoints(
    home, fake_bundle, cli, tmp_path, monkeypatch
):
    """ParallelCluster's home is the head node's NFS export; here a real 1 MiB tmpfs under $HOME.
    tiny-cpu's model (869,504 parameters x 12 B = 10.4 MB a checkpoint) keeps 3 checkpoints and
    writes a fourth before it deletes the oldest: 41.7 MB."""
    from tests.disks import small_disk

    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    with small_disk(tmp_path / "user" / "nfs", size="1m") as nfs:
        free = os.statvfs(nfs).f_bavail * os.statvfs(nfs).f_frsize
        shared = nfs / "launcher"
        result = gpu_submit(cli, "--set", f"slurm.shared_dir={shared}")
        assert result.code == 2, result.err
        (line,) = [line for line in result.err_lines if line.startswith("slurm.shared_dir")]
        assert line == (
            f"slurm.shared_dir: {shared} is under the home directory {tmp_path / 'user'}, whose file system has "
            f"{free:,} bytes ({free / 1e6:.1f} MB) free, but this GPU job's checkpoints need 41,736,192 bytes "
            "(4 x 10.4 MB: checkpoint.keep 3 and the one being written); set slurm.shared_dir to a directory on a "
            "file system every node mounts with that room (e.g. FSx for Lustre at /fsx)"
        )
        assert not shared.exists()  # nothing written
        cpu = cli(
            "submit", recipe_path("tiny-cpu"), "--backend", "slurm", "--dry-run", "--set", f"slurm.shared_dir={shared}"
        )
        assert cpu.code == 0, cpu.err  # CPU jobs (tiny-cpu, the tests) are not checked
        keep_none = gpu_submit(
            cli, "--set", f"slurm.shared_dir={shared}", "--set", f"checkpoint.dir={tmp_path / 'fsx'}"
        )
        assert keep_none.code == 0, keep_none.err  # the checkpoints go elsewhere: code and logs fit
    roomy = gpu_submit(cli, "--set", f"slurm.shared_dir={tmp_path / 'user' / 'launcher'}")  # /tmp's disk: room
    assert roomy.code == 0, roomy.err


def test_a_node_that_cannot_see_the_shared_dir_fails_the_job_with_one_line(home, fake_bundle, tmp_path):
    """The script under bash with an `srun` that runs its command here, where the code dir is missing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    srun.chmod(srun.stat().st_mode | stat.S_IXUSR)
    directory = home / "jobs" / "tiny-cpu-job"
    directory.mkdir(parents=True)
    script = tmp_path / "job.sbatch"
    script.write_text(render().text)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1"}
    env["SLURMD_NODENAME"] = "node1"
    result = subprocess.run(["bash", str(script)], cwd=directory, env=env, capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1].startswith(
        f"launcher: node node1 ({os.uname().nodename}) cannot read {directory}/code/resolved.json; "
        f"slurm.shared_dir ({home}) must be mounted at the same path on every node"
    )
    assert (directory / "exit_code").read_text() == "1\n"


def test_a_stopped_job_cancels_itself_after_training_ends_and_is_not_requeued_on_usr1(home, fake_bundle, tmp_path):
    """The script under bash: `launcher stop` marked the job and USR1 came too; once training has
    ended, the script cancels the job instead of requeueing it. Stand-in srun, scancel and scontrol:
    the training task waits for `saved`, as the workers save after SIGTERM."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_ins = {
        "srun": 'while [[ "$1" == --* ]]; do [[ "$1" == --kill-on-bad-exit=1 ]] && training=1; shift; done\n'
        '[[ -z "$training" ]] && exec "$@"\n'
        f"touch {tmp_path}/started; until [[ -e {tmp_path}/saved ]]; do sleep 0.05; done; exit 143\n",
        "scancel": f'echo "scancel $*" >> {tmp_path}/calls\n',
        "scontrol": f'echo "scontrol $*" >> {tmp_path}/calls\n',
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    directory = home / "jobs" / "tiny-cpu-job"
    (directory / "code").mkdir(parents=True)
    (directory / "code" / "resolved.json").write_text("{}")
    (tmp_path / "job.sbatch").write_text(render().text)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1"}
    env["SLURM_CPUS_ON_NODE"] = "1"
    job = subprocess.Popen(
        ["bash", str(tmp_path / "job.sbatch")], cwd=directory, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        wait_for_file(tmp_path / "started", job)
        (directory / "stop_requested").touch()
        job.send_signal(signal.SIGUSR1)
        wait_for_file(tmp_path / "calls", job)  # the USR1 trap's SIGTERM to the training
        (tmp_path / "saved").touch()
        out, _ = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 143, out
    assert (tmp_path / "calls").read_text().splitlines() == ["scancel --signal=TERM 7", "scancel 7"]
    assert "launcher: training stopped by launcher stop; cancelling Slurm job 7" in out
    assert "requeueing" not in out
    assert (directory / "exit_code").read_text() == "143\n"


# A stand-in `enroot import --output FILE URI` as NVIDIA/enroot src/docker.sh (docker::import) does
# it: "File already exists" for an existing FILE, else the image written in place, here in five
# slow pieces, so a job that read the file while another wrote it would see a part.
ENROOT = """[[ "$1 $2" == "import --output" ]] || exit 64
echo "$SLURM_JOB_ID $4" >> {calls}
[[ -z "$ENROOT_REFUSES" ]] || {{ echo '[ERROR] 401 Unauthorized' >&2; exit 1; }}
[[ -e "$3" ]] && {{ echo "[ERROR] File already exists: $3" >&2; exit 1; }}
for piece in 1 2 3 4 5; do printf 'layer%s;' $piece >> "$3"; sleep 0.1; done
"""
# A stand-in srun: the training step copies the image it was given (what pyxis would start);
# any other step runs its command here.
SRUN = """training=''; image=''
while [[ "$1" == --* ]]; do
    [[ "$1" == --kill-on-bad-exit=1 ]] && training=1
    [[ "$1" == --container-image=* ]] && image="${{1#--container-image=}}"
    shift
done
[[ -z "$training" ]] && exec "$@"
cp -- "$image" {seen}/$SLURM_JOB_ID.$$
"""
WHOLE_IMAGE = "layer1;layer2;layer3;layer4;layer5;"


def test_two_jobs_and_a_requeue_import_the_image_once_and_start_only_from_a_whole_file(home, fake_bundle, tmp_path):
    """The script under bash, twice at once and then again (a requeue), with a stand-in enroot."""
    bin_dir, seen = tmp_path / "bin", tmp_path / "seen"
    bin_dir.mkdir(), seen.mkdir()
    for name, body in {"enroot": ENROOT.format(calls=tmp_path / "calls"), "srun": SRUN.format(seen=seen)}.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    directory = home / "jobs" / "tiny-cpu-job"
    (directory / "code").mkdir(parents=True)
    (directory / "code" / "resolved.json").write_text("{}")
    (tmp_path / "job.sbatch").write_text(render(**{"slurm.container_image": NGC}).text)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node1"}
    env["SLURM_CPUS_ON_NODE"] = "1"

    def job(job_id: str, **extra: str) -> subprocess.Popen:
        return subprocess.Popen(
            ["bash", str(tmp_path / "job.sbatch")],
            cwd=directory,
            env={**env, "SLURM_JOB_ID": job_id, **extra},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    first, second = job("7"), job("8")
    assert [p.wait(timeout=60) for p in (first, second)] == [0, 0], [p.communicate() for p in (first, second)]
    requeued = job("7")
    out, err = requeued.communicate(timeout=60)
    assert requeued.returncode == 0, err
    images = home / "images"
    image = images / f"nvcr.io_nvidia_pytorch_25.01-py3-{NGC_NAME_HASH}.sqsh"
    assert sorted(images.iterdir()) == [image] and image.read_text() == WHOLE_IMAGE  # no part left behind
    assert {p.read_text() for p in seen.iterdir()} == {WHOLE_IMAGE} and len(list(seen.iterdir())) == 3
    calls = (tmp_path / "calls").read_text().splitlines()
    assert 1 <= len(calls) <= 2 and all(call.endswith(f" docker://{NGC}") for call in calls)  # not on requeue
    assert "importing" not in out

    image.unlink()
    refused = job("9", ENROOT_REFUSES="1")
    out, err = refused.communicate(timeout=60)
    assert refused.returncode == 1
    assert err.splitlines()[-1].startswith(f"launcher: enroot import of docker://{NGC} failed (its error is above)")
    assert list(images.iterdir()) == [] and len(list(seen.iterdir())) == 3  # no part left, no training started


def wait_for_file(path: Path, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None and time.monotonic() < deadline, f"no {path}; the script exited {process.poll()}"
        time.sleep(0.02)


# --- Slurm's answers ---------------------------------------------------------------------------------


def test_scontrol_fields_parse_with_empty_values_and_colons_in_names():
    fields = parse_scontrol(captured("scontrol-show-job-requeued.txt"))
    assert (fields["JobState"], fields["Reason"], fields["Restarts"], fields["NodeList"]) == (
        "PENDING",
        "BeginTime",
        "1",
        "",
    )
    assert fields["AllocNode:Sid"] == "localhost:20433" and fields["StdOut"] == "/dev/null"


@pytest.mark.parametrize(
    "value, code",
    [("0:0", 0), ("3:0", 3), ("0:15", -15), ("143:0", 143), ("", None)],
)
def test_exit_codes_read_signals_as_negative(value, code):
    assert exit_code_of(value) == code


@pytest.mark.parametrize(
    "capture, state, secondary, exit_code, reason",
    [
        ("pending", "InProgress", "PENDING", None, None),
        ("running", "InProgress", "RUNNING", None, None),
        ("requeued", "InProgress", "PENDING", None, None),
        ("completed", "Completed", "COMPLETED", 0, None),
        ("cancelled", "Stopped", "CANCELLED", -15, None),
        ("failed", "Failed", "FAILED", 3, "Slurm job 4242 ended FAILED (exit code 3:0, NonZeroExitCode)"),
        ("timeout", "Failed", "TIMEOUT", -15, "Slurm job 4242 ran past its time limit (cluster.max_run)"),
    ],
)
def test_status_maps_what_scontrol_says(home, fake_bundle, tools, cli, capture, state, secondary, exit_code, reason):
    tools("sbatch", "4242\n")
    tools("scontrol", captured(f"scontrol-show-job-{capture}.txt"))
    name = json.loads(cli("submit", recipe_path("tiny-cpu"), "--backend", "slurm", "--json").out)["name"]
    status = json.loads(cli("status", name, "--json").out)
    assert (status["state"], status["secondary"], status["exit_code"]) == (state, secondary, exit_code)
    assert (status["failure_reason"] or "").split("; see ")[0] == (reason or "")
    assert ("nodes" in status["details"]) == (capture not in ("pending", "requeued"))  # none while waiting
    assert tools.calls("scontrol")[0]["argv"] == ["--oneliner", "show", "job", "4242"]


@pytest.mark.parametrize(
    "exit_file, stop_requested, state, exit_code",
    [
        ("0\n", False, "Completed", 0),
        ("1\n", False, "Failed", 1),
        ("143\n", True, "Stopped", 143),
        (None, False, "Failed", None),
    ],
)
def test_a_job_slurm_forgot_reads_its_exit_file(
    home, fake_bundle, tools, cli, exit_file, stop_requested, state, exit_code
):
    """After MinJobAge (300 s) scontrol no longer knows a job; no accounting database is assumed."""
    tools("sbatch", "4242\n")
    name = json.loads(cli("submit", recipe_path("tiny-cpu"), "--backend", "slurm", "--json").out)["name"]
    failing_tool(tools, "scontrol", captured("scontrol-show-job-unknown.stderr"))
    directory = home / "jobs" / name
    if exit_file is not None:
        (directory / "exit_code").write_text(exit_file)
    if stop_requested:
        (directory / "stop_requested").touch()
    status = json.loads(cli("status", name, "--json").out)
    assert (status["state"], status["exit_code"]) == (state, exit_code), status
    if exit_file is None:
        assert status["failure_reason"].startswith("Slurm no longer knows job 4242 and the job left no exit code")


def scontrol_until_cancelled(tools, tmp_path, before: str, *, cancelled_by: list[str]) -> None:
    """A stand-in scontrol that shows job 4242 (as submitted) `before` until scancel has got
    `cancelled_by`, CANCELLED after."""
    tools("scancel")
    tools("scontrol")
    scontrol = Path(os.environ["PATH"].split(os.pathsep)[0]) / "scontrol"
    answers = [
        captured(f"scontrol-show-job-{state}.txt").replace("JobName=wrap", "JobName=tiny-cpu-job")
        for state in (before, "cancelled")
    ]
    calls = str(tmp_path / "scancel.calls")
    cancelled = (
        f"import os; cancelled = os.path.exists({calls!r}) and any(json.loads(line)['argv'] == {cancelled_by!r} "
        f"for line in open({calls!r})); sys.stdout.write({answers[1]!r} if cancelled else {answers[0]!r})"
    )
    scontrol.write_text(scontrol.read_text().replace("sys.stdout.write('')", cancelled))


def test_logs_read_the_shared_log_and_stop_signals_the_training_before_cancelling(
    home, fake_bundle, tools, cli, tmp_path, fixed_names
):
    """The job ends on the SIGTERM to its steps (the script then cancels itself): no scancel follows."""
    tools("sbatch", "4242\n")
    scontrol_until_cancelled(tools, tmp_path, "running", cancelled_by=["--signal=TERM", "4242"])
    name = json.loads(cli("submit", recipe_path("tiny-cpu"), "--backend", "slurm", "--json").out)["name"]
    (home / "jobs" / name / "slurm-4242.out").write_text("metrics step=1 loss=2\nsummary steps=1")
    assert cli("logs", name).out.splitlines() == ["metrics step=1 loss=2", "summary steps=1"]
    assert json.loads(cli("status", name, "--json").out)["state"] == "InProgress"
    stopped = cli("stop", name)
    assert stopped.out.startswith(f"{name}  [slurm]  Stopped (CANCELLED)"), stopped.out
    assert [call["argv"] for call in tools.calls("scancel")] == [["--signal=TERM", "4242"]]
    assert (home / "jobs" / name / "stop_requested").exists()
    assert cli("stop", name).out.startswith(f"{name}  [slurm]  Stopped (CANCELLED)")  # over: nothing more is sent
    assert len(tools.calls("scancel")) == 1


@pytest.mark.parametrize(
    "state, argvs",
    [
        ("running", [["--signal=TERM", "4242"], ["4242"]]),  # still running after its stop grace
        ("pending", [["4242"]]),  # no steps to signal yet
    ],
)
def test_a_job_that_outlasts_its_stop_grace_or_has_not_started_is_cancelled(
    home, fake_bundle, tools, cli, tmp_path, fixed_names, state, argvs
):
    tools("sbatch", "4242\n")
    scontrol_until_cancelled(tools, tmp_path, state, cancelled_by=["4242"])
    submitted = cli("submit", recipe_path("tiny-cpu"), "--backend", "slurm", "--json", "--set", "cluster.stop_grace=1s")
    name = json.loads(submitted.out)["name"]
    stopped = cli("stop", name, "--grace", "0")
    assert stopped.out.startswith(f"{name}  [slurm]  Stopped (CANCELLED)"), stopped.out
    assert [call["argv"] for call in tools.calls("scancel")] == argvs


@pytest.mark.parametrize(
    "native_id, says",
    [
        ("4242", "Slurm job 4242 is named 'wrap', not 'tiny-cpu-job' (the record in"),  # another job of the user's
        ("--user=root", "its Slurm job id '--user=root' is not a number"),  # an option for scancel
    ],
)
def test_stop_of_a_record_naming_another_slurm_job_cancels_nothing(
    home, fake_bundle, tools, cli, fixed_names, native_id, says
):
    tools("sbatch", "4242\n")
    tools("scancel")
    tools("scontrol", captured("scontrol-show-job-running.txt"))  # job 4242 is someone else's: JobName=wrap
    name = json.loads(cli("submit", recipe_path("tiny-cpu"), "--backend", "slurm", "--json").out)["name"]
    record = home / "jobs" / name / "job.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "native_id": native_id}))
    stopped = cli("stop", name)
    (line,) = stopped.err_lines
    assert (
        stopped.code == 1 and line.startswith(f"not stopping {name}: {says}") and line.endswith("nothing was cancelled")
    )
    assert tools.calls("scancel") == []


# --- one line when Slurm is missing or refuses ---------------------------------------------------------


@pytest.mark.parametrize("verb", [("list", "--backend", "slurm"), ("status", "4242", "--backend", "slurm")])
def test_without_slurms_tools_list_and_status_say_so_in_one_line(home, cli, monkeypatch, tmp_path, verb):
    monkeypatch.setenv("PATH", str(tmp_path))
    result = cli(*verb)
    assert result.code == 3  # an engine error
    (line,) = result.err_lines
    assert "` is not installed here (not on PATH)" in line and ("`squeue`" in line or "`scontrol`" in line)


def test_sbatch_refusing_shows_slurms_own_message(home, fake_bundle, tools, cli):
    failing_tool(tools, "sbatch", captured("sbatch-bad-partition.stderr"))
    result = cli("submit", recipe_path("tiny-cpu"), "--backend", "slurm", "--set", "slurm.partition=nosuch")
    assert result.code == 3  # an engine error
    assert result.err_lines[-1].endswith(
        "sbatch failed: sbatch: error: invalid partition specified: nosuch "
        "sbatch: error: Batch job submission failed: Invalid partition name specified"
    )


def test_a_job_name_not_submitted_from_here_asks_for_the_job_id(home, cli):
    result = cli("status", "someone-elses-job", "--backend", "slurm")
    assert result.code == 2
    assert result.err_lines == [
        "someone-elses-job was not submitted from here, so its Slurm job id is unknown; "
        "pass the job id instead (launcher status JOBID --backend slurm)"
    ]


def test_states_while_a_stop_is_pending_read_stopping():
    assert state_of("RUNNING", stop_requested=True) == "Stopping"
    assert state_of("FAILED", stop_requested=True) == "Stopped"


def test_a_damaged_spec_of_a_slurm_job_is_one_line_naming_it(home, fake_bundle, tools, cli):
    """status reads the job's directory from its saved spec: a cut-off or foreign spec.json is a
    line naming the file, not a traceback."""
    tools("sbatch", "4242\n")
    tools("scontrol", captured("scontrol-show-job-completed.txt"))
    name = json.loads(cli("submit", recipe_path("tiny-cpu"), "--backend", "slurm", "--json").out)["name"]
    path = home / "jobs" / name / "spec.json"
    whole = path.read_text()
    path.write_text(whole[: len(whole) // 2])
    result = cli("status", name)
    assert result.code == 2 and result.err_lines[0].startswith(f"{path}: damaged job spec: "), result.err
    assert len(result.err_lines) == 1 and "Traceback" not in result.err
    path.write_text(json.dumps({**json.loads(whole), "format": 3}))
    result = cli("status", name)
    assert result.code == 2 and result.err_lines == [
        f"{path}: job spec format 3 is not one this launcher reads (1 or 2); "
        "use the launcher version that submitted the job"
    ], result.err

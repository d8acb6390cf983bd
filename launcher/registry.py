"""The job registry under $LAUNCHER_HOME (default ~/.launcher): where jobs live and what is kept.

Every submitted job, on any backend, gets `jobs/<name>/` with `job.json` (its `JobRef`: which
backend and region to ask), `spec.json` and `resolved.json`; the local backend also keeps its
logs, status and metrics there. This module sits below the backends, which write and read it;
the `Job` handle above them (`launcher.jobs`) finds jobs through it.

Everything here is read back from disk, so nothing is trusted until checked: names are names
(never a path, so no path built from one leaves its root), and a state file that is missing a
key, holds the wrong type, is not JSON or is not a file at all is one `DamagedRecord` line that
names it. Every write goes to a temporary file first and is renamed into place, and the
temporary file never outlives a failed write.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO

from launcher.contract.regular_files import NotRegularFile, open_regular_file
from launcher.errors import LauncherError, UsageError
from launcher.spec import JOB_NAME_RE, JobSpec, Placement

RECORD = "job.json"
SPEC = "spec.json"
MAX_STATE_BYTES = 16 * 1024 * 1024
"""No state file the launcher writes comes near this; a bigger one is not one of them."""
NAME_RULE = "1 to 63 letters, digits and hyphens, starting and ending with a letter or digit"


class DamagedRecord(UsageError):
    """A state file that cannot be what it should be: exit 2, one line naming the file."""


class NoSuchJob(UsageError):
    """The backend has no job of that name (as opposed to: it could not be asked)."""


class DiskError(LauncherError):
    """A state file could not be written: the disk is full, read-only, or not ours."""


@dataclass(frozen=True, kw_only=True)
class JobRef:
    """Enough to find a job again: what `launcher status NAME` reads from the job registry."""

    name: str
    backend: str
    region: str | None = None
    native_id: str | None = None
    """The engine's own id where it differs from the name (a Slurm job id)."""
    created: str | None = None
    submitting: dict[str, Any] | None = None
    """While `submit` has not heard back from the backend: the submitting process (pid, start
    time, host), so that a record whose submit died is told from one still under way."""
    predicted: dict[str, float] | None = None
    """The planner's speed for this job's layout, settled at submit (`PREDICTED_KEYS`: tokens/s per
    GPU, MFU; no MFU on host CPUs), which status compares with the live metrics; None where nothing
    predicts it (a GPU without datasheet peaks)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- names and the paths built from them -------------------------------------------------------


def check_name(value: object, what: str = "job name") -> str:
    """`value` if it is a name as every backend makes them (SageMaker's TrainingJobName pattern);
    otherwise one line saying what a name is. A name holds no `/` or `.`, so it is never a path."""
    if not isinstance(value, str) or not JOB_NAME_RE.fullmatch(value):
        raise UsageError(f"{what} {value!r} is not a job name: a name is {NAME_RULE}")
    return value


def inside(root: Path, name: object, what: str = "job name") -> Path:
    """`root/name`, once `name` is a name and the path (symlinks followed) stays under `root`."""
    path = root / check_name(name, what)
    if not path.resolve().is_relative_to(root.resolve()):
        raise UsageError(f"{what} {name}: {path} leads outside {root} (a link); move it back under {root}")
    return path


def launcher_home() -> Path:
    return Path(os.environ.get("LAUNCHER_HOME") or "~/.launcher").expanduser()


def jobs_root() -> Path:
    return launcher_home() / "jobs"


def job_dir(name: str) -> Path:
    return inside(jobs_root(), name)


def checkpoint_home(recipe, lineage: str, root: Path | None = None) -> Path:
    """The recipe's checkpoint.dir, or `<root>/checkpoints/<recipe>/<lineage>`: one directory per
    lineage, so a `--resume` finds the earlier job's checkpoints and two fresh runs never mix."""
    if recipe.checkpoint.dir:
        return Path(recipe.checkpoint.dir)
    return inside(
        (root or launcher_home()) / "checkpoints" / check_name(recipe.name, "recipe name"), lineage, "lineage"
    )


def job_dir_placement(recipe, name: str, lineage: str | None = None) -> Placement:
    """Outputs in the job directory, checkpoints per lineage: for backends whose processes see
    this machine's files (local)."""
    checkpoints = checkpoint_home(recipe, lineage or name)
    return Placement(checkpoint_dir=str(checkpoints), output_dir=str(job_dir(name)))


# --- reading and writing state files -------------------------------------------------------------

_ERRNO_WORDS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
}


def os_error_line(error: OSError, action: str, path: object = None) -> str:
    """'disk full writing /x/status.json (ENOSPC)': what failed, where, and the errno's name."""
    code = errno.errorcode.get(error.errno or 0, "")
    what = _ERRNO_WORDS.get(error.errno or 0) or (error.strerror or str(error)).lower()
    where = path if path is not None else (error.filename or "")
    return f"{what} {action} {where}".rstrip() + (f" ({code})" if code else "")


def write_json(path: Path, data: Any) -> None:
    """Write so that readers never see half a file: to a temporary name, then rename. A failed
    write removes its temporary file and is one DiskError line naming `path` and the errno."""
    text = json.dumps(data, indent=2) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_orphans(path)
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    except OSError as error:
        raise DiskError(os_error_line(error, "writing", path)) from None
    try:
        with os.fdopen(descriptor, "w") as file:
            os.fchmod(file.fileno(), 0o644)
            file.write(text)
            file.flush()
            os.fsync(file.fileno())  # a full disk may only say so here, not at write()
        os.replace(temporary, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(error, OSError):
            raise DiskError(os_error_line(error, "writing", path)) from None
        raise


def _remove_orphans(path: Path) -> None:
    """Remove the temporary files of earlier writers of `path` that died mid-write (killed): each
    is named `.<file>.<writer's pid>.<random>.tmp`, and one whose pid is gone has no writer left."""
    for orphan in path.parent.glob(f".{path.name}.*.tmp"):
        pid = orphan.name.removeprefix(f".{path.name}.").split(".")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                orphan.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: alive
    return True


def json_type(value: object) -> str:
    if isinstance(value, bool):
        return "true/false"
    names = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def open_regular(path: Path, what: str) -> BinaryIO | None:
    """`path` opened to read, or None when there is no such file. A directory, FIFO or device in
    the file's place is a DamagedRecord naming it (launcher.contract.failure.open_regular_file)."""
    try:
        return open_regular_file(path)
    except FileNotFoundError:
        return None
    except NotRegularFile as error:
        raise DamagedRecord(f"{path}: damaged {what}: it is {error.shape}, not a file; move it away") from None
    except OSError as error:
        raise DamagedRecord(f"{path}: unreadable {what}: {os_error_line(error, 'reading', path)}") from None


def read_json(path: Path, what: str) -> Any:
    """The JSON value in `path`, or None when there is no such file. Anything else that is not a
    JSON file (a directory, a FIFO, binary bytes, a cut-off write) is a DamagedRecord naming it."""
    file = open_regular(path, what)
    if file is None:
        return None
    with file:
        try:
            raw = file.read(MAX_STATE_BYTES + 1)
        except OSError as error:
            raise DamagedRecord(f"{path}: unreadable {what}: {os_error_line(error, 'reading', path)}") from None
    return parse_json(raw, path, what)


def parse_json(raw: bytes, path: Path, what: str) -> Any:
    def damaged(problem: str) -> DamagedRecord:
        return DamagedRecord(f"{path}: damaged {what}: {problem}")

    if len(raw) > MAX_STATE_BYTES:
        raise damaged(f"larger than {MAX_STATE_BYTES} bytes")
    if not raw.strip():
        raise damaged(f"empty ({len(raw)} bytes)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise damaged(f"not text (a byte that is not UTF-8 at offset {error.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        cut = " (cut off)" if error.pos >= len(text.rstrip()) else ""
        raise damaged(f"not JSON{cut}: {error.msg} at line {error.lineno} column {error.colno}") from None
    except RecursionError:
        raise damaged("not JSON: nested too deeply") from None


def checked_object(data: Any, path: Path, what: str, types: dict[str, tuple[type, ...]], required=()) -> dict:
    """`data` once it is a JSON object whose keys in `types` hold those types and `required` keys
    are present; keys it does not know are left alone (a newer launcher may add some)."""
    if not isinstance(data, dict):
        raise DamagedRecord(f"{path}: damaged {what}: {json_type(data)} where an object is expected")
    missing = [key for key in required if key not in data]
    if missing:
        raise DamagedRecord(f"{path}: damaged {what}: no {', '.join(missing)}")
    for key, allowed in types.items():
        value = data.get(key)
        if key in data and not (isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)):
            expected = " or ".join(sorted({json_type(t()) if t is not type(None) else "null" for t in allowed}))
            raise DamagedRecord(f"{path}: damaged {what}: {key} is {json_type(value)}, not {expected}")
    return data


# --- the records -------------------------------------------------------------------------------

_OPTIONAL_TEXT = (str, type(None))
_REF_TYPES = {f.name: _OPTIONAL_TEXT for f in fields(JobRef)} | {
    "name": (str,),
    "backend": (str,),
    "submitting": (dict, type(None)),
    "predicted": (dict, type(None)),
}
PREDICTED_KEYS = ("tokens_per_s_per_gpu", "mfu")
OPTIONAL_PREDICTED_KEYS = ("mfu",)  # no MFU is predicted on host CPUs


def save(ref: JobRef, spec: JobSpec) -> Path:
    """The record first: a submit that dies after it leaves a record `list --clean` can see."""
    directory = job_dir(ref.name)
    write_json(directory / RECORD, ref.to_dict())
    write_json(directory / SPEC, spec.to_dict())
    try:
        (directory / "resolved.json").write_text(spec.resolved_json)
    except OSError as error:
        raise DiskError(os_error_line(error, "writing", directory / "resolved.json")) from None
    return directory


def forget(name: str) -> None:
    """Remove a job's record (what `save` wrote); the directory goes too if nothing else is in it."""
    directory = job_dir(name)
    for file in (RECORD, SPEC, "resolved.json"):
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            (directory / file).unlink()
    try:
        directory.rmdir()
    except OSError:
        pass  # the backend's own files (a local job's code) stay where it put them


def discard(name: str) -> None:
    """Remove a job's whole directory: only for a record whose submit never reached the backend
    (nothing of a running job is in it)."""
    directory = job_dir(name)
    try:
        shutil.rmtree(directory)
    except FileNotFoundError:
        pass
    except OSError as error:
        raise DiskError(os_error_line(error, "removing", directory)) from None


def load(name: str) -> JobRef | None:
    """The record of job `name`, None when there is none; a DamagedRecord when it is not one."""
    path = job_dir(name) / RECORD
    data = read_json(path, "job record")
    if data is None:
        return None
    data = checked_object(data, path, "job record", _REF_TYPES, ("name", "backend"))
    if data["name"] != name:
        raise DamagedRecord(f"{path}: damaged job record: it names job {data['name']!r}, not {name}")
    _check_prediction(data.get("predicted"), path)
    return JobRef(**{key: data.get(key) for key in _REF_TYPES})


def _check_prediction(predicted: dict | None, path: Path) -> None:
    """A record's `predicted` holds a positive finite number under each of PREDICTED_KEYS (those of
    OPTIONAL_PREDICTED_KEYS where present)."""
    for key in PREDICTED_KEYS if predicted is not None else ():
        if key in OPTIONAL_PREDICTED_KEYS and key not in predicted:
            continue
        value = predicted.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            found = json_type(value) if key in predicted else "missing"
        elif 0 < value < math.inf:
            continue
        else:
            found = repr(value)
        raise DamagedRecord(f"{path}: damaged job record: predicted.{key} is {found}, not a positive number")


def lineage_of(name: str, recipe_name: str) -> str:
    """The checkpoint lineage that a `--resume NAME` of recipe `recipe_name` continues."""
    path = inside(jobs_root(), name, "--resume") / SPEC
    spec = read_json(path, "job spec")
    if spec is None:
        raise UsageError(f"--resume: no job {name} under {jobs_root()}; name a job submitted from here (launcher list)")
    types = {"recipe_name": (str,), "name": (str,), "lineage": _OPTIONAL_TEXT}
    spec = checked_object(spec, path, "job spec", types, ("recipe_name", "name"))
    if spec["recipe_name"] != recipe_name:
        raise UsageError(
            f"--resume: {name} ran recipe {spec['recipe_name']}, not {recipe_name}; resume a job of the same recipe"
        )
    return check_name(spec.get("lineage") or spec["name"], f"{path}: lineage")


@dataclass(frozen=True)
class Scan:
    """Every record under jobs/, newest first, and one DamagedRecord per record that is not one."""

    refs: list[JobRef]
    damaged: list[LauncherError]


def scan() -> Scan:
    root = jobs_root()
    try:
        entries = sorted(root.iterdir()) if root.exists() else []
    except OSError as error:
        return Scan([], [DamagedRecord(f"{root}: {os_error_line(error, 'listing', root)}")])
    refs, damaged = [], []
    for entry in entries:
        if not os.path.lexists(entry / RECORD):
            continue
        try:
            ref = load(entry.name)
        except UsageError as error:  # a damaged record, or a directory whose name is no job's
            damaged.append(error if isinstance(error, DamagedRecord) else DamagedRecord(f"{entry}: {error}"))
            continue
        if ref is not None:
            refs.append(ref)
    return Scan(sorted(refs, key=lambda r: r.created or "", reverse=True), damaged)


def records() -> list[JobRef]:
    """The readable records, newest first (`scan` also says which ones are damaged)."""
    return scan().refs

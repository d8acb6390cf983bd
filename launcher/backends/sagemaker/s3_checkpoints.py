"""The newest complete checkpoint under a SageMaker job's checkpoint prefix, read from S3 at submit.

Both ways a SageMaker job's checkpoints reach S3 keep the directory's layout under the prefix:
CheckpointConfig copies /opt/ml/checkpoints file by file ("Use checkpoints in Amazon SageMaker
AI", SageMaker developer guide), and the per-host copy (entrypoints/checkpoint_mirror.py) writes
`<prefix>/step-NNNNNNNN/<file>`. So the contract's rule reads S3 as it reads a directory
(launcher/contract/checkpoint_dirs.py): a step counts once every host's COMPLETE marker is
there. Two kinds of ListObjectsV2 call: the step "directories" (Delimiter "/"), then the
markers of each step, newest first, until one is complete. Keys come from the network: only
names that match the contract's patterns count.
"""

from __future__ import annotations

from launcher.backends.sagemaker import aws
from launcher.contract.checkpoint_dirs import STEP_DIR, has_every_marker, step_dir_name


def newest_complete_step(uri: str, region: str, owner: str | None) -> int | None:
    """The step of the newest complete checkpoint under `uri`; None: none.
    `owner`: the account that must own the bucket (ExpectedBucketOwner), for the default bucket."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    prefix = prefix.rstrip("/")
    owner_args = {"ExpectedBucketOwner": owner} if owner else {}
    try:
        s3 = aws.client("s3", region)
        steps = _steps(s3, bucket, prefix, owner_args)
        for step in sorted(steps, reverse=True):
            names = _names(s3, bucket, f"{prefix}/{step_dir_name(step)}/COMPLETE.", owner_args)
            if has_every_marker(names):
                return step
    except Exception as error:
        raise aws.explain(error, action=f"ListObjectsV2 (S3) of {uri}", region=region) from None
    return None


def _steps(s3, bucket: str, prefix: str, owner_args: dict) -> set[int]:
    steps = set()
    pages = s3.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"{prefix}/", Delimiter="/", **owner_args
    )
    for page in pages:
        for common in page.get("CommonPrefixes") or ():
            match = STEP_DIR.match(str(common.get("Prefix", "")).rstrip("/").rsplit("/", 1)[-1])
            if match:
                steps.add(int(match.group(1)))
    return steps


def _names(s3, bucket: str, prefix: str, owner_args: dict) -> list[str]:
    names = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, **owner_args):
        names += [str(item.get("Key", "")).rsplit("/", 1)[-1] for item in page.get("Contents") or ()]
    return names

"""SageMaker answers made with botocore's Stubber: a described job, and a client stubbed in place.

botocore's Stubber checks each stubbed call's parameters and responses against the same
service model the real client uses.
"""

from __future__ import annotations

import datetime

from botocore.stub import Stubber

from launcher.backends.sagemaker import aws as aws_clients

from .helpers import REGION

NAME = "llama3-8b-8k-20261109-153012-345-abcd"
T0 = datetime.datetime(2026, 11, 9, 15, 30, tzinfo=datetime.UTC)


def description(state: str, secondary: str, *, transitions=(), failure: str | None = None, count: int = 1) -> dict:
    d = {
        "TrainingJobName": NAME,
        "TrainingJobArn": f"arn:aws:sagemaker:{REGION}:111122223333:training-job/{NAME}",
        "TrainingJobStatus": state,
        "SecondaryStatus": secondary,
        "AlgorithmSpecification": {"TrainingInputMode": "File", "TrainingImage": "img"},
        "ResourceConfig": {"InstanceType": "ml.p5.48xlarge", "InstanceCount": count, "VolumeSizeInGB": 500},
        "StoppingCondition": {"MaxRuntimeInSeconds": 3600},
        "CreationTime": T0,
        "ModelArtifacts": {"S3ModelArtifacts": "s3://b/out/model.tar.gz"},
        "SecondaryStatusTransitions": [
            {"Status": s, "StartTime": T0 + datetime.timedelta(minutes=i), "StatusMessage": m}
            for i, (s, m) in enumerate(transitions)
        ],
    }
    if failure:
        d["FailureReason"] = failure
    return d


def stub(service: str) -> Stubber:
    stubber = Stubber(aws_clients.client(service, REGION))
    stubber.activate()
    return stubber

"""kubectl for the Kubernetes backend: every failure becomes one line that says what to do.

kubectl repeats a failed API discovery once per attempt as klog records (`E1130 07:57:01.79
24657 memcache.go:265] "Unhandled Error" err="..."`) before its own message; the user needs
that message once, with the step that fixes it (a kubeconfig, a context, the training operator).
"""

from __future__ import annotations

import re

from launcher.backends.base import EngineUnavailable
from launcher.backends.tools import ToolFailed, run_tool
from launcher.errors import EngineError, UsageError

# A klog header and its structured record: `E1130 07:57:01.792858   24657 file.go:265] "msg" k="v" ...`
_KLOG_RECORD = re.compile(
    r'[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ [\w.-]+:\d+\] "(?:[^"\\]|\\.)*"(?: \w+="(?:[^"\\]|\\.)*")*\s*'
)
_KLOG_ERR = re.compile(r'err="((?:[^"\\]|\\.)*)"')
NO_CLUSTER = "set KUBECONFIG to your cluster's kubeconfig or pick a context (kubectl config use-context NAME)"
# (pattern in kubectl's message, what to do)
ADVICE = (
    (re.compile(r"refused|no such host|Unable to connect|current-context|no configuration|dial tcp|i/o timeout"), NO_CLUSTER),
    (re.compile(r"Unauthorized|must be logged in|provide credentials|token has expired"),
     "refresh your cluster credentials (for EKS: aws eks update-kubeconfig --name CLUSTER)"),
    (re.compile(r"[Ff]orbidden"), "ask your cluster admin for these rights in the namespace"),
    (re.compile(r"""doesn't have a resource type "pytorchjobs?"|no matches for kind "PyTorchJob\""""),
     "install the Kubeflow training operator (v1.9: it serves the PyTorchJob kind) on the cluster"),
)  # fmt: skip


class KubectlFailed(EngineError):
    def __init__(self, message: str, detail: str):
        super().__init__(message)
        self.detail = detail

    @property
    def not_found(self) -> bool:
        return "(NotFound)" in self.detail or " not found" in self.detail


def first_message(output: str) -> str:
    """kubectl's own message without the repeated klog records (or the first record's error)."""
    text = _KLOG_RECORD.sub("", output).strip()
    if text:
        return text
    found = _KLOG_ERR.search(output)
    return found.group(1).replace('\\"', '"') if found else output.strip()


def advice(message: str) -> str | None:
    return next((what for pattern, what in ADVICE if pattern.search(message)), None)


def kubectl(args: list[str], *, action: str, namespace: str | None = None, input: str | None = None) -> str:
    """stdout of `kubectl [-n NAMESPACE] ARGS`; a failure is one line: the action, kubectl's message, the fix."""
    argv = ["kubectl", *(["--namespace", namespace] if namespace else []), *args]
    try:
        return run_tool(argv, action=action, input=input)
    except ToolFailed as failure:
        message = first_message(failure.output)
        fix = advice(message)
        line = f"{action}: kubectl failed: {message}" + (f"; {fix}" if fix else "")
        error = EngineUnavailable(line) if fix == NO_CLUSTER else KubectlFailed(line, message)
        raise error from None


def current_namespace() -> str:
    """The namespace kubectl uses when none is given (its context's, else `default`)."""
    out = kubectl(["config", "view", "--minify", "--output", "jsonpath={..namespace}"], action="finding the namespace")
    return out.strip() or "default"


def missing(kind: str, name: str, namespace: str | None) -> UsageError:
    where = f"namespace {namespace}" if namespace else "kubectl's current namespace"
    return UsageError(f"no {kind} named {name} in {where}; `launcher list --backend k8s` lists the jobs there")

"""The exit-code table on Kubernetes, declared once and derived from `errors.RETRY`.

Each `Retry` answer maps to what a Job's podFailurePolicy does with a pod that exited with
such a code; the codes themselves come from `errors.ExitCode` and `errors.RETRY`, never
from a list here:

| Retry   | Job podFailurePolicy action | why |
|---------|-----------------------------|-----|
| NEVER   | FailJob | permanent (gave up, bad configuration): fail the Job, and the JobSet |
| NODE    | Count   | transient: recreate the pod (its agent rejoins); counts toward backoffLimit |
| REPLACE | Count   | this machine is bad: the recreated pod may land elsewhere; counts too |
| SIGNAL  | Ignore  | it was told to stop or leave (deletion, eviction, drain): recreate it, never counting |
| NONE    | (none)  | success: no rule; the job's training finished (`JOB_SUCCESS_POLICY`) |

A first rule ignores any pod with the `DisruptionTarget` condition (preemption, eviction,
node drain, deletion by the taint manager), whatever its exit code. An exit code in no rule
(a SIGKILL'd agent's 137, say) is Kubernetes' default: it counts toward backoffLimit.

The JobSet's failurePolicy then tells the two Job failures apart: a Job failed by a FailJob
rule (reason `PodFailurePolicy`) fails the JobSet at once; any other Job failure
(`BackoffLimitExceeded`) restarts the whole JobSet, up to `maxRestarts`. The JobSet keeps its
UID across restarts, so the agents keep their `--rdzv-id` and continue from the checkpoint.
"""

from __future__ import annotations

import ast
import inspect
import re

from unbroken import errors
from unbroken.errors import RETRY, ExitCode, Retry
from unbroken.k8s.spec import K8sSpec

FAIL_JOB, COUNT, IGNORE = "FailJob", "Count", "Ignore"

JOB_ACTION: dict[Retry, str | None] = {
    Retry.NEVER: FAIL_JOB,
    Retry.NODE: COUNT,
    Retry.REPLACE: COUNT,
    Retry.SIGNAL: IGNORE,
    Retry.NONE: None,  # success: no rule
}
"""The podFailurePolicy action for each `Retry` answer (None: success, no rule)."""

RULE_ORDER = (IGNORE, FAIL_JOB, COUNT)
"""The order of the exit-code rules, after the DisruptionTarget rule (the first rule that
matches a failed pod decides; the code sets are disjoint, so the order is for reading)."""

JOBSET_CONSEQUENCE: dict[str | None, str] = {
    None: "the training finished: the Job succeeds on this pod (`successPolicy` "
          "succeededCount 1, its other pods are ended), and the JobSet with the `node` Job",
    FAIL_JOB: "fails at once: the Job fails with reason PodFailurePolicy, which the rule "
              "`permanent` turns into FailJobSet",
    COUNT: "none while the Job's backoffLimit lasts (the pod is recreated for its index); past "
           "it the Job fails (BackoffLimitExceeded) and the JobSet restarts, up to maxRestarts",
    IGNORE: "none: the pod is recreated for its index, and never uses up backoffLimit",
}
"""What each Job action means for the whole JobSet."""

JOB_SUCCESS_POLICY: dict = {"rules": [{"succeededCount": 1}]}
"""Each Job succeeds on its first pod that exits 0, and the Job controller then ends its
other pods. Exit 0 means that the job's training finished, whichever node says it (a drained
or quarantined node has codes of its own): so a pod recreated after the end, which would
wait for a job that is gone, never holds the JobSet open. Needs Kubernetes 1.31 (the Job
success policy is beta there, on by default; GA in 1.33)."""

PERMANENT_RULE = "permanent"
POD_FAILURE_POLICY_REASON = "PodFailurePolicy"  # batch/v1 JobReasonPodFailurePolicy
DISRUPTION_TARGET = "DisruptionTarget"


def job_action(code: ExitCode) -> str | None:
    """The podFailurePolicy action for a pod whose container exited with `code`."""
    return JOB_ACTION[RETRY[code]]


def codes_for(action: str) -> list[int]:
    """Every exit code whose action is `action`, sorted (Kubernetes wants them ordered)."""
    return sorted(int(code) for code in ExitCode if job_action(code) == action)


def pod_failure_rules(container: str) -> list[dict]:
    """The Job's podFailurePolicy rules for pods whose agent runs in `container`."""
    rules: list[dict] = [{"action": IGNORE,
                          "onPodConditions": [{"type": DISRUPTION_TARGET, "status": "True"}]}]
    for action in RULE_ORDER:
        if codes := codes_for(action):
            rules.append({"action": action,
                          "onExitCodes": {"containerName": container, "operator": "In",
                                          "values": codes}})
    return rules


def jobset_failure_policy(spec: K8sSpec) -> dict:
    """The JobSet's failurePolicy: a permanent failure fails it, any other Job failure
    restarts it, at most `spec.max_restarts` times."""
    return {"maxRestarts": spec.max_restarts,
            "rules": [{"name": PERMANENT_RULE, "action": "FailJobSet",
                       "onJobFailureReasons": [POD_FAILURE_POLICY_REASON]}]}


def member_docs() -> dict[ExitCode, str]:
    """Each ExitCode member's docstring (the string under it in errors.py), read from the
    source: Python keeps no docstring of an enum member."""
    tree = ast.parse(inspect.getsource(errors))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ExitCode"]
    docs = {}
    for node, doc in zip(cls.body, cls.body[1:], strict=False):
        if (isinstance(node, ast.Assign) and isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            docs[ExitCode[node.targets[0].id]] = " ".join(doc.value.value.split())
    return docs


def first_sentence(text: str) -> str:
    """Up to and including the first full stop that ends a sentence."""
    match = re.search(r"\.(\s|$)", text)
    return text[:match.start() + 1] if match else text


def markdown_table() -> str:
    """The exit-code table of docs/kubernetes.md: code, name, meaning, Job action, JobSet
    consequence (a unit test checks the document holds exactly this)."""
    docs = member_docs()
    lines = ["| code | name | what it means | Job action | JobSet consequence |",
             "|---|---|---|---|---|"]
    for code in sorted(ExitCode):
        action = job_action(code)
        cells = [str(int(code)), f"`{code.name}`", first_sentence(docs[code]),
                 f"`{action}`" if action else "none (success)", JOBSET_CONSEQUENCE[action]]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"

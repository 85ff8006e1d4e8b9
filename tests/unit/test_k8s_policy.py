"""The exit-code table on Kubernetes (`unbroken.k8s.policy`) is derived from `errors.RETRY`,
and docs/kubernetes.md holds it exactly (as tests/unit/test_exit_codes.py checks
docs/troubleshoot.md's)."""

from __future__ import annotations

import re
from pathlib import Path

from unbroken import errors
from unbroken.errors import RETRY, ExitCode, Retry
from unbroken.k8s import policy
from unbroken.k8s.spec import K8sSpec

DOC = Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md"
START, END = "<!-- exit-code-table:start -->\n", "<!-- exit-code-table:end -->"


def test_the_doc_holds_the_table_markdown_table_makes():
    text = DOC.read_text()
    assert text.count(START) == 1 and text.count(END) == 1
    held = text[text.index(START) + len(START):text.index(END)]
    assert held == policy.markdown_table(), (
        "docs/kubernetes.md's exit-code table is stale: paste policy.markdown_table() between "
        "its markers (.venv/bin/python -c 'from unbroken.k8s.policy import markdown_table; "
        "print(markdown_table(), end=\"\")')")


def test_the_table_has_a_row_per_code_with_its_job_action():
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| [^|]+ \| ([^|]+) \| [^|]+ \|$",
                      policy.markdown_table(), re.M)
    assert [(int(c), n) for c, n, _ in rows] == [(int(c), c.name) for c in sorted(ExitCode)]
    for code, _, action in rows:
        expected = policy.job_action(ExitCode(int(code)))
        assert action == (f"`{expected}`" if expected else "none (success)")


def test_every_retry_answer_has_an_action_and_every_action_a_consequence():
    assert set(policy.JOB_ACTION) == set(Retry)
    assert set(policy.JOBSET_CONSEQUENCE) == set(policy.JOB_ACTION.values())
    assert set(policy.RULE_ORDER) == {a for a in policy.JOB_ACTION.values() if a}


def test_the_rules_follow_errors_retry_not_a_list_of_their_own(monkeypatch):
    before = policy.codes_for(policy.FAIL_JOB)
    assert before == sorted(int(c) for c in ExitCode if RETRY[c] == Retry.NEVER)
    monkeypatch.setitem(errors.RETRY, ExitCode.CONTROL_PLANE, Retry.NEVER)
    assert policy.codes_for(policy.FAIL_JOB) == sorted([*before, int(ExitCode.CONTROL_PLANE)])
    assert int(ExitCode.CONTROL_PLANE) not in policy.codes_for(policy.COUNT)


def test_rules_are_ordered_disjoint_and_never_name_success():
    rules = policy.pod_failure_rules("node")
    assert rules[0]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    seen: set[int] = set()
    for rule in rules[1:]:
        values = rule["onExitCodes"]["values"]
        assert values == sorted(values) and not seen & set(values) and 0 not in values
        seen |= set(values)
    assert seen == {int(c) for c in ExitCode if RETRY[c] != Retry.NONE}


def test_the_jobset_policy_fails_on_a_permanent_job_failure_only():
    spec = K8sSpec(name="x", image="i", script="s.py", max_restarts=5)
    assert policy.jobset_failure_policy(spec) == {
        "maxRestarts": 5, "rules": [{"name": "permanent", "action": "FailJobSet",
                                     "onJobFailureReasons": ["PodFailurePolicy"]}]}


def test_every_exit_code_has_a_docstring_whose_first_sentence_is_shown():
    docs = policy.member_docs()
    assert set(docs) == set(ExitCode)
    assert policy.first_sentence(docs[ExitCode.GAVE_UP]) == (
        "A fault the job could not recover from: the restart budget was spent.")
    assert policy.first_sentence("No full stop") == "No full stop"

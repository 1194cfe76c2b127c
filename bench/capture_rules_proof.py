"""The table of what the emulated capture refuses, proved rule by rule: each rule of
:mod:`scalefold.compilation.capture_rules` is removed in turn, its planted tests
(``tests/compilation/test_capture_rules.py::test_planted``) are run, the rule is restored, and they are run
again. A row says which planted tests failed without the rule (all of them, or the rule would be dead or
shadowed) and that they pass with it. Prints the Markdown table of bench/RESULTS.md.

    .venv/bin/python bench/capture_rules_proof.py            # about a minute on a CPU
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/compilation/test_capture_rules.py"


class _Outcomes:
    """A pytest plugin: the outcome of each test's call phase, and why it failed (in a few words)."""

    def __init__(self) -> None:
        self.passed: list[str] = []
        self.failed: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        test = report.nodeid.split("::")[-1]
        if report.passed:
            self.passed.append(test)
            return
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr)
        if "DID NOT RAISE" in message:
            self.failed[test] = "not refused"
        elif "inside the captured region" in message:  # the test's assertion on another rule's refusal
            self.failed[test] = "refused as another rule"
        else:  # the call ran unrefused and failed by itself (torch.cuda.* on a machine without CUDA)
            self.failed[test] = f"not refused: the call ran ({message.split(':')[0]} of its own)"


def _run(ids: list[str]) -> _Outcomes:
    outcomes = _Outcomes()
    pytest.main(["-q", "-p", "no:cacheprovider", "--no-header", "-o", "addopts=", *(f"{TEST}::{i}" for i in ids)],
                plugins=[outcomes])  # fmt: skip
    return outcomes


def main() -> int:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests" / "compilation"))
    import test_capture_rules as planted

    from scalefold.compilation import capture_rules as rules

    rows, dead = [], []
    for name, rule in list(rules.RULES.items()):
        ids = [f"test_planted[{i}]" for (r, _), i in zip(planted.CASES, planted.IDS) if r == name]
        with rules.without(name):
            removed = _run(ids)
        kept = _run(ids)
        if len(removed.failed) != len(ids) or len(kept.passed) != len(ids):
            dead.append(name)
        why_failed = sorted(set(removed.failed.values()))
        cases = ", ".join(f"`{i[len('test_planted'):]}`" for i in ids)
        rows.append(f"| `{name}` | {rule.what} | {rule.why} | {rule.source} | "
                    f"{cases} | "
                    f"{len(removed.failed)} of {len(ids)} failed ({'; '.join(why_failed)}); "
                    f"{len(kept.passed)} of {len(ids)} pass with the rule |")  # fmt: skip
    print("| rule | operation refused | why a CUDA capture refuses it | source | planted tests "
          "(`test_capture_rules.py::test_planted`) | without the rule |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    if dead:
        print(f"\nrules whose planted tests did not all fail without them (dead or shadowed): {dead}")
    return 1 if dead else 0


if __name__ == "__main__":
    raise SystemExit(main())

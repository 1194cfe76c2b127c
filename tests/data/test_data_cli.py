"""``scalefold preprocess``'s screen summary: counts on screen, details in the report and the log file."""

from __future__ import annotations

from scalefold.commands.data import _preprocess_summary


def _report(skipped: dict) -> dict:
    return {"store": "out/store.h5", "chains_written": 2, "skipped": skipped}


def test_summary_points_to_the_report_the_log_and_allow_missing_alignments():
    report = _report({"corrupt_mmcif": {"count": 1}, "missing_alignment": {"count": 33}})
    lines = _preprocess_summary(report, "out/store.h5.log", warnings=34, allow_missing=False)
    assert lines == [
        "wrote 2 chains to out/store.h5",
        "skipped (corrupt_mmcif: 1, missing_alignment: 33): every file and chain with its reason in "
        "out/store.h5.report.json",
        "34 warnings logged to out/store.h5.log",
        "33 chains had no alignment directory: --allow-missing-alignments keeps such chains (without MSA)",
    ]


def test_summary_of_a_clean_run_is_one_line():
    assert _preprocess_summary(_report({}), "s.log", warnings=0, allow_missing=False) == [
        "wrote 2 chains to out/store.h5"
    ]
    lines = _preprocess_summary(_report({"missing_alignment": {"count": 1}}), "s.log", 1, allow_missing=True)
    assert len(lines) == 3 and "1 warning logged" in lines[2]  # no hint when the option is already given

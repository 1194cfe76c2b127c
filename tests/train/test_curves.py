"""``read_metrics``: the training loop's metrics file, plain or gzip-compressed (the committed curves)."""

from __future__ import annotations

import gzip
import json

from scalefold.train.curves import read_metrics


def test_read_metrics_splits_records_and_reads_gzip_alike(tmp_path):
    records = [{"step": 1, "loss": 2.0}, {"step": 1, "eval_lddt_ca": 0.25}, {"step": 2, "loss": 1.5}]
    text = "\n".join(json.dumps(r) for r in records) + "\n\n"
    plain, packed = tmp_path / "metrics.jsonl", tmp_path / "metrics.jsonl.gz"
    plain.write_text(text)
    packed.write_bytes(gzip.compress(text.encode()))
    train, evals = read_metrics(plain)
    assert train == [records[0], records[2]] and evals == [records[1]]
    assert read_metrics(packed) == (train, evals)

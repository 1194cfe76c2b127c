"""The trainer's whole-step path against eager: two runs of the same ``scalefold train`` command, one with
``--cuda-graphs step`` and one with ``--cuda-graphs off``, compared record by record.

    python bench/train_step_compare.py --graphs RUN_DIR --off RUN_DIR --log GRAPHS_RUN.log [--tolerance 2e-2]

Every training step's loss, gradient norm and loss terms and every evaluation's metrics in the two runs'
``metrics.jsonl`` must agree within ``--tolerance`` (relative; default the whole step's warm-up check on a GPU,
``WHOLE_STEP_TOLERANCE``: on the CPU emulation the replays are bit-identical, so the same bound holds with
room); both runs must have the same steps and evaluations. The graphed run's output (``--log``) must say how
many steps were replayed from the whole-step graphs (its summary line ``cuda graphs (whole step): N step(s)
graphed, ...``) and N must be at least 1: a run whose capture fell back would compare eager with eager.
Prints one line per compared quantity's worst step and a verdict; exit 0 (agree), 1 (differ, or nothing was
graphed), 3 (a missing or unreadable input, named in one line).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: the numbers of a record that are the run's arithmetic (timings, throughput and bookkeeping left out)
COMPARED = re.compile(r"^(loss.*|grad_norm|eval_.*)$")
GRAPHED = re.compile(r"cuda graphs \(whole step\): (\d+) step\(s\) graphed[^\n]*")  # WholeStepGraphs.summary()


class InputError(Exception):
    """A missing or unreadable input (exit status 3)."""


def read_records(run: Path) -> dict[tuple[str, int], dict[str, float]]:
    """``{(kind, step): {quantity: value}}`` of a run's ``metrics.jsonl`` (kind ``train`` or ``eval``)."""
    path = run / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InputError(f"{path}: {exc.strerror or exc}") from None
    records: dict[tuple[str, int], dict[str, float]] = {}
    for i, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except ValueError:
            raise InputError(f"{path}:{i}: not a JSON record") from None
        values = {k: float(v) for k, v in rec.items() if COMPARED.match(k) and isinstance(v, (int, float))}
        if values:
            kind = "eval" if any(k.startswith("eval_") for k in values) else "train"
            records[(kind, int(rec.get("step", -1)))] = values
    return records


def graphed_steps(log: Path) -> tuple[int, str]:
    """``(steps replayed from whole-step graphs, the summary line)`` from the graphed run's output."""
    try:
        text = log.read_text(errors="replace")
    except OSError as exc:
        raise InputError(f"{log}: {exc.strerror or exc}") from None
    match = None
    for match in GRAPHED.finditer(text):
        pass
    if match is None:
        raise InputError(f"{log}: no 'cuda graphs (whole step): N step(s) graphed' line (was it run with --cuda-graphs step?)")
    return int(match.group(1)), match.group(0)


def relative(a: float, b: float) -> float:
    """|a - b| / |b| (0 where both are equal, incl. both non-finite alike; inf where only one is finite)."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-30)


def compare(graphs: dict, off: dict, tolerance: float) -> tuple[list[str], bool]:
    """Lines (the worst step of each quantity) and whether every shared quantity agrees within ``tolerance``."""
    if set(graphs) != set(off):
        only = sorted(set(graphs) ^ set(off))
        return [f"the runs hold different records: {only[:6]}{' ...' if len(only) > 6 else ''}"], False
    worst: dict[str, tuple[float, tuple[str, int]]] = {}
    for key, values in off.items():
        for name, want in values.items():
            if name not in graphs[key]:
                return [f"{key[0]} step {key[1]}: {name} missing from the graphed run"], False
            rel = relative(graphs[key][name], want)
            if rel >= worst.get(name, (-1.0, key))[0]:
                worst[name] = (rel, key)
    lines, ok = [], True
    for name, (rel, (kind, step)) in sorted(worst.items()):
        bad = not rel <= tolerance
        ok = ok and not bad
        lines.append(f"  {name:<34} max relative difference {rel:.2e} ({kind} step {step}){'  > tolerance' if bad else ''}")
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    from scalefold.compilation.graphed_step import WHOLE_STEP_TOLERANCE

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--graphs", type=Path, required=True, help="the --cuda-graphs step run's --out")
    ap.add_argument("--off", type=Path, required=True, help="the --cuda-graphs off run's --out")
    ap.add_argument("--log", type=Path, required=True, help="the graphed run's output (stdout + stderr)")
    ap.add_argument("--tolerance", type=float, default=WHOLE_STEP_TOLERANCE,
                    help=f"relative (default {WHOLE_STEP_TOLERANCE:g}: the whole step's warm-up check on a GPU)")
    args = ap.parse_args(argv)
    try:
        graphed, summary = graphed_steps(args.log)
        records_g, records_o = read_records(args.graphs), read_records(args.off)
    except InputError as exc:
        print(f"train_step_compare: {exc}", file=sys.stderr)
        return 3
    lines, ok = compare(records_g, records_o, args.tolerance)
    train = sum(1 for kind, _ in records_o if kind == "train")
    evals = sum(1 for kind, _ in records_o if kind == "eval")
    print(f"train_step_compare: {summary}")
    print(f"train_step_compare: {train} training steps and {evals} evaluations of --cuda-graphs step against --cuda-graphs "
          f"off, tolerance {args.tolerance:g} relative:")  # fmt: skip
    print("\n".join(lines))
    if graphed < 1:
        print("train_step_compare: FAIL: no step was replayed from a whole-step graph (the capture fell back or never "
              "ran): eager was compared with eager")  # fmt: skip
        return 1
    print(f"train_step_compare: {'PASS' if ok else 'FAIL'}: {graphed} graphed step(s); the metrics "
          f"{'agree' if ok else 'differ'} within {args.tolerance:g}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

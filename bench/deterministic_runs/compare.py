"""Compare every loss/grad/eval field of two metrics.jsonl trees: compare.py BEFORE_DIR AFTER_DIR."""
import json
import sys
from pathlib import Path

a, b = Path(sys.argv[1]), Path(sys.argv[2])
names = ["single", "dap2", "bp2dap2", "async", "resume", "resume_first"]
ok = True
for n in names:
    fa = a / f"{n}.metrics.jsonl"; fb = (b / n / "metrics.jsonl") if n != "resume_first" else b / "resume_first.metrics.jsonl"
    if not fb.exists() and (b / f"{n}.metrics.jsonl").exists():
        fb = b / f"{n}.metrics.jsonl"
    ra = [json.loads(l) for l in fa.read_text().splitlines()]
    rb = [json.loads(l) for l in fb.read_text().splitlines()]
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("time_") and k not in ("tflops", "mfu", "hfu")}
    sa, sb = [strip(r) for r in ra], [strip(r) for r in rb]
    fields = sorted({k for r in sa for k in r if k.startswith(("loss", "eval", "grad"))})
    same = sa == sb
    ok &= same
    print(f"{n:13s} {len(sa)} records, {len(fields)} loss/eval/grad fields: {'bit-identical' if same else 'DIFFERENT'}")
    if not same:
        for x, y in zip(sa, sb):
            if x != y:
                print("   before", x); print("   after ", y); break
print("ALL IDENTICAL" if ok else "MISMATCH")

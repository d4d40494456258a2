"""The Chrome trace: valid JSON, one span per bucket per step, overlap and per-bucket updates visible."""

import json
from collections import Counter

import pytest

from fdp.run.config.compose import compose
from fdp.run.trainer import run

STEPS = 3


@pytest.mark.parametrize("schedule", ["after", "overlap"])
def test_trace_has_one_span_per_bucket_per_step(tmp_path, schedule):
    cfg = compose(
        "trainer.progress=false",
        "trainer.eval_every=0",
        "trainer.trace=true",
        f"trainer.max_steps={STEPS}",
        "trainer.bucket_cap_mb=0.1",
        "trainer.first_bucket_cap_mb=0.05",
        f"trainer.schedule={schedule}",
    )
    run(cfg, tmp_path)
    buckets = len(json.loads((tmp_path / "plan.json").read_text())["buckets"])
    assert buckets > 1
    events = json.loads((tmp_path / "trace" / "rank0.json").read_text())["traceEvents"]
    spans = Counter(
        (e["args"]["step"], e["args"]["bucket"], e["ph"])
        for e in events
        if e.get("cat") == "bucket" and e["name"].startswith("bucket")
    )
    for step in range(1, STEPS + 1):
        for bucket in range(buckets):
            assert spans[(step, bucket, "b")] == 1 and spans[(step, bucket, "e")] == 1
    for name in ("forward", "backward"):
        assert sum(e["name"] == name for e in events) == STEPS
    # The trainer donates its state and SGD is elementwise: each bucket's params are updated
    # on their own, after that bucket's reduction has ended (and before later ones may have).
    bucket_end = {
        (e["args"]["step"], e["args"]["bucket"]): e["ts"]
        for e in events
        if e.get("cat") == "bucket" and e["name"].startswith("bucket") and e["ph"] == "e"
    }
    updates = [e for e in events if e["name"] == "optimizer"]
    assert sorted((e["args"]["step"], e["args"]["bucket"]) for e in updates) == sorted(bucket_end)
    assert all(e["ts"] >= bucket_end[(e["args"]["step"], e["args"]["bucket"])] for e in updates)
    backward_end = {e["args"]["step"]: e["ts"] + e["dur"] for e in events if e["name"] == "backward"}
    first_start = {e["args"]["step"]: e["ts"] for e in events if e["name"] == "bucket 0" and e["ph"] == "b"}
    started_inside_backward = all(first_start[s] < backward_end[s] for s in backward_end)
    # Overlap starts bucket 0 while backward still runs; the other schedule waits for backward to end.
    assert started_inside_backward == (schedule == "overlap")

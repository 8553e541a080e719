"""benchmarks.overhead_share: the plugin's share of training time, whole run and from step 2, from both kinds of
committed result (a trl_arms JSON's histories, a sweep's packed JSONL run logs)."""

from __future__ import annotations

import io
import json
import tarfile

from benchmarks import overhead_share

# step 1: 0.5 s of plugin time in a 2.0 s step (the one-time set-up); steps 2-3: 0.01 s of 0.5 s each
RECORDS = [{"step": 1, "step_time": 2.0, "gap/time/scoring_s": 0.5},
           {"step": 2, "step_time": 0.5, "gap/time/scoring_s": 0.01},
           {"step": 2, "reward": 0.5},  # a record without timing is skipped
           {"step": 3, "step_time": 0.5, "gap/time/scoring_s": 0.01}]


def test_shares_whole_run_and_from_step_two():
    s = overhead_share.shares(RECORDS)
    assert s == {"all": 0.52 / 3.0, "from_step_2": 0.02 / 1.0, "steps": 3}


def test_reads_trl_arms_json_and_packed_run_logs(tmp_path, capsys):
    arms = tmp_path / "trl_overhead.json"
    arms.write_text(json.dumps({"results": {"A (probe_every 8)": {"history": RECORDS}, "errors": {}}}))
    packed = tmp_path / "sweep" / "runs.tar.xz"
    packed.parent.mkdir()
    with tarfile.open(packed, "w:xz") as tar:
        for name, records in (("runs/G_s0.jsonl", RECORDS[1:]), ("runs/G_s0.out", None)):
            data = ("\n".join(json.dumps(r) for r in records) + "\n" if records else "console\n").encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert overhead_share.run_histories(arms) == {"A (probe_every 8)": RECORDS}
    assert overhead_share.run_histories(packed) == {"G_s0": RECORDS[1:]}
    assert overhead_share.main([str(arms), str(packed)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == ["trl_overhead.json | A (probe_every 8) | 3 | 17.33 | 2.00",
                         "sweep | G_s0 | 2 | 2.00 | 2.00"]

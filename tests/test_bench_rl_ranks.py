"""Smoke test of bench/rl_ranks.py --quick: the JSON has its fields, and what FSDP2 shards
(parameters, gradients, optimizer state) is halved per rank at 2 ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_run_writes_the_report_and_two_ranks_hold_half(tmp_path):
    out = tmp_path / "rl_ranks.json"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "rl_ranks.py"), "--quick",
                        "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=55)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "| opt | N |" in p.stdout  # the markdown table
    r = json.loads(out.read_text())
    for k in ("command", "machine", "cpu_cores", "model", "rows", "conclusions", "not_sharded"):
        assert k in r, k
    assert "--quick" in r["command"]
    assert r["model"]["parameters"] > 0
    rows = {(x["optimizer"], x["world"]): x for x in r["rows"]}
    assert set(rows) == {(o, n) for o in ("muon", "adamw") for n in (1, 2)}
    for opt in ("muon", "adamw"):
        one, two = rows[(opt, 1)], rows[(opt, 2)]
        for row in (one, two):
            assert row["step_s_median"] > 0
            b = row["bytes_per_rank"]
            assert len(b) == row["world"]
            for k in ("params", "grads", "optimizer_state"):
                assert b[0][k]["total"] > 0, (opt, k)
            assert len(row["peak_rss_mb_per_rank"]) == row["world"]
        # sharded per-rank bytes at 2 ranks: half of the one process's (within 10%)
        whole = one["bytes_per_rank"][0]["params_grads_optimizer"]
        for rank_bytes in two["bytes_per_rank"]:
            ratio = rank_bytes["params_grads_optimizer"] / whole
            assert abs(ratio - 0.5) <= 0.05, (opt, ratio)
        assert set(two["publish"]) == {"shards", "gathered"}
        assert set(one["publish"]) == {"one_process"}
        for route, pub in two["publish"].items():
            assert pub["publish_s_median"] > 0
            assert pub["nbytes"][0] > 0 and pub["wire_bytes"][0] >= pub["nbytes"][0]
            assert pub["receiver"]["equals_published"], (opt, route)
        assert two["routes_same_weights"] is True, opt
        # the shard route's snapshot is split; the gathered route's stays whole on rank 0
        pb = two["publisher_bytes_per_rank"]
        snap1 = one["publisher_bytes_per_rank"][0]["one_process"]["snapshot"]
        assert abs(pb[1]["shards"]["snapshot"] / snap1 - 0.5) <= 0.05
        assert pb[0]["gathered"]["snapshot"] == snap1
    mu = rows[("muon", 2)]["muon"]
    for k in ("step_s_median", "sharded_ns_comm_s_median", "sharded_ns_s_median",
              "gather_broadcast_payload_bytes", "gram_allreduce_payload_bytes"):
        assert mu[k] > 0, k

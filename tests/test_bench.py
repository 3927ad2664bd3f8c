"""`glm5 bench`: rows carry times, roofline figures and peak memory; backends are compared with
the reference side by side."""

from __future__ import annotations

import json
import logging
import mmap
import time

import torch

import glm5
from glm5 import cli
from glm5.ir.catalog import OPS
from glm5.testing.measure import PeakRSS, time_it


def test_bench_rows_against_reference(capsys):
    logging.getLogger("glm5").setLevel(logging.ERROR)
    b = glm5.Backend("t_bench", vendor="t", device_type="cpu")
    b.kernel("silu_mul", dtypes=(torch.float32,))(OPS["silu_mul"].reference)
    glm5.get_registry().register(b)
    assert cli.main(["bench", "--backend", "t_bench", "--ops", "silu_mul", "--repeat", "1",
                     "--quick", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ceilings"]["fp32_flops"] > 0 and doc["ceilings"]["bandwidth"] > 0
    (row,) = doc["rows"]
    assert row["op"] == "silu_mul" and row["dtype"] == "float32"
    assert row["ms"] > 0 and row["reference_ms"] > 0 and row["speedup_vs_reference"] > 0
    assert row["gflops"] > 0 and row["gbps"] > 0 and 0 < row["roofline_pct"]
    assert cli.main(["bench", "--ops", "no_such_op"]) == 2


def test_peak_rss_sees_an_allocation():
    # An anonymous mapping is fresh memory whatever allocator the process runs (a torch tensor
    # can reuse pages an earlier test freed, and then the resident set never grows).
    with PeakRSS() as p:
        m = mmap.mmap(-1, 64 * 2**20)
        m.write(b"\x01" * len(m))  # touched: every page resident
        time.sleep(0.05)  # the sampler's fallback sees it too where VmHWM cannot be reset
        m.close()
    assert p.peak > 32 * 2**20
    assert time_it(lambda: sum(range(100)), repeat=2) > 0

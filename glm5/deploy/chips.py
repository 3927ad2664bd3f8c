"""Accelerator spec table for the planner (`glm5 plan`): memory, HBM bandwidth, peak dense
matrix throughput per dtype, scale-up interconnect bandwidth, and the glm5 backend serving each.

Every figure carries its public source. Where the vendor publishes no datasheet figure the
entry is marked ``estimate`` and the source says where the number comes from; docs/planner.md
repeats the table. Units: memory in GB (10^9 bytes, the vendors' unit), bandwidths in GB/s,
throughput in dense (non-sparse) TFLOPS / TOPS.

``link_gbs`` is the figure as published; ``link_bidirectional`` says whether it counts both
directions (NVLink's 900 GB/s does), and :attr:`Chip.link_gbs_per_direction` is what the ring
and all-to-all formulas use. ``collective_latency_us`` is the fixed time of one small collective
(all-reduce, reduce-scatter, all-gather or all-to-all) on the scale-up link, added to each
collective's bandwidth term: it is what makes small decode batches latency-bound.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

NVIDIA_H100 = "https://www.nvidia.com/en-us/data-center/h100/ (NVIDIA H100 Tensor Core GPU " \
              "datasheet, H100 SXM column; tensor figures there are 'with sparsity', dense = 1/2)"
NVIDIA_H200 = "https://www.nvidia.com/en-us/data-center/h200/ (NVIDIA H200 Tensor Core GPU " \
              "datasheet, H200 SXM column; tensor figures there are 'with sparsity', dense = 1/2)"
ASCEND_A2 = ("https://gitcode.com/cann/ops-nn/issues/6033 (CANN docs issue quoting the CANN "
             "platform_config INI for Atlas A2 / Ascend 910B2: 24 AI cores at 1.8 GHz, Cube "
             "353.9 TFLOPS BF16/FP16, 64 GB, 1.6 TB/s)")
H100_SMALL_AR = ("sgl-project/sglang#2904 (https://github.com/sgl-project/sglang/pull/2904), "
                 "H100 at tp 2/4/8 without CUDA graphs: an all-reduce of 512 B - 32 KB takes "
                 "5.7-7.8 us at tp 8 with SGLang's custom all-reduce, 9.3-11.8 us with vLLM's")
ASCEND_NO_FP8 = ("no FP8 matrix rate: 'On A2/A3, uint16, uint32, uint64, fp64 and fp8 are "
                 "unsupported for most ops. Ascend 950 adds them.' (triton-ascend "
                 "docs/zh/python-api/_ascend_constraints.py)")
NO_FP8_PUBLISHED = "no FP8 matrix rate published for this chip"
MTHREADS_S4000 = ("https://www.io-tech.fi/uutinen/moore-threads-julkaisi-uuden-mtt-s4000-"
                  "laskentakortin-ja-kuae-intelligent-computing-center-palvelinklusterit/ "
                  "(report of Moore Threads' MTT S4000 launch figures: 100 TFLOPS FP16/BF16, "
                  "200 TOPS INT8, 48 GB GDDR6 at 768 GB/s, MTLink 1.0 240 GB/s)")


@dataclass(frozen=True)
class Chip:
    """One accelerator. ``sources`` maps each figure's field name to its source text;
    ``estimates`` names the fields that are estimates rather than published figures."""

    name: str
    vendor: str
    backend: str  # the glm5/backends package serving it
    memory_gb: float
    hbm_gbs: float
    bf16_tflops: float  # dense matrix BF16 (= FP16 on every chip here)
    int8_tops: float  # dense matrix INT8
    link_gbs: float
    link_bidirectional: bool
    link_name: str
    collective_latency_us: float  # fixed cost of one small collective on the scale-up link
    # dense matrix FP8 (e4m3); None: no FP8 matrix rate (the fp8 ops' decompositions
    # dequantize and multiply at the BF16 rate)
    fp8_tflops: float | None = None
    sources: dict[str, str] = field(default_factory=dict)
    estimates: tuple[str, ...] = ()

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def link_gbs_per_direction(self) -> float:
        return self.link_gbs / 2 if self.link_bidirectional else self.link_gbs

    def peak_flops(self, dtype: str) -> float:
        """Peak dense ops/s of the matrix units for ``dtype`` ('bf16', 'int8' or 'fp8'; 'fp8'
        on a chip without an FP8 rate is the BF16 rate: glm5 dequantizes there)."""
        if dtype == "bf16" or (dtype == "fp8" and self.fp8_tflops is None):
            return self.bf16_tflops * 1e12
        if dtype == "int8":
            return self.int8_tops * 1e12
        if dtype == "fp8":
            return self.fp8_tflops * 1e12
        raise ValueError(f"glm5.plan: peak dtype expected 'bf16', 'int8' or 'fp8', "
                         f"got {dtype!r}")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["estimates"] = list(self.estimates)
        d["link_gbs_per_direction"] = self.link_gbs_per_direction
        return d


def _same(src: str, *fields: str) -> dict[str, str]:
    return {f: src for f in fields}


_FIELDS = ("memory_gb", "hbm_gbs", "bf16_tflops", "int8_tops", "link_gbs",
           "collective_latency_us")
#: chips with no published small-collective latency take the slower H100 figure (a stand-in,
#: not a measurement of that link)
_LIB_LATENCY = ("estimate: no published small-message collective latency found for this link; "
                "10 us, the slower small all-reduce figure on H100 at tp 8 in " + H100_SMALL_AR)
_NVLINK_LATENCY = ("estimate: 6 us per collective, the faster small all-reduce figure on H100 at "
                   "tp 8 in " + H100_SMALL_AR + "; applied to reduce-scatter, all-gather and "
                   "all-to-all alike")

CHIPS: dict[str, Chip] = {
    "ascend-910b": Chip(
        name="ascend-910b", vendor="Huawei", backend="ascend",
        memory_gb=64, hbm_gbs=1600, bf16_tflops=353.9, int8_tops=707.8,
        link_gbs=392, link_bidirectional=True, link_name="HCCS", collective_latency_us=10,
        sources={
            **_same(ASCEND_A2, "memory_gb", "hbm_gbs", "bf16_tflops"),
            "int8_tops": "estimate: 2x the Cube BF16 figure, the DaVinci Cube's INT8:FP16 MAC "
                         "ratio (8192:4096 per core, Hot Chips 2019 Ascend 910 talk, summarised "
                         "at https://vengineer.hatenablog.com/entry/2019/09/06/070000)",
            "link_gbs": "estimate: 7 HCCS links x 56 GB/s in the Atlas 800T A2 8-NPU full mesh, "
                        "as widely quoted; Huawei publishes no per-chip datasheet figure",
            "collective_latency_us": _LIB_LATENCY,
            "fp8_tflops": ASCEND_NO_FP8,
        },
        estimates=("int8_tops", "link_gbs", "collective_latency_us"),
    ),
    "mlu590": Chip(
        name="mlu590", vendor="Cambricon", backend="cambricon",
        memory_gb=80, hbm_gbs=2400, bf16_tflops=314, int8_tops=628,
        link_gbs=600, link_bidirectional=True, link_name="MLU-Link",
        collective_latency_us=10,
        sources={
            "memory_gb": "estimate: 80 GB HBM2e as reported by the trade press; Cambricon "
                         "publishes no MLU590 datasheet",
            "hbm_gbs": "estimate: trade-press figure (no Cambricon datasheet); for scale the "
                       "official MLU290-M5 is 1.23 TB/s HBM2 "
                       "(https://21ic.com/article/890568.html)",
            "bf16_tflops": "estimate: trade-press figure, no Cambricon datasheet",
            "int8_tops": "estimate: 2x the BF16 figure (the MLU290's INT8:INT16 ratio, "
                         "http://t.zoukankan.com/kongchung-p-14746622.html)",
            "link_gbs": "estimate: the official MLU290-M5 MLU-Link figure (6 links x 8 lanes x "
                        "50 Gb/s x 2 directions = 600 GB/s, http://t.zoukankan.com/kongchung-p-"
                        "14746622.html); no MLU590 figure is published",
            "collective_latency_us": _LIB_LATENCY,
            "fp8_tflops": NO_FP8_PUBLISHED,
        },
        estimates=_FIELDS,
    ),
    "mtt-s4000": Chip(
        name="mtt-s4000", vendor="Moore Threads", backend="mthreads",
        memory_gb=48, hbm_gbs=768, bf16_tflops=100, int8_tops=200,
        link_gbs=240, link_bidirectional=True, link_name="MTLink 1.0",
        collective_latency_us=10,
        sources={
            **_same(MTHREADS_S4000, *_FIELDS),
            "link_gbs": MTHREADS_S4000 + "; direction not stated, read as bidirectional "
                        "(the conservative reading)",
            "collective_latency_us": _LIB_LATENCY,
            "fp8_tflops": NO_FP8_PUBLISHED + " (the launch figures name FP16/BF16 and INT8 only)",
        },
        estimates=("collective_latency_us",),
    ),
    "hygon-k100": Chip(
        name="hygon-k100", vendor="Hygon", backend="hygon",
        memory_gb=64, hbm_gbs=1600, bf16_tflops=196, int8_tops=392,
        link_gbs=200, link_bidirectional=True, link_name="xGMI",
        collective_latency_us=10,
        sources={
            f: "estimate: Hygon publishes no DCU K100 datasheet; figures are trade-press "
               "reports of the K100-AI (64 GB HBM2e; about 196 TFLOPS BF16 and twice that INT8) "
               "and an MI210-class memory system (1.6 TB/s) and xGMI link" for f in _FIELDS
            if f != "collective_latency_us"
        } | {"collective_latency_us": _LIB_LATENCY, "fp8_tflops": NO_FP8_PUBLISHED},
        estimates=_FIELDS,
    ),
    "h100-sxm": Chip(
        name="h100-sxm", vendor="NVIDIA", backend="cuda",
        memory_gb=80, hbm_gbs=3350, bf16_tflops=989.4, int8_tops=1978.9,
        link_gbs=900, link_bidirectional=True, link_name="NVLink 4", collective_latency_us=6,
        fp8_tflops=1978.9,
        sources=_same(NVIDIA_H100, *_FIELDS[:-1], "fp8_tflops") | {
            "collective_latency_us": _NVLINK_LATENCY},
        estimates=("collective_latency_us",),
    ),
    "h200": Chip(
        name="h200", vendor="NVIDIA", backend="cuda",
        memory_gb=141, hbm_gbs=4800, bf16_tflops=989.4, int8_tops=1978.9,
        link_gbs=900, link_bidirectional=True, link_name="NVLink 4", collective_latency_us=6,
        fp8_tflops=1978.9,
        sources=_same(NVIDIA_H200, *_FIELDS[:-1], "fp8_tflops") | {
            "collective_latency_us": _NVLINK_LATENCY + " (H200 SXM has the same NVLink 4 / "
                                     "NVSwitch fabric as H100 SXM)"},
        estimates=("collective_latency_us",),
    ),
}


def get_chip(name: str) -> Chip:
    """The chip called ``name``; the error names the argument and lists the known chips."""
    try:
        return CHIPS[name]
    except KeyError:
        raise ValueError(f"glm5.plan: argument 'chip' expected one of {', '.join(CHIPS)}, "
                         f"got {name!r}") from None

"""The text `glm5 plan` prints: a plan (memory, step times, the slowest ops) and its
communication table, from the dict `glm5.deploy.plan.plan` returns."""

from __future__ import annotations

from typing import Any

from glm5.deploy.flashcomm import COMM_OPTIONS

def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def _num(x: float) -> str:
    for unit, s in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= unit:
            return f"{x / unit:.2f} {s}"
    return f"{x:.0f} "


def format_plan(p: dict[str, Any], top: int = 8) -> str:
    """The plan as readable text."""
    i, ch, lay, mem = p["inputs"], p["chip"], p["layout"], p["memory"]
    est = f" (estimates: {', '.join(ch['estimates'])})" if ch["estimates"] else ""
    lines = [
        f"glm5 plan: {ch['vendor']} {ch['name']} (backend {ch['backend']}){est}",
        f"  quant {i['quant']}, batch {i['batch']}, context {i['context']}, KV cache "
        f"{i['kv_dtype']}, indexer {i['indexer_dtype']}{', MTP on' if i['mtp'] else ''}",
        f"  layout: tp {lay['tp']}, ep {lay['ep']} on {lay['devices']} device(s); "
        f"{lay['dp']} attention group(s) of {lay['local_batch']} sequence(s); experts split "
        f"{lay['ep']} ways by expert x {lay['expert_tp']} by column",
        "",
        "memory per device",
        f"  weights            {_gb(mem['weights_bytes_per_device'])}",
        f"  KV cache           {_gb(mem['kv_cache_bytes_per_device'])}  "
        f"({mem['kv_cache_bytes_per_token']:,} B/token)",
        f"  reserve            {_gb(mem['reserve_bytes'])}  (activations, workspace, runtime)",
        f"  total / capacity   {_gb(mem['needed_bytes'])} / {_gb(mem['capacity_bytes'])}"
        f"  -> {'fits' if mem['fits'] else 'DOES NOT FIT'}",
    ]
    if not mem["fits"]:
        lines.append(f"  short by {_gb(mem['shortfall_bytes'])}")
        s = p["suggestion"]
        lines.append(f"  smallest layout that fits: tp {s['tp']}, ep {s['ep']} on {s['devices']} "
                     f"device(s)" if s else "  no layout up to 4096 devices fits")
    d, f = p["decode"], p["prefill"]
    lines += [
        "",
        "per device        decode step        prefill",
        f"  FLOPs           {_num(d['flops']):<18} {_num(f['flops'])}",
        f"  bytes           {_num(d['bytes']) + 'B':<18} {_num(f['bytes'])}B",
        f"  compute         {d['compute_ms']:<10.3f} ms      {f['compute_ms'] / 1e3:.3f} s",
        f"  TP comm         {d['tp_comm_ms']:<10.3f} ms      {f['tp_comm_ms'] / 1e3:.3f} s",
        f"    (option)      {d['comm_option']:<18} {f['comm_option']}",
        f"  EP all-to-all   {d['ep_alltoall_ms']:<10.3f} ms      "
        f"{f['ep_alltoall_ms'] / 1e3:.3f} s",
        *([f"  EP all-reduce   {d['ep_allreduce_ms']:<10.3f} ms      "
           f"{f['ep_allreduce_ms'] / 1e3:.3f} s"] if d.get("ep_allreduce_ms") else []),
        f"  total           {d['total_ms']:<10.3f} ms      {f['time_s']:.3f} s",
        f"  tokens/s        {d['tokens_per_s']:<18,.1f} {f['tokens_per_s']:,.1f}",
        "",
        f"slowest decode ops (of {len(d['ops'])}):",
    ]
    rows = [("op", "calls", "dtype", "FLOPs", "bytes", "ms", "bound")]
    for r in d["ops"][:top]:
        rows.append((r["label"], f"{r['calls']:g}", r["dtype"], _num(r["flops"]),
                     _num(r["bytes"]) + "B", f"{r['ms']:.3f}", r["bound"]))
    lines += _table(rows, "  ")
    lines += ["", *format_comm(p), "", f"model: {p['formula']}"]
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]], indent: str) -> list[str]:
    w = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(x) for c, x in zip(r, w)).rstrip() for r in rows]


def format_comm(p: dict[str, Any]) -> list[str]:
    """The plan's communication section as text lines: per phase and layer kind, link bytes
    sent per device per layer and the time of the collectives + the residual/norm work after
    them, for each TP option and the EP all-to-all; the FlashComm thresholds; the options the
    step times use."""
    ch, lay = p["chip"], p["layout"]
    est = ", estimate" if "collective_latency_us" in ch["estimates"] else ""
    head = (f"communication per device ({ch['link_name']}: {ch['link_gbs_per_direction']:g} GB/s "
            f"each way, {ch['collective_latency_us']:g} us per collective{est})")
    if lay["tp"] == 1 and lay["ep"] == 1:
        return [head, "  none: one device"]
    lines = [head, "  per layer: link bytes sent, and us = the collectives + the residual add and "
             "RMSNorm after them"]
    for phase in ("decode", "prefill"):
        cm = p[phase]["comm"]
        lines.append(f"  {phase}, {cm['tokens_per_tp_group']:,} tokens per TP group"
                     + (f" (padded to {cm['padded_tokens']:,})"
                        if cm["padded_tokens"] != cm["tokens_per_tp_group"] else ""))
        opts = COMM_OPTIONS if lay["tp"] > 1 else ()
        rows = [("layers", *opts, "EP all-to-all")]
        for k in cm["kinds"]:
            cells = [f"{k['kind']} x{k['layers']}"]
            for o in opts:
                r = k["tp"][o]
                cells.append(f"{_num(r['link_bytes'])}B {r['total_us']:,.1f} us")
            a = k["ep_alltoall"] or k.get("ep_allreduce")  # replicated tokens: all-reduce
            cells.append(f"{_num(a['link_bytes'])}B {a['us']:,.1f} us"
                         + ("" if a is k["ep_alltoall"] else " (all-reduce)") if a else "-")
            rows.append(tuple(cells))
        lines += _table(rows, "    ")
    th = p["decode"]["comm"]["thresholds"]
    if lay["tp"] > 1:
        def at(n: int | None) -> str:
            return f"from {n:,} tokens per TP group" if n is not None else "never"

        lines.append(f"  FlashComm beats all-reduce {at(th['flashcomm'])}; with the int8 "
                     f"all-gather {at(th['flashcomm-int8'])} (vllm-ascend used 1,000 for dense "
                     f"models)")
    else:
        lines.append("  no TP reduction (tp 1)")
    lines.append(f"  step times use: decode {p['decode']['comm_option']}, prefill "
                 f"{p['prefill']['comm_option']} (--comm {p['inputs']['comm']})")
    return lines

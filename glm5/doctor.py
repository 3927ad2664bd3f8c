"""`glm5 doctor`: what this machine can do for glm5, section by section — Python, torch, the CPU
and its features, the backends and whether each is usable here, the optional dependencies, and
the RL sandbox (bwrap or the weaker rlimits mode) — with warnings that say what is missing and
how to fix it.

Nothing optional is imported to report it: packages are found with `importlib.util.find_spec`
and their versions read from their installed metadata. (Backend availability is each backend's
own detection, the same `glm5 backends` shows.)
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import platform
import sys
from typing import Any, Sequence

from glm5 import cpu_threads
from glm5.backends import tuning_cache
from glm5.perf import measure
from glm5.rl.envs import sandbox

# (module, distributions that may provide it, what glm5 uses it for)
OPTIONAL_DEPS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("triton", ("triton",), "Triton kernels (cuda, hygon, ascend backends; --emulate)"),
    ("tvm", ("apache-tvm", "tvm"), "TVM kernels (glm5[tvm])"),
    ("transformers", ("transformers",), "parity tests against transformers"),
    ("ray", ("ray",), "`glm5 rl train --ray`"),
    ("redis", ("redis",), "the Redis experience pool (glm5.rl.pool)"),
    ("tokenizers", ("tokenizers",), "text in / out: `glm5 serve`, glm5.LLM, chat"),
    ("fastapi", ("fastapi",), "`glm5 serve`"),
)

#: What to do when the sandbox has to run in the weaker rlimits mode.
FIX_NO_BWRAP = ("install bubblewrap (`apt-get install bubblewrap`; `dnf install bubblewrap` on "
                "Fedora/RHEL), then rerun `glm5 doctor`")
FIX_BWRAP_REFUSED = (
    "bwrap is installed but cannot create its namespaces here: enable unprivileged user "
    "namespaces (`sysctl -w kernel.unprivileged_userns_clone=1` where that sysctl exists, "
    "`sysctl -w user.max_user_namespaces=15000`, and on Ubuntu 24.04+ `sysctl -w "
    "kernel.apparmor_restrict_unprivileged_userns=0`), or run this container with namespaces "
    "allowed (e.g. docker run --security-opt seccomp=unconfined --security-opt "
    "apparmor=unconfined)")


def python_info() -> dict[str, Any]:
    return {"version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable, "platform": platform.platform()}


def torch_info() -> dict[str, Any]:
    """torch's version and build: "CUDA <v>", "ROCm <v>" or "CPU", and the devices it sees."""
    import torch

    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    build = f"ROCm {hip}" if hip else f"CUDA {cuda}" if cuda else "CPU"
    available = bool(torch.cuda.is_available())
    names = []
    if available:
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"version": torch.__version__, "build": build, "cuda": cuda, "hip": hip,
            "cuda_available": available, "devices": names,
            "debug": bool(getattr(torch.version, "debug", False))}


def cpu_info() -> dict[str, Any]:
    """The CPU model, core counts, torch's thread count and the features detected at run time
    (`glm5.perf.measure.cpu_features`: /proc/cpuinfo flags and torch's own checks)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    feats = measure.cpu_features()
    return {"model": measure.cpu_model(), "architecture": platform.machine(),
            "cores": os.cpu_count(),
            "usable_cores": usable, "torch_threads": feats["threads"], "features": feats,
            "threads": thread_info()}


def thread_info() -> dict[str, Any]:
    """The cpu backend's pool size (`glm5.cpu_threads.decide`: affinity, cgroup quota,
    GLM5_CPU_THREADS) or the error a bad GLM5_CPU_THREADS gives, and torch's OpenMP wait
    policy."""
    try:
        d = cpu_threads.decide()
        out: dict[str, Any] = {"threads": d.threads, "source": d.source, "affinity": d.affinity,
                               "quota": d.quota, "quota_file": d.quota_file,
                               "described": d.describe(), "error": None}
    except cpu_threads.CPUThreadsError as e:
        out = {"error": str(e)}
    out["openmp"] = dict(cpu_threads.openmp_state())
    out["openmp_warning"] = cpu_threads.spinning_warning()
    return out


def optional_deps() -> list[dict[str, Any]]:
    """Each optional dependency: found or not, its installed version — without importing it."""
    rows = []
    for module, dists, used_for in OPTIONAL_DEPS:
        try:
            found = importlib.util.find_spec(module) is not None
            problem = None
        except (ImportError, ValueError) as e:  # a broken parent package, a bad __spec__
            found, problem = False, f"{type(e).__name__}: {e}"
        version = None
        if found:
            for dist in dists:
                try:
                    version = importlib.metadata.version(dist)
                    break
                except importlib.metadata.PackageNotFoundError:
                    continue
        rows.append({"name": module, "installed": found, "version": version,
                     "used_for": used_for, "problem": problem})
    return rows


def _weaker_mode_warning(sb: dict[str, Any]) -> dict[str, str]:
    enforced, bw = sb["enforced"], sb["bwrap"]
    missing = ["no mount namespace: the host's filesystem is visible, and writable where the "
               "commands' uid may write"]
    if sb["root"]:
        missing.insert(0, "as root it is refused unless SandboxConfig(unsafe_rlimits_as_root="
                          "True), and then commands run as an unprivileged uid of their own")
    else:
        missing.append("another session's files are readable (commands run as this user)")
    missing.append("no PID, IPC or UTS namespace: host processes are visible")
    if not enforced["network_isolated"]:
        missing.append("no network namespace: commands reach the host's network")
    why = bw["problem"] or enforced.get("mode_note") or "bwrap not used"
    return {"source": "sandbox",
            "message": (f"the RL sandbox runs in the weaker rlimits mode ({why}): "
                        + "; ".join(missing) + ". Do not run untrusted code this way."),
            "fix": FIX_NO_BWRAP if bw["path"] is None else FIX_BWRAP_REFUSED}


def _sandbox_warning_fix(text: str, sb: dict[str, Any]) -> str | None:
    """A fix for one of the sandbox's own warnings (matched on the start of its message)."""
    if text.startswith("no seccomp filter") and not sb["libseccomp"]["loaded"]:
        return "install libseccomp (`apt-get install libseccomp2`)"
    if text.startswith("network not isolated"):
        return FIX_NO_BWRAP if sb["bwrap"]["path"] is None else FIX_BWRAP_REFUSED
    if text.startswith("max_processes not enforced"):
        return ("give this process a writable pids cgroup (cgroup v1 `pids`, or v2 with "
                "`pids` in cgroup.subtree_control), or run as a non-root user")
    return None


def sandbox_section() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(`glm5.rl.envs.sandbox.sandbox_report()` or the error that stopped it, warnings)."""
    # The sandbox logs its warnings once per process; doctor prints them itself, with fixes.
    level = sandbox.log.level
    sandbox.log.setLevel(logging.ERROR)
    try:
        sb = sandbox.sandbox_report()
    except Exception as e:  # doctor reports what is broken; it does not stop at it
        msg = f"the sandbox could not be set up: {type(e).__name__}: {e}"
        return {"error": msg}, [{"source": "sandbox", "message": msg, "fix": None}]
    finally:
        sandbox.log.setLevel(level)
    warnings = []
    weaker = sb["mode"] == "rlimits"
    if weaker:
        warnings.append(_weaker_mode_warning(sb))
    for w in sb["warnings"]:
        if weaker and w.startswith("rlimits mode"):
            continue  # the weaker-mode warning above says this and more, with the fix
        warnings.append({"source": "sandbox", "message": w,
                         "fix": _sandbox_warning_fix(w, sb)})
    return sb, warnings


def doctor_report(backends: Sequence[dict[str, Any]],
                  plugins: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The whole report as JSON values. ``backends`` / ``plugins``: the rows `glm5 backends`
    shows (`glm5.cli.backends.backend_rows`, `plugin_rows`)."""
    sb, warnings = sandbox_section()
    for p in plugins:
        if p["status"] in ("failed", "refused"):
            warnings.append({"source": "backends",
                             "message": f"plugin {p['name']} ({p['source']}) {p['status']}: "
                                        f"{p['message']}",
                             "fix": "see `glm5 backends --diagnose`"})
    cpu = cpu_info()
    th = cpu["threads"]
    if th["error"]:
        warnings.append({"source": "cpu", "message": th["error"],
                         "fix": "set GLM5_CPU_THREADS to a positive integer, or unset it"})
    if th["openmp_warning"]:
        warnings.append({"source": "cpu", "message": th["openmp_warning"], "fix": None})
    return {
        "python": python_info(), "torch": torch_info(), "cpu": cpu,
        "backends": [{k: b[k] for k in ("name", "vendor", "device_type", "available", "reason",
                                        "priority", "source")} for b in backends],
        "plugins": [{k: p[k] for k in ("name", "source", "status", "message")}
                    for p in plugins],
        "optional": optional_deps(), "sandbox": sb, "tuning_cache": tuning_cache_section(),
        "warnings": warnings,
    }


def tuning_cache_section() -> dict[str, Any]:
    """The per-device tuning cache (`glm5 tune`): its directory and files, applied or stale."""
    try:
        return tuning_cache.listing()
    except OSError as e:  # an unreadable cache directory is reported, not fatal
        return {"dir": None, "files": [], "error": f"{type(e).__name__}: {e}"}


def _yes(v: Any) -> str:
    return "yes" if v else "no" if v is not None else "unknown"


def format_report(r: dict[str, Any], table: Any) -> str:
    """The report as text, one section per heading; ``table(rows)`` formats a table (the
    CLI's `_fmt`)."""
    out: list[str] = ["glm5 doctor: what this machine can do for glm5", ""]

    def kv(key: str, value: Any) -> None:
        out.append(f"  {key:<13}{value}")

    py, t, c = r["python"], r["torch"], r["cpu"]
    out.append("Python")
    kv("version", f"{py['version']} ({py['implementation']}) {py['executable']}")
    kv("platform", py["platform"])
    out.append("Torch")
    kv("version", t["version"])
    kv("build", t["build"])
    kv("devices", ", ".join(t["devices"]) if t["devices"] else
       "none (torch.cuda.is_available() is False)")
    out.append("CPU")
    f = c["features"]
    kv("model", f"{c['model']} ({c['architecture']})")
    kv("cores", f"{c['cores']} ({c['usable_cores']} usable by this process); torch threads "
                f"{c['torch_threads']}")
    th = c["threads"]
    kv("cpu threads", th["error"] or f"{th['described']}: torch's and TVM's pools "
                      f"(GLM5_CPU_THREADS overrides)")
    omp = th["openmp"]
    kv("OpenMP wait", f"{omp['policy'] or 'default'} (by {omp['by']}): idle threads "
                      f"{'SPIN' if omp['spinning'] else 'sleep'}")
    kv("flags", " ".join(f["flags"]) or "none of those torch's fast paths use")
    kv("torch ISA", f"{f['torch_isa']}; MKL {_yes(f['mkl'])}; oneDNN {_yes(f['onednn'])}, "
                    f"bf16 {_yes(f['onednn_bf16'])}; AMX {_yes(f['amx'])}; AVX-512 BF16 "
                    f"{_yes(f['avx512_bf16'])}; VNNI {_yes(f['vnni'])}")

    out += ["", "Backends"]
    rows = [("backend", "device", "usable", "priority", "source", "reason")]
    rows += [(b["name"], b["device_type"], "yes" if b["available"] else "no", str(b["priority"]),
              b["source"], b["reason"]) for b in r["backends"]]
    out.append(table(rows))  # not indented: table() fits its lines to the terminal

    out += ["", "Optional dependencies (found without importing them)"]
    rows = [("package", "version", "used for")]
    rows += [(d["name"], (d["version"] or "installed") if d["installed"] else
              "missing" + (f" ({d['problem']})" if d["problem"] else ""), d["used_for"])
             for d in r["optional"]]
    out.append(table(rows))  # not indented: table() fits its lines to the terminal

    out += ["", "Tuning cache (glm5 tune)"]
    tcs = r["tuning_cache"]
    if tcs.get("error"):
        kv("error", tcs["error"])
    elif tcs["dir"] is None:
        kv("dir", f"off ({tuning_cache.ENV}=off)")
    else:
        kv("dir", tcs["dir"])
        for row in tcs["files"] or []:
            kv("file", tuning_cache.describe(row))
        if not tcs["files"]:
            kv("files", "none: kernels run with their backends' tuning tables")

    out += ["", "RL sandbox (glm5.rl.envs.sandbox)"]
    sb = r["sandbox"]
    if "error" in sb:
        kv("error", sb["error"])
    else:
        e, bw, lib, cg = sb["enforced"], sb["bwrap"], sb["libseccomp"], sb["pids_cgroup"]
        kv("mode", "bwrap (namespaces, read-only system)" if sb["mode"] == "bwrap" else
           "rlimits (WEAKER: no filesystem or process isolation)"
           + ("; REFUSED as root unless unsafe_rlimits_as_root=True"
              if sb.get("refused_as_root") else ""))
        if bw["works"]:
            how = ("the uid starts bwrap, which maps it in a user namespace"
                   if bw.get("privilege") == "userns" else
                   "bwrap runs as root, setpriv drops to the uid inside")
            kv("bwrap", f"{bw['path']}: {bw['version']}, works; user namespace "
                        f"{_yes(bw['user_namespace'])} ({how})")
        else:
            kv("bwrap", f"not usable: {bw['problem']}")
        kv("libseccomp", f"{lib['version']}, loaded" if lib["loaded"] else
           f"not loaded: {lib['problem']}")
        kv("seccomp", f"on ({e['seccomp_action']}): {len(e['seccomp_denied'])} system calls "
                      f"denied" if e["seccomp"] else f"off: {e['seccomp_error']}")
        kv("pids cgroup", f"{cg['path']} (v{cg['version']})" if cg["path"] else
           f"none: {cg['problem']}")
        kv("runs as", f"host uid {e['host_uid']}"
           + (" (one of their own per session)" if sb["root"] else " (this user's)")
           + f", uid {e['uid_inside']} inside; no capabilities, no_new_privs")
        kv("work dir", e["work_dir"])
        kv("file access", e["file_io"])
        kv("network", "own namespace (loopback only)" if e["network_isolated"] else
           "HOST NETWORK shared with commands")
        kv("isolation", f"filesystem {_yes(e['filesystem_isolated'])}, sessions "
                        f"{_yes(e['sessions_isolated'])}, PID namespace "
                        f"{_yes(e['pid_namespace'])}; a command's end kills: "
                        f"{e['containment']}")
        for i, (k, v) in enumerate(e["limits"].items()):
            kv("limits" if i == 0 else "", f"{k}: {v or 'NOT ENFORCED'}")
        for i, gap in enumerate(e.get("gaps", [])):
            kv("not covered" if i == 0 else "", gap)
        kv("running as", "root" if sb["root"] else "a non-root user")

    out += ["", "Warnings"]
    if not r["warnings"]:
        out.append("  none")
    for w in r["warnings"]:
        out.append(f"  WARNING ({w['source']}): {w['message']}")
        if w["fix"]:
            out.append(f"    fix: {w['fix']}")
    return "\n".join(out)

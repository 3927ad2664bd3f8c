"""Rollout workers over HTTP: `glm5.rl.remote.HTTPWorkerService` against the real `glm5 serve`
app (uvicorn on a free port of 127.0.0.1, in a thread), and once against a `glm5 serve
--allow-weight-updates` process that the test kills mid-episode.

The model is `test_rl_trainer._cfg()` (tiny, vocabulary 32, random weights). Oracles: the
in-process `RolloutWorker` over an engine with the same weights (token ids exactly, logprobs
within 1e-5, versions); the trainer's `WeightPublisher` checksums; the server's own version.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_rl_trainer import _cfg  # noqa: E402
from test_serve_api import LiveServer  # noqa: E402

from glm5.core.model import GLM5ForCausalLM  # noqa: E402
from glm5.engine.async_engine import AsyncEngine  # noqa: E402
from glm5.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from glm5.rl.remote import HTTPWorkerService, RemoteWorkerError  # noqa: E402
from glm5.rl.rollout import PromptGroup, RolloutWorker  # noqa: E402
from glm5.rl.services import ServiceDied  # noqa: E402
from glm5.rl.weight_sync import (StaleUpdateError, WeightPublisher, WeightReceiver,  # noqa: E402
                                 WeightSyncError, WeightUpdate, state_checksums)
from glm5.serve.app import build_app  # noqa: E402

NAME = "tiny-rl"
WEIGHTS = "/glm5/v1/weights"


def _engine_config() -> EngineConfig:
    return EngineConfig(num_pages=96, page_size=16, seed=0)


def _groups(tag: str) -> list[PromptGroup]:
    """Groups that differ in every setting the request carries."""
    return [
        PromptGroup(f"{tag}a", "copy", [1, 2, 3, 4], 4, temperature=1.0, max_tokens=6, seed=7),
        PromptGroup(f"{tag}b", "copy", [5, 6, 7], 3, temperature=0.7, top_p=0.8, max_tokens=5,
                    seed=11, meta={"answer": [7, 6, 5]}),
        PromptGroup(f"{tag}c", "sort", [9, 3, 8, 2, 2], 3, temperature=1.3, max_tokens=7,
                    stop_token_ids=[4, 5], seed=3),
    ]


def _drain(worker) -> tuple[list, list]:
    """Step until nothing is open: (trajectories by id, failed)."""
    done, failed = [], []
    deadline = time.monotonic() + 60
    while worker.num_open():
        assert time.monotonic() < deadline, "rollouts did not finish"
        out = worker.step()
        d, f = out if isinstance(out, tuple) else (out, [])
        done += d
        failed += f
    return sorted(done, key=lambda t: t.traj_id), failed


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """A trainer step's worth of change to two tensors."""
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in ("lm_head.weight", "model.layers.0.mlp.gate_proj.weight"):
            p = params[name]
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)


@pytest.fixture(scope="module")
def base_model():
    torch.manual_seed(0)
    return GLM5ForCausalLM(_cfg(), with_mtp=False).eval()


@pytest.fixture(scope="module")
def srv(base_model):
    engine = LLMEngine(copy.deepcopy(base_model), _engine_config())
    ae = AsyncEngine(engine)
    live = LiveServer(build_app(ae, NAME, None, allow_weight_updates=True))
    live.engine = engine
    yield live
    live.stop()


@pytest.fixture(scope="module")
def trainer(base_model):
    """(trainer's model, its publisher)."""
    model = copy.deepcopy(base_model)
    return model, WeightPublisher(model)


@pytest.fixture
def worker(srv):
    w = HTTPWorkerService(srv.url, "h0", timeout=60)
    yield w
    w.close()


def _sync(worker: HTTPWorkerService, publisher: WeightPublisher) -> int:
    """Bring the server to the publisher's version (a full update applies from any version)."""
    return worker.apply_update(publisher.full_update().to_bytes())


# ---------------------------------------------------------------------------- rollouts
def test_rollouts_over_http_equal_in_process(srv, trainer, worker, base_model):
    model, pub = trainer
    _perturb(model, 1)
    pub.publish()  # version >= 1: the versions checked below are not the default 0
    v = _sync(worker, pub)
    assert v == pub.version >= 1

    local_model = copy.deepcopy(base_model)
    local = RolloutWorker(LLMEngine(local_model, _engine_config()), "l0",
                          WeightReceiver(local_model, 0))
    local.apply_update(pub.full_update())
    assert local.version == v

    for g in _groups("eq"):
        local.submit(g)
        worker.submit(g)
    want, lfail = _drain(local)
    got, hfail = _drain(worker)
    assert lfail == [] and hfail == []
    assert [t.traj_id for t in got] == [t.traj_id for t in want] and len(got) == 10
    for a, b in zip(got, want):
        assert a.completion_ids == b.completion_ids, a.traj_id
        assert a.versions == b.versions == [v] * len(b.completion_ids)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5, rel=0)
        assert (a.finish_reason, a.prompt_ids, a.group_id, a.task_type, a.temperature,
                a.meta) == (b.finish_reason, b.prompt_ids, b.group_id, b.task_type,
                            b.temperature, b.meta)
    # the members of a group sample differently (each its own seed), and stop tokens end them
    assert len({tuple(t.completion_ids) for t in got if t.group_id == "eqa"}) > 1
    assert worker.tokens_generated() == sum(len(t.completion_ids) for t in got)
    assert worker.step() == ([], []) and worker.num_open() == 0


def test_return_token_ids_fields_and_stream(srv, worker):
    """The extension's fields agree with the legacy logprobs block, and streaming gives the
    same tokens chunk by chunk."""
    body = {"model": NAME, "prompt": [3, 1, 4, 1, 5], "max_tokens": 8, "seed": 5,
            "temperature": 1.0, "ignore_eos": True}
    plain = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert "token_ids" not in plain  # off by default: the OpenAI response as it was
    r = httpx.post(srv.url + "/v1/completions", json={**body, "return_token_ids": True,
                                                      "logprobs": 0}, timeout=60)
    c = r.json()["choices"][0]
    assert len(c["token_ids"]) == 8 and c["finish_reason"] == "length"
    assert c["token_logprobs"] == c["logprobs"]["token_logprobs"]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    assert c["token_versions"] == [worker.version()] * 8
    assert all(lp < 0 for lp in c["token_logprobs"])
    ids, lps, vs = [], [], []
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                      json={**body, "return_token_ids": True, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                assert ch["logprobs"] is None  # not asked for
                ids += ch["token_ids"]
                lps += ch["token_logprobs"]
                vs += ch["token_versions"]
    assert (ids, vs) == (c["token_ids"], c["token_versions"])
    assert lps == pytest.approx(c["token_logprobs"], abs=1e-5, rel=0)


# ---------------------------------------------------------------------------- weights
def test_weight_update_over_http(srv, trainer, worker):
    model, pub = trainer
    _sync(worker, pub)
    before = worker.checksums()
    assert before == pub.checksums()
    v0 = worker.version()
    _perturb(model, 2)
    up = pub.publish()
    assert up is not None and up.mode == "xor" and len(up.names) < len(pub.checksums())
    assert worker.apply_update(up.to_bytes()) == pub.version == v0 + 1
    assert worker.version() == v0 + 1
    after = worker.checksums()
    assert after == pub.checksums() == state_checksums(model) and after != before
    assert after == state_checksums(srv.engine.model)  # what the server's engine runs
    # tokens sampled after the update carry the new version
    g = PromptGroup("after", "copy", [2, 7, 1], 2, max_tokens=4, seed=1)
    worker.submit(g)
    got, failed = _drain(worker)
    assert failed == [] and len(got) == 2
    assert all(t.versions == [v0 + 1] * len(t.completion_ids) for t in got)
    # the same delta again does not start from the version the server holds: 409, unchanged
    with pytest.raises(StaleUpdateError, match=f"holds version {v0 + 1}"):
        worker.apply_update(up.to_bytes())
    r = httpx.post(srv.url + WEIGHTS, content=up.to_bytes(), timeout=60)
    assert r.status_code == 409 and "apply the updates in order" in r.json()["error"]["message"]
    assert worker.checksums() == after and worker.version() == v0 + 1


def test_version_changes_mid_request(srv, trainer, worker):
    """A request in flight across an update: its first tokens carry the old version, the rest
    the new one (each token's own version, not the request's)."""
    model, pub = trainer
    v0 = _sync(worker, pub)
    _perturb(model, 3)
    data = pub.publish().to_bytes()
    body = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 150, "seed": 2,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    versions: list[int] = []
    applied = False
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                versions += ch["token_versions"]
                if not applied and len(versions) >= 2:
                    assert worker.apply_update(data) == v0 + 1  # the stream goes on meanwhile
                    applied = True
    k = versions.index(v0 + 1)
    assert 2 <= k < len(versions) == 150
    assert versions == [v0] * k + [v0 + 1] * (150 - k)

    # the same without streaming: the reply's token_versions are per token too
    _perturb(model, 5)
    data = pub.publish().to_bytes()
    reply: dict = {}
    t = threading.Thread(target=lambda: reply.update(httpx.post(
        srv.url + "/v1/completions", json={**body, "stream": False}, timeout=60).json()))
    t.start()
    deadline = time.monotonic() + 30
    while not any(len(r.output_ids) >= 2 for r in list(srv.engine.requests.values())):
        assert time.monotonic() < deadline and t.is_alive(), "the request never generated"
        time.sleep(0.005)
    assert worker.apply_update(data) == v0 + 2
    t.join(60)
    versions = reply["choices"][0]["token_versions"]
    k = versions.index(v0 + 2)
    assert 2 <= k < len(versions) == 150
    assert versions == [v0 + 1] * k + [v0 + 2] * (150 - k)


def test_corrupt_update_is_refused(srv, trainer, worker):
    model, pub = trainer
    _sync(worker, pub)
    before, v = worker.checksums(), worker.version()
    _perturb(model, 4)
    data = bytearray(pub.publish().to_bytes())
    data[-1] ^= 0x40  # one bit of the last tensor's payload
    r = httpx.post(srv.url + WEIGHTS, content=bytes(data), timeout=60,
                   headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 400, r.text
    assert "sha256" in r.json()["error"]["message"]
    assert worker.checksums() == before and worker.version() == v
    with pytest.raises(WeightSyncError, match="sha256") as e:
        worker.apply_update(bytes(data))
    assert not isinstance(e.value, StaleUpdateError)
    assert worker.checksums() == before and worker.version() == v
    for junk in (b"", b"not a weight update", json.dumps({"version": 9}).encode()):
        r = httpx.post(srv.url + WEIGHTS, content=junk, timeout=60)
        assert r.status_code == 400 and "WeightUpdate.from_bytes" in r.json()["error"]["message"]
    # a full update of another model's shapes
    other = GLM5ForCausalLM(_cfg().replace(hidden_size=_cfg().hidden_size * 2), with_mtp=False)
    r = httpx.post(srv.url + WEIGHTS, content=WeightPublisher(other).full_update().to_bytes(),
                   timeout=60)
    assert r.status_code == 400 and "in the model" in r.json()["error"]["message"]
    assert worker.checksums() == before and worker.version() == v
    assert state_checksums(srv.engine.model) == before


def test_weight_endpoints_need_opt_in(base_model):
    engine = LLMEngine(copy.deepcopy(base_model), _engine_config())
    live = LiveServer(build_app(AsyncEngine(engine), NAME))
    try:
        for method in ("GET", "POST"):
            r = httpx.request(method, live.url + WEIGHTS, content=b"x" if method == "POST"
                              else None, timeout=60)
            assert r.status_code == 404
            assert "--allow-weight-updates" in r.json()["error"]["message"]
        w = HTTPWorkerService(live.url, "off", timeout=60)
        try:
            with pytest.raises(RemoteWorkerError, match="HTTP 404.*allow-weight-updates"):
                w.version()
            full = WeightPublisher(copy.deepcopy(base_model)).full_update().to_bytes()
            before = state_checksums(engine.model)
            with pytest.raises(RemoteWorkerError, match="HTTP 404"):
                w.apply_update(full)
            assert state_checksums(engine.model) == before
            w.submit(PromptGroup("off", "copy", [1, 2], 2, max_tokens=3, seed=0))
            got, failed = _drain(w)  # rollouts work without the opt-in
            assert len(got) == 2 and failed == []
        finally:
            w.close()
    finally:
        live.stop()
    with pytest.raises(TypeError, match="allow_weight_updates expected a bool"):
        build_app(AsyncEngine(engine), NAME, allow_weight_updates="yes")


def test_bad_arguments(srv, worker):
    with pytest.raises(ValueError, match="url expected an http"):
        HTTPWorkerService("localhost:8000", "x")
    with pytest.raises(ValueError, match="timeout expected"):
        HTTPWorkerService(srv.url, "x", timeout=0)
    with pytest.raises(ServiceDied, match=r"http://127\.0\.0\.1:1 is unreachable"):
        HTTPWorkerService("http://127.0.0.1:1", "x")  # nothing listens on port 1
    with pytest.raises(TypeError, match="data expected bytes"):
        worker.apply_update("weights")
    g = PromptGroup("dup", "copy", [1, 2], 2, max_tokens=40, seed=0)
    worker.submit(g)
    with pytest.raises(ValueError, match="already in flight"):
        worker.submit(PromptGroup(**{**g.to_dict(), "pending": [1]}))
    _drain(worker)
    # a request the server refuses (prompt + max_tokens over the context) is a failed member
    worker.submit(PromptGroup("long", "copy", [1, 2], 1, max_tokens=10**6, seed=0))
    got, failed = _drain(worker)
    assert got == [] and len(failed) == 1
    assert failed[0][1] == 0 and "HTTP 400" in failed[0][2] and "max_tokens" in failed[0][2]


# ---------------------------------------------------------------------------- a killed server
def test_server_killed_mid_episode(tmp_path, trainer):
    """`glm5 serve --allow-weight-updates` in its own process, SIGKILLed while a group
    generates: the trajectories that finished before stay delivered, the in-flight members come
    back in ``failed``, later requests fail too, and the weight calls raise ServiceDied."""
    from glm5.core.checkpoint import save_pretrained

    torch.manual_seed(0)
    # no EOS token: the long group cannot finish before the kill
    save_pretrained(GLM5ForCausalLM(_cfg().replace(eos_token_id=None), with_mtp=False),
                    tmp_path / "ckpt")
    proc = subprocess.Popen(
        [sys.executable, "-m", "glm5.cli", "serve", str(tmp_path / "ckpt"), "--port", "0",
         "--allow-weight-updates", "--log-level", "warning", "--page-size", "16",
         "--num-pages", "800", "--served-model-name", "killme"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        for line in proc.stdout:
            m = re.search(r" at (http://[\d.:]+)/v1 ", line)
            if m:
                url = m[1]
                break
        assert url, f"glm5 serve did not start (rc {proc.poll()})"
        w = HTTPWorkerService(url, "k0", timeout=60)
        assert w.model == "killme"
        model, pub = trainer
        assert w.apply_update(pub.full_update().to_bytes()) == pub.version
        assert w.checksums() == pub.checksums()  # the flag turned the endpoints on
        short = PromptGroup("short", "copy", [1, 2, 3], 2, max_tokens=3, seed=1)
        w.submit(short)
        first, failed = _drain(w)
        assert [t.traj_id for t in first] == ["short/0", "short/1"] and failed == []
        long = PromptGroup("long", "copy", [4, 5, 6], 3, max_tokens=3000, seed=2)
        w.submit(long)
        deadline = time.monotonic() + 30
        while True:  # until all three generate
            metrics = httpx.get(url + "/metrics", timeout=10).text
            if re.search(r"^glm5_num_requests_running(\{[^}]*\})? 3(\.0)?$", metrics, re.M):
                break
            assert time.monotonic() < deadline, "the long group never ran"
            time.sleep(0.05)
        proc.kill()
        proc.wait(10)
        got, failed = _drain(w)
        assert got == []
        assert sorted((g.group_id, m) for g, m, _ in failed) == [("long", 0), ("long", 1),
                                                                 ("long", 2)]
        assert all(url in err for _, _, err in failed)
        assert all(g.pending == [0, 1, 2] and g.max_tokens == 3000 for g, _, _ in failed)
        # nothing listens now: new requests fail (connection refused), weight calls raise
        w.submit(PromptGroup("after", "copy", [1], 1, max_tokens=2, seed=0))
        got, failed = _drain(w)
        assert got == [] and [(g.group_id, m) for g, m, _ in failed] == [("after", 0)]
        assert "ConnectError" in failed[0][2]
        with pytest.raises(ServiceDied, match=re.escape(url)):
            w.version()
        with pytest.raises(ServiceDied, match=re.escape(url)):
            w.apply_update(pub.full_update().to_bytes())
        with pytest.raises(ServiceDied, match=re.escape(url)):
            w.checksums()
        assert w.tokens_generated() == 6  # the two short trajectories, kept
        w.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

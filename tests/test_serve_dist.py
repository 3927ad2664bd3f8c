"""`glm5 serve` across ranks (gloo, 2 and 4 processes): the OpenAI API's greedy tokens against
the single-process engine for TP, TP + FlashComm, EP and EP + DP attention, with float, w8a8
and w4a8 weights; DP attention's routing (64 requests at once: spread over the ranks, none
lost); per-rank metrics; a rank that diverges is caught; the real command line under torchrun:
a SIGKILLed rank gives the open request a 503 and the server exits non-zero, SIGTERM drains
and stops every rank."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import threading
import time

import httpx
import pytest
import torch

from glm5.engine.lockstep import BALANCE_SLACK
from glm5.serve.ranks import ServeLayout, ServeLayoutError
from glm5.testing.dist import DistPool, values
from glm5.testing.serve_process import ServeProcess, alive

ENGINE = {"page_size": 16, "num_pages": 64, "max_num_seqs": 16}
MAX_TOKENS = 5
PROMPTS = [[(7 * i + 3 * j) % 100 + 1 for j in range(18 + i)] for i in range(8)]
LAYOUTS = {  # name: ServeLayout fields
    "tp": {"tp": 2},
    "tp+flashcomm": {"tp": 2, "flashcomm": True, "flashcomm_min_tokens": 0},
    "ep": {"ep": 2},
    "ep+dp-attention": {"ep": 2, "dp_attention": True},
}


# --------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from glm5.core.config import preset
    from glm5.core.model import GLM5ForCausalLM
    from glm5.deploy.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("serve_dist")
    torch.manual_seed(0)
    GLM5ForCausalLM(preset("tiny").replace(num_nextn_predict_layers=0)).eval() \
        .save_pretrained(root / "float")
    for scheme in ("w8a8", "w4a8"):
        quantize_checkpoint(root / "float", root / scheme, scheme)
    return {k: str(root / k) for k in ("float", "w8a8", "w4a8")}


def _reference(model_dir: str, prompts) -> list[list[int]]:
    """Greedy tokens of the single-process engine."""
    from glm5.core import checkpoint

    return greedy_tokens(checkpoint.load_model(model_dir), prompts, ENGINE)


def greedy_tokens(model: torch.nn.Module, prompts: list[list[int]], engine: dict
                  ) -> list[list[int]]:
    """Each prompt's MAX_TOKENS greedy tokens from a single-process engine over ``model``."""
    from glm5.engine.engine import EngineConfig, LLMEngine
    from glm5.engine.sampling import SamplingParams

    eng = LLMEngine(model, EngineConfig(**engine))
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                  ignore_eos=True))
    done = {o.request_id: o.token_ids for o in eng.run_to_completion()}
    return [done[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def references(checkpoints):
    return {k: _reference(d, PROMPTS) for k, d in checkpoints.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- in a DistPool
async def _complete(client: httpx.AsyncClient, url: str, prompt: list[int]) -> tuple[int, dict]:
    r = await client.post(url + "/v1/completions", json={
        "model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}, timeout=120)
    return r.status_code, r.json()


def serve_in_world(ctx, model_dir: str, port: int, client, **serve_kw) -> dict | None:
    """Every rank runs `glm5.serve.server.serve` (the command's code, under the pool's world);
    on rank 0 a thread waits for /health, runs ``client(url, result)``, then stops the server
    as SIGTERM does (uvicorn drains; rank 0 stops the others). Rank 0 returns ``result`` (an
    exception in the client as ``result["error"]``, never a hang), the others None."""
    from glm5.serve.server import serve

    result: dict = {}
    url = f"http://127.0.0.1:{port}"

    def run_client() -> None:
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.1)
            client(url, result)
        except BaseException as e:  # noqa: BLE001 - reported to the test, never a hang
            result["error"] = f"{type(e).__name__}: {e}"
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    t = None
    if ctx.rank == 0:
        t = threading.Thread(target=run_client, daemon=True)
        t.start()
    serve(model_dir, host="127.0.0.1", port=port, served_model_name="m", log_level="warning",
          limits={"graceful_timeout": 5.0}, **serve_kw)
    if t is not None:
        t.join(60)
        return result
    return None


def _serve_rank(ctx, model_dir: str, parallel: dict, port: int, burst: int) -> dict | None:
    """Rank 0's client sends each prompt alone (one rank idle at a time under DP attention),
    then ``burst`` requests at once (the prompts over and over), reads /metrics."""

    def client(url: str, result: dict) -> None:
        async def run() -> None:
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=128)) as c:
                result["alone"] = [await _complete(c, url, p) for p in PROMPTS]
                # sampled, unseeded: every replicated rank must draw what rank 0 draws
                r = await c.post(url + "/v1/completions", json={
                    "model": "m", "prompt": PROMPTS[0], "max_tokens": 8, "n": 2,
                    "temperature": 1.0, "ignore_eos": True}, timeout=120)
                result["sampled"] = (r.status_code, r.text)
                result["burst"] = await asyncio.gather(*[
                    _complete(c, url, PROMPTS[i % len(PROMPTS)]) for i in range(burst)])
        asyncio.run(run())
        result["metrics"] = httpx.get(url + "/metrics", timeout=10).text

    return serve_in_world(ctx, model_dir, port, client, engine_options=ENGINE,
                          parallel=parallel)


@pytest.fixture(scope="module")
def world2():
    with DistPool(2, comm_timeout_s=60) as pool:
        yield pool


def _tokens(answers) -> list[list[int]]:
    out = []
    for status, body in answers:
        assert status == 200, body
        out.append(body["choices"][0]["token_ids"])
    return out


def _rank_series(metrics: str, name: str) -> dict[int, float]:
    return {int(r): float(v) for r, v in re.findall(rf'^{name}{{rank="(\d+)"}} (\S+)$', metrics,
                                                    re.M)}


@pytest.mark.parametrize("weights", ["float", "w8a8", "w4a8"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_served_tokens_equal_the_single_process(world2, checkpoints, references, layout,
                                                weights):
    burst = 16
    res = values(world2.run(_serve_rank, checkpoints[weights], LAYOUTS[layout], _free_port(),
                            burst, timeout_s=240))[0]
    assert "error" not in res, res["error"]
    ref = references[weights]
    assert res["sampled"][0] == 200, res["sampled"][1]
    assert _tokens(res["alone"]) == ref
    assert _tokens(res["burst"]) == [ref[i % len(ref)] for i in range(burst)]
    gen = _rank_series(res["metrics"], "glm5_rank_generation_tokens_total")
    assert set(gen) == {0, 1}
    total = (len(PROMPTS) + burst) * MAX_TOKENS + 2 * 8  # + the sampled request's n=2 x 8
    if LAYOUTS[layout].get("dp_attention"):  # each rank generated for its own requests
        assert sum(gen.values()) == total
        assert min(gen.values()) > 0
    else:  # every rank ran every request
        assert gen[0] == gen[1] == total


def test_dp_attention_spreads_64_requests_over_4_ranks_and_loses_none(checkpoints, references):
    with DistPool(4, comm_timeout_s=60) as pool:
        res = values(pool.run(_serve_rank, checkpoints["float"], {"ep": 4, "dp_attention": True},
                              _free_port(), 64, timeout_s=300))[0]
    assert "error" not in res, res["error"]
    ref = references["float"]
    assert _tokens(res["alone"]) == ref
    assert _tokens(res["burst"]) == [ref[i % len(ref)] for i in range(64)]
    gen = _rank_series(res["metrics"], "glm5_rank_generation_tokens_total")
    per = [gen[r] / MAX_TOKENS for r in range(4)]  # requests each rank served (+ the sampled
    assert sum(per) == len(PROMPTS) + 64 + 2 * 8 / MAX_TOKENS  # n=2 x 8 tokens)
    assert min(per) >= 10, per  # spread: no rank starved (16 each when even)


# --------------------------------------------------------------------------- divergence
def _diverge(ctx, model_dir: str) -> str | None:
    """Rank 1's engine reports a different token at its third step: rank 0 must raise."""
    from glm5.engine.engine import EngineConfig, LLMEngine
    from glm5.engine.sampling import SamplingParams
    from glm5.serve import ranks

    layout = ServeLayout(tp=2)
    model = ranks.load_rank_model(model_dir, layout, ctx, None)
    eng = LLMEngine(model, EngineConfig(**ENGINE))
    if ctx.rank == 1:
        real, n = eng.step, [0]

        def step():
            outs = real()
            n[0] += 1
            if n[0] == 3 and outs:
                outs[0].new_token_ids = [t + 1 for t in outs[0].new_token_ids]
            return outs
        eng.step = step
        try:
            ranks.follow(eng, layout)
        except ranks.RankLost:
            pass
        return None
    front = ranks.front(eng, layout)
    front.add_request("a", PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0,
                                                      ignore_eos=True))
    try:
        while front.has_unfinished():
            front.step()
        return "no divergence seen"
    except ranks.RankDiverged as e:
        assert front.lost
        return str(e)
    finally:
        front._ch.send({"kind": "stop"})  # release rank 1 (a real server would exit)


def _budgets(ctx, model_dir: str, dp: bool) -> list[float]:
    """The decode-step times each rank's prefill budget holds after a few requests."""
    from glm5.engine.engine import EngineConfig, LLMEngine
    from glm5.engine.sampling import SamplingParams
    from glm5.serve import ranks

    layout = ServeLayout(ep=2, dp_attention=dp)
    eng = LLMEngine(ranks.load_rank_model(model_dir, layout, ctx, None), EngineConfig(**ENGINE))
    if ctx.rank == 1:
        ranks.follow(eng, layout)
    else:
        front = ranks.front(eng, layout)
        for i in range(4):
            front.add_request(str(i), PROMPTS[i], SamplingParams(max_tokens=6, temperature=0.0))
        while front.has_unfinished():
            front.step()
        front.close()
    return list(eng.scheduler.budget._decode_s)


@pytest.mark.parametrize("dp", [False, True])
def test_the_prefill_budget_follows_rank_0_with_replicated_tokens_only(world2, checkpoints, dp):
    """Replicated tokens: every rank's budget holds rank 0's measured times (so every rank
    schedules alike); DP attention: each rank's its own."""
    r0, r1 = values(world2.run(_budgets, checkpoints["float"], dp, timeout_s=120))
    assert r0 and r1
    # rank 0's last step is observed after its round: the others get it with the next one
    same = r1 == r0[:len(r1)] and len(r0) - len(r1) <= 1
    assert same is (not dp), (r0, r1)


def test_a_rank_that_samples_other_tokens_is_an_error(world2, checkpoints):
    msg = values(world2.run(_diverge, checkpoints["float"], timeout_s=120))[0]
    assert "rank 1 sampled other tokens than rank 0" in msg and "request 'a'" in msg


def _fail_mid_round(ctx, model_dir: str) -> str | None:
    """Rank 0's engine raises in its second step (after the round's broadcast): the front
    must stop for good (RankLost), never start another round out of step."""
    from glm5.engine.engine import EngineConfig, LLMEngine
    from glm5.engine.sampling import SamplingParams
    from glm5.serve import ranks

    layout = ServeLayout(ep=2, dp_attention=True)
    eng = LLMEngine(ranks.load_rank_model(model_dir, layout, ctx, None), EngineConfig(**ENGINE))
    if ctx.rank == 1:
        try:
            ranks.follow(eng, layout)
        except Exception as e:  # noqa: BLE001 - the lost world, as a follower sees it
            return type(e).__name__
        return "stopped"
    real, n = eng.step, [0]

    def step():
        n[0] += 1
        if n[0] == 2:
            raise RuntimeError("planted")
        return real()
    eng.step = step
    front = ranks.front(eng, layout)
    for i in range(2):  # one request per rank
        front.add_request(str(i), PROMPTS[i], SamplingParams(max_tokens=4, temperature=0.0))
    try:
        while front.has_unfinished():
            front.step()
        return "no error"
    except ranks.RankLost as e:
        assert front.lost and e.fatal_to_step and e.http_status == 503
        return str(e)
    finally:
        ctx.world.pg = None  # as the server: no further round (rank 1 times out or is killed)


def test_a_step_that_fails_mid_round_stops_the_front(checkpoints):
    from glm5.testing.dist import RankError

    with DistPool(2, comm_timeout_s=5) as pool:
        res = pool.run(_fail_mid_round, checkpoints["float"], timeout_s=60)
    assert isinstance(res[0], str) and "rank 0's step failed mid-round" in res[0], res[0]
    assert "planted" in res[0] and "out of step" in res[0]
    # rank 1 waited in its forward's all-to-all (or the gather): it fails instead of hanging
    lost = ("RankLost", "CollectiveTimeout", "PeerLost")
    assert res[1] in lost or isinstance(res[1], RankError), res[1]


# --------------------------------------------------------------------------- routing, settings
class _FakeLocal:
    page_size = 4


def _front(world: int):
    from glm5.engine.lockstep import RankFront

    f = RankFront.__new__(RankFront)
    f.local, f.world = _FakeLocal(), world
    f.held, f.routed = [0] * world, [0] * world
    from collections import OrderedDict
    f._prefixes = [OrderedDict() for _ in range(world)]
    return f


def test_route_prefers_the_prefix_holder_within_the_slack_else_the_least_loaded():
    f = _front(3)
    shared = list(range(12))
    first = f.route(shared + [50])
    f.held[first] += 1
    # the same 3 pages again: the same rank while its load is within the slack
    for _ in range(BALANCE_SLACK):
        assert f.route(shared + [60]) == first
        f.held[first] += 1
    # now it holds BALANCE_SLACK + 1 more than the others: the least loaded takes it
    other = f.route(shared + [70])
    assert other != first
    # no shared page (a prompt shorter than a page): the least loaded, fewest routed first
    g = _front(3)
    got = []
    for _ in range(6):
        r = g.route([1, 2])
        g.held[r] += 1
        g.routed[r] += 1
        got.append(r)
    assert sorted(got) == [0, 0, 1, 1, 2, 2]


def test_prefix_keys_are_page_aligned_chains():
    f = _front(2)
    k = f._prefix_keys(list(range(10)))
    assert len(k) == 2  # two whole pages of 4; the last 2 tokens are no page
    assert f._prefix_keys(list(range(8)) + [99, 98])[:2] == k
    assert f._prefix_keys([0, 1, 2, 9] + list(range(4, 8)))[1] != k[1]  # page 0 differs


@pytest.mark.parametrize("kw, msg", [
    ({"tp": 2, "ep": 4}, "argument 'ep' expected 1 or tp=2"),
    ({"dp_attention": True}, "argument 'dp_attention' expected with ep > 1 and tp 1"),
    ({"tp": 2, "dp_attention": True}, "argument 'dp_attention'"),
    ({"ep": 2, "flashcomm": True}, "argument 'flashcomm' expected with tp > 1"),
    ({"tp": 0}, "argument 'tp' expected an int >= 1"),
    ({"tp": 2, "flashcomm": True, "flashcomm_min_tokens": -1},
     "argument 'flashcomm_min_tokens'"),
])
def test_bad_layouts_are_refused(kw, msg):
    with pytest.raises(ServeLayoutError, match=re.escape(msg)):
        ServeLayout(**kw)


def test_layout_world_sizes():
    assert ServeLayout().world == 1
    assert ServeLayout(tp=4).world == ServeLayout(tp=4, ep=4).world == 4
    assert ServeLayout(ep=2, dp_attention=True).world == 2


def test_cli_names_the_options(checkpoints, capsys):
    from glm5.cli import main

    assert main(["serve", checkpoints["float"], "--dp-attention"]) == 2
    assert "--dp-attention expected with ep > 1" in capsys.readouterr().err
    assert main(["serve", checkpoints["float"], "--tp", "2", "--ep", "4"]) == 2
    assert "--ep expected 1 or tp=2" in capsys.readouterr().err


def test_cli_checks_the_model_dir_before_starting_ranks(tmp_path, capsys):
    from glm5.cli import main

    t0 = time.monotonic()
    assert main(["serve", str(tmp_path / "nope"), "--tp", "2"]) == 2
    assert "MODEL_DIR" in capsys.readouterr().err and time.monotonic() - t0 < 10


def test_the_ranks_command_line(checkpoints):
    from glm5.cli import build_parser
    from glm5.cli.errors import UsageError
    from glm5.cli.serve import ranks_argv

    def argv(*a):
        args = build_parser().parse_args(["serve", checkpoints["float"], *a])
        args.argv = ["serve", checkpoints["float"], *a]
        return ranks_argv(args, 4)

    one = argv("--tp", "4")
    assert "--nproc-per-node=4" in one and "--standalone" in one
    assert one[-6:] == ["--module", "glm5.cli", "serve", checkpoints["float"], "--tp", "4"]
    two = argv("--tp", "4", "--nnodes", "2", "--rdzv-endpoint", "h:29500", "--rdzv-id", "j")
    assert "--nproc-per-node=2" in two and "--nnodes=2" in two and "--standalone" not in two
    assert "--rdzv-endpoint=h:29500" in two and "--rdzv-id=j" in two
    with pytest.raises(UsageError, match="divide evenly"):
        argv("--tp", "4", "--nnodes", "3", "--rdzv-endpoint", "h:1")
    with pytest.raises(UsageError, match="--rdzv-endpoint expected with --nnodes"):
        argv("--tp", "4", "--rdzv-endpoint", "h:1")


def test_mtp_drafts_are_refused_with_dp_attention():
    from types import SimpleNamespace

    from glm5.serve.ranks import check_engine

    eng = SimpleNamespace(config=SimpleNamespace(num_speculative_tokens=2))
    with pytest.raises(ServeLayoutError, match="num_speculative_tokens"):
        check_engine(eng, ServeLayout(ep=2, dp_attention=True))
    check_engine(eng, ServeLayout(tp=2))  # replicated tokens: every rank drafts the same


# --------------------------------------------------------------------------- the command line
def _post(url: str, prompt, max_tokens: int, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={
        "model": "float", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}, timeout=timeout)


def test_cli_tp2_a_killed_rank_gives_503_and_a_non_zero_exit(checkpoints, references):
    cmd = ServeProcess([checkpoints["float"], "--tp", "2", "--rank-timeout", "20", "--page-size", "16",
                "--num-pages", "64"])
    try:
        r = _post(cmd.url, PROMPTS[0], MAX_TOKENS)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == \
            references["float"][0]
        pids = cmd.ranks()
        assert sorted(pids) == [0, 1], cmd.lines
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("r", _post(cmd.url, PROMPTS[1],
                                                                       900)))
        t.start()
        time.sleep(1.0)  # the long request is running
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        t.join(40)
        assert not t.is_alive(), "the open request hung"
        assert box["r"].status_code == 503, box["r"].text
        assert "rank" in box["r"].json()["error"]["message"]
        rc = cmd.proc.wait(40)
        assert rc not in (0, None) and time.monotonic() - t0 < 40, cmd.output
        assert "a rank failed" in cmd.output
        time.sleep(0.5)
        assert not any(alive(p) for p in pids.values())
    finally:
        cmd.kill()


def test_cli_dp_attention_sigterm_drains_and_stops_every_rank(checkpoints, references):
    cmd = ServeProcess([checkpoints["float"], "--ep", "2", "--dp-attention", "--page-size", "16",
                "--num-pages", "64"])
    try:
        for i in (2, 3):
            r = _post(cmd.url, PROMPTS[i], MAX_TOKENS)
            assert r.json()["choices"][0]["token_ids"] == references["float"][i]
        pids = cmd.ranks()
        assert sorted(pids) == [0, 1]
        cmd.proc.send_signal(signal.SIGTERM)
        assert cmd.proc.wait(60) == -signal.SIGTERM, cmd.output  # as one process ends
        time.sleep(0.5)
        assert not any(alive(p) for p in pids.values())
        assert "Traceback" not in cmd.output, cmd.output
    finally:
        cmd.kill()

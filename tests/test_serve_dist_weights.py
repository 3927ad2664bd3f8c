"""RL weight updates on `glm5 serve` across ranks (gloo, 2 processes; `glm5.serve.rank_weights`):
for TP 2, EP 2 and EP 2 + DP attention, a server started with allow_weight_updates takes
updates a `WeightPublisher` over a single-process copy of the checkpoint made ("sub", "xor"
with row-range checksums, "full"); after each, its greedy tokens equal a single-process engine
holding the same weights, they carry the new version, and its checksums equal the
single-process model's `state_checksums`. A corrupted update is refused with the checksum error
(400) and a stale one with 409, leaving tokens and version as they were."""

from __future__ import annotations

import asyncio
import copy

import httpx
import pytest
import torch

from glm5.engine.weight_sync import (WeightPublisher, WeightUpdate, row_checksums,
                                     state_checksums)
from glm5.testing.dist import DistPool, values
from test_serve_dist import _free_port, greedy_tokens, serve_in_world

ENGINE = {"page_size": 16, "num_pages": 32, "max_num_seqs": 8}
MAX_TOKENS = 5
PROMPTS = [[(7 * i + 3 * j) % 100 + 1 for j in range(18 + i)] for i in range(3)]
LAYOUTS = {"tp": {"tp": 2}, "ep": {"ep": 2}, "ep+dp-attention": {"ep": 2, "dp_attention": True}}
WEIGHTS = "/glm5/v1/weights"
CORRUPT = "model.layers.1.mlp.experts.gate_up_proj"  # cut on either layout (by expert)


def _greedy(model: torch.nn.Module) -> list[list[int]]:
    return greedy_tokens(copy.deepcopy(model), PROMPTS, ENGINE)


def _perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.02)


def _corrupted(u: WeightUpdate, name: str) -> bytes:
    """``u`` with one byte of ``name``'s payload flipped (in its last element: rank 1's cut)."""
    tensors = dict(u.tensors)
    t = tensors[name].clone()
    t.view(torch.uint8)[-1] ^= 1
    tensors[name] = t
    return WeightUpdate(u.base_version, u.version, u.mode, tensors, u.checksums, u.shapes,
                        u.dtypes, u.modes).to_bytes()


def _with_row_checksums(u: WeightUpdate, model: torch.nn.Module) -> WeightUpdate:
    sd = model.state_dict()
    sums = {}
    for n in u.tensors:
        rows = u.shapes[n][0] if u.shapes[n] else 1
        sums[n] = row_checksums(sd[n], [0, rows // 2, rows])
    return WeightUpdate(u.base_version, u.version, u.mode, u.tensors, sums, u.shapes, u.dtypes,
                        u.modes)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The checkpoint, the updates a trainer publishes over a copy of it, and what a
    single-process engine answers at each version."""
    from glm5.core import checkpoint
    from glm5.core.config import preset
    from glm5.core.model import GLM5ForCausalLM

    root = tmp_path_factory.mktemp("serve_dist_weights")
    torch.manual_seed(0)
    GLM5ForCausalLM(preset("tiny").replace(num_nextn_predict_layers=0)).eval() \
        .save_pretrained(root / "float")
    model = checkpoint.load_model(root / "float")
    pub = WeightPublisher(model, "sub")
    out = {"dir": str(root / "float"), "tokens": [_greedy(model)],
           "sums": [state_checksums(model)]}
    _perturb(model, 1)
    u1 = pub.publish()
    assert u1 is not None and CORRUPT in u1.tensors and "sub" in u1.modes.values()
    out["tokens"].append(_greedy(model))
    out["sums"].append(state_checksums(model))
    pub.mode = "xor"
    _perturb(model, 2)
    u2 = _with_row_checksums(pub.publish(), model)
    out["tokens"].append(_greedy(model))
    out["sums"].append(state_checksums(model))
    assert out["tokens"][0] != out["tokens"][1] != out["tokens"][2]  # the updates matter
    out["posts"] = [("corrupt", _corrupted(u1, CORRUPT)), ("v1", u1.to_bytes()),
                    ("v2", u2.to_bytes()), ("full", pub.full_update().to_bytes()),
                    ("stale", u1.to_bytes())]
    return out


async def _complete(c: httpx.AsyncClient, url: str, prompt: list[int]) -> dict:
    r = await c.post(url + "/v1/completions", json={
        "model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}, timeout=120)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    return {"ids": ch["token_ids"], "versions": ch["token_versions"]}


def _serve_updates(ctx, model_dir: str, parallel: dict, port: int,
                   posts: list[tuple[str, bytes]]) -> dict | None:
    """Every rank serves; rank 0's client reads tokens, version and checksums before the posts
    and after each."""

    def client(url: str, result: dict) -> None:
        with httpx.Client(timeout=120) as c:
            def look(what: str) -> None:
                async def run() -> list[dict]:
                    async with httpx.AsyncClient() as ac:  # at once: DP attention spreads them
                        return await asyncio.gather(*[_complete(ac, url, p) for p in PROMPTS])
                result[what] = {"completions": asyncio.run(run()),
                                "version": c.get(url + WEIGHTS,
                                                 params={"checksums": "false"}).json(),
                                "weights": c.get(url + WEIGHTS).json()}

            look("start")
            for name, data in posts:
                r = c.post(url + WEIGHTS, content=data,
                           headers={"content-type": "application/octet-stream"})
                result["post " + name] = (r.status_code, r.json())
                look(name)

    return serve_in_world(ctx, model_dir, port, client, engine_options=ENGINE,
                          parallel=parallel, allow_weight_updates=True)


@pytest.fixture(scope="module")
def world2():
    with DistPool(2, comm_timeout_s=60) as pool:
        yield pool


def _ids(seen: dict) -> list[list[int]]:
    return [c["ids"] for c in seen["completions"]]


def _at(seen: dict, version: int, case: dict, k: int) -> None:
    """What the server showed equals the single-process engine at weights ``k``, version
    ``version``."""
    assert _ids(seen) == case["tokens"][k]
    assert all(v == version for c in seen["completions"] for v in c["versions"])
    assert seen["version"] == {"version": version}
    assert seen["weights"]["version"] == version
    assert seen["weights"]["checksums"] == case["sums"][k]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_weight_updates_across_ranks_equal_the_single_process(world2, case, layout):
    res = values(world2.run(_serve_updates, case["dir"], LAYOUTS[layout], _free_port(),
                            case["posts"], timeout_s=180))[0]
    assert "error" not in res, res["error"]
    _at(res["start"], 0, case, 0)
    status, body = res["post corrupt"]  # refused: nothing changed on any rank
    assert status == 400, body
    msg = body["error"]["message"]
    assert CORRUPT in msg and "sha256" in msg and "nothing was applied" in msg, msg
    _at(res["corrupt"], 0, case, 0)
    assert res["post v1"] == (200, {"version": 1})  # "sub" (and "xor" where sub was inexact)
    _at(res["v1"], 1, case, 1)
    assert res["post v2"] == (200, {"version": 2})  # "xor", row-range checksums
    _at(res["v2"], 2, case, 2)
    assert res["post full"] == (200, {"version": 2})  # every tensor's bits
    _at(res["full"], 2, case, 2)
    status, body = res["post stale"]  # from version 0: the server holds 2
    assert status == 409 and "holds version 2" in body["error"]["message"], body
    _at(res["stale"], 2, case, 2)


# --------------------------------------------------------------------------- quantized, no HTTP
def _quantized_rank(ctx, model_dir: str, data: bytes) -> dict | None:
    """tp 2 over a w8a8 checkpoint (row-parallel parts widened by one column): the update
    through the lockstep round itself, then the checksums and greedy tokens."""
    from glm5.engine.engine import EngineConfig, LLMEngine
    from glm5.engine.sampling import SamplingParams
    from glm5.serve import ranks
    from glm5.serve.ranks import ServeLayout

    layout = ServeLayout(tp=2)
    eng = LLMEngine(ranks.load_rank_model(model_dir, layout, ctx, None), EngineConfig(**ENGINE))
    updates = ranks.weights(eng)
    if ctx.rank == 1:
        ranks.follow(eng, layout, updates)
        return None
    front = ranks.front(eng, layout, updates)
    try:
        out = {"version": front.weights_round("apply", data),
               "sums": front.weights_round("checksums")}
        for i, p in enumerate(PROMPTS):
            front.add_request(str(i), p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                        ignore_eos=True))
        done = {}
        while front.has_unfinished():
            done.update({o.request_id: o.token_ids for o in front.step() if o.finished})
        out["tokens"] = [done[str(i)] for i in range(len(PROMPTS))]
        return out
    finally:
        front.close()


def test_a_quantized_tp_server_takes_updates_of_its_packed_tensors(world2, case, tmp_path):
    """As one process does: the update names the quantized model's own tensors (codes xor'ed,
    scales changed), each cut in packed coordinates."""
    from glm5.core import checkpoint
    from glm5.deploy.quantize import quantize_checkpoint

    quantize_checkpoint(case["dir"], tmp_path / "w8a8", "w8a8")
    model = checkpoint.load_model(tmp_path / "w8a8")
    pub = WeightPublisher(model, "xor")
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("weight_packed"):
                t.view(torch.uint8)[..., ::5] ^= 1
            elif name.endswith("weight_scale"):
                t.mul_(1.01)
    u = pub.publish()
    assert any(n.endswith("o_proj.weight_packed") for n in u.tensors)  # row-parallel, widened
    res = values(world2.run(_quantized_rank, str(tmp_path / "w8a8"), u.to_bytes(),
                            timeout_s=120))[0]
    assert res["version"] == 1
    assert res["sums"] == state_checksums(model)
    assert res["tokens"] == _greedy(model)


# --------------------------------------------------------------------------- the whole table
def test_whole_table_assembles_shapes_and_refuses_what_cannot_be_one_tensor():
    from glm5.serve.rank_weights import RankWeightsError, whole_table

    f = torch.float32
    t = whole_table([
        {"norm": (None, (8,), f), "w": ((0, 0, 4), (4, 6), f), "o": ((1, 0, 3), (5, 4), f),
         "bias": (None, (5,), f)},  # o: a widened row-parallel part (3 columns + 1)
        {"norm": (None, (8,), f), "w": ((0, 4, 8), (4, 6), f), "o": ((1, 3, 6), (5, 4), f)}])
    assert t["norm"].shape == (8,) and t["norm"].local_on_rank0
    assert t["w"].shape == (8, 6) and t["w"].cuts == {0: (0, 0, 4), 1: (0, 4, 8)}
    assert t["o"].shape == (5, 6) and not t["o"].local_on_rank0
    assert t["bias"].cuts == {0: None}  # held by rank 0 only
    with pytest.raises(RankWeightsError, match="'w'.*uncovered"):
        whole_table([{"w": ((0, 0, 4), (4, 6), f)}, {"w": ((0, 5, 8), (3, 6), f)}])
    with pytest.raises(RankWeightsError, match="'n' has dtypes"):
        whole_table([{"n": (None, (8,), f)}, {"n": (None, (8,), torch.bfloat16)}])
    with pytest.raises(RankWeightsError, match="'n' makes whole shapes"):
        whole_table([{"n": (None, (8,), f)}, {"n": (None, (9,), f)}])

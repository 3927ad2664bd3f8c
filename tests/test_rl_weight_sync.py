"""Weight sync (glm5/rl/weight_sync.py) on the ``tiny`` preset: a trainer model takes a few AdamW
steps on random tokens, publishes the delta, and a copy of the initial model (the rollout
engine's) applies it. The oracle is the trainer's own tensors: after a sync the engine's must be
bit-identical (``torch.equal`` on the bits, and the checksums), in xor and sub mode, fp32 and
bf16; a damaged, stale or mismatched update must change nothing at all.
"""

from __future__ import annotations

import copy

import pytest
import torch

from glm5.core.config import preset
from glm5.core.model import GLM5ForCausalLM
from glm5.engine.engine import EngineConfig, LLMEngine
from glm5.engine.sampling import SamplingParams
from glm5.rl.trajectory import Trajectory
from glm5.rl.weight_sync import (ChecksumMismatchError, StaleUpdateError, WeightPublisher,
                                 WeightReceiver, WeightSyncError, WeightUpdate, apply_to_engine,
                                 staleness_weights, state_checksums, tensor_checksum,
                                 weights_equal)

DTYPES = [torch.float32, torch.bfloat16]
MODES = ["xor", "sub"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def base() -> GLM5ForCausalLM:
    torch.manual_seed(0)
    return GLM5ForCausalLM(preset("tiny"), with_mtp=False).float()


def _train(model: torch.nn.Module, steps: int = 2, lr: float = 1e-2, seed: int = 0) -> None:
    """A few AdamW steps of next-token loss on random ids (moves every trainable tensor)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    V = model.config.vocab_size
    for _ in range(steps):
        ids = torch.randint(0, V, (2, 8), generator=g)
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V).float(),
                                                 ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def _pair(base: GLM5ForCausalLM, dtype: torch.dtype) -> tuple[GLM5ForCausalLM, GLM5ForCausalLM]:
    """(trainer, engine model): two copies of the same initial weights."""
    trainer = copy.deepcopy(base).to(dtype)
    return trainer, copy.deepcopy(trainer)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _bits_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """The test's own bitwise comparison (independent of weights_equal)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for n in sa:
        x, y = sa[n], sb[n]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return False
    return True


def _flip_bit(update: WeightUpdate, name: str) -> None:
    """Flip the sign bit of one payload element, in place: the element of largest magnitude of
    a float ("sub") payload, whose sign flip moves the result (flipping a low bit of a tiny
    delta can round to the same weight, a harmless change the checksum rightly accepts); any
    element of a bit payload, where every flipped bit flips one in the result."""
    p = update.tensors[name]
    i = int(p.abs().argmax()) if p.is_floating_point() else p.numel() // 2
    size = p.element_size()
    p.view(torch.uint8)[i * size + size - 1] ^= 0x80  # little-endian: the top byte is last


# --------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES)
def test_publish_apply_is_bit_exact(base, dtype, mode):
    trainer, engine = _pair(base, dtype)
    pub, rec = WeightPublisher(trainer, mode=mode), WeightReceiver(engine)
    for step in (1, 2):  # two syncs in a row: the second starts from the first's result
        _train(trainer, seed=step)
        assert not _bits_equal(trainer, engine)
        u = pub.publish()
        assert (u.base_version, u.version, pub.version) == (step - 1, step, step)
        assert rec.apply(u) == step and rec.version == step
        assert _bits_equal(trainer, engine)
        for n, t in trainer.state_dict().items():
            assert torch.equal(t, engine.state_dict()[n]), n
        assert rec.checksums() == state_checksums(trainer) == pub.checksums()
        assert weights_equal(trainer, engine)
    if mode == "sub":
        # lr 1e-2 moves small matrix weights by more than a factor 2 somewhere (subtraction not
        # exact: sent as xor); norm weights near 1 stay exact: both encodings are exercised.
        assert set(u.modes.values()) == {"sub", "xor"}
        for n, k in u.modes.items():
            assert u.tensors[n].dtype == (dtype if k == "sub" else torch.int16 if
                                          dtype == torch.bfloat16 else torch.int32)
    else:
        assert set(u.modes.values()) == {"xor"}


def test_xor_payload_is_the_bit_difference(base):
    trainer, _ = _pair(base, torch.float32)
    before = _snapshot(trainer)
    pub = WeightPublisher(trainer)
    _train(trainer)
    u = pub.publish()
    name = "model.norm.weight"
    want = (trainer.state_dict()[name].view(torch.int32) ^ before[name].view(torch.int32))
    assert torch.equal(u.tensors[name], want.reshape(-1))
    assert u.checksums[name] == tensor_checksum(trainer.state_dict()[name])


# --------------------------------------------------------------------------- only what changed
def test_only_changed_tensors_are_sent(base):
    trainer, engine = _pair(base, torch.float32)
    frozen = [n for n, p in trainer.named_parameters()
              if "embed_tokens" in n or ".indexer." in n or n.startswith("model.layers.1.")]
    for n, p in trainer.named_parameters():
        p.requires_grad_(n not in frozen)
    before = _snapshot(trainer)
    pub, rec = WeightPublisher(trainer), WeightReceiver(engine)
    _train(trainer)
    changed = {n for n, t in trainer.state_dict().items()
               if not torch.equal(t.view(torch.int32), before[n].view(torch.int32))}
    u = pub.publish()
    assert set(u.tensors) == changed and changed  # exactly the tensors whose bytes moved
    assert not set(frozen) & set(u.tensors)
    full = pub.full_update()
    assert u.nbytes == sum(trainer.state_dict()[n].numel() * 4 for n in changed) < full.nbytes
    assert full.nbytes == sum(t.numel() * 4 for t in trainer.state_dict().values())
    rec.apply(u)
    assert _bits_equal(trainer, engine)
    # Nothing moved since: no update, the version stays.
    assert pub.publish() is None and pub.version == 1


# --------------------------------------------------------------------------- atomicity
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["first", "last"])
def test_corrupted_payload_changes_nothing(base, mode, where):
    trainer, engine = _pair(base, torch.float32)
    pub, rec = WeightPublisher(trainer, mode=mode), WeightReceiver(engine)
    _train(trainer)
    u = pub.publish()
    names = list(u.tensors)
    # In sub mode pick a tensor sent as sub, so the damaged arithmetic is the float one.
    cand = [n for n in names if u.modes[n] == mode]
    victim = cand[0] if where == "first" else cand[-1]
    good = u.tensors[victim].clone()
    _flip_bit(u, victim)
    before = _snapshot(engine)
    with pytest.raises(ChecksumMismatchError, match=victim.replace(".", r"\.")):
        rec.apply(u)
    assert rec.version == 0
    for n, t in engine.state_dict().items():
        assert torch.equal(t, before[n]), n
    u.tensors[victim] = good  # the intact update still applies
    assert rec.apply(u) == 1 and _bits_equal(trainer, engine)


def test_failed_copy_is_rolled_back(base):
    """A copy into the model that fails half-way (here: a buffer the engine made an inference
    tensor, which refuses in-place writes) puts back every tensor already copied."""
    trainer, engine = _pair(base, torch.float32)
    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    pub, rec = WeightPublisher(trainer), WeightReceiver(engine)
    _train(trainer)
    with torch.no_grad():
        trainer.model.layers[2].mlp.gate.e_score_correction_bias.add_(0.5)  # a buffer moves too
    u = pub.publish()
    assert name in u.tensors and list(u.tensors).index(name) > 10  # copies happened before it
    with torch.inference_mode():
        frozen = engine.model.layers[2].mlp.gate.e_score_correction_bias.clone()
    engine.model.layers[2].mlp.gate.e_score_correction_bias = frozen
    before = _snapshot(engine)
    with pytest.raises(RuntimeError, match="[Ii]nference"):
        rec.apply(u)
    assert rec.version == 0
    for n, t in engine.state_dict().items():
        assert torch.equal(t, before[n]), n


def test_wrong_checksum_changes_nothing(base):
    trainer, engine = _pair(base, torch.float32)
    pub, rec = WeightPublisher(trainer), WeightReceiver(engine)
    _train(trainer)
    u = pub.publish()
    last = list(u.tensors)[-1]
    u.checksums[last] = "0" * 64
    before = _snapshot(engine)
    with pytest.raises(ChecksumMismatchError, match="nothing was applied"):
        rec.apply(u)
    assert rec.version == 0 and all(torch.equal(t, before[n])
                                    for n, t in engine.state_dict().items())


def test_update_from_another_base_state_is_refused(base):
    """A receiver whose tensors are not the publisher's base (same version number) computes a
    wrong result: the checksum refuses it."""
    trainer, engine = _pair(base, torch.float32)
    with torch.no_grad():
        engine.model.norm.weight.add_(1.0)
    pub, rec = WeightPublisher(trainer), WeightReceiver(engine)
    _train(trainer)
    with pytest.raises(ChecksumMismatchError, match="model.norm.weight"):
        rec.apply(pub.publish())
    assert rec.version == 0


def test_stale_update_raises(base):
    trainer, engine = _pair(base, torch.float32)
    pub, rec = WeightPublisher(trainer), WeightReceiver(engine)
    _train(trainer, seed=1)
    u1 = pub.publish()
    _train(trainer, seed=2)
    u2 = pub.publish()
    before = _snapshot(engine)
    with pytest.raises(StaleUpdateError, match="from version 1 to 2.*holds version 0"):
        rec.apply(u2)
    assert rec.version == 0 and all(torch.equal(t, before[n])
                                    for n, t in engine.state_dict().items())
    rec.apply(u1)
    with pytest.raises(StaleUpdateError, match="from version 0 to 1.*holds version 1"):
        rec.apply(u1)  # applied twice
    assert rec.apply(u2) == 2 and _bits_equal(trainer, engine)


@pytest.mark.parametrize("damage", ["unknown", "shape", "dtype"])
def test_mismatched_tensor_names_it_and_changes_nothing(base, damage):
    trainer, engine = _pair(base, torch.float32)
    pub, rec = WeightPublisher(trainer), WeightReceiver(engine)
    _train(trainer)
    u = pub.publish()
    name = list(u.tensors)[-1]
    if damage == "unknown":
        for d in (u.tensors, u.checksums, u.shapes, u.dtypes, u.modes):
            d["model.no_such.weight"] = d.pop(name)
        name, msg = "model.no_such.weight", "not in the model's state_dict"
    elif damage == "shape":
        u.shapes[name] = (1, *u.shapes[name])
        msg = "in the model, the update has"
    else:
        u.dtypes[name] = torch.float64
        msg = "in the model, the update has"
    before = _snapshot(engine)
    with pytest.raises(WeightSyncError, match=f"{name.replace('.', r'[.]')}.*{msg}"):
        rec.apply(u)
    assert rec.version == 0 and all(torch.equal(t, before[n])
                                    for n, t in engine.state_dict().items())


# --------------------------------------------------------------------------- full update
def test_full_update_brings_a_fresh_model_up(base):
    trainer, _ = _pair(base, torch.float32)
    pub = WeightPublisher(trainer, mode="sub")
    for s in (1, 2):
        _train(trainer, seed=s)
        pub.publish()
    torch.manual_seed(123)
    fresh = GLM5ForCausalLM(preset("tiny"), with_mtp=False).float()  # other initial weights
    assert not _bits_equal(trainer, fresh)
    rec = WeightReceiver(fresh, version=0)
    published = _snapshot(trainer)
    _train(trainer, seed=3)  # unpublished: the full update carries version 2, not these
    full = pub.full_update()
    assert full.mode == "full" and full.version == 2 and set(full.tensors) == set(published)
    assert rec.apply(full) == 2
    assert all(torch.equal(t, published[n]) for n, t in fresh.state_dict().items())
    u3 = pub.publish()  # the deltas follow on from the full update
    assert rec.apply(u3) == 3 and _bits_equal(trainer, fresh)


def test_full_update_missing_a_tensor_is_refused(base):
    trainer, engine = _pair(base, torch.float32)
    full = WeightPublisher(trainer).full_update()
    name = "lm_head.weight"
    for d in (full.tensors, full.checksums, full.shapes, full.dtypes, full.modes):
        del d[name]
    with pytest.raises(WeightSyncError, match="lacks tensor 'lm_head.weight'"):
        WeightReceiver(engine).apply(full)


# --------------------------------------------------------------------------- wire format
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["xor", "sub", "full"])
def test_to_bytes_round_trip(base, dtype, kind):
    trainer, engine = _pair(base, dtype)
    pub = WeightPublisher(trainer, mode="sub" if kind == "sub" else "xor")
    _train(trainer)
    u = pub.full_update() if kind == "full" else pub.publish()
    b = u.to_bytes()
    v = WeightUpdate.from_bytes(b)
    assert (v.base_version, v.version, v.mode) == (u.base_version, u.version, u.mode)
    assert (v.checksums, v.shapes, v.dtypes, v.modes) == (u.checksums, u.shapes, u.dtypes,
                                                          u.modes)
    assert v.tensors.keys() == u.tensors.keys()
    for n, t in u.tensors.items():
        assert v.tensors[n].dtype == t.dtype and torch.equal(v.tensors[n], t), n
    assert v.nbytes == u.nbytes and v.to_bytes() == b
    WeightReceiver(engine, version=u.base_version).apply(v)
    want = pub.checksums() if kind != "full" else state_checksums(base.to(dtype))
    assert state_checksums(engine) == want


def test_from_bytes_rejects_other_bytes():
    from safetensors.torch import save

    with pytest.raises(WeightSyncError, match="not a safetensors weight update"):
        WeightUpdate.from_bytes(b"hello world, not safetensors")
    with pytest.raises(WeightSyncError, match="no 'glm5_weight_update' header"):
        WeightUpdate.from_bytes(save({"x": torch.zeros(2)}))
    with pytest.raises(WeightSyncError, match="expected format 'glm5-weight-update' version 1, "
                                              "got 'other' version 1"):
        WeightUpdate.from_bytes(save({"x": torch.zeros(2)}, metadata={
            "glm5_weight_update": '{"format": "other", "format_version": 1}'}))
    with pytest.raises(WeightSyncError, match="b expected bytes"):
        WeightUpdate.from_bytes("text")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- engine
def test_engine_update_moves_version_and_empties_prefix_cache(base):
    trainer, model = _pair(base, torch.float32)
    engine = LLMEngine(model, EngineConfig(num_pages=64, page_size=16))
    pub, rec = WeightPublisher(trainer), WeightReceiver(engine.model)
    prompt = list(range(2, 36))  # two whole pages go to the prefix cache when it finishes
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def run(rid: str) -> list[int]:
        engine.add_request(rid, prompt, params)
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished]
        return outs[-1].token_versions

    assert run("a") == [0, 0] and engine.radix.num_cached_pages > 0
    _train(trainer)
    u = pub.publish()
    bad = copy.deepcopy(u)
    _flip_bit(bad, list(bad.tensors)[-1])
    with pytest.raises(ChecksumMismatchError):
        apply_to_engine(engine, rec, bad)  # refused: neither the engine nor its cache moves
    assert engine.weights_version == 0 and engine.radix.num_cached_pages > 0
    assert apply_to_engine(engine, rec, u) == 1
    assert engine.weights_version == 1 and engine.radix.num_cached_pages == 0
    assert weights_equal(engine.model, trainer)
    assert weights_equal(rec.checksums(), trainer)  # a remote engine's report, by checksum
    assert run("b") == [1, 1]
    with pytest.raises(WeightSyncError, match="receiver.model is not engine.model"):
        apply_to_engine(engine, WeightReceiver(copy.deepcopy(model), version=1),
                        pub.full_update())


def test_async_engine_update_runs_between_steps(base):
    import asyncio

    from glm5.engine.async_engine import AsyncEngine

    trainer, model = _pair(base, torch.float32)
    aeng = AsyncEngine(LLMEngine(model, EngineConfig(num_pages=64, page_size=16)))
    try:
        pub, rec = WeightPublisher(trainer), WeightReceiver(model)
        _train(trainer)
        assert apply_to_engine(aeng, rec, pub.publish()) == 1
        assert aeng.engine.weights_version == 1 and weights_equal(model, trainer)
    finally:
        assert asyncio.run(aeng.shutdown(timeout=5.0))


# --------------------------------------------------------------------------- helpers
def test_weights_equal_sees_one_bit(base):
    a, b = _pair(base, torch.float32)
    assert weights_equal(a, b) and weights_equal(a, state_checksums(b))
    assert weights_equal(a.state_dict(), b)
    with torch.no_grad():
        w = b.model.norm.weight
        w.view(torch.int32)[5] ^= 1  # one mantissa bit
    assert not weights_equal(a, b) and not weights_equal(a, state_checksums(b))
    zero_a, zero_b = {"z": torch.tensor([0.0])}, {"z": torch.tensor([-0.0])}
    assert not weights_equal(zero_a, zero_b)  # equal as numbers, not as bits
    assert not weights_equal({"x": torch.zeros(2)}, {"y": torch.zeros(2)})
    assert not weights_equal({"x": torch.zeros(2)}, {"x": torch.zeros(2, dtype=torch.float64)})
    with pytest.raises(TypeError, match="weights_equal: a expected"):
        weights_equal([1], b)  # type: ignore[arg-type]


def _traj(i: int, versions: list[int]) -> Trajectory:
    return Trajectory(traj_id=f"t{i}", group_id="g", task_type="reverse", prompt_ids=[2, 3],
                      completion_ids=[4] * len(versions), logprobs=[-1.0] * len(versions),
                      versions=versions)


def test_staleness_weights_hand_cases():
    trajs = [_traj(0, [10, 10]), _traj(1, [8, 10]), _traj(2, [7, 9]), _traj(3, [5]),
             _traj(4, [])]  # t4: no completion tokens, its prompt's version (meta) is 0
    # staleness at version 10: 0, 2, 3, 5, 10 with max_staleness 2
    assert staleness_weights(trajs, 10, 2, "drop") == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert staleness_weights(trajs, 10, 2, "downweight") == [1.0, 1.0, 0.5, 0.125, 0.5 ** 8]
    assert staleness_weights(trajs, 10, 0, "drop") == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert staleness_weights([], 3, 1, "drop") == []
    with pytest.raises(ValueError, match="policy expected one of"):
        staleness_weights(trajs, 10, 2, "ignore")
    with pytest.raises(ValueError, match="max_staleness expected an int >= 0"):
        staleness_weights(trajs, 10, -1, "drop")
    with pytest.raises(ValueError, match="trajectory 't0' has version 10, newer than"):
        staleness_weights(trajs, 9, 2, "drop")


def test_publisher_and_receiver_reject_bad_arguments(base):
    with pytest.raises(WeightSyncError, match="mode expected one of"):
        WeightPublisher(base, mode="full")
    with pytest.raises(TypeError, match="model expected an nn.Module"):
        WeightReceiver({"a": torch.zeros(1)})  # type: ignore[arg-type]
    with pytest.raises(WeightSyncError, match="mode expected one of"):
        WeightUpdate(0, 1, "gzip", {}, {}, {}, {})

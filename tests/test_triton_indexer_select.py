"""The threshold-filtered running selection of the Triton indexer_topk / paged_indexer_topk
kernels (glm5/kernels/triton/_indexer_kernels.py): exact output and the number of merges.

Scores are designed through the keys' features: k[s] = (s, S - s, r1[s], r2[s]) with r1 a
random permutation and r2 small random integers, so a query (1, 0, 0, 0) scores keys in
increasing order (every key beats the threshold: the buffer overflows at tile boundaries),
(0, 1, 0, 0) in decreasing order, (1, 1, 0, 0) all equal (ties: the smallest indices win),
(0, 0, 1, 0) randomly and (0, 0, 0, 1) randomly with many ties. Inputs are small integers,
so every score is exact and the output must be exactly the reference's.

The merge count (``merge_counts=``, an int32 [T] tensor the kernels fill on request) is checked
against ``model_merges``, the documented schedule written out independently: before each key
tile of the block (tiles start at the block's smallest k_start) a row that a full tile could
overflow (more than W - BLOCK_S of its W = 2*CH slots filled) is merged (keeping its best CH,
threshold = the TOPK-th); then the row's keys above its threshold are appended; a row with keys
appended since its last merge is merged once more at the end. Planted bugs in the kernel source
(threshold compare, threshold slot, final merge, kept count, the bitonic top-k merge) must each
fail these checks.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import glm5  # noqa: E402
import paged_util  # noqa: E402
from glm5.ir.ops_dsa import indexer_topk_ref, lightning_indexer_ref  # noqa: E402
from glm5.kernels.triton import indexer  # noqa: E402
from glm5.kernels.triton.launch import next_pow2  # noqa: E402
from glm5.testing.compare import assert_matches  # noqa: E402

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP else "cuda"
I32 = torch.int32
BS = 16  # BLOCK_S of every case here: tiles of 16 keys


def _tuning(op: str, merge: str, **extra) -> dict:
    # BLOCK_T 16: every case's queries share one block (one tile grid starting at its lo)
    return {**indexer.DEFAULTS[op], "BLOCK_S": BS, "BLOCK_T": 16, "BLOCK_D": 16,
            "MERGE": merge, **extra}


# --------------------------------------------------------------------------- the model
def model_merges(scores: torch.Tensor, lo: int, hi: int, topk: int) -> list[int]:
    """Per row of ``scores`` ([T, S] float64, -inf = not in the row's range): the merges the
    documented schedule makes over key tiles [lo + i*BS, lo + (i+1)*BS) of [lo, hi)."""
    ch = max(next_pow2(topk), 2 * BS, 16)
    W = 2 * ch
    out = []
    for row in scores.tolist():
        kept: list[tuple[float, int]] = []  # (score, -index): Python order = the contract's
        thr = None  # None: nothing to beat (fewer than topk keys merged so far)
        merges, dirty = 0, False
        for s0 in range(lo, hi, BS):
            if len(kept) > W - BS:  # a full tile could overflow the row: merge first
                merges += 1
                kept = sorted(kept, reverse=True)[:ch]
                thr = kept[topk - 1] if len(kept) >= topk else None
                dirty = False
            tile = [(row[s], -s) for s in range(s0, min(s0 + BS, hi)) if row[s] != -math.inf]
            take = [x for x in tile if thr is None or x > thr]
            kept += take
            dirty = dirty or bool(take)
        out.append(merges + int(dirty))
    return out


def _block_span(ks: torch.Tensor, ke: torch.Tensor) -> tuple[int, int]:
    ne = ks < ke
    return int(ks[ne].min()), int(ke[ne].max())


# --------------------------------------------------------------------------- designed cases
S = 100
ROWS = [  # (q features, k_start, k_end, why)
    ((1, 0, 0, 0), 0, S, "increasing: exactly W - BLOCK_S slots filled before tile 3 (no "
                         "merge), all W before tile 4 (merge)"),
    ((1, 0, 0, 0), 15, S, "increasing, 1 key in tile 0: W - BLOCK_S + 1 filled before tile 3"),
    ((1, 0, 0, 0), 5, 48, "increasing, ends on a tile boundary"),
    ((0, 1, 0, 0), 0, S, "decreasing: one overflow merge, then nothing passes"),
    ((1, 1, 0, 0), 3, S, "all scores equal: the smallest indices, in order"),
    ((1, 1, 0, 0), 70, 71, "a single key"),
    ((0, 0, 1, 0), 0, S, "random, distinct scores"),
    ((0, 0, 0, 1), 0, S, "random with ties"),
    ((0, 0, 2, -1), 9, 90, "random with ties, negative scores relu'd to 0"),
    ((0, 0, 1, 0), 40, 43, "3 keys, fewer than topk: -1 tail"),
    ((1, 0, 0, 0), 20, 20, "empty range"),
    ((0, 1, 0, 0), 0, 0, "empty range at 0"),
    ((0, 1, 0, 0), S, S, "empty range at S"),
]


def designed_case(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = torch.arange(S, dtype=torch.float64)
    r1 = torch.randperm(S, generator=g)  # distinct
    # the 5 best of r1 among the first 64 keys and the 6th best at key 80: for topk 6 the 6th
    # arrives after the first merge (before tile [64, 80)), just above the threshold it must beat
    for pos, val in zip((2, 7, 11, 19, 30, 80), range(S - 1, S - 7, -1)):
        at = int((r1 == val).nonzero())
        r1[at], r1[pos] = r1[pos].clone(), val
    r1 = r1.double()
    r2 = torch.randint(0, 6, (S,), generator=g).double()  # many ties
    k = torch.stack([s, S - s, r1, r2], dim=1)
    f = torch.tensor([row[0] for row in ROWS], dtype=torch.float64)
    Hi = 3  # padded to 4 heads: one masked row per query in the dot
    q = f[:, None, :].expand(-1, Hi, -1).contiguous()
    w = torch.tensor([1.0, 2.0, 1.0]).expand(len(ROWS), Hi).contiguous()
    ks = torch.tensor([row[1] for row in ROWS], dtype=I32)
    ke = torch.tensor([row[2] for row in ROWS], dtype=I32)
    return q.to(dtype), k.to(dtype), w.to(dtype), ks, ke


def run_topk(fn, case, topk):
    q, k, w, ks, ke = case
    mc = torch.full((q.shape[0],), -7, dtype=I32, device=DEV)
    got = fn(q.to(DEV), k.to(DEV), w.to(DEV), ks.to(DEV), ke.to(DEV), topk, merge_counts=mc)
    return got.cpu(), mc.cpu()


def check_designed(fn, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the designed case: exactly the reference, merges exactly the model's; returns
    (idx, merge counts)."""
    case = designed_case()
    q, k, w, ks, ke = case
    got, mc = run_topk(fn, case, topk)
    want = indexer_topk_ref(q.double(), k.double(), w.double(), ks, ke, topk)
    assert torch.equal(got, want), (topk, got, want)
    scores = lightning_indexer_ref(q.double(), k.double(), w.double(), ks, ke)
    want_m = model_merges(scores, *_block_span(ks, ke), topk)
    assert mc.tolist() == want_m, (topk, mc.tolist(), want_m)
    return got, mc


@pytest.mark.parametrize("merge", ["rank", "sort"])
def test_designed_rows_exact_output_and_merges(merge):
    fn = indexer.make_indexer_topk(_tuning("indexer_topk", merge))
    # CH 32, W 64 for topk 6; topk 32: TOPK == CH, the tightest buffer (the rank merge only:
    # the bitonic one is slow under the interpreter; both merge the same rows at the same points)
    if merge == "rank" or not INTERP:
        check_designed(fn, 32)
    got, mc = check_designed(fn, 6)
    # the plain expectations the model stands for, for topk 6
    # S=100, W=64: 48 slots filled before tile 3 (no merge), 64 before tile 4 (merge, 32 kept),
    # 48 before tile 5 (no merge), 64 before tile 6 (merge); the final merge
    assert mc[0] == 3
    assert mc[1] > 1 and mc[3] == 1 and mc[4] == 1  # overflow / no overflow after it
    assert got[4].tolist() == [3, 4, 5, 6, 7, 8]  # ties: smallest indices first
    assert got[3].tolist() == [0, 1, 2, 3, 4, 5]
    assert got[0].tolist() == [99, 98, 97, 96, 95, 94]
    assert sorted(got[9, :3].tolist()) == [40, 41, 42] and (got[9, 3:] == -1).all()
    for r in (10, 11, 12):  # empty ranges: all -1, never merged
        assert (got[r] == -1).all() and mc[r] == 0
    assert mc[5] == 1 and got[5].tolist() == [70, -1, -1, -1, -1, -1]


def test_topk_at_least_every_range():
    # topk 100 = S: CH 128, no overflow ever, one merge per row with keys, -1 tails
    fn = indexer.make_indexer_topk(_tuning("indexer_topk", "auto"))
    check_designed(fn, S)


def test_merges_are_few_on_random_data():
    """Random Gaussian inputs, 4 queries over S = 512 keys, topk 8 (CH 32, W 64): the former
    design sorted after every chunk of max(next_pow2(topk), BLOCK_S) = 16 keys, 32 sorts per
    query. Once a merge has seen n keys, a new key passes the threshold with probability
    topk/n, so the CH - BLOCK_S free slots last until the stream has grown by a factor
    1 + (CH - BLOCK_S)/topk = 3: about log3(S/W) + 2 merges (3 here)."""
    g = torch.Generator().manual_seed(3)
    T, Sr, Hi, Di, topk = 4, 512, 2, 16, 8
    q = torch.randn(T, Hi, Di, generator=g)
    k = torch.randn(Sr, Di, generator=g)
    w = torch.rand(T, Hi, generator=g) + 0.5
    ks = torch.zeros(T, dtype=I32)
    ke = torch.full((T,), Sr, dtype=I32)
    fn = indexer.make_indexer_topk(_tuning("indexer_topk", "auto"))
    got, mc = run_topk(fn, (q, k, w, ks, ke), topk)
    op = glm5.get_op("indexer_topk")
    assert_matches(op, got, {"q": q, "k": k, "w": w, "k_start": ks, "k_end": ke, "topk": topk})
    chunks = Sr // max(next_pow2(topk), BS)  # the former design's sorts per query
    assert int(mc.max()) <= chunks // 8, (mc, chunks)
    assert int(mc.min()) >= 2  # the first overflow and the final merge
    # on exact (integer) random scores the count is the model's
    qi = torch.randint(-3, 4, (T, Hi, Di), generator=g).double()
    ki = torch.randint(-3, 4, (Sr, Di), generator=g).double()
    wi = torch.randint(1, 3, (T, Hi), generator=g).double()
    got, mc = run_topk(fn, (qi.float(), ki.float(), wi.float(), ks, ke), topk)
    assert torch.equal(got, indexer_topk_ref(qi, ki, wi, ks, ke, topk))
    scores = lightning_indexer_ref(qi, ki, wi, ks, ke)
    assert mc.tolist() == model_merges(scores, 0, Sr, topk)
    assert int(mc.max()) <= chunks // 8


def test_merge_counts_argument_checked():
    fn = indexer.make_indexer_topk(_tuning("indexer_topk", "rank"))
    q, k, w, ks, ke = designed_case()
    with pytest.raises(ValueError, match="indexer_topk: argument 'merge_counts' expected"):
        fn(q.to(DEV), k.to(DEV), w.to(DEV), ks.to(DEV), ke.to(DEV), 6,
           merge_counts=torch.zeros(q.shape[0], dtype=torch.int64, device=DEV))


# --------------------------------------------------------------------------- paged
def paged_case(seed=0):
    """Three sequences of 90, 71 (mid-page) and 0 keys in a shuffled pool of 4-row pages, with
    logical keys featured as above (key j of a sequence of L keys: (j, L - j, r, r')); queries
    of each kind per sequence, interleaved in one block."""
    g = torch.Generator().manual_seed(seed)
    ps, lens = 4, [90, 71, 0]
    pages = [-(-n // ps) for n in lens]
    perm = torch.randperm(sum(pages) + 2, generator=g).tolist()
    table = torch.full((3, max(pages) + 1), -1, dtype=I32)
    k = torch.zeros(((sum(pages) + 2) * ps, 4), dtype=torch.float64)
    for b, n in enumerate(lens):
        for p in range(pages[b]):
            table[b, p] = perm.pop()
        for j in range(n):
            row = int(table[b, j // ps]) * ps + j % ps
            r = torch.randint(0, 6, (2,), generator=g).double()
            k[row] = torch.tensor([j, n - j, float(r[0]), float(r[1])])
    feats = [(1, 0, 0, 0), (0, 1, 0, 0), (1, 1, 0, 0), (0, 0, 1, 2)]
    seq, k_len, f = [], [], []
    for i, x in enumerate(feats):
        for b, n in enumerate(lens):
            seq.append(b)
            k_len.append(max(0, n - 3 * i) if n else 0)
            f.append(x)
    Hi = 2
    q = torch.tensor(f, dtype=torch.float64)[:, None, :].expand(-1, Hi, -1).contiguous()
    w = torch.ones(len(f), Hi, dtype=torch.float64)
    return {"q": q.float(), "k": k.float(), "w": w.float(), "block_table": table,
            "seq": torch.tensor(seq, dtype=I32), "k_len": torch.tensor(k_len, dtype=I32),
            "page_size": ps, "topk": 6}


@pytest.mark.parametrize("merge", ["rank", "sort"])
def test_paged_exact_output_and_merges(merge):
    fn = indexer.make_paged_indexer_topk(_tuning("paged_indexer_topk", merge))
    v = paged_case()
    op = glm5.get_op("paged_indexer_topk")
    op.validate((), v)
    dev = {n: x.to(DEV) if isinstance(x, torch.Tensor) else x for n, x in v.items()}
    mc = torch.full((v["q"].shape[0],), -7, dtype=I32, device=DEV)
    got = fn(*paged_util.args(dev), merge_counts=mc).cpu()
    assert torch.equal(got, op.reference(*paged_util.args(v))), got
    # merges: each query's logical keys 0 .. k_len-1 stream in tiles from 0 (its own pass)
    want = []
    for t in range(v["q"].shape[0]):
        n = int(v["k_len"][t])
        rows = paged_util.logical_rows(v["block_table"][int(v["seq"][t])].tolist(), 4, n)
        keys = v["k"][torch.tensor(rows, dtype=torch.long)] if n else v["k"][:0]
        sc = lightning_indexer_ref(v["q"][t:t + 1].double(), keys.double(),
                                   v["w"][t:t + 1].double(), torch.zeros(1, dtype=I32),
                                   torch.full((1,), n, dtype=I32))
        want += model_merges(sc, 0, n, 6) if n else [0]
    assert mc.cpu().tolist() == want
    assert max(want) >= 2  # some query overflowed its buffer


# --------------------------------------------------------------------------- planted bugs
KERNELS = Path(indexer.__file__).with_name("_indexer_kernels.py")
MUTANTS = {  # name: (kernel source, planted bug, merge path it is in)
    # a key equal to the threshold (an empty slot's SENT while the row is not full) is let in
    "threshold compare >=": ("(key > thr[:, None])", "(key >= thr[:, None])", "rank"),
    # the threshold one slot too high: the key that belongs at slot TOPK-1 is filtered out
    "threshold slot TOPK-2": ("rows + (TOPK - 1)", "rows + (TOPK - 2)", "rank"),
    # appends do not mark the row for the final merge: its last candidates are decoded
    # unsorted, or not at all
    "no final merge": ("return cnt + n, dirty | (n > 0)", "return cnt + n, dirty", "rank"),
    # too few keys kept at a merge: the appends overwrite the running set
    "keeps TOPK - 1": ("tl.minimum(cnt, CH), cnt)", "tl.minimum(cnt, TOPK - 1), cnt)", "rank"),
    # bitonic top-k: the running set taken as sorted on the row's first merge
    "first merge skips sorting A": ("tl.where(sel, merges, 0), axis=0) == 0:",
                                    "tl.where(sel, merges, 0), axis=0) == 1:", "sort"),
    # bitonic top-k: the buffer sorted the same way as the running set (max is then no top-k)
    "buffer sorted descending": ("tl.sort(vb, descending=False)", "tl.sort(vb, descending=True)",
                                 "sort"),
}


def _mutant_module(name: str, tmp_path: Path):
    old, new, _ = MUTANTS[name]
    src = KERNELS.read_text()
    assert old in src, f"the planted bug {name!r} no longer matches the kernel source"
    path = tmp_path / f"_indexer_kernels_mut_{abs(hash(name))}.py"
    path.write_text(src.replace(old, new))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_planted_selection_bugs_fail(name, tmp_path, monkeypatch):
    mod = _mutant_module(name, tmp_path)
    monkeypatch.setattr(indexer, "_k", lambda: mod)
    fn = indexer.make_indexer_topk(_tuning("indexer_topk", MUTANTS[name][2]))
    with pytest.raises(AssertionError):
        check_designed(fn, 6)


# --------------------------------------------------------------------------- split top-k
# ascend's grid policy: 3 programs walk the (block, window) tiles; blocks of 4 queries
PERSISTENT = {"grid": "persistent", "programs": 3, "BLOCK_T": 4}


@pytest.mark.parametrize("grid", ["tiles", "persistent"])
@pytest.mark.parametrize("split", [2, 3, 7])
def test_split_topk_exact(split, grid):
    """Split top-k (decode): each query block's keys cut into `split` 16-key-aligned windows,
    each window's best topk order keys merged by a second kernel: exactly the reference,
    ties included (7 windows of the 100 keys: some rows' ranges miss most windows, empty
    rows stay all -1). With merge_counts the launch does not split (the counts describe one
    selection)."""
    pol = PERSISTENT if grid == "persistent" else {}
    fn = indexer.make_indexer_topk(_tuning("indexer_topk", "rank", SPLIT_K=split, **pol))
    q, k, w, ks, ke = designed_case()
    for topk in (6, 32):
        got = fn(q.to(DEV), k.to(DEV), w.to(DEV), ks.to(DEV), ke.to(DEV), topk).cpu()
        want = indexer_topk_ref(q.double(), k.double(), w.double(), ks, ke, topk)
        assert torch.equal(got, want), (split, topk, got, want)
    if grid == "tiles":  # merge_counts given: one split, the model's merges (one block)
        check_designed(fn, 6)


@pytest.mark.parametrize("grid", ["tiles", "persistent"])
@pytest.mark.parametrize("split", [2, 5])
def test_split_paged_topk_exact(split, grid):
    pol = PERSISTENT if grid == "persistent" else {}
    fn = indexer.make_paged_indexer_topk(_tuning("paged_indexer_topk", "rank", SPLIT_K=split,
                                                 **pol))
    v = paged_case()
    op = glm5.get_op("paged_indexer_topk")
    dev = {n: x.to(DEV) if isinstance(x, torch.Tensor) else x for n, x in v.items()}
    got = fn(*paged_util.args(dev)).cpu()
    assert torch.equal(got, op.reference(*paged_util.args(v))), got


def test_split_topk_rule():
    """GLM-5 decode (topk 2048, Hi 32, Di 128): one query over 128K keys splits in 16 windows
    of 8K keys; a 4K-token prefill (512 blocks of 8 queries) and short contexts do not."""
    p = {**indexer.DEFAULTS["indexer_topk"], "TARGET_PROGRAMS_INTERPRETED": 264}
    assert indexer._merge_plan(p, 2048, 32, 128, 1, 131072, True)[4] == 16
    assert indexer._merge_plan(p, 2048, 32, 128, 1, 131072, False)[4] == 1  # merge counts
    assert indexer._merge_plan(p, 2048, 32, 128, 4096, 4096, True)[4] == 1
    assert indexer._merge_plan(p, 2048, 32, 128, 1, 8192, True)[4] == 1
    pp = {**indexer.DEFAULTS["paged_indexer_topk"], "TARGET_PROGRAMS_INTERPRETED": 264}
    assert indexer._merge_plan(pp, 2048, 32, 128, 32, 65536, True)[4] == 8

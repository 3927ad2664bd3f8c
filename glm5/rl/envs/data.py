"""A data-analysis environment: a small CSV of sales records in the episode's sandbox and a
question about it whose exact answer the environment computes (a total, the region with the
highest revenue, a count above a threshold, a mean rounded to 2 decimals). The agent reads or
computes with the tools (``shell`` — bash, with python3 and awk — and ``read_file``) and replies
with the answer alone.

The data and the question come from the seed: names are invented and values random, so no
answer can be known without reading the data. Prices are kept in whole cents and answers
computed with exact fractions (no float rounding in the gold answer); a mean whose value lies
exactly halfway between two 2-decimal numbers is never asked (round-half-even and half-up
would disagree).
"""

from __future__ import annotations

import random
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from math import floor
from typing import Any, Sequence

from glm5.rl.envs.base import register_env
from glm5.rl.envs.search import invented_word
from glm5.rl.envs.tools import tool_call
from glm5.rl.envs.workspace import WorkspaceEnv

CSV_NAME = "sales.csv"
COLUMNS = ("region", "product", "units", "price")
MAX_ROWS = 500  # a file read_file returns whole (MAX_FILE_CHARS)
KINDS = ("units_total", "top_region", "count_above", "mean")

# (region, product, units, price in cents)
Row = tuple[str, str, int, int]


def _cents(c: int) -> str:
    """Whole cents as a decimal with 2 places (non-negative): 1234 -> '12.34'."""
    return f"{c // 100}.{c % 100:02d}"


def _names(rng: random.Random, k: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < k:
        w = invented_word(rng, 2)
        if w.lower() not in taken:
            taken.add(w.lower())
            out.append(w)
    return out


def to_csv(rows: Sequence[Row]) -> str:
    """The CSV text of ``rows`` (a header line, prices with 2 decimals), as the episode's
    file holds it."""
    return "".join([",".join(COLUMNS) + "\n"] + [f"{r},{p},{u},{_cents(c)}\n"
                                                 for r, p, u, c in rows])


def _round2(x: Fraction) -> Fraction | None:
    """``x`` rounded to 2 decimals; None when it lies exactly halfway (ambiguous rounding)."""
    q = x * 100
    if q.denominator == 2:
        return None
    return Fraction(floor(q + Fraction(1, 2)), 100)


def make_question(rng: random.Random, rows: Sequence[Row], kind: str
                  ) -> tuple[str, str, str, str] | None:
    """(question, gold answer, answer type "number" | "name", a shell command that prints the
    answer) for ``kind`` over ``rows``; None when the data gives that kind no well-posed
    question (a tie for the top region, one price only, a mean exactly halfway)."""
    def awk(program: str) -> str:
        return f"awk -F, '{program}' {CSV_NAME}"

    if kind == "units_total":
        product = rng.choice(sorted({r[1] for r in rows}))
        total = sum(r[2] for r in rows if r[1] == product)
        return (f"How many units of product {product} were sold in total?", str(total),
                "number", awk(f'$2=="{product}"{{s+=$3}}END{{print s}}'))
    if kind == "top_region":
        revenue: dict[str, int] = {}
        for region, _, units, cents in rows:
            revenue[region] = revenue.get(region, 0) + units * cents
        best = max(revenue.values())
        leaders = [r for r, v in revenue.items() if v == best]
        if len(leaders) != 1:
            return None
        return ("Which region has the highest revenue (the sum of units times price over its "
                "rows)?", leaders[0], "name",
                awk("NR>1{r[$1]+=$3*$4}END{for(k in r)if(r[k]>m){m=r[k];b=k}print b}"))
    if kind == "count_above":
        prices = sorted({r[3] for r in rows})
        if len(prices) < 2:
            return None
        # a threshold from the lowest price up to (not including) the highest: at least one
        # row is above it and at least one is not; it may equal a price (strictly above)
        p = rng.randint(prices[0], prices[-1] - 1)
        n = sum(r[3] > p for r in rows)
        return (f"How many rows have a price strictly above {_cents(p)}?", str(n), "number",
                awk(f"NR>1&&$4>{_cents(p)}{{n++}}END{{print n+0}}"))
    if kind == "mean":
        column = rng.choice(("units", "price"))
        if column == "units":
            mean = Fraction(sum(r[2] for r in rows), len(rows))
        else:
            mean = Fraction(sum(r[3] for r in rows), 100 * len(rows))
        rounded = _round2(mean)
        if rounded is None:
            return None
        field = COLUMNS.index(column) + 1
        return (f"What is the mean of the {column} column, rounded to 2 decimals?",
                _cents(int(rounded * 100)), "number",
                awk(f'NR>1{{s+=${field};n++}}END{{printf "%.2f\\n",s/n}}'))
    raise ValueError(f"glm5 make_question: kind expected one of {KINDS}, got {kind!r}")


def parse_number(text: str) -> Decimal | None:
    """The number an answer states, or None: surrounding spaces and one trailing period are
    ignored, thousands separators allowed (``1,234.5``); anything else is not a number."""
    t = text.strip()
    if t.endswith("."):
        t = t[:-1]
    if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?", t):
        t = t.replace(",", "")
    if not re.fullmatch(r"[+-]?(\d+(\.\d*)?|\.\d+)", t):
        return None
    try:
        return Decimal(t)
    except InvalidOperation:
        return None


def answer_matches(answer: str, gold: str, kind: str) -> bool:
    """Exact check: a number equals the gold value as a number (``12.5`` is ``12.50``; the
    question states the rounding, so ``12.504`` is not ``12.50``); a name matches ignoring
    case, surrounding spaces and one trailing period."""
    if kind == "number":
        got = parse_number(answer)
        return got is not None and got == Decimal(gold)
    if kind == "name":
        t = answer.strip()
        return (t[:-1] if t.endswith(".") else t).strip().casefold() == gold.casefold()
    raise ValueError(f"glm5 answer_matches: kind expected 'number' or 'name', got {kind!r}")


class DataEnv(WorkspaceEnv):
    """params: ``n_rows`` (rows of the CSV: an int, or a (low, high) range drawn from per
    episode; 2..`MAX_ROWS`), ``max_turns``, ``sandbox_config``. Tools: shell(command),
    read_file(path). Reward 1 when the final answer is exactly the gold answer (see
    `answer_matches`), else 0; ``info["gold"]`` holds it."""

    name = "data"

    def __init__(self, n_rows: int | Sequence[int] = (5, 30), max_turns: int = 6,
                 sandbox_config: Any = None) -> None:
        super().__init__(max_turns, sandbox_config)
        lo_hi = (n_rows, n_rows) if isinstance(n_rows, int) else tuple(n_rows) \
            if isinstance(n_rows, (list, tuple)) else ()
        if len(lo_hi) != 2 or any(isinstance(v, bool) or not isinstance(v, int)
                                  for v in lo_hi) or not 2 <= lo_hi[0] <= lo_hi[1] <= MAX_ROWS:
            raise ValueError(f"glm5 DataEnv: n_rows expected an int or a (low, high) pair with "
                             f"2 <= low <= high <= {MAX_ROWS}, got {n_rows!r}")
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"glm5 DataEnv: max_turns expected an int >= 1, got {max_turns!r}")
        self.n_rows: tuple[int, int] = (lo_hi[0], lo_hi[1])
        self.tools = {"shell": self.shell, "read_file": self.read_file}
        self.rows: list[Row] = []
        self.question = self.gold = self.kind = self.answer_type = self._command = ""

    @staticmethod
    def generate(seed: int, n_rows: tuple[int, int] = (5, 30)
                 ) -> tuple[list[Row], str, str, str, str, str]:
        """(rows, question kind, question, gold answer, answer type, solving command) of the
        episode ``seed``."""
        rng = random.Random(seed)
        taken = set(COLUMNS)
        regions = _names(rng, rng.randint(3, 5), taken)
        products = _names(rng, rng.randint(3, 5), taken)
        rows = [(rng.choice(regions), rng.choice(products), rng.randint(1, 50),
                 rng.randint(50, 9999)) for _ in range(rng.randint(*n_rows))]
        kind = rng.choice(KINDS)
        q = make_question(rng, rows, kind)
        while q is None:  # ill-posed for this data: another kind (units_total always works)
            kind = rng.choice(KINDS)
            q = make_question(rng, rows, kind)
        return (rows, kind, *q)

    def reset(self, seed: int) -> str:
        self._new_sandbox()
        self.seed, self.turns, self.done = seed, 0, False
        (self.rows, self.kind, self.question, self.gold, self.answer_type,
         self._command) = self.generate(seed, self.n_rows)
        self.sandbox.write_file(CSV_NAME, to_csv(self.rows))
        return (f"{CSV_NAME} (columns {','.join(COLUMNS)}; a header line, then one sale per "
                f"line) is in the work directory. {self.question} Tools: shell(command) (bash, "
                f"with python3 and awk), read_file(path). Reply with the answer alone, "
                f"without a tool call.")

    def demonstration(self) -> list[str]:
        """The expert's turns for the episode after ``reset``: one shell command (awk) that
        prints the answer, then the answer."""
        if not self._command:
            raise RuntimeError("glm5 DataEnv.demonstration: no episode; call reset()")
        return [tool_call("shell", command=self._command), self.gold]

    def check_answer(self, answer: str) -> tuple[float, dict[str, Any]]:
        ok = answer_matches(answer, self.gold, self.answer_type)
        return float(ok), {"gold": self.gold, "kind": self.kind}


register_env("data", DataEnv)

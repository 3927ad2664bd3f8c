"""A search environment over a local corpus (no network): documents indexed with SQLite FTS5,
tools `search(query, k)` and `open(doc_id)`, and a question whose answer is in one document.

The default corpus is generated from the seed: invented countries, each with a capital, a river
and a founding year, written as short documents among distractors, so an answer cannot be
guessed and must be looked up. A corpus of your own: ``SearchEnv(corpus=[(title, body), ...],
questions=[(question, answer), ...])``.
"""

from __future__ import annotations

import random
import re
import sqlite3
from typing import Any, Sequence

from glm5.rl.envs.base import register_env
from glm5.rl.envs.tools import ToolEnv, ToolError, tool_call

_SYLLABLES = ("ka", "lo", "mi", "ra", "zu", "ten", "vor", "bel", "qua", "dris", "om", "ny")


def invented_word(rng: random.Random, n: int) -> str:
    """A capitalised made-up word of ``n`` syllables (names no model knows facts about)."""
    return "".join(rng.choice(_SYLLABLES) for _ in range(n)).capitalize()


def synthetic_corpus(seed: int, n_countries: int = 12
                     ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(documents [(title, body)], questions [(question, answer)]) of invented facts."""
    rng = random.Random(seed)
    docs, qs, names = [], [], set()
    while len(names) < n_countries:
        names.add(invented_word(rng, 3) + "land")
    for country in sorted(names):
        capital, river = invented_word(rng, 2) + "ville", "the " + invented_word(rng, 2)
        year = rng.randint(1100, 1950)
        docs.append((f"{country}", f"{country} is a country whose capital is {capital}. "
                                   f"The river {river} crosses it. It was founded in {year}."))
        docs.append((f"Travel in {country}", f"Trains from {capital} leave hourly; tourists "
                                             f"visit the banks of {river}."))
        qs += [(f"What is the capital of {country}?", capital),
               (f"In which year was {country} founded?", str(year)),
               (f"Which river crosses {country}?", river)]
    return docs, qs


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^\w\s]", "", text.lower())).strip()


# question words a search gains nothing from (the demonstration's query leaves them out)
_STOPWORDS = frozenset("a an and are did does do for how in is of on the to was what when where "
                       "which who whom whose why".split())


def _contains(text: str, answer: str) -> bool:
    """Whether ``answer`` appears in ``text`` as whole words (normalized as answers are)."""
    a = normalize(answer)
    return bool(a) and f" {a} " in f" {normalize(text)} "


class SearchEnv(ToolEnv):
    """params: ``n_countries`` (synthetic corpus size), ``max_turns``, or ``corpus`` and
    ``questions`` of your own. Reward 1 when the final answer matches the gold answer
    (case, punctuation and spacing ignored), else 0."""

    name = "search"

    def __init__(self, n_countries: int = 12, max_turns: int = 6,
                 corpus: Sequence[tuple[str, str]] | None = None,
                 questions: Sequence[tuple[str, str]] | None = None) -> None:
        super().__init__()
        if (corpus is None) != (questions is None):
            raise ValueError("glm5 SearchEnv: corpus and questions go together")
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"glm5 SearchEnv: max_turns expected an int >= 1, got "
                             f"{max_turns!r}")
        self.n_countries, self.max_turns = n_countries, max_turns
        self._fixed = (list(corpus), list(questions)) if corpus is not None else None
        self.tools = {"search": self.search, "open": self.open}
        self.db: sqlite3.Connection | None = None
        self.docs: list[tuple[str, str]] = []
        self.question, self.answer, self.seed = "", "", 0

    def reset(self, seed: int) -> str:
        self.seed, self.turns, self.done = seed, 0, False
        docs, qs = self._fixed or synthetic_corpus(seed, self.n_countries)
        if not docs or not qs:
            raise ValueError("glm5 SearchEnv: the corpus and the questions must not be empty")
        self.docs = list(docs)
        self.question, self.answer = random.Random(seed).choice(list(qs))
        # an episode is reset in one thread and stepped in another (the rollout worker's
        # environment threads); its steps never overlap
        self.db = sqlite3.connect(":memory:", check_same_thread=False)
        self.db.execute("CREATE VIRTUAL TABLE docs USING fts5(title, body)")
        self.db.executemany("INSERT INTO docs(rowid, title, body) VALUES (?, ?, ?)",
                            [(i, t, b) for i, (t, b) in enumerate(self.docs)])
        return (f"Question: {self.question}\nTools: search(query, k=3) -> matching documents; "
                f"open(doc_id) -> a document's text. Answer with the answer alone.")

    def search(self, query: str, k: int = 3) -> list[dict[str, Any]]:
        """Documents matching the words of query, best first (BM25)."""
        if not isinstance(query, str) or not query.strip():
            raise ToolError("search: query expected non-empty text")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 10:
            raise ToolError(f"search: k expected an int in [1, 10], got {k!r}")
        words = re.findall(r"\w+", query)
        if not words:
            raise ToolError("search: query has no words")
        match = " OR ".join(f'"{w}"' for w in words)  # quoted: no FTS5 syntax from the agent
        rows = self.db.execute(
            "SELECT rowid, title, snippet(docs, 1, '', '', ' ... ', 12) FROM docs "
            "WHERE docs MATCH ? ORDER BY bm25(docs) LIMIT ?", (match, k)).fetchall()
        return [{"doc_id": r[0], "title": r[1], "snippet": r[2]} for r in rows]

    def open(self, doc_id: int) -> dict[str, Any]:
        """A document's whole text."""
        if isinstance(doc_id, bool) or not isinstance(doc_id, int) or \
                not 0 <= doc_id < len(self.docs):
            raise ToolError(f"open: doc_id expected an int in [0, {len(self.docs)}), got "
                            f"{doc_id!r}")
        title, body = self.docs[doc_id]
        return {"doc_id": doc_id, "title": title, "body": body}

    def demonstration(self) -> list[str]:
        """The expert's turns for the episode after ``reset``: a search with the question's
        content words, an ``open`` of the document holding the answer only when no result's
        snippet shows it, then the answer. Worked out by running the search here."""
        if self.db is None:
            raise RuntimeError("glm5 SearchEnv.demonstration: no episode; call reset()")
        words = [w for w in re.findall(r"\w+", self.question) if w.lower() not in _STOPWORDS]
        query = " ".join(words or re.findall(r"\w+", self.question))
        hits = self.search(query)
        turns = [tool_call("search", query=query)]
        if not any(_contains(h["title"] + " " + h["snippet"], self.answer) for h in hits):
            # the answer's document: among the results if there, else wherever it is (a
            # corpus of your own may hold no document with the answer: then none is opened)
            ids = [h["doc_id"] for h in hits] + list(range(len(self.docs)))
            doc = next((i for i in ids if _contains(" ".join(self.docs[i]), self.answer)), None)
            if doc is not None:
                turns.append(tool_call("open", doc_id=doc))
        return turns + [self.answer]

    def check_answer(self, answer: str) -> tuple[float, dict[str, Any]]:
        ok = normalize(answer) == normalize(self.answer)
        return float(ok), {"gold": self.answer}

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "turns": self.turns, "done": self.done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset(int(state["seed"]))  # the corpus and question come from the seed
        self.turns, self.done = int(state["turns"]), bool(state["done"])


register_env("search", SearchEnv)

"""Deterministic skill routing: which skill a user message activates, from the skills' names and descriptions only.

    python -m evals.routing "my 8B model runs out of memory on 8 GPUs with DDP"

A host shows the model every skill's front matter (name + description) and the model picks the skill whose
description matches what the user said. This module is a fixed, documented stand-in for that choice, so CI can
notice when a description stops mentioning what users actually say:

- Documents: one per `skills/<name>/SKILL.md`, the front-matter `name` (split on `-`, counted twice: a name is a
  strong signal) plus the `description`. Nothing from the body is used; hosts do not see it before activation.
- Tokens: lower-cased runs of letters and digits (`ZeRO-3` -> `zero`, `3`; `OOM` -> `oom`), English stop words
  dropped, a light suffix stemmer (`benchmarks` / `benchmarking` -> `benchmark`, `experts` -> `expert`,
  `parallelism` -> `parallel`). No synonyms: if users say "gradient checkpointing" the description must say it.
- Score: Okapi BM25 (k1 = 1.2, b = 0.75) of the message's tokens against each document, IDF
  `ln(1 + (N - n + 0.5) / (n + 0.5))` over the skill pack. The highest score wins; ties break by skill name.

A conversation routes correctly when its expected skill is the top-1 result.
"""

from __future__ import annotations

import math
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import yaml

SKILLS_DIR = Path(__file__).resolve().parent.parent / "skills"
K1, B = 1.2, 0.75
NAME_WEIGHT = 2

# "out" stays a word: "out of memory" is what users say.
STOP_WORDS = frozenset("""
a an and are as at be been but by can could do does did for from had has have how i i'm if in into is it its
just me my of on or our so than that the their them then there these this those to too us was we were what when
where which while who why will with would you your yours am should any all also about after before both each
few more most other some such no nor not only own same very s t don now up out off over under again further once
here get got use using want need please hi hey ok okay still let lets im ive really just actually
someone say says said told tell think thing anything something maybe guys team thanks thank right first
help helps try add adding
""".split()) - {"out"}  # noqa: SIM905 - a word list reads better as text

_TOKEN = re.compile(r"[a-z0-9]+")
# Longest first; a suffix is stripped only when the stem keeps >= 3 characters.
_SUFFIXES = ("isations", "izations", "isation", "ization", "ational", "fulness", "ousness", "iveness",
             "ments", "ement", "ities", "ness", "ment", "ings", "ity", "ism", "ing", "ies", "ied", "ed", "es",
             "ly", "s")


def stem(word: str) -> str:
    """A light, deterministic suffix stripper (not Porter): merges plurals, -ing/-ed/-ism forms and a final -e."""
    if word.isdigit() or len(word) <= 3:
        return word
    for suf in _SUFFIXES:
        if word.endswith(suf) and len(word) - len(suf) >= 3 and not (suf == "ed" and word.endswith("eed")):
            base = word[: -len(suf)]
            if suf in ("ies", "ied"):
                base += "y"
            elif suf == "s" and base.endswith(("s", "i")):  # "class", "analysis"
                base = word
            elif len(base) >= 4 and base[-1] == base[-2] and base[-1] not in "lsz":  # "running" -> "run"
                base = base[:-1]
            word = base
            break
    if len(word) >= 4 and word.endswith("e"):  # "measure" / "measured" / "measuring" -> "measur"
        word = word[:-1]
    return word


def tokenize(text: str) -> list[str]:
    return [stem(t) for t in _TOKEN.findall(text.lower()) if t not in STOP_WORDS]


@dataclass(frozen=True)
class Skill:
    name: str
    description: str

    def tokens(self) -> list[str]:
        return tokenize(" ".join([self.name.replace("-", " ")] * NAME_WEIGHT)) + tokenize(self.description)


def front_matter(text: str) -> dict[str, str]:
    if not text.startswith("---"):
        raise ValueError("SKILL.md must start with a '---' front-matter block")
    block = text.split("---", 2)[1]
    data = yaml.safe_load(block)
    if not isinstance(data, dict):
        raise ValueError("front matter is not a mapping")  # noqa: TRY004 - bad file content, not a bad argument
    return data


def load_skills(skills_dir: Path = SKILLS_DIR) -> list[Skill]:
    out = []
    for md in sorted(skills_dir.glob("*/SKILL.md")):
        fm = front_matter(md.read_text(encoding="utf-8"))
        out.append(Skill(name=str(fm["name"]), description=str(fm["description"])))
    if not out:
        raise FileNotFoundError(f"no skills under {skills_dir}")
    return out


class Router:
    """BM25 over the skill pack; `rank(message)` -> [(skill, score)] best first."""

    def __init__(self, skills: list[Skill] | None = None):
        self.skills = skills if skills is not None else load_skills()
        self.docs = [Counter(s.tokens()) for s in self.skills]
        self.lengths = [sum(d.values()) for d in self.docs]
        self.avg_len = sum(self.lengths) / len(self.lengths)
        n = len(self.docs)
        df = Counter(t for d in self.docs for t in d)
        self.idf = {t: math.log(1 + (n - k + 0.5) / (k + 0.5)) for t, k in df.items()}

    def rank(self, message: str) -> list[tuple[str, float]]:
        query = tokenize(message)
        scores = []
        for skill, doc, length in zip(self.skills, self.docs, self.lengths):
            score = 0.0
            for t in query:
                tf = doc.get(t, 0)
                if tf:
                    score += self.idf[t] * tf * (K1 + 1) / (tf + K1 * (1 - B + B * length / self.avg_len))
            scores.append((skill.name, score))
        return sorted(scores, key=lambda x: (-x[1], x[0]))

    def route(self, message: str) -> str:
        return self.rank(message)[0][0]

    def explain(self, message: str, skill: str) -> list[str]:
        """The message tokens that the named skill's description contains (for failure messages)."""
        doc = self.docs[[s.name for s in self.skills].index(skill)]
        return sorted({t for t in tokenize(message) if t in doc})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__.splitlines()[2].strip())
        return 2
    router = Router()
    for name, score in router.rank(" ".join(argv)):
        print(f"{score:7.3f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The bug catalogue of `codefix`: small functions, each with one planted bug.

Every entry has the documented function (its docstring is the specification the agent reads),
the buggy body, the fixed body, a generator of test inputs, and a difficulty bucket. Hidden tests
are generated per instance by running the fixed function on generated inputs in this process.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Bug:
    name: str  # the function
    signature: str
    doc: str
    fixed: str  # body lines, indented by 4
    buggy: str
    inputs: Callable[[random.Random], tuple[Any, ...]]
    difficulty: str

    def source(self, fixed: bool) -> str:
        body = self.fixed if fixed else self.buggy
        return f'def {self.name}({self.signature}):\n    """{self.doc}"""\n{body}\n'


def _ints(rng: random.Random, n: int, lo: int = -20, hi: int = 20) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


BUGS: tuple[Bug, ...] = (
    Bug("clamp", "x, lo, hi", "Return x limited to the range [lo, hi].",
        "    return max(lo, min(x, hi))", "    return min(lo, max(x, hi))",
        lambda r: (r.randint(-30, 30), r.randint(-10, 0), r.randint(1, 10)), "easy"),
    Bug("mean", "xs", "Return the arithmetic mean of the non-empty list xs.",
        "    return sum(xs) / len(xs)", "    return sum(xs) / (len(xs) + 1)",
        lambda r: (r.choice([[0], _ints(r, r.randint(1, 6), 0, 4)]),), "easy"),
    Bug("is_leap", "year", "Return True if year is a leap year in the Gregorian calendar.",
        "    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)",
        "    return year % 4 == 0 and year % 100 != 0",
        lambda r: (r.choice([r.randint(1, 3000), 400 * r.randint(1, 7), 100 * r.randint(1, 30)]),),
        "medium"),
    Bug("count_vowels", "text", "Return how many letters of text are vowels (a, e, i, o, u), "
        "ignoring case.",
        "    return sum(1 for c in text.lower() if c in 'aeiou')",
        "    return sum(1 for c in text if c in 'aeiou')",
        lambda r: ("".join(r.choice("aEiObcDfgU xyZ") for _ in range(r.randint(0, 12))),),
        "easy"),
    Bug("last_n", "xs, n", "Return the last n items of the list xs (an empty list when n is 0).",
        "    return xs[len(xs) - n:] if n > 0 else []", "    return xs[-n:]",
        lambda r: (_ints(r, 6), r.randint(0, 6)), "medium"),
    Bug("factorial", "n", "Return n! for an integer n >= 0.",
        "    out = 1\n    for k in range(2, n + 1):\n        out *= k\n    return out",
        "    out = 1\n    for k in range(2, n):\n        out *= k\n    return out",
        lambda r: (r.randint(0, 10),), "easy"),
    Bug("to_celsius", "fahrenheit", "Convert a temperature from Fahrenheit to Celsius.",
        "    return (fahrenheit - 32) * 5 / 9", "    return fahrenheit - 32 * 5 / 9",
        lambda r: (r.choice([0, r.randint(-40, 220)]),), "easy"),
    Bug("dedupe", "xs", "Return the items of xs without repeats, keeping first occurrences "
        "in order.",
        "    seen = set()\n    out = []\n    for x in xs:\n        if x not in seen:\n"
        "            seen.add(x)\n            out.append(x)\n    return out",
        "    return sorted(set(xs))",
        lambda r: (_ints(r, r.randint(0, 8), 0, 5),), "medium"),
)


@functools.lru_cache(maxsize=64)
def _function(source: str, name: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<codefix:{name}>", "exec"), namespace)  # noqa: S102 - trusted source
    return namespace[name]


def run(source: str, name: str, args: tuple[Any, ...]) -> Any:
    """Call `name` defined by `source` (our own catalogue code, never agent output)."""
    return _function(source, name)(*[list(a) if isinstance(a, list) else a for a in args])

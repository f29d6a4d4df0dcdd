"""One log line, printed and read back by the same object: :class:`LogLine`'s ``format``
prints it, its ``parse`` reads it back. The engine's modules define each line they print beside
the code that prints it (``distlab.gpt.parallel_state.BANNER``, ``distlab.gpt.training.log.ITERATION``,
...); the notebooks' readers in ``distlab.logs`` import them from there.

The regular expression is derived from the ``str.format`` template, so a change of wording
changes printer and parser together::

    LogLine("rank ({tp:d}, {pp:d}): {n:,d}").format(tp=0, pp=1, n=185536)  ->  "rank (0, 1): 185,536"
    LogLine("rank ({tp:d}, {pp:d}): {n:,d}").parse("... rank (0, 1): 185,536")  ->  [{"tp": 0, "pp": 1, "n": 185536}]

Specs and what they read back: ``d`` (width, sign, ``,``) int; ``f`` and ``E`` (width, sign,
precision) float, NaN and infinity included; no spec: str, up to the text that follows it. The
module needs only the standard library and imports nothing of ``distlab``: any layer may print
with it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from string import Formatter

_SPEC = re.compile(r"[+-]?(?P<width>\d*)(?P<comma>,?)(?:\.\d+)?(?P<kind>[dfE])")
_NUMBER = {
    "d": r"[+-]?\d+",
    ",d": r"[+-]?\d{1,3}(?:,\d{3})*",
    "f": r"[+-]?(?:\d+(?:\.\d*)?|nan|inf)",
    "E": r"[+-]?(?:\d(?:\.\d+)?E[+-]\d+|NAN|INF)",
}


def _int(text: str) -> int:
    return int(text.replace(",", ""))


class Opt(str):
    """A template part printed only when all its fields are given (not None); a parsed line may lack it."""


class LogLine:
    """One log line: ``format(**fields)`` prints it, ``parse(text)`` reads every such line back
    into dicts of the same fields (those of a missing :class:`Opt` part left out)."""

    def __init__(self, *parts: str) -> None:
        self.parts = parts
        self.readers: dict[str, Callable[[str], object]] = {}
        self.regex = re.compile("".join(map(self._pattern, parts)))

    def _pattern(self, part: str) -> str:
        pattern = ""
        for literal, name, spec, _ in Formatter().parse(part):
            pattern += re.escape(literal) + ("" if name is None else self._field(name, spec))
        return f"(?:{pattern})?" if isinstance(part, Opt) else pattern

    def _field(self, name: str, spec: str) -> str:
        """The regex of one field; records how to read it back."""
        if not spec:
            self.readers[name] = str
            return f"(?P<{name}>.*?)"
        m = _SPEC.fullmatch(spec)
        if m is None or m["comma"] + m["kind"] not in _NUMBER:
            raise ValueError(f"{{{name}:{spec}}}: a LogLine reads back only d, ,d, f and E specs")
        self.readers[name] = _int if m["kind"] == "d" else float
        padding = " *" if m["width"] else ""
        return f"{padding}(?P<{name}>{_NUMBER[m['comma'] + m['kind']]})"

    def format(self, **fields: object) -> str:
        """The line, with the :class:`Opt` parts whose fields are all given."""
        unknown = fields.keys() - self.readers.keys()
        if unknown:
            raise TypeError(f"no field {sorted(unknown)} in this line (its fields: {list(self.readers)})")
        line = ""
        for part in self.parts:
            names = [name for _, name, _, _ in Formatter().parse(part) if name is not None]
            if not (isinstance(part, Opt) and any(fields.get(name) is None for name in names)):
                line += part.format(**fields)
        return line

    def parse(self, text: str) -> list[dict]:
        """Every occurrence in ``text``, as typed fields, in order."""
        return [self._read(m) for m in self.regex.finditer(text)]

    def search(self, text: str) -> dict | None:
        """The first occurrence in ``text`` (None when there is none)."""
        m = self.regex.search(text)
        return None if m is None else self._read(m)

    def _read(self, m: re.Match) -> dict:
        return {k: self.readers[k](v) for k, v in m.groupdict().items() if v is not None}

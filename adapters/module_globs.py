"""Glob keys of PEFT's `rank_pattern` / `alpha_pattern`, matched without compiling a
regular expression: a tenant's config of 1024 keys of 256 characters costs
milliseconds, not the seconds Python's regex compiler spends on fnmatch's translation.

Semantics: those of `fnmatch.fnmatchcase` on one name. `*` is any run of characters
(dots included), `?` one character, `[seq]` / `[!seq]` one character in / not in
`seq` (ranges `a-z`; a `]` first in `seq` is literal; a `[` without its `]` is
literal); everything else is literal. Matching splits the pattern at its `*`s into
fixed-length segments: the first must match at the start of the name, the last at its
end, the others leftmost in order, which is exact for fixed-length segments and takes
O(len(name) x segments) steps, whatever the pattern.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from dataclasses import dataclass

_ANY = None
"""The atom `?`: any one character."""


@dataclass(frozen=True)
class _CharClass:
    """A bracket expression, matched by fnmatch's own translation of it alone (a short
    regex, compiled once per distinct expression)."""

    regex: re.Pattern[str]

    def holds(self, char: str) -> bool:
        return self.regex.fullmatch(char) is not None


Atom = str | _CharClass | None
"""A literal character, a class, or `_ANY`."""


@dataclass(frozen=True)
class _Segment:
    atoms: tuple[Atom, ...]
    literal: str | None
    """The segment's text when every atom is a literal character (matched by str.find)."""

    def __len__(self) -> int:
        return len(self.atoms)

    def matches_at(self, name: str, start: int) -> bool:
        if self.literal is not None:
            return name.startswith(self.literal, start)
        if start + len(self.atoms) > len(name):
            return False
        for offset, atom in enumerate(self.atoms):
            char = name[start + offset]
            if atom is _ANY:
                continue
            if isinstance(atom, str):
                if atom != char:
                    return False
            elif not atom.holds(char):
                return False
        return True

    def find(self, name: str, start: int) -> int:
        """The leftmost position >= start where the segment matches, or -1."""
        if self.literal is not None:
            return name.find(self.literal, start)
        for position in range(start, len(name) - len(self.atoms) + 1):
            if self.matches_at(name, position):
                return position
        return -1


@dataclass(frozen=True)
class ModuleGlob:
    segments: tuple[_Segment, ...]
    """The pattern split at its `*`s; one segment means no `*`."""

    @classmethod
    def parse(cls, pattern: str) -> ModuleGlob:
        segments: list[_Segment] = []
        atoms: list[Atom] = []
        i = 0
        while i < len(pattern):
            char = pattern[i]
            i += 1
            if char == "*":
                segments.append(_segment(tuple(atoms)))
                atoms = []
            elif char == "?":
                atoms.append(_ANY)
            elif char == "[":
                parsed = _char_class(pattern, i)
                if parsed is None:
                    atoms.append("[")
                else:
                    atom, i = parsed
                    atoms.append(atom)
            else:
                atoms.append(char)
        segments.append(_segment(tuple(atoms)))
        return cls(tuple(segments))

    def fullmatch(self, name: str) -> bool:
        first, *middle = self.segments
        if not middle:
            return len(name) == len(first) and first.matches_at(name, 0)
        *middle, last = middle
        if len(name) < len(first) + len(last) or not first.matches_at(name, 0):
            return False
        end = len(name) - len(last)
        if not last.matches_at(name, end):
            return False
        position = len(first)
        for segment in middle:
            found = segment.find(name[:end], position)
            if found < 0:
                return False
            position = found + len(segment)
        return True


@functools.lru_cache(maxsize=4096)
def _segment(atoms: tuple[Atom, ...]) -> _Segment:
    """One segment per distinct atom sequence (a long key repeats the same few)."""
    literal = "".join(atoms) if all(isinstance(atom, str) for atom in atoms) else None
    return _Segment(atoms, literal)


def _char_class(pattern: str, start: int) -> tuple[_CharClass, int] | None:
    """The class whose `[` precedes `start`, and the index after its `]`; None when the
    `[` has no closing `]` (then it is a literal, as in fnmatch)."""
    i = start
    if i < len(pattern) and pattern[i] == "!":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1
    close = pattern.find("]", i)
    if close < 0:
        return None
    return _CharClass(_class_regex(pattern[start - 1 : close + 1])), close + 1


@functools.lru_cache(maxsize=1024)
def _class_regex(expression: str) -> re.Pattern[str]:
    return re.compile(fnmatch.translate(expression))

"""PII redaction over a whole batch of texts.

All recognisers (built-in and ``redaction.pattern.<NAME>`` custom ones) are compiled into ONE
alternation of named groups, so each text is scanned at most once by the regex engine in C.
Checks that regexes cannot express well (Luhn, IBAN mod-97, IP octet ranges, NANP digit rules)
run in Python only on the few candidate spans, never on every token. Cheap tests keep the scan
short: texts without "@" use the alternation without EMAIL, and since every other built-in needs
an ASCII digit, ":", "+" or "(" near its start, the scan begins at the word holding the first
such character (prose without one is not scanned at all).

Matching is case-insensitive (``JOHN@EXAMPLE.COM``, lower-case IBANs); a custom pattern that must
be case-sensitive can say so inline with ``(?-i:...)``. A candidate that fails its check is left
as it is, and the scan resumes after it: a 16-digit number that is not Luhn-valid is an order or
tracking number, and re-reading its digits as a phone number would only add false positives.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

_OCTET_IP = r"\d{1,3}(?:\.\d{1,3}){3}"
_H = r"[0-9a-f]{1,4}"

# name -> regex. Every pattern starts and ends with look-arounds so that a match never starts or
# ends inside a longer word or number ("1.2.3.4000", "order12345678901234"), which is where most
# false positives of naive PII regexes come from. Only non-capturing groups, except the named
# separator groups of CREDIT_CARD (the outer group still closes last, so ``lastgroup`` is right).
BUILTIN_PATTERNS: dict[str, str] = {
    "EMAIL": r"(?<![\w.%+-])[a-z0-9][a-z0-9._%+-]{0,63}@[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?"
             r"(?:\.[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?)*\.[a-z]{2,24}(?![\w-])",
    "IBAN": r"(?<![\w-])[a-z]{2}\d{2}(?: ?[a-z0-9]{4}){2,7}(?: ?[a-z0-9]{1,3})?(?![\w-])",
    "IPV6": r"(?<![\w:.])(?:"
            rf"(?:{_H}:){{7}}{_H}|(?:{_H}:){{6}}{_OCTET_IP}"
            rf"|(?:{_H}:){{1,6}}(?::{_H}){{1,6}}|(?:{_H}:){{1,7}}:|::(?:{_H}:){{0,5}}{_H}"
            rf"|(?:{_H}:){{1,5}}:(?:{_H}:){{0,4}}{_OCTET_IP}|::(?:{_H}:){{0,5}}{_OCTET_IP}"
            r")(?![\w:]|\.\d)",
    "IPV4": r"(?<![\w.])" + _OCTET_IP + r"(?![\w]|\.\d)",
    "SSN": r"(?<![\w-])(?!000|666|9)\d{3}-(?!00)\d{2}-(?!0000)\d{4}(?![\w]|-\d)",
    "CREDIT_CARD": r"(?<![\w-])(?:\d{13,19}"
                   r"|\d{4}(?P<_ccs1>[ -])\d{4}(?P=_ccs1)\d{4}(?P=_ccs1)\d{1,4}(?:(?P=_ccs1)\d{1,3})?"
                   r"|\d{4}(?P<_ccs2>[ -])\d{6}(?P=_ccs2)\d{4,5}"
                   r")(?![\w]|-\d)",
    # "+" international numbers: 2-5 digit groups, 8-15 digits in all (checked below); US/NANP
    # numbers need separators, so bare 10-digit order numbers and years never match.
    "PHONE": r"(?<![\w+])(?:\+\d{1,3}(?:[ .-]?(?:\(\d{1,4}\)|\d{1,4})){2,5}"
             r"|(?<!\()(?:1[ .-])?(?:\(\d{3}\) ?|\d{3}[ .-])\d{3}[ .-]\d{4})(?![\w]|[.-]\d)",
}

# ASCII digits only: the anchor scan below can then use a plain byte class (2x faster than \d),
# and PII written in other scripts' digits is out of scope anyway.
BUILTIN_PATTERNS = {k: v.replace(r"\d", "[0-9]") for k, v in BUILTIN_PATTERNS.items()}
DEFAULT_RECOGNIZERS = tuple(BUILTIN_PATTERNS)
# Cheap look-aheads shared by consecutive built-ins: a word that cannot start any of them is
# rejected by one test instead of one per recogniser (about 3x faster on ordinary prose).
_NUMERIC_GATE = r"(?=[0-9+(])"
# IPv6 needs "::" or seven colons (six before an embedded IPv4): without this test each of its
# branches would backtrack through every "10:23:45" timestamp
_GATES = {
    "IPV6": r"(?=[0-9a-f:]*::|(?:[0-9a-f]{1,4}:){6}[0-9a-f]{1,4}[:.])",
    **dict.fromkeys(("IPV4", "SSN", "CREDIT_CARD", "PHONE"), _NUMERIC_GATE),
}
_ANCHOR = re.compile(r"[0-9:+(]")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_NON_DIGIT = re.compile(r"\D")
_IBAN_LETTERS = {chr(c): str(c - 55) for c in range(ord("A"), ord("Z") + 1)}


# The checks below stay hand-written: on the hot path they measured much faster than the libraries
# (redact_batch of perf/privacy_bench.py's sentences x4, 7 alternating rounds, 2 loaded cores):
# python-stdnum's luhn 1.3x the whole batch's time, phonenumbers.parse + is_valid_number 2.9x
# (~180 µs per phone candidate vs ~5 µs), stdnum's iban 5.5x on texts holding an IBAN (~200 µs vs
# ~15 µs per candidate; its per-country rules also reject real IBANs such as BE68 5390 0754 7034
# whose bank code is not in its registry). tests/unit/test_redaction.py checks them against those
# libraries instead.
def luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def iban_ok(compact: str) -> bool:
    """ISO 13616 check: move the first four characters to the end, letters -> 10..35, mod 97."""
    if not 15 <= len(compact) <= 34:
        return False
    moved = compact[4:] + compact[:4]
    try:
        return int("".join(_IBAN_LETTERS.get(c, c) for c in moved)) % 97 == 1
    except ValueError:
        return False


def _check_card(span: str) -> int:
    digits = _NON_DIGIT.sub("", span)
    # one repeated digit passes Luhn for some lengths (0000…) but is a placeholder, not a card
    if 13 <= len(digits) <= 19 and len(set(digits)) > 1 and luhn_ok(digits):
        return len(span)
    return 0


def _check_iban(span: str) -> int:
    # A greedy match may have swallowed the next 4-letter word ("BE68 5390 0754 7034 from"):
    # drop trailing space-separated chunks until the checksum holds.
    parts = span.split(" ")
    for n in range(len(parts), 0, -1):
        cand = " ".join(parts[:n])
        if iban_ok(cand.replace(" ", "").upper()):
            return len(cand)
    return 0


def _check_ipv4(span: str) -> int:
    return len(span) if all(int(o) <= 255 for o in span.split(".")) else 0


def _check_ipv6(span: str) -> int:
    try:
        ipaddress.IPv6Address(span)
    except ValueError:
        return 0
    return len(span)


def _check_phone(span: str) -> int:
    digits = _NON_DIGIT.sub("", span)
    if span.startswith("+"):
        return len(span) if 8 <= len(digits) <= 15 else 0
    local = digits[-10:]
    # NANP: neither the area code nor the exchange starts with 0 or 1
    return len(span) if local[0] not in "01" and local[3] not in "01" else 0


# Returns how many characters of the candidate to redact (0 = not PII).
_CHECKS: dict[str, Callable[[str], int]] = {
    "CREDIT_CARD": _check_card,
    "IBAN": _check_iban,
    "IPV4": _check_ipv4,
    "IPV6": _check_ipv6,
    "PHONE": _check_phone,
}


@dataclass(kw_only=True)
class RedactionConfig:
    """``redaction.*`` parameters of a guard model."""

    DYNAMIC_PREFIXES = ("pattern",)

    enabled: bool = True
    replacement: str = "[{type}]"  # str.format'ed with the recogniser name
    recognizers: tuple[str, ...] = DEFAULT_RECOGNIZERS  # built-ins to run
    # ``redaction.pattern.EMPLOYEE_ID = "EMP-\d{6}"``: custom recognisers, run before built-ins
    pattern: dict[str, str] = field(default_factory=dict)
    redact_outputs: bool = False  # also redact BYTES outputs before they leave the guard
    # True: the target is given the redacted text. False: only what the guard stores or logs
    # (cache, audit) is redacted, and the target sees the original.
    model_sees_redacted: bool = True

    def __post_init__(self) -> None:
        unknown = [r for r in self.recognizers if r.upper() not in BUILTIN_PATTERNS]
        if unknown:
            raise ValueError(f"redaction.recognizers: unknown {', '.join(unknown)} "
                             f"(built-in: {', '.join(BUILTIN_PATTERNS)})")
        self.recognizers = tuple(dict.fromkeys(r.upper() for r in self.recognizers))
        try:
            self.replacement.format(type="X")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"redaction.replacement {self.replacement!r} must only use {{type}}: {exc}") from None
        custom: dict[str, str] = {}
        for name, regex in self.pattern.items():
            key = f"redaction.pattern.{name}"
            if not _NAME_RE.match(name):
                raise ValueError(f"{key}: name must be letters, digits and '_'")
            if name.upper() in BUILTIN_PATTERNS:
                raise ValueError(f"{key}: '{name.upper()}' is a built-in recogniser; pick another name")
            try:
                compiled = re.compile(regex, re.IGNORECASE)
            except re.error as exc:
                raise ValueError(f"{key}: invalid regex: {exc}") from None
            # capturing groups would shift the numbering of the combined regex (and back-references
            # with it); an empty match would "redact" between every two characters
            if compiled.groups:
                raise ValueError(f"{key}: use non-capturing groups (?:...) instead of (...)")
            if compiled.fullmatch(""):
                raise ValueError(f"{key}: pattern matches the empty string")
            custom[name.upper()] = regex
        self.pattern = custom


class Redactor:
    """Replaces PII in texts with ``replacement.format(type=NAME)``."""

    def __init__(self, config: RedactionConfig):
        self.config = config
        names = [*config.pattern, *config.recognizers]
        self._labels = {n: config.replacement.format(type=n) for n in names}
        self._group = {f"r_{n}": n for n in names}
        self._pattern = self._compile(config.recognizers) if config.enabled else None
        # An e-mail needs an "@": texts without one (most) use the pattern without EMAIL, whose
        # local-part scan would otherwise run at every word start.
        self._pattern_no_at = self._pattern
        if self._pattern is not None and "EMAIL" in config.recognizers:
            self._pattern_no_at = self._compile([n for n in config.recognizers if n != "EMAIL"])
        self._checks = {f"r_{n}": _CHECKS[n] for n in config.recognizers if n in _CHECKS}
        log.debug("redaction: %s", ", ".join(names) if self._pattern is not None else "off")

    def _compile(self, recognizers: Sequence[str]) -> re.Pattern[str] | None:
        # Custom patterns go first (a user's pattern wins over a built-in at the same position).
        branches = [f"(?P<r_{n}>{rx})" for n, rx in self.config.pattern.items()]
        builtins = []
        # canonical order: where two built-ins match at one position, the more specific wins
        chosen = [n for n in BUILTIN_PATTERNS if n in recognizers]
        for gate, names in itertools.groupby(chosen, key=lambda n: _GATES.get(n, "")):
            body = "|".join(f"(?P<r_{n}>{BUILTIN_PATTERNS[n]})" for n in names)
            builtins.append(f"{gate}(?:{body})")
        if builtins:
            # Every built-in starts after a non-word character: one test rejects the positions
            # inside words before any branch is tried.
            branches.append(f"(?<!\\w)(?:{'|'.join(builtins)})")
        return re.compile("|".join(branches), re.IGNORECASE) if branches else None

    @property
    def active(self) -> bool:
        return self._pattern is not None

    def _redact(self, text: str, counts: dict[str, int]) -> str:
        checks, groups, labels = self._checks, self._group, self._labels

        def replace(m: re.Match[str]) -> str:
            span = m.group()
            group = m.lastgroup
            check = checks.get(group)
            keep = check(span) if check is not None else len(span)
            if not keep:
                return span
            name = groups[group]
            counts[name] = counts.get(name, 0) + 1
            return labels[name] + span[keep:]

        if "@" in text or self.config.pattern:
            return self._pattern.sub(replace, text)
        pattern = self._pattern_no_at
        # Every built-in but EMAIL has a digit, ":", "+" or "(" within its first five characters
        # and no space before it, so nothing can match before the space preceding the first such
        # character: prose without one skips the regex entirely, and the rest scans from there.
        anchor = _ANCHOR.search(text)
        if anchor is None or pattern is None:
            return text
        cut = max(text.rfind(" ", 0, anchor.start()), 0)
        tail = text[cut:]
        red = pattern.sub(replace, tail)
        return text if red is tail else text[:cut] + red

    def redact_batch(self, texts: Sequence[str]) -> tuple[list[str], dict[str, int]]:
        """Redacted copies of ``texts`` (same order) and how many spans of each type were replaced."""
        counts: dict[str, int] = {}
        if self._pattern is None:
            return list(texts), counts
        redact = self._redact
        return [redact(t, counts) for t in texts], counts

    def redact_bytes_array(self, arr: np.ndarray) -> tuple[np.ndarray, dict[str, int]]:
        """Redact a Triton BYTES tensor (object array of UTF-8 ``bytes``), any shape.

        Elements without PII keep their original ``bytes`` object. Invalid UTF-8 survives as it
        was (``surrogateescape``): validation decides whether such input is allowed, not redaction.
        """
        counts: dict[str, int] = {}
        if self._pattern is None or arr.size == 0:
            return arr, counts
        flat = arr.reshape(-1)
        out = np.empty(flat.shape, dtype=object)
        redact = self._redact
        for i, item in enumerate(flat):
            if isinstance(item, str):
                text = item
            else:
                item = bytes(item)
                text = item.decode("utf-8", "surrogateescape")
            red = redact(text, counts)
            if isinstance(item, bytes) and (red is text or red == text):
                out[i] = item
            else:
                out[i] = red.encode("utf-8", "surrogateescape")
        return out.reshape(arr.shape), counts


# -- redaction across token boundaries (a decoupled guard's answer) -------------------------------
class StreamRedactor:
    """Redacts a text that arrives in pieces, releasing it as early as is safe.

    The last ``holdback`` characters are kept back (with built-ins only: just the :attr:`TAIL`
    that may still grow into a match, at most ``holdback``), and so is any match that reaches
    into them (it may still grow). Everything before that is final: a match of at most ``holdback``
    characters that starts there already lies whole in the buffer, with the character after it
    (its look-ahead) too. The output equals :meth:`Redactor.redact_batch` of the whole text for
    every match of at most ``holdback`` characters; a longer one is redacted from the point it
    was still held back.
    """

    CONTEXT = 8  # released characters kept for look-behinds at the buffer's start
    # Where a built-in match may still be growing: every built-in match is one run of non-space
    # characters, or groups joined by single spaces (phone and card numbers, IBANs) where each
    # group holds a digit or is 1-4 letters and digits. With built-ins only, the buffer's tail
    # that has this shape is held back (at most ``holdback`` characters), not the whole window:
    # plain prose is released a word behind, not ``holdback`` characters behind.
    TAIL = re.compile(r"(?<!\S)(?:(?>[^\s]*[0-9][^\s]*|[A-Za-z0-9]{1,4}) )*+[^\s]*\Z")

    def __init__(self, redactor: Redactor, holdback: int) -> None:
        self.redactor, self.holdback = redactor, holdback
        # custom patterns (redaction.pattern.*) may match anything: they keep the fixed window
        self.tail = self.TAIL if redactor.active and not redactor.config.pattern else None
        self.pattern = redactor._pattern if redactor.active else None  # noqa: SLF001 - spans, not text
        self.context = ""  # the last original characters released (for look-behinds)
        self.consumed = 0  # where in ``context`` the scan resumes (after the last candidate)
        self.pending = ""  # original text not released yet
        self.counts: dict[str, int] = {}
        self.released = 0  # characters of original text released

    def _candidates(self, text: str, pos: int) -> list[tuple[int, int, int, str | None]]:
        """Matches of ``text`` from ``pos`` on (look-behinds see the context before it):
        (start, end, end of the redacted part, label or None where the check rejected it), as
        :meth:`Redactor._redact` decides them (checksums, partial keeps)."""
        r = self.redactor
        out = []
        for m in self.pattern.finditer(text, pos):  # type: ignore[union-attr]
            group = m.lastgroup
            check = r._checks.get(group)  # noqa: SLF001
            keep = check(m.group()) if check is not None else len(m.group())
            out.append((m.start(), m.end(), m.start() + keep, r._group[group] if keep else None))  # noqa: SLF001
        return out

    def _release(self, final: bool) -> str:
        if self.pattern is None:
            out, self.pending = self.pending, ""
            self.released += len(out)
            return out
        text = self.context + self.pending
        off = len(self.context)
        if final:
            cut = len(text)
        elif self.tail is not None:
            tail = self.tail.search(text, off)
            cut = max(len(text) - self.holdback, tail.start() if tail is not None else off, off)
            if cut <= off:
                return ""
        else:
            if len(self.pending) <= self.holdback:
                return ""
            cut = len(text) - self.holdback
        out: list[str] = []
        pos = off
        # The scan goes on after the last candidate, as re.sub's does. A match may start at the
        # context's first character, whose own look-behind is gone: that errs towards redacting
        # (a match longer than the window is still cut off where it was held back).
        consumed = self.consumed
        for start, end, keep_end, name in self._candidates(text, consumed):
            if start >= cut or (not final and end > cut):
                cut = max(min(cut, start), off)  # may still grow or change: keep it back whole
                break
            consumed = end
            if name is None or keep_end <= off:
                continue  # rejected by its check, or redacted already
            start = max(start, off)  # began before the buffer (longer than holdback): redact what is left
            out.append(text[pos:start])
            out.append(self.redactor._labels[name])  # noqa: SLF001
            self.counts[name] = self.counts.get(name, 0) + 1
            pos = keep_end
        if pos < cut:
            out.append(text[pos:cut])
        self.released += cut - off
        base = max(0, cut - self.CONTEXT)
        self.context = text[base:cut]
        self.consumed = max(0, min(consumed, cut) - base)
        self.pending = text[cut:]
        return "".join(out)

    def feed(self, piece: str) -> str:
        """Add ``piece``; returns the text that is now safe to send (often '')."""
        self.pending += piece
        return self._release(final=False)

    def flush(self) -> str:
        """The rest, redacted: call once at the end of the stream."""
        return self._release(final=True)

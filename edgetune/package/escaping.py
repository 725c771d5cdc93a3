"""The only ways a string reaches a generated file: escaped for Markdown, or refused in source code.

Names come from the model (its inputs, outputs and file name), the recipe and the device profile:
anything a user or a model's author wrote. Generated source (run.py, deploy.cc, CMakeLists.txt)
reads names at run time from the artifact's io.json, so a code template may print only numbers
and plain words (`code_value`); the README shows names through `markdown_text`, which no
character can escape from.
"""

from __future__ import annotations

import re
import string
import unicodedata

from edgetune.errors import InputError

_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})
"""Controls (newline, NUL, ESC), format characters (bidi overrides), line/paragraph separators,
surrogates, private-use and unassigned code points: each could end a line or hide text."""

_MARKDOWN_SPECIAL = frozenset(string.punctuation)
"""CommonMark lets every ASCII punctuation character be backslash-escaped, and reads many of them
(emphasis, links, HTML, tables, headings, lists, code spans): escaping all of them is simplest and safe."""

_CODE_WORD = re.compile(r"[A-Za-z0-9_.,+\- ]*")
"""What a code template may print: no quote, backslash, newline, `/`, `*`, `#`, `$` or bracket, so
nothing printed can end a string literal or a comment, or start one."""


def visible_text(value: str) -> str:
    """`value` on one line, every invisible or line-breaking character spelled as `\\u{XXXX}`."""
    return "".join(f"\\u{{{ord(c):04x}}}" if unicodedata.category(c) in _INVISIBLE_CATEGORIES else c
                   for c in value)


def markdown_text(value: object) -> str:
    """`value` as Markdown text that renders as exactly its characters: no markup, no HTML, one line.

    Not for code spans or code blocks, where Markdown reads no escapes."""
    text = "".join(f"\\{c}" if c in _MARKDOWN_SPECIAL else c for c in visible_text(str(value)))
    # Spaces that begin a line make a code block and those at either end are dropped: write them as entities.
    middle = text.strip(" ")
    if not middle:
        return "&#32;" * len(text)
    leading = len(text) - len(text.lstrip(" "))
    trailing = len(text) - len(text.rstrip(" "))
    return "&#32;" * leading + middle + "&#32;" * trailing


def code_value(value: object) -> int | str:
    """A value a code template prints: an integer, or a plain word; anything else is refused.

    Names never belong in generated code (they are data in io.json); this catches a template or
    a context that would paste one anyway."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and _CODE_WORD.fullmatch(value):
        return value
    raise InputError(f"{excerpt_for_error(value)}: cannot be written into generated source code; expected an "
                     "integer or a word of letters, digits and '_.,+- '")


def excerpt_for_error(value: object, limit: int = 80) -> str:
    """A value quoted for an error message: one line, invisible characters spelled out, at most `limit` chars."""
    text = visible_text(repr(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."

"""How every ``meshrun`` command's ``--help`` reads: plain text, never the reStructuredText of the docstrings.

Commands take their descriptions from their module docstrings, which are written for Sphinx (``meshrun plan``,
:func:`...`); torch's launcher options, which ``meshrun launch`` shows, are written the same way. The formatter
turns that markup into the words it marks.
"""

from __future__ import annotations

import argparse
import re

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(~?)([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain(text: str) -> str:
    """``x`` -> x; :func:`a.b` -> a.b; :class:`~a.B` -> B (Sphinx's short form)."""
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), text)
    return _LITERAL.sub(r"\1", text)


class PlainHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's formatter that keeps the description's and epilog's line breaks (examples stay as written) and
    shows every text without reStructuredText markup."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = super()._get_help_string(action)
        return plain(text) if text else text

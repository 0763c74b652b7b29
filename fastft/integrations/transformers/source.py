"""A transformers function's body as one line of text, to match against the forms fastft computes: ``body(fn)``.

transformers copies each layer's forward (an RMSNorm's, a gated MLP's, ``apply_rotary_pos_emb``) into many model
files; fastft takes a copy only where its text is a form whose math fastft's op computes. Comments, a docstring,
decorators and the signature are dropped and whitespace collapsed, so that formatting does not matter and any
change to the code does.
"""

from __future__ import annotations

import inspect
import re

_DOCSTRING = re.compile(r'^("""|\'\'\').*?\1 ?', re.S)
_HEADER = re.compile(r"def \w+\(.*?\)(?: -> [\w.\[\], |]+)?: ")


def body(fn) -> str | None:
    """``fn``'s body: comments, a docstring and decorators dropped, whitespace collapsed (None without source)."""
    try:
        source = inspect.getsource(inspect.unwrap(fn))
    except (OSError, TypeError):
        return None
    lines = source.split("\n")
    while lines and lines[0].lstrip().startswith("@"):
        lines.pop(0)
    source = " ".join(re.sub(r"#[^\n]*", "", "\n".join(lines)).split())
    header = _HEADER.match(source)
    return None if header is None else _DOCSTRING.sub("", source[header.end() :])

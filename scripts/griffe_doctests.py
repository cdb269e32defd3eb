"""Griffe extension for the API reference (mkdocs.yml): doctest blocks render as code.

grpotrl's docstrings carry doctests in their prose (``>>> f(x)`` then the expected output, as
TRL's and the standard library's do), which pytest runs (``--doctest-modules``). Markdown has no
notion of them: it would join a block into one paragraph and read ``[0.5, 0.5]`` as a link. This
extension fences each block (from a ``>>>`` line to the next blank line) as ``pycon`` code in the
docstring text the site renders; the source files are left as they are.
"""

import re

import griffe

_PROMPT = re.compile(r"^(\s*)>>> ")


def fence_doctests(text: str) -> str:
    r"""``text`` with every doctest block wrapped in a ```` ```pycon ```` fence at its indentation.

    >>> fence_doctests("Sum:\n>>> 1 + 1\n2\n\nDone.").split("\n")
    ['Sum:', '```pycon', '>>> 1 + 1', '2', '```', '', 'Done.']
    """
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        match = _PROMPT.match(lines[i])
        if not match:
            out.append(lines[i])
            i += 1
            continue
        indent = match.group(1)
        out.append(f"{indent}```pycon")
        while i < len(lines) and lines[i].strip():
            out.append(lines[i])
            i += 1
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    def on_object(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None and ">>> " in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)

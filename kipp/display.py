"""How Kipp's objects show themselves: `repr` in a terminal, `_repr_html_` in Jupyter.

    >>> model
    <kipp.Model kipp-synthetic/qwen3-tiny @ synthetic-v2-seed-1
      weights  bf16, .../bf16.gguf
      backend  reference (numpy, bf16 weights)
      context  40,960 tokens; KV pool 0 of 1,280 blocks in use (32 tokens each)>

Both views come from one list of (label, value) rows, so they cannot say different things.
"""

from __future__ import annotations

import contextlib
import html

# A Generation's text is cut to this many characters in its display (the object keeps it all).
TEXT_PREVIEW = 2000


def text_view(title: str, rows: list[tuple[str, str]]) -> str:
    """`<kipp.Title\\n  label  value ...>` with labels aligned."""
    width = max((len(label) for label, _ in rows), default=0)
    lines = [f"  {label:<{width}}  {value}" for label, value in rows]
    return "<" + "\n".join([title] + lines) + ">"


def html_view(title: str, rows: list[tuple[str, str]], text: str | None = None) -> str:
    """A small table (and an optional preformatted text) for Jupyter's rich display."""
    cells = "".join(
        f"<tr><th style='text-align:left;padding-right:1em'>{html.escape(label)}</th>"
        f"<td style='text-align:left'>{html.escape(value)}</td></tr>" for label, value in rows)
    body = f"<b>{html.escape(title)}</b><table>{cells}</table>"
    if text is not None:
        body += f"<pre style='white-space:pre-wrap'>{html.escape(preview(text))}</pre>"
    return f"<div>{body}</div>"


def preview(text: str, limit: int = TEXT_PREVIEW) -> str:
    """The text, or its last `limit` characters after an ellipsis."""
    return text if len(text) <= limit else "…" + text[-limit:]


def count(n: int, noun: str) -> str:
    """`1 block`, `2 blocks`, `1,280 blocks`."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


@contextlib.contextmanager
def step_bar(description: str, enabled: bool = True):
    """A progress bar of one step for a long call with no progress of its own (a compile): it
    shows `description` while the call runs, then the time it took (a widget in Jupyter)."""
    from tqdm.auto import tqdm

    bar = tqdm(total=1, desc=description, disable=not enabled, bar_format="{desc}: {elapsed}")
    try:
        yield
        bar.update(1)
    finally:
        bar.close()

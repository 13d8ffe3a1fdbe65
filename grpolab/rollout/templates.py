"""A chat template rendered once at start-up, under a time limit.

A chat template is a Jinja program that ships with the model. transformers renders it in
Jinja's sandbox, so one that reaches for Python internals fails (``SecurityError``); but the
sandbox bounds neither time nor loops, and ``{% for %}`` over ``range`` nested a few deep
renders for hours. So the first prompt is rendered in a forked child that is killed past
``TEMPLATE_SECONDS``: such a template is refused in one line before the run starts instead of
hanging it. (Only the sample prompt is timed: the run's own renders are not.)
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable
from typing import Any

TEMPLATE_SECONDS = 10.0
EMPTY = "the chat template renders the first prompt as nothing"


def _empty(rendered: Any) -> bool:
    """A render (``HFBackend.render``'s (text, templated)) whose template produced no text."""
    return isinstance(rendered, tuple) and bool(rendered[1]) and not str(rendered[0]).strip()


def _child(conn: Any, render: Callable[[Any], Any], prompt: Any) -> None:
    try:
        conn.send(EMPTY if _empty(render(prompt)) else None)
    except ValueError as e:  # already one line for the user
        conn.send(str(e))
    except BaseException as e:  # noqa: BLE001 - reported by the parent, in one line
        conn.send(f"the tokenizer's chat template cannot render a prompt: "
                  f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")


def check_render(render: Callable[[Any], Any], prompt: Any,
                 seconds: float = TEMPLATE_SECONDS) -> None:
    """``render(prompt)`` must finish within ``seconds``; else a one-line ValueError, as for
    any failure of the render (chat prompts without a template, a template that raises)."""
    if "fork" not in multiprocessing.get_all_start_methods():  # a thread cannot be stopped,
        _in_thread(render, prompt, seconds)  # but a daemon one does not keep the run alive
        return
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, render, prompt), daemon=True,
                       name="grpolab-template-check")
    proc.start()
    child.close()
    try:
        if not parent.poll(seconds):
            raise _too_slow(seconds)
        try:
            error = parent.recv()
        except EOFError:
            error = "the process rendering the chat template died (out of memory?)"
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        parent.close()
    if error is not None:
        raise ValueError(error)


def _in_thread(render: Callable[[Any], Any], prompt: Any, seconds: float) -> None:
    box: list[BaseException] = []

    def run() -> None:
        try:
            if _empty(render(prompt)):
                box.append(ValueError(EMPTY))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box.append(e)

    t = threading.Thread(target=run, daemon=True, name="grpolab-template-check")
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise _too_slow(seconds)
    if box:
        raise box[0]


def _too_slow(seconds: float) -> ValueError:
    return ValueError(f"the tokenizer's chat template did not render a sample prompt within "
                      f"{seconds:g} s (an unbounded loop?); fix the template, or set "
                      "use_chat_template: false")

"""The agent's to-do list: the state behind the `todo` tool.

One list per episode, kept by the harness (not in the workspace), so it survives self-summaries
(c2jax.agent.summarize re-states it after a restart). Items are numbered from 1 in the order they
were added; ids are never reused. Every change returns the whole list, so the model sees it in
the tool result. Items still open when the episode ends are counted
(stats["unfinished_todos"]) and penalized by the RL reward (c2jax.rl.rewards).
"""
from __future__ import annotations

import dataclasses
import threading

MAX_ITEMS = 50
MAX_TEXT_CHARS = 200
ACTIONS = ("add", "update", "complete", "remove", "list")


class TodoError(ValueError):
    """A bad to-do request; its message goes back to the model."""


@dataclasses.dataclass
class TodoItem:
    id: int
    text: str
    done: bool = False


class TodoList:
    """The episode's to-do items (thread-safe: tool calls may run on worker threads)."""

    def __init__(self):
        self.items: list[TodoItem] = []
        self.next_id = 1
        self.created = 0
        self.completed = 0
        self._lock = threading.Lock()

    def unfinished(self) -> int:
        """Number of open items."""
        return sum(not it.done for it in self.items)

    def render(self) -> str:
        """The list as the model sees it ("" when it was never used)."""
        if not self.items:
            return "to-do list: (empty)" if self.created else ""
        n_open = self.unfinished()
        head = f"to-do list ({n_open} open, {len(self.items) - n_open} done):"
        return "\n".join([head] + [f"[{'x' if it.done else ' '}] {it.id}. {it.text}" for it in self.items])

    def apply(self, action: str, item_id: int | None = None, text: str | None = None) -> str:
        """Runs one `todo` tool request; returns the list after it. Raises TodoError."""
        if action not in ACTIONS:
            raise TodoError(f"todo: unknown action {action!r}; use one of {', '.join(ACTIONS)}")
        with self._lock:
            if action == "add":
                self._no_id(action, item_id)
                self._add(_clean_text(action, text))
            elif action == "update":
                self._find(action, item_id).text = _clean_text(action, text)
            elif action in ("complete", "remove"):
                if text is not None:
                    raise TodoError(f"todo: action {action!r} takes only 'id', not 'text'")
                it = self._find(action, item_id)
                if action == "remove":
                    self.items.remove(it)
                elif it.done:
                    raise TodoError(f"todo: item {it.id} is already complete")
                else:
                    it.done = True
                    self.completed += 1
            else:
                self._no_id(action, item_id)
                if text is not None:
                    raise TodoError("todo: action 'list' takes no arguments besides 'action'")
            return self.render() or "to-do list: (empty)"

    def _add(self, text: str) -> None:
        if len(self.items) >= MAX_ITEMS:
            raise TodoError(f"todo: the list holds at most {MAX_ITEMS} items; complete or remove some first")
        self.items.append(TodoItem(self.next_id, text))
        self.next_id += 1
        self.created += 1

    def _find(self, action: str, item_id: int | None) -> TodoItem:
        if item_id is None:
            raise TodoError(f"todo: action {action!r} needs 'id' (the item's number)")
        for it in self.items:
            if it.id == item_id:
                return it
        ids = ", ".join(str(it.id) for it in self.items) or "none"
        raise TodoError(f"todo: no item {item_id}; the items are: {ids}")

    @staticmethod
    def _no_id(action: str, item_id: int | None) -> None:
        if item_id is not None:
            raise TodoError(f"todo: action {action!r} takes no 'id'")


def _clean_text(action: str, text: str | None) -> str:
    if text is None or not text.strip():
        raise TodoError(f"todo: action {action!r} needs a non-empty 'text'")
    text = " ".join(text.split())
    if len(text) > MAX_TEXT_CHARS:
        raise TodoError(f"todo: 'text' is {len(text)} characters; the limit is {MAX_TEXT_CHARS}")
    return text

"""What an Open WebUI request tells clawd about itself.

Open WebUI drops its request `metadata` (chat id, message id, task) before it calls a model
server (routers/openai.py `generate_chat_completion` pops it), so clawd can only see what
arrives as headers:

- with ENABLE_FORWARD_USER_INFO_HEADERS=true it sends `X-OpenWebUI-Chat-Id` (utils/headers.py);
- a connection's own "Headers" setting is templated per request: `{{CHAT_ID}}`, `{{MESSAGE_ID}}`
  (the assistant message being generated: the id a rating of it names) and `{{TASK}}`
  (`title_generation`, `tags_generation`, ...; empty for a chat reply). CONNECTION_HEADERS is
  the setting README tells users to paste.

Open WebUI's background tasks (title, tags, follow-ups, autocomplete, query and image-prompt
generation, emoji, mixture-of-agents) are no conversation: they are side turns, never mined.
The task header says so exactly; without it the request is recognised by the opening of Open
WebUI's default task templates (config.py DEFAULT_*_PROMPT_TEMPLATE), sent as one message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from clawd.protocol import Message

CHAT_ID_HEADER = "x-openwebui-chat-id"
MESSAGE_ID_HEADER = "x-openwebui-message-id"
TASK_HEADER = "x-openwebui-task"
CONNECTION_HEADERS = {
    "X-OpenWebUI-Chat-Id": "{{CHAT_ID}}",
    "X-OpenWebUI-Message-Id": "{{MESSAGE_ID}}",
    "X-OpenWebUI-Task": "{{TASK}}",
}
MAX_ID_CHARS = 128  # Open WebUI's ids are UUIDs; anything longer is not one of its ids

# How Open WebUI's default task prompts begin (open_webui/config.py, 0.6-0.12): every
# "### Task:" template (title, tags, follow-ups, query, autocomplete, image prompt) quotes the
# chat inside <chat_history> (autocomplete: the typed <text>).
_TASK_HEADING = "### Task:"
_TASK_QUOTES = ("<chat_history>", "<text>")
_OTHER_TASK_OPENINGS = (
    "Your task is to reflect the speaker's likely facial expression",  # emoji generation
    "You have been provided with a set of responses from various models",  # mixture of agents
)


@dataclass(frozen=True)
class Origin:
    chat_id: str | None = None
    message_id: str | None = None
    task: str | None = None  # the task header's value, or "template" when recognised by its text


def _id(headers: Mapping[str, str], name: str) -> str | None:
    value = (headers.get(name) or "").strip()
    return value if value and len(value) <= MAX_ID_CHARS and value.isprintable() else None


def origin(headers: Mapping[str, str], messages: Sequence[Message]) -> Origin:
    """The ids Open WebUI sent with this chat request, and the task it is, if any."""
    task = _id(headers, TASK_HEADER) or ("template" if looks_like_task(messages) else None)
    return Origin(_id(headers, CHAT_ID_HEADER), _id(headers, MESSAGE_ID_HEADER), task)


def looks_like_task(messages: Sequence[Message]) -> bool:
    """Open WebUI sends a task as one user message (a system prompt may precede it) holding the
    filled-in template. A conversation that merely quotes a template has an assistant turn, or
    more messages, so it is not taken for one."""
    if not messages or len(messages) > 2 or any(m.role not in ("system", "developer", "user") for m in messages):
        return False
    if messages[-1].role != "user":
        return False
    text = messages[-1].text().lstrip()
    if text.startswith(_TASK_HEADING):
        return any(q in text for q in _TASK_QUOTES)
    return text.startswith(_OTHER_TASK_OPENINGS)

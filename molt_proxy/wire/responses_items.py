"""OpenAI Responses on the wire: the ids the proxy shows, and `input` items as the chat
template's messages (`wire/responses.py` decodes the rest of a request).

Items become messages in order. Leading `system` / `developer` messages join the system
prompt (after `instructions`); one later in the input becomes a user message with the same
text, in place, as on the Anthropic route (every template accepts it there, and it rewrites
nothing before it). A run of assistant-side items — `reasoning`, an assistant `message`,
`function_call`, `custom_tool_call` — is one assistant message, in sampled order: a new one
starts where a `reasoning` item or a message follows text or calls. Tool outputs
(`function_call_output`, `custom_tool_call_output`) are tool messages.

A reasoning item's text is its `encrypted_content` when the proxy minted it (the exact text
the reply returned, so the echo renders the sampled tokens), else its `summary` texts (or its
`content`, as vLLM writes reasoning). Ids: a call id the parser minted (`chatcmpl-tool-X`) is
shown as `call_X` (its item `fc_X`), the completion `chatcmpl-X` as the response `resp_X`, and
echoed ids are read back, so echoes are recognised as chat completions' are (`echo.py`).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from vllm.entrypoints.openai.responses.utils import encode_custom_tool_input
from vllm.tool_parsers.utils import flat_namespace_tool_name

from molt_proxy.errors import BadRequest

_CALL, _SHOWN_CALL = "chatcmpl-tool-", "call_"
_COMPLETION, _RESPONSE = "chatcmpl-", "resp_"
_ENCRYPTED = "molt-reasoning:"

_ASSISTANT_SIDE = frozenset({"reasoning", "function_call", "custom_tool_call"})
_OUTPUTS = frozenset({"function_call_output", "custom_tool_call_output"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal"})


def shown_call_id(call_id: str) -> str:
    return _SHOWN_CALL + call_id.removeprefix(_CALL) if call_id.startswith(_CALL) else call_id


def call_id(shown: str) -> str:
    """The call id an echoed `call_id` stands for (the inverse of `shown_call_id`)."""
    return _CALL + shown.removeprefix(_SHOWN_CALL) if shown.startswith(_SHOWN_CALL) else shown


def response_id(completion_id: str) -> str:
    return _RESPONSE + completion_id.removeprefix(_COMPLETION)


def recorded_completion_id(any_id: str) -> str:
    """A completion id as recorded, given it as a response id (`resp_X`) or as recorded."""
    return _COMPLETION + any_id.removeprefix(_RESPONSE) if any_id.startswith(_RESPONSE) else any_id


def item_id(prefix: str, completion_id: str) -> str:
    """`msg_X` / `rs_X`: the id of a reply's message or reasoning item."""
    return f"{prefix}_{completion_id.removeprefix(_COMPLETION)}"


def function_item_id(call: str) -> str:
    return "fc_" + call.removeprefix(_CALL)


def encrypted_reasoning(text: str) -> str:
    """The `encrypted_content` of a reasoning item: the exact reasoning text, which the proxy
    reads back (not secret: an agent's history is its own; what it renders is checked by the
    stitching, byte for byte)."""
    return _ENCRYPTED + base64.urlsafe_b64encode(text.encode()).decode()


def _decrypted(value: str, param: str) -> str:
    try:
        return base64.b64decode(value.removeprefix(_ENCRYPTED), altchars=b"-_", validate=True).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise BadRequest(f"{param}: not an encrypted_content this proxy minted", param=param) from None


def _text(content: Any, param: str) -> str:
    """A string, or text parts joined by newlines (images, files and audio are refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{param} must be a string or an array of content parts", param=param)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise BadRequest(
                f"{param}.{i}: {kind!r} content is not supported: the served model reads text only",
                param=f"{param}.{i}",
            )
        value = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(value, str):
            raise BadRequest(f"{param}.{i} needs a string 'text'", param=f"{param}.{i}")
        texts.append(value)
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise BadRequest(f"{param}.{key} must be a string", param=f"{param}.{key}")
    return value


def _reasoning(item: dict[str, Any], param: str) -> str:
    encrypted = item.get("encrypted_content")
    if isinstance(encrypted, str) and encrypted.startswith(_ENCRYPTED):
        return _decrypted(encrypted, f"{param}.encrypted_content")
    summary = item.get("summary")
    texts = _text(summary, f"{param}.summary") if summary else ""
    content = item.get("content")
    return texts or (_text(content, f"{param}.content") if content else "")


def _call(item: dict[str, Any], param: str) -> dict[str, Any]:
    name = _string(item, "name", param)
    namespace = item.get("namespace")
    if isinstance(namespace, str) and namespace:
        name = flat_namespace_tool_name(namespace, name)
    if item["type"] == "custom_tool_call":
        arguments = encode_custom_tool_input(_string(item, "input", param))
    else:
        arguments = _string(item, "arguments", param)
    shown = _string(item, "call_id", param)
    return {"id": call_id(shown), "type": "function", "function": {"name": name, "arguments": arguments}}


class _Messages:
    """The messages being built, with the open assistant message."""

    def __init__(self, system: list[str]):
        self.system = system
        self.out: list[dict[str, Any]] = []
        self.assistant: dict[str, Any] | None = None

    def _open(self, starts_anew: bool) -> dict[str, Any]:
        if self.assistant is None or starts_anew:
            self.assistant = {"role": "assistant", "content": ""}
            self.out.append(self.assistant)
        return self.assistant

    def add(self, item: dict[str, Any], param: str) -> None:
        kind = item["type"]
        if kind in _ASSISTANT_SIDE or (kind == "message" and item.get("role") == "assistant"):
            self._assistant(item, kind, param)
            return
        self.assistant = None
        if kind in _OUTPUTS:
            output = _text(item.get("output"), f"{param}.output")
            self.out.append(
                {"role": "tool", "tool_call_id": call_id(_string(item, "call_id", param)), "content": output}
            )
        elif kind == "message":
            self._message(item, param)
        else:
            raise BadRequest(f"{param}: {kind!r} items are not supported", param=f"{param}.type")

    def _message(self, item: dict[str, Any], param: str) -> None:
        role = item.get("role")
        text = _text(item.get("content"), f"{param}.content")
        if role in ("system", "developer"):
            if not self.out:
                self.system.append(text)
            else:
                self.out.append({"role": "user", "content": text})
        elif role == "user":
            self.out.append({"role": "user", "content": text})
        else:
            raise BadRequest(
                f"{param}.role must be user, assistant, system or developer, got {role!r}",
                param=f"{param}.role",
            )

    def _assistant(self, item: dict[str, Any], kind: str, param: str) -> None:
        open_ = self.assistant
        said = open_ is not None and bool(open_["content"] or open_.get("tool_calls"))
        if kind == "reasoning":
            message = self._open(said)
            message["reasoning_content"] = message.get("reasoning_content", "") + _reasoning(item, param)
        elif kind == "message":
            message = self._open(said)
            message["content"] = _text(item.get("content"), f"{param}.content")
        else:
            message = self._open(False)
            message.setdefault("tool_calls", []).append(_call(item, param))


def input_messages(items: list[Any], system: list[str]) -> list[dict[str, Any]]:
    """`input` items → the template's messages; `system` (the instructions, if any) takes the
    leading system and developer messages and becomes the first message."""
    messages = _Messages(list(system))
    for index, item in enumerate(items):
        param = f"input.{index}"
        if not isinstance(item, dict):
            raise BadRequest(f"{param} must be an object", param=param)
        kind = item.get("type", "message" if "role" in item else None)
        if not isinstance(kind, str):
            raise BadRequest(f"{param} needs a 'type'", param=f"{param}.type")
        messages.add({**item, "type": kind}, param)
    head = [{"role": "system", "content": "\n\n".join(messages.system)}] if messages.system else []
    return head + messages.out

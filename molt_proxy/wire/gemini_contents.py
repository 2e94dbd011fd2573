"""The Gemini API on the wire: `contents` and `systemInstruction` as the chat template's
messages, and the thought signatures the proxy mints (`wire/gemini.py` decodes the rest of a
request, `wire/gemini_reply.py` encodes the answer).

A `user` content's text parts are one user message (joined by a newline), its
`functionResponse` parts tool messages, in order; a `model` content is one assistant message:
its text parts joined as sampled pieces (no separator), its thought parts (`thought: true`)
the reasoning, its `functionCall` parts the calls, `args` as the object it is (templates print
it with `tojson`). A `functionResponse`'s `response` renders as its `output` where that is the
only field and a string (Google's convention, and what Gemini CLI sends), else as the object's
JSON.

Ids: a call id the proxy's parser minted (`chatcmpl-tool-X`) is shown as it is; an echoed one
is read back as it is, or with the `<name>__` prefix Gemini CLI adds to every call id taken
off. A `functionResponse` without an `id` answers the first unanswered call of its name in
the model content before it.

Thought signatures: the proxy mints each as the exact reasoning text of its reply
(`thought_signature`; not secret: an agent's history is its own, and the stitching checks what
it renders byte for byte). A model content with one on any part (Gemini puts it on the first
`functionCall` part; Gemini CLI keeps it there and drops thought parts) has that reasoning
back, whatever thought text it carries, so the echo renders the sampled tokens. Any other
signature (Gemini CLI's `skip_thought_signature_validator`) is ignored.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from molt_proxy.errors import BadRequest

_CALL_PREFIX = "chatcmpl-tool-"
_SIGNED = b"molt-thought:"
_MEDIA = ("inlineData", "fileData")
_CODE = ("executableCode", "codeExecutionResult")


def thought_signature(reasoning: str) -> str:
    """The `thoughtSignature` of a reply's reasoning: the exact text, which the proxy reads
    back (`signed_reasoning`), in base64's URL-safe alphabet, as Google's SDKs write bytes."""
    return base64.urlsafe_b64encode(_SIGNED + reasoning.encode()).decode()


def signed_reasoning(signature: Any) -> str | None:
    """The reasoning a signature the proxy minted stands for (either base64 alphabet: the
    SDKs decode and re-encode it); None for any other."""
    if not isinstance(signature, str):
        return None
    try:
        raw = base64.b64decode(signature.replace("-", "+").replace("_", "/"), validate=True)
        return raw.removeprefix(_SIGNED).decode() if raw.startswith(_SIGNED) else None
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


def object_field(value: Any, param: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"'{param}' must be an object", param=param)
    return value


def string_field(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"'{param}' must be a string", param=param)
    return value


def _parts(content: Any, param: str) -> list[dict[str, Any]]:
    """A content's parts, each an object; media and code parts refused."""
    if not isinstance(content, dict):
        raise BadRequest(f"'{param}' must be an object with 'parts'", param=param)
    parts = content.get("parts")
    if not isinstance(parts, list):
        raise BadRequest(f"'{param}.parts' must be an array", param=f"{param}.parts")
    for j, part in enumerate(parts):
        where = f"{param}.parts.{j}"
        if not isinstance(part, dict):
            raise BadRequest(f"'{where}' must be an object", param=where)
        for kind in (*_MEDIA, *_CODE):
            if part.get(kind) is not None:
                why = "the served model reads text only" if kind in _MEDIA else "nothing here runs code"
                raise BadRequest(f"{where}: {kind} parts are not supported: {why}", param=f"{where}.{kind}")
    return parts


def system_text(instruction: Any) -> str:
    """`systemInstruction`: a content (its text parts joined by a newline) or a string."""
    if instruction is None or isinstance(instruction, str):
        return instruction or ""
    parts = _parts(instruction, "systemInstruction")
    texts = []
    for j, part in enumerate(parts):
        if "text" not in part:
            raise BadRequest(
                f"systemInstruction.parts.{j}: only text parts are supported",
                param=f"systemInstruction.parts.{j}",
            )
        texts.append(string_field(part["text"], f"systemInstruction.parts.{j}.text"))
    return "\n".join(texts)


def call_id(echoed: str, name: str) -> str:
    """The call id an echoed `functionCall.id` stands for: as shown, or with the `<name>__`
    prefix Gemini CLI puts on every call id taken off one the proxy minted."""
    bare = echoed.removeprefix(f"{name}__")
    return bare if bare.startswith(_CALL_PREFIX) else echoed


class _Contents:
    """`contents` → the template's messages, with the calls each tool result answers."""

    def __init__(self) -> None:
        self.out: list[dict[str, Any]] = []
        self.unanswered: list[tuple[str, str]] = []
        """(name, id) of the last model content's calls that no response has answered."""

    def messages(self, contents: Any) -> list[dict[str, Any]]:
        if not isinstance(contents, list) or not contents:
            raise BadRequest("'contents' must be a non-empty array of contents", param="contents")
        for i, content in enumerate(contents):
            param = f"contents.{i}"
            parts = _parts(content, param)
            role = content.get("role") or "user"
            if role == "model":
                self.out.append(self._model(parts, param))
            elif role in ("user", "function"):  # "function": the API's older role for responses
                self._user(parts, param)
            else:
                raise BadRequest(f"'{param}.role' must be user or model, got {role!r}", param=f"{param}.role")
        if not any(m["role"] != "system" for m in self.out):
            raise BadRequest("'contents' must hold a part", param="contents")
        return self.out

    def _user(self, parts: list[dict[str, Any]], param: str) -> None:
        texts: list[str] = []
        for j, part in enumerate(parts):
            where = f"{param}.parts.{j}"
            if "functionResponse" in part:
                if texts:
                    self.out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                self.out.append(self._response(part["functionResponse"], f"{where}.functionResponse"))
            elif "text" in part:
                if not part.get("thought"):  # a thought of the user's is no message
                    texts.append(string_field(part["text"], f"{where}.text"))
            elif "functionCall" in part:
                raise BadRequest(f"{where}: a user content cannot hold a functionCall", param=where)
        if texts or not parts:
            self.out.append({"role": "user", "content": "\n".join(texts)})

    def _model(self, parts: list[dict[str, Any]], param: str) -> dict[str, Any]:
        texts: list[str] = []
        thoughts: list[str] = []
        signed: str | None = None
        calls: list[dict[str, Any]] = []
        for j, part in enumerate(parts):
            where = f"{param}.parts.{j}"
            if signed is None:
                signed = signed_reasoning(part.get("thoughtSignature"))
            if "functionCall" in part:
                calls.append(self._call(part["functionCall"], f"{where}.functionCall", len(calls)))
            elif "text" in part:
                text = string_field(part["text"], f"{where}.text")
                (thoughts if part.get("thought") else texts).append(text)
            elif "functionResponse" in part:
                raise BadRequest(f"{where}: a model content cannot hold a functionResponse", param=where)
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        reasoning = signed if signed is not None else "".join(thoughts)
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        self.unanswered = [(c["function"]["name"], c["id"]) for c in calls]
        return message

    def _call(self, call: Any, param: str, index: int) -> dict[str, Any]:
        call = object_field(call, param)
        name = string_field(call.get("name"), f"{param}.name")
        args = call.get("args", {})
        if not isinstance(args, dict):
            raise BadRequest(f"'{param}.args' must be an object", param=f"{param}.args")
        shown = call.get("id")
        identity = (
            call_id(string_field(shown, f"{param}.id"), name) if shown is not None else f"{name}-{index}"
        )
        return {"id": identity, "type": "function", "function": {"name": name, "arguments": args}}

    def _response(self, response: Any, param: str) -> dict[str, Any]:
        response = object_field(response, param)
        name = string_field(response.get("name"), f"{param}.name")
        value = response.get("response", {})
        if not isinstance(value, dict):
            raise BadRequest(f"'{param}.response' must be an object", param=f"{param}.response")
        if response.get("parts"):
            raise BadRequest(f"{param}.parts: multimodal function responses are not supported", param=param)
        shown = response.get("id")
        answered = next((pair for pair in self.unanswered if pair[0] == name), None)
        if shown is not None:
            identity = call_id(string_field(shown, f"{param}.id"), name)
            answered = next((pair for pair in self.unanswered if pair[1] == identity), answered)
        else:
            identity = answered[1] if answered is not None else name
        if answered is not None:
            self.unanswered.remove(answered)
        output = value.get("output")
        text = (
            output
            if set(value) == {"output"} and isinstance(output, str)
            else json.dumps(value, ensure_ascii=False)
        )
        return {"role": "tool", "tool_call_id": identity, "content": text}


def contents_messages(contents: Any) -> list[dict[str, Any]]:
    """`contents` → the template's messages."""
    return _Contents().messages(contents)

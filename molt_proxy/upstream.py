"""The only module that speaks HTTP to vLLM (DESIGN §4).

Token in, token out: `POST /inference/v1/generate` (vLLM's `--enable-scale-out` route)
takes the exact prompt ids and returns the sampled ids, their logprobs (with the most likely
alternatives at each position when an agent asks for `top_logprobs`) and per-token weight
versions. A vLLM upgrade that moves these fields touches this file only.
The client is aiohttp, the per-token path: here it sustains ~10x httpx's rate (DESIGN §4).
The seam is the `session` factory `Upstream` takes (httpx's `MockTransport` idea): production's
`aiohttp.ClientSession` by default, any session, pointed anywhere, in a test. Every HTTP
exchange goes through `Upstream._send`, and there, once, aiohttp's exceptions become domain
errors: a server that cannot be reached, times out or cuts its answer short is
`UpstreamUnavailable` (503, and `Replicas` fails over); any other client failure, or a body that
is not JSON, is `UpstreamError` (502). vLLM's own 5xx answers are `UpstreamError` too, a 503
`UpstreamUnavailable`; its 4xx answers (a sampling field it rejects) are `BadRequest` with vLLM's
message, since they are the caller's input.

With a LoRA name (`lora.py`), a weights push loads an adapter instead, each request names the
newest adapter loaded, and its tokens carry that adapter's version. It does not route:
`replicas.py` decides which `Upstream` serves a request.
"""

from __future__ import annotations

import json
import logging
from array import array
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Self

import aiohttp
import numpy as np
import orjson

from molt_proxy import lora
from molt_proxy.errors import BadRequest, MoltError, UpstreamError, UpstreamUnavailable
from molt_proxy.types import Generation
from molt_proxy.wire.generate import (
    TokenDelta,
    parse_generation,
    parse_tokens,
    parse_top,
    parse_versions,
    top_asked,
)

log = logging.getLogger(__name__)

_GENERATE = "/inference/v1/generate"
_JSON_HEADERS = {"content-type": "application/json"}

SessionFactory = Callable[[], aiohttp.ClientSession]
"""Builds the HTTP client when an `Upstream` opens (inside the event loop, where aiohttp wants
its sessions made); the `Upstream` owns what it returns and closes it."""


KEEPALIVE_S = 2.0
"""How long an idle connection to vLLM is kept for reuse: well under the 5 s after which
vLLM's server closes it (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`). With aiohttp's default of 15 s, a
request could go out on a connection vLLM was closing that moment ("Can not write request
body"), and the replica was taken for dead; a weight refresh, which idles every connection
for seconds, made that likely."""


def production_session(timeout_s: float) -> SessionFactory:
    """The client production uses: one total timeout per request, and no cap on connections
    (aiohttp's default pool of 100 would queue requests inside the proxy, out of sight of
    vLLM's scheduler, which is the one that should decide what runs)."""

    def build() -> aiohttp.ClientSession:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        return aiohttp.ClientSession(timeout=timeout, connector=connector)

    return build


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """What the proxy needs to know of the served model."""

    id: str
    """The name vLLM serves it under (`/v1/models`)."""
    max_model_len: int
    """Prompt plus completion, in tokens."""


class Upstream:
    """One vLLM OpenAI server. It may come up after the proxy: model facts are fetched on
    first use and kept. Use it as `async with Upstream(url) as upstream:`; the HTTP client
    lives from enter to exit."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        session: SessionFactory | None = None,
        lora_name: str | None = None,
    ):
        """`timeout_s` bounds each request of the default client; `session` replaces that
        client (it is then the factory's to set timeouts). `lora_name`: sample from that LoRA
        adapter's newest version once one is pushed (`lora.py`)."""
        self.base_url = base_url.rstrip("/")
        self._new_session = session or production_session(timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._model: ModelInfo | None = None
        self.lora_name = lora_name
        self._adapters: list[tuple[str, int]] = []
        """(vLLM name, version) of the adapters loaded, oldest first; requests go to the last."""

    async def __aenter__(self) -> Self:
        self._session = self._new_session()
        return self

    async def __aexit__(self, *exc: object) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    @asynccontextmanager
    async def _send(
        self, method: str, path: str, payload: dict[str, Any] | None = None
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """One HTTP exchange, answered 2xx; the only place aiohttp is called. Reading the
        response inside the `async with` is covered by the same error translation."""
        if self._session is None:
            raise UpstreamUnavailable(f"the client for vLLM at {self.base_url} is not open")
        data = None if payload is None else encoded(payload)
        headers = None if payload is None else _JSON_HEADERS
        url = f"{self.base_url}{path}"
        with _translated(self.base_url):
            async with self._session.request(method, url, data=data, headers=headers) as resp:
                if resp.status >= 400:
                    raise _status_error(resp.status, await resp.text())
                yield resp

    async def _request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        """The decoded JSON answer, or the text of a route that answers plain text."""
        async with self._send(method, path, payload) as resp:
            if resp.content_type == "application/json":
                return _decode(await resp.read())
            return await resp.text()

    async def generate(
        self, prompt_ids: Sequence[int], sampling: dict[str, Any], *, return_prompt_ids: bool = False
    ) -> Generation:
        body = generate_body(prompt_ids, sampling, stream=False, return_prompt_ids=return_prompt_ids)
        adapter = self._adapter(body)
        generation = parse_generation(
            await self._request("POST", _GENERATE, body), sampling.get("logprobs") or 0
        )
        return _labelled(generation, adapter)

    async def stream(
        self, prompt_ids: Sequence[int], sampling: dict[str, Any], *, return_prompt_ids: bool = False
    ) -> AsyncGenerator[TokenDelta | Generation, None]:
        """Yield each `TokenDelta` as vLLM samples it, then the whole `Generation`.

        vLLM sends the weight-version spans on the last chunk only, so versions are known
        once the stream ends. Leaving the loop early closes the connection, and vLLM aborts
        the request. A stream that ends without a finish reason was cut short: the server
        went away, so it is `UpstreamUnavailable`. `return_prompt_ids`: vLLM echoes the prompt
        ids it read on its first chunk; they are on the first delta and on the `Generation`.
        """
        body = generate_body(prompt_ids, sampling, stream=True, return_prompt_ids=return_prompt_ids)
        adapter = self._adapter(body)
        k = sampling.get("logprobs") or 0
        ids: list[int] = []
        logprobs: list[float] = []
        top: list[list[tuple[int, float]]] = []
        spans: list[dict[str, Any]] | None = None
        finish_reason: str | None = None
        echoed: list[int] | None = None
        unsent: list[int] | None = None
        """The echoed prompt ids until a delta has carried them."""
        async with self._send("POST", _GENERATE, body) as resp:
            async for line in resp.content:
                chunk = _streamed_chunk(line)
                if echoed is None and chunk.get("prompt_token_ids") is not None:
                    echoed = unsent = chunk["prompt_token_ids"]
                for choice in chunk.get("choices") or []:
                    # a chunk's ids only: the versions' spans come on the last chunk, for all
                    delta_ids, delta_logprobs = parse_tokens(choice)
                    spans = choice.get("weight_versions") or spans
                    finish_reason = choice.get("finish_reason") or finish_reason
                    if delta_ids:
                        delta_top = parse_top(choice, k) if k else None
                        ids += delta_ids
                        logprobs += delta_logprobs
                        top += delta_top or []
                        yield TokenDelta(delta_ids, delta_logprobs, delta_top, unsent)
                        unsent = None
        if finish_reason is None:
            raise UpstreamUnavailable(f"vLLM at {self.base_url} ended the stream before it finished")
        yield _labelled(
            Generation(
                ids,
                logprobs,
                parse_versions(spans, len(ids)),
                finish_reason,
                prompt_token_ids=echoed,
                top_logprobs=top if k else None,
            ),
            adapter,
        )

    async def models(self) -> list[dict[str, Any]]:
        return (await self._request("GET", "/v1/models"))["data"]

    async def model(self) -> ModelInfo:
        if self._model is None:
            first = (await self.models())[0]
            self._model = ModelInfo(first["id"], first["max_model_len"])
        return self._model

    async def refresh_weights(self, weights_dir: str, version: int) -> None:
        """Load new weights without failing a request (DESIGN §5); with `lora_name`, a new
        adapter (`load_adapter`).

        `pause?mode=keep` freezes in-flight requests instead of failing them and clears the
        prefix cache (stale KV would give wrong tokens); they continue on `resume` with the
        new weights, and vLLM labels each later token with the new version.
        """
        if self.lora_name is not None:
            return await self.load_adapter(weights_dir, version)
        await self._request("POST", "/pause?mode=keep")
        try:
            await self._request(
                "POST",
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": weights_dir}},
            )
            await self._request("POST", "/update_weight_version", {"new_version": str(version)})
        finally:
            await self._request("POST", "/resume")

    async def load_adapter(self, adapter_dir: str, version: int) -> None:
        """Load version `version` of the adapter under its own name and send the next requests
        to it; then unload all but the newest `lora.KEPT` (`lora.py` says why this keeps
        every token's version exact without pausing vLLM). Loading the same version again (a
        trainer restarting, a relaunched vLLM) reloads it in place."""
        name = lora.adapter_name(self.lora_name or "", version)
        body = {"lora_name": name, "lora_path": adapter_dir, "load_inplace": True}
        try:
            await self._request("POST", "/v1/load_lora_adapter", body)
        except UpstreamUnavailable:
            raise
        except UpstreamError as exc:  # 404: no such route (LoRA off), or a folder it cannot see
            raise UpstreamError(
                f"vLLM at {self.base_url} did not load LoRA adapter {name} from {adapter_dir} "
                f"({exc.message}): it must run with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, "
                "and see that folder"
            ) from exc
        self._adapters = [a for a in self._adapters if a[0] != name] + [(name, version)]
        old, self._adapters = self._adapters[: -lora.KEPT], self._adapters[-lora.KEPT :]
        for stale, _ in old:
            try:
                await self._request("POST", "/v1/unload_lora_adapter", {"lora_name": stale})
            except MoltError as exc:  # gone already (vLLM restarted): nothing to free
                log.info("unloading LoRA adapter %s from %s: %s", stale, self.base_url, exc)

    def _adapter(self, body: dict[str, Any]) -> tuple[str, int] | None:
        """The adapter this request samples from (named in `body`), or None: the base weights."""
        if not self._adapters:
            return None
        body["model"] = self._adapters[-1][0]
        return self._adapters[-1]

    # vLLM's weight-transfer routes (DESIGN §5; `transfer.py` drives them, a phase at a time).

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        await self._request("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    async def start_weight_update(self) -> None:
        """Pause as `refresh_weights` does (held, not failed), then open the update."""
        await self._request("POST", "/pause?mode=keep")
        try:
            await self._request("POST", "/start_weight_update")
        except BaseException:
            await self._request("POST", "/resume")
            raise

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Answers once the trainer's transfer (e.g. its NCCL broadcast) has arrived."""
        await self._request("POST", "/update_weights", {"update_info": update_info})

    async def finish_weight_update(self, version: int) -> None:
        """Load what arrived, label it `version`, resume the held requests."""
        try:
            await self._request("POST", "/finish_weight_update", {"weight_version": str(version)})
        finally:
            await self._request("POST", "/resume")

    async def healthy(self) -> bool:
        """Whether `/health` answers 2xx; any upstream failure is a no, not an exception."""
        try:
            await self._request("GET", "/health")
        except UpstreamError:
            return False
        return True


def generate_body(
    prompt_ids: Sequence[int], sampling: dict[str, Any], *, stream: bool, return_prompt_ids: bool
) -> dict[str, Any]:
    """The generate route's request for these prompt ids (`encoded` writes it)."""
    streamed = {"stream": True} if stream else {}
    return {
        "token_ids": prompt_ids,
        "sampling_params": top_asked(sampling),
        **streamed,
        "return_token_ids": return_prompt_ids,
    }


def encoded(payload: dict[str, Any]) -> bytes:
    """A request's JSON. Prompt ids packed in an `array` of int32 (a continued chain's,
    `stitching.PromptPlan.ids`) go to orjson as a NumPy view of the same memory: no Python
    int per id, at about a third of the cost of encoding them from a list, and none of the
    cost of building that list."""
    ids = payload.get("token_ids")
    if isinstance(ids, array):
        payload = {**payload, "token_ids": np.frombuffer(ids, dtype=np.int32)}
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)


def _labelled(generation: Generation, adapter: tuple[str, int] | None) -> Generation:
    """Every token sampled under an adapter carries the adapter's version: vLLM's own label
    is the engine's, which LoRA refreshes leave at its boot weights."""
    if adapter is not None:
        generation.weight_versions = [adapter[1]] * len(generation.token_ids)
    return generation


@contextmanager
def _translated(base_url: str) -> Iterator[None]:
    """aiohttp's exceptions as domain errors (see the module doc). A cut-short body
    (`ClientPayloadError`) counts as unreachable: it is what a vLLM killed mid-answer gives."""
    try:
        yield
    except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
        raise UpstreamUnavailable(f"vLLM at {base_url} is unreachable: {exc!r}") from exc
    except aiohttp.ClientError as exc:
        raise UpstreamError(f"talking to vLLM at {base_url} failed: {exc!r}") from exc


def _decode(data: bytes) -> Any:
    """vLLM's JSON, read by orjson; by Python's `json` if orjson refuses it (vLLM writes a
    logprob of minus infinity as `-Infinity`, which only `json` reads)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(data)
    except ValueError as exc:
        raise UpstreamError(f"vLLM answered something that is not JSON: {data[:200]!r}") from exc


def _streamed_chunk(line: bytes) -> dict[str, Any]:
    """The chunk of one server-sent-events line (empty for a comment, a blank or `[DONE]`);
    an error chunk raises the error for its code."""
    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
        return {}
    chunk = _decode(line[6:])
    if "error" in chunk:
        raise _status_error(chunk["error"].get("code") or 500, json.dumps(chunk))
    return chunk


def _status_error(status: int, text: str) -> Exception:
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text[:500]
    if 400 <= status < 500 and status != 404:
        return BadRequest(f"vLLM rejected the request: {message}")
    if status == 503:
        return UpstreamUnavailable(f"vLLM is unavailable: {message}")
    return UpstreamError(f"vLLM failed with HTTP {status}: {message}")

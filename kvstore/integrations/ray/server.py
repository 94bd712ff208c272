"""The Ray Serve side of kvstore P/D: a connector backend for `KVStoreConnector` and a decode server
that keeps serving when its prefill does not. Imports ray.serve.llm (and so vLLM): loaded by the
builders and by Ray in each decode replica, never by `import kvstore`.

Ray's decode server (`PDDecodeServer`) asks a prefill replica for one token with
`kv_transfer_params: {"do_remote_decode": true}`, then runs the decode on its own engine with the
`kv_transfer_params` the prefill answered (`{"kvstore": {...}}`): the decode's connector loads the
prompt's blocks from the store. Ours does the same, and when the prefill call raises (a replica
that died under it, no replica at all), answers an error, or does not answer within
`kvstore_prefill_timeout_s`, it runs the request on its own engine as a co-located server would:
the request costs a local prefill, never an error.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncGenerator

from ray import serve
from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest, ErrorResponse
from ray.llm._internal.serve.engines.vllm.kv_transfer.base import (BaseConnectorBackend, DefaultPDProtocolMixin,
                                                                    clamp_request_to_single_token)
from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import KVConnectorBackendFactory
from ray.llm._internal.serve.serving_patterns.prefill_decode import builder as pd_builder
from ray.llm._internal.serve.serving_patterns.prefill_decode.pd_server import (DPPDDecodeServer, PDDecodeServer,
                                                                              PDOrchestratorMixin)
from ray.serve._private.http_util import session_id_from_headers

from .names import CONNECTOR, DEFAULT_PREFILL_TIMEOUT_S

log = logging.getLogger(__name__)
BACKEND_PATH = "kvstore.integrations.ray.server:KVStoreConnectorBackend"


class KVStoreConnectorBackend(DefaultPDProtocolMixin, BaseConnectorBackend):
    """Ray's default P/D protocol (no peer binding, prefill before decode), with the prefill asked
    for exactly what our connector reads: `{"do_remote_decode": true}`, one token."""

    def prepare_prefill_request(self, *, request, peer):
        prefill = request.model_copy(deep=True)
        prefill.kv_transfer_params = {"do_remote_decode": True}
        clamp_request_to_single_token(prefill)
        return prefill


def register_backend() -> None:
    """Make Ray pick KVStoreConnectorBackend for `KVStoreConnector` (in every process of the Ray
    cluster when Ray is initialised, else in this one)."""
    if not KVConnectorBackendFactory.is_registered(CONNECTOR):
        KVConnectorBackendFactory.register_backend(CONNECTOR, BACKEND_PATH)


class LocalPrefillFallback:
    """Decode-server mixin: the P/D hand-off, or a local prefill where the remote one failed."""

    _prefill_handle: Any
    _kvstore_counts: dict[str, int]

    def _kvstore_count(self, what: str) -> None:
        counts = self.__dict__.setdefault("_kvstore_counts", {})
        counts[what] = counts.get(what, 0) + 1

    async def kvstore_stats(self) -> dict[str, int]:
        """Requests handed off (`handoffs`) and prefilled here instead (`local_prefills`, split by
        reason: `prefill_failed`, `prefill_error`, `prefill_timeout`)."""
        return dict(self.__dict__.get("_kvstore_counts", {}))

    def _prefill_timeout(self) -> float:
        config = getattr(self, "_llm_config", None)
        extra = getattr(config, "experimental_configs", None) or {}
        return float(extra.get("kvstore_prefill_timeout_s", DEFAULT_PREFILL_TIMEOUT_S))

    async def _pd_handle_request(self, request, raw_request_info=None) -> AsyncGenerator[Any, None]:
        backend = self._get_connector_backend()  # type: ignore[attr-defined]
        if backend.requires_peer_binding or backend.concurrent_handoff:  # not a protocol we know: Ray's own flow
            async for chunk in super()._pd_handle_request(request, raw_request_info):  # type: ignore[misc]
                yield chunk
            return
        method = "chat" if isinstance(request, ChatCompletionRequest) else "completions"
        decode_request = await self._remote_prefill(backend, method, request, raw_request_info)
        # The decode on this replica's engine: LLMServer's own chat/completions (the orchestrator's
        # are what called us).
        local = await getattr(super(PDOrchestratorMixin, self), method)(decode_request, raw_request_info)
        async for chunk in local:
            yield chunk

    async def _remote_prefill(self, backend, method: str, request, raw_request_info):
        """The decode request: with the prefill's kv_transfer_params, or `request` as it came when
        the prefill failed (this engine then computes the prompt)."""
        prefill_request = backend.prepare_prefill_request(request=request, peer=None)
        handle = self._prefill_handle
        model_id = serve.get_multiplexed_model_id()
        if model_id:
            handle = handle.options(multiplexed_model_id=model_id)
        if raw_request_info is not None:
            session = session_id_from_headers(raw_request_info.headers)
            if session:
                handle = handle.options(session_id=session)
        response = None
        timeout = self._prefill_timeout()
        try:
            response = getattr(handle, method).remote(prefill_request, raw_request_info)
            chunk = await asyncio.wait_for(response.__anext__(), timeout)
        except asyncio.TimeoutError:
            reason, detail = "prefill_timeout", f"no answer within {timeout:g} s"
        except Exception as exc:  # noqa: BLE001 - a dead replica, no replica, a cancelled call: all the same here
            reason, detail = "prefill_failed", f"{type(exc).__name__}: {exc}"
        else:
            if not isinstance(chunk, ErrorResponse):
                self._kvstore_count("handoffs")
                return backend.prepare_decode_request(request=request, peer=None, prefill_response=chunk)
            reason, detail = "prefill_error", str(getattr(chunk, "error", chunk))[:300]
        if response is not None:
            try:
                response.cancel()
            except Exception:  # noqa: BLE001 - best effort: the replica may be gone
                pass
        self._kvstore_count("local_prefills")
        self._kvstore_count(reason)
        log.warning("remote prefill failed (%s: %s); this decode replica computes the prompt", reason, detail[:300])
        return request.model_copy(deep=True)


class KVStorePDDecodeServer(LocalPrefillFallback, PDDecodeServer):
    """Ray's PDDecodeServer with the local-prefill fallback."""

    async def __init__(self, llm_config, *, prefill_server, engine_cls=None, model_downloader=None):
        register_backend()  # in this replica's process, before its engine picks a backend
        await super().__init__(llm_config, prefill_server=prefill_server, engine_cls=engine_cls,
                               model_downloader=model_downloader)


class KVStoreDPPDDecodeServer(LocalPrefillFallback, DPPDDecodeServer):
    """Ray's DPPDDecodeServer (data-parallel decode) with the local-prefill fallback."""

    async def __init__(self, llm_config, *, prefill_server, engine_cls=None, model_downloader=None):
        register_backend()
        await super().__init__(llm_config, prefill_server=prefill_server, engine_cls=engine_cls,
                               model_downloader=model_downloader)


def build_with_kvstore_decode(serving_args: dict[str, Any]):
    """Ray's build_pd_openai_app(serving_args), its decode deployment of our classes."""
    swaps = {"PDDecodeServer": KVStorePDDecodeServer, "DPPDDecodeServer": KVStoreDPPDDecodeServer}
    missing = [name for name in swaps if not hasattr(pd_builder, name)]
    if missing:
        raise ImportError(f"ray.serve.llm's P/D builder has no {', '.join(missing)}: this Ray version is not one "
                          "kvstore.integrations.ray knows (tested: ray 2.60)")
    originals = {name: getattr(pd_builder, name) for name in swaps}
    try:
        for name, cls in swaps.items():
            setattr(pd_builder, name, cls)
        app = pd_builder.build_pd_openai_app(serving_args)
    finally:
        for name, cls in originals.items():
            setattr(pd_builder, name, cls)
    decode = decode_deployment_class(app)
    if not issubclass(decode, LocalPrefillFallback):
        raise ImportError(f"ray.serve.llm built its decode deployment of {decode.__name__}, not of ours: this Ray "
                          "version is not one kvstore.integrations.ray knows (tested: ray 2.60)")
    return app


def decode_deployment_class(app) -> type:
    """The class of the decode deployment an app's ingress serves."""
    ingress = app._bound_deployment
    deployments = list((ingress.init_kwargs.get("llm_deployments") or {}).values())
    if len(deployments) != 1:
        raise ValueError(f"expected one model behind the ingress, found {len(deployments)}")
    return deployments[0]._bound_deployment.func_or_class


__all__ = ["KVStoreConnectorBackend", "KVStoreDPPDDecodeServer", "KVStorePDDecodeServer", "LocalPrefillFallback",
           "build_with_kvstore_decode", "decode_deployment_class", "register_backend"]

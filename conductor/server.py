"""`conductor serve`: a small HTTP/JSON front for proxies over the router core (conductor.routing).

    POST /route  {"hashes": [hex, ...] | "token_ids": [...], "prompt_tokens": N, "output_tokens": M,
                  "session": ..., "exclude": [instance names the request already failed on]}
    POST /load   {"name": ..., "role": "prefill"|"decode", "queue_ms": ..., "running_tokens": ..., ...}
    GET  /health
"""
from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvstore.keys import ModelFingerprint, chain_hashes

from .router import Conductor, InstanceLoad

MAX_BODY = 8 << 20


def make_server(conductor: Conductor, host: str = "127.0.0.1", port: int = 0,
                fingerprint: ModelFingerprint | None = None) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:  # quiet: this is on the request path
            pass

        def do_GET(self) -> None:
            if self.path == "/health":
                self._reply(200, {"ok": True, "index_stale": conductor.mirror.stale})
            else:
                self._reply(404, {"error": f"no such path {self.path}"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                return self._reply(413, {"error": f"body over {MAX_BODY} bytes"})
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("body must be a JSON object")
                if self.path == "/route":
                    return self._reply(200, self._route(body))
                if self.path == "/load":
                    conductor.report(InstanceLoad(**body))
                    return self._reply(200, {"ok": True})
                return self._reply(404, {"error": f"no such path {self.path}"})
            except (ValueError, TypeError, KeyError) as exc:
                return self._reply(400, {"error": str(exc)})

        def _route(self, body: dict) -> dict:
            if "hashes" in body:
                hashes = [bytes.fromhex(h) for h in body["hashes"]]
            elif "token_ids" in body and fingerprint is not None:
                hashes = chain_hashes(fingerprint, body["token_ids"])
            else:
                raise ValueError("give 'hashes' (hex) or 'token_ids'")
            prompt = int(body.get("prompt_tokens", len(body.get("token_ids", [])) or len(hashes) * conductor.block_tokens))
            exclude = body.get("exclude", [])
            if not isinstance(exclude, list) or not all(isinstance(name, str) for name in exclude):
                raise ValueError("'exclude' must be a list of instance names")
            session = body.get("session")
            if session is not None and not isinstance(session, str):
                raise ValueError("'session' must be a string")
            decision = conductor.route(hashes, prompt, int(body.get("output_tokens", 0)), session, frozenset(exclude))
            return decision.to_dict()

    return ThreadingHTTPServer((host, port), Handler)

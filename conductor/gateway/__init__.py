"""The OpenAI-compatible front door: `conductor serve --prefill URL ... --decode URL ...`.

Routes each request by the conductor's policies (store-pool hits from the index mirror, what each
engine's own prefix cache holds, live load scraped from the engines), runs the prefill -> decode
hand-off over vLLM's HTTP API, and streams the answer back."""
from .config import GatewayConfig
from .app import Gateway

__all__ = ["Gateway", "GatewayConfig"]

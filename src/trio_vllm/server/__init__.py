"""The OpenAI-compatible HTTP server (``trio-vllm serve``): vLLM's API on trio or asyncio.

`OpenAIServer` is a plain ASGI app over a text frontend (``trio_vllm.llm``);
`serve_app` serves any ASGI app with hypercorn (trio worker under trio, asyncio
worker under asyncio); `run_openai_server` is the whole command: engines, frontend,
app, signals and the engine-death policy. hypercorn and prometheus_client are imported
only when an app is built or served.
"""

from __future__ import annotations

from ._app import DEFAULT_MAX_BODY_BYTES as DEFAULT_MAX_BODY_BYTES
from ._app import OpenAIServer as OpenAIServer
from ._frontend import TextFrontend as TextFrontend
from ._lora import LoRAModulePath as LoRAModulePath
from ._lora import parse_lora_modules as parse_lora_modules
from ._run import run_openai_server as run_openai_server
from ._serve import DEFAULT_SHUTDOWN_GRACE as DEFAULT_SHUTDOWN_GRACE
from ._serve import serve_app as serve_app
from ._tools import ToolOptions as ToolOptions

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_SHUTDOWN_GRACE",
    "LoRAModulePath",
    "OpenAIServer",
    "TextFrontend",
    "ToolOptions",
    "parse_lora_modules",
    "run_openai_server",
    "serve_app",
]

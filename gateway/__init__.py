"""The HTTP gateway (OpenAI-compatible API, SSE, admission, request bounds, /metrics) and the local launcher
(dflash-serve)."""

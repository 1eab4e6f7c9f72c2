"""The HTTP gateway (OpenAI-compatible API, SSE, admission, /metrics) and the local launcher.

Not built yet: see docs/architecture.md ("Status") for what exists today.
"""

"""The OpenAI-compatible HTTP door (`cp-runtime serve --http-port`, docs/http.md): uvicorn on
the server's own event loop with its connection limit and read timeout (`listener`), the
Starlette endpoints (`openai_api`), the request and response shapes as pure functions
(`openai_format`, `openai_responses`), chat templates (`chat_template`) and the Prometheus
metrics (`metrics`). Needs the `http` extra.

Talks to the server only through cp_runtime.serving.backend.Backend: never the engine, the
device loop or the server's attributes. Of the engine it imports only the request and event
types (cp_runtime.engine.requests).
"""

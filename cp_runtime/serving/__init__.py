"""Serving: two front doors on one server, and the sessions' durable state.

    session/   the session protocol over TCP: frames, ops and error codes (`protocol`), the
               server with its device loop and request log (`server`, `engine_loop`,
               `activity`), and the Python clients (`client`)
    http/      the OpenAI-compatible HTTP door: uvicorn on the server's loop (`listener`), the
               endpoints (`openai_api`), the request and response shapes (`openai_format`,
               `openai_responses`), chat templates (`chat_template`), Prometheus (`metrics`)
    state/     durable sessions under --state-dir: the engine's journal (`token_store`), the
               token log's and the snapshots' file formats (`token_log`, `snapshots`), and
               start-up's checks and repairs (`recovery`)

and beside them what they share: `backend` (the limits on what clients may ask, and the small
interface through which the HTTP door talks to the server), `errors` (an exception's error
code, the same at both doors), `app` (putting a server together and running it) and `process`
(`cp-runtime serve` as a child process: the tests', the benchmarks' and a notebook's way to
start a real server, so it ships with the package).

May import cp_runtime.engine, model, parallel, cache and weights, config, dtypes, platform and
optional; never the command line, the cluster code or aot. Inside, state/ imports no other part
of serving, and http/ reaches the server only through `backend`
(tests/project/test_layering.py). The clients and the protocol import neither JAX nor the engine
(msgpack, numpy and tqdm only), so `import cp_runtime` stays light.
"""

"""Serving: the session protocol (`protocol`), the server with its device loop (`server`,
`engine_loop`, `activity`), the Python clients (`client`), durable state (`state`,
`token_log`, `snapshots`, `recovery`), the OpenAI HTTP door (`http_front`, `openai_api`,
`openai_format`, `openai_responses`, `chat_template`, `metrics`), putting a server together
(`app`) and starting one as a child process (`process`).

May import cp_runtime.engine, model, parallel, cache and weights, config, dtypes, platform and
optional; never the command line, the cluster code or aot. The clients and the protocol import
neither JAX nor the engine (msgpack, numpy and tqdm only), so `import cp_runtime` stays light.
"""

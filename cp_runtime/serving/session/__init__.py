"""The session protocol (docs/protocol.md): msgpack frames over TCP (`protocol`), the server
that runs one engine on a device thread of its own for both front doors (`server`,
`engine_loop`), its request log and summaries (`activity`), and the Python clients that
`cp_runtime` exports (`client`).

May import serving's `backend`, `errors` and state/; never http/ (app.build_server attaches
the HTTP door to a server).
"""

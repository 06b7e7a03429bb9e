"""Durable sessions under a state directory (`cp-runtime serve --state-dir DIR`, docs/state.md):
the engine's journal over DIR (`token_store`), the token log's checksummed records
(`token_log`), snapshot files (`snapshots`), and start-up's checks, repairs and quarantine that
bring the sessions back into the engine (`recovery`).

Imports no other part of serving: the server and the command line hand a `TokenStore` to the
engine.
"""

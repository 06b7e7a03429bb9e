"""The serving wing: wire protocol, server (with its device loop) and Python clients."""

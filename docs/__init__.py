"""The project's documentation (Markdown), installed with the package so that the
`docs/NAME.md` files the command line's help names are on every machine that has the code:
`cp-runtime --help` prints where."""

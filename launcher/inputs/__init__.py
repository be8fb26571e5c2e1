"""The ``in=`` side of ``flotilla run``: HTTP server, interactive text, batch file."""

"""duck-console: the Textual operator console of duckd (talks to it over gRPC only)."""

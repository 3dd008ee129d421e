"""Command-line tools: cli, bench, eval, info."""

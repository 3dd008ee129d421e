"""schemathesis against the server's own /openapi.json: valid and invalid requests
(positive and negative modes), every response checked against the published schema.

Bounded: a fixed seed, at most EXAMPLES examples per operation and a time budget; the tiny
model keeps generation cheap. Zero 5xx and zero responses outside the schema are required.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_helpers import SubprocessServer, tiny_model

pytest.importorskip("schemathesis")

KEY = "sk-schema"
EXAMPLES = 150
# The command line, with what its worker threads import lazily imported first: two threads
# compiling the same module at once can fail inside CPython 3.11 ("AST constructor recursion
# depth mismatch"), an error of the test tool, not of the server.
CLI = ("import anyio.from_thread, schemathesis.transport.asgi; "
       "from schemathesis.cli import schemathesis; schemathesis()")
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_headers_conformance,response_schema_conformance,negative_data_rejection")


def test_schemathesis_finds_nothing(tmp_path: Path) -> None:
    model = tiny_model(tmp_path / "model", max_position_embeddings=64)
    srv = SubprocessServer(model, tmp_path / "run", "--api-key", KEY, "--n-ctx", "64",
                           "--max-queue", "64").wait_ready()
    cmd = [sys.executable, "-c", CLI]
    try:
        run = subprocess.run(
            [*cmd, "run", srv.url + "/openapi.json", "-H", f"Authorization: Bearer {KEY}",
             "--mode", "all", "--checks", CHECKS, "--max-examples", str(EXAMPLES),
             "--seed", "20261201", "--max-time", "150", "--workers", "2",
             "--request-timeout", "30", "--no-color", "--warnings", "off"],
            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    finally:
        code = srv.stop()
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-8000:]
    assert "passed" in out.lower()
    assert code == 0, srv.log()[-4000:]
    assert "Traceback" not in srv.log(), srv.log()[-4000:]

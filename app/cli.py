"""`colibri serve`: argparse options over COLIBRI_* environment variables over `.env`, all made
from the engine's options table.

`add_serve_parser(subparsers)` registers the subcommand, `serve_main(args)` runs it and
returns the exit code: 0 after SIGTERM/SIGINT and a drain, 1 when the engine fails. Before
anything is bound or loaded, the port and the model are checked: a taken port or a bad model
folder is one line on stderr and exit code 2 (raised as ValueError / ModelError for
engine.tools.cli's handler), never a traceback after "Uvicorn running".
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from pydantic import ValidationError

from colibri.app.http import event_loop, uvicorn_options
from colibri.app.memory import limit_arenas
from colibri.app.middleware import exposure_warning
from colibri.app.replicas.launch import wants_replicas
from colibri.app.server import create_app
from colibri.app.settings import Settings
from colibri.app.state import ServerState
from colibri.engine import check_model, cli_main, options

log = logging.getLogger("colibri.app")


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `serve` on an argparse subparsers object; returns the new parser."""
    parser = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API. Every option can also "
                    "be set as COLIBRI_<OPTION> in the environment or in a .env file; "
                    "docs/configuration.md lists them all.")
    # options not given stay out of the namespace: Settings layers them over the environment
    options.add_option_args(parser, options.command_options("serve"), suppress=True)
    parser.add_argument("--env-file", default=".env", help="settings file (default .env)")
    parser.set_defaults(handler=serve_main)
    return parser


# read by the engine from the environment, not by Settings; a .env file sets them too
ENGINE_VARIABLES = options.engine_env_variables()


def engine_variables_from_file(env_file: str | None) -> None:
    """Copy ENGINE_VARIABLES from env_file into the environment where it has none (an empty
    value is no value, as for Settings)."""
    if not env_file or not Path(env_file).is_file():
        return
    from dotenv import dotenv_values

    for key, value in dotenv_values(env_file, encoding="utf-8").items():
        if key in ENGINE_VARIABLES and value and key not in os.environ:
            os.environ[key] = value


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings: given options first, then COLIBRI_* variables, then the .env file."""
    given = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    env_file = getattr(args, "env_file", ".env")
    engine_variables_from_file(env_file)
    try:
        return Settings(_env_file=env_file, **given)  # type: ignore[call-arg]
    except ValidationError as e:  # one line for the user, like every other start-up error
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg'].removeprefix('Value error, ')}"
            for err in e.errors())
        raise ValueError(f"invalid setting ({problems}); fix the option, its COLIBRI_* "
                         f"variable or {env_file}") from None


class _Server(uvicorn.Server):
    """uvicorn's server, marking the app as draining as soon as a signal arrives."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.colibri = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.colibri.draining = True
        super().handle_exit(sig, frame)


def check_port(host: str, port: int) -> None:
    """Raise ValueError (one line, with what to do) if host:port cannot be listened on now.

    Binds a throw-away socket the way uvicorn will (SO_REUSEADDR), so a port held by another
    server is found before the model is loaded.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot listen on {host}:{port}: unknown address ({e.strerror}); "
                         f"pass --host an address of this machine (default 127.0.0.1)") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                why = "the port is already in use"
            elif e.errno == errno.EACCES:
                why = "permission denied (ports below 1024 need privileges)"
            else:
                why = e.strerror or str(e)
            raise ValueError(f"cannot listen on {host}:{port}: {why}; pass --port another "
                             f"port (or set COLIBRI_PORT)") from None


def serve_main(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT; returns the process exit code."""
    limit_arenas()  # before any thread: see app.memory
    settings = settings_from_args(args)
    check_port(settings.host, settings.port)
    check_model(settings.model, n_ctx=settings.n_ctx)
    level = settings.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    warning = exposure_warning(settings)
    if warning:
        log.warning("%s", warning)
    if wants_replicas(settings):
        from colibri.app.replicas.launch import serve_replicas  # imports Ray

        return serve_replicas(settings)
    app = create_app(settings)
    state: ServerState = app.state.colibri
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
        loop=event_loop(), lifespan="on", **uvicorn_options(settings),
    )
    server = _Server(config, state)

    def request_exit(code: int) -> None:
        state.exit_code = code
        server.should_exit = True

    state.request_exit = request_exit
    # uvicorn re-raises the signal it caught once it has shut down; a no-op handler lets the
    # drained process exit with our code (0) instead of dying by that signal.
    signal.signal(signal.SIGTERM, lambda s, f: None)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    return state.exit_code


def main(argv: list[str] | None = None) -> int:
    """The `colibri` command: the engine's subcommands plus `serve`."""
    return cli_main(argv, extra=[add_serve_parser])

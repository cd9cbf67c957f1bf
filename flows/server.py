"""The Prefect server a command talks to: the one `PREFECT_API_URL` names, else the temporary one
Prefect starts for a process without it, with its database made before it is waited for.

Prefect's temporary server migrates its database and registers its block types as it starts, and
its client waits `PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS` (20 s) for it to answer. On a
machine that has never run Prefect (an empty `PREFECT_HOME`) that work alone took 8 s on 2 idle
cores and 15-21 s on loaded ones, so a first run raced a fixed wait and lost whenever the machine
was a little slow. Here the same work (Prefect's own functions) is done first, in this process:
with no deadline, a progress line while it takes time, and the database's own error, at once,
when it cannot be made; the server then starts on a ready database (4-7 s on 2 cores), inside the
wait it is given. A server that does not answer even then fails with Prefect's message and what
to set.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable

from storage.store import UnusableFolder, home_problem

SLOW_SECONDS = 1.0  # a database ready sooner is not worth a line


def _stderr(line: str) -> None:
    print(f"precast: {line}", file=sys.stderr, flush=True)


def database_name() -> str:
    """Where Prefect keeps its database, for messages: the SQLite file, or the URL without its password."""
    from prefect.settings import get_current_settings
    from sqlalchemy.engine import make_url

    url = make_url(get_current_settings().server.database.connection_url.get_secret_value())
    return url.database if url.get_backend_name() == "sqlite" else url.render_as_string(hide_password=True)


def prepare_database(echo: Callable[[str], None] = _stderr) -> float:
    """Prefect's database migrated to this Prefect's schema and its block types registered, as
    its server's start does (recorded where that start looks, so it skips the work); returns the
    seconds it took. Says so while it takes more than a moment (a first run: the whole schema)."""
    from prefect.server.api.server import _memoize_block_auto_registration
    from prefect.server.database import provide_database_interface
    from prefect.server.models.block_registration import run_block_auto_registration
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    db = provide_database_interface()

    @_memoize_block_auto_registration
    async def register_blocks() -> None:
        async with await db.session() as session:
            await run_block_auto_registration(session=session)

    async def prepare() -> None:
        if settings.server.database.migrate_on_start:
            await db.create_db()
        if settings.server.register_blocks_on_start:
            await register_blocks()

    where = database_name()
    if (reason := home_problem()) and not os.environ.get("PREFECT_HOME") and where.startswith(str(settings.home)):
        raise UnusableFolder(f"{reason}, so there is no ~/.prefect for Prefect's database: set PREFECT_HOME to a "
                             "writable folder (or HOME to a writable home), or PREFECT_API_URL to a running Prefect "
                             "server")
    started, shown = time.monotonic(), threading.Event()

    def announce() -> None:
        echo(f"preparing Prefect's database at {where} (on a first run its tables: 8-25 s on 2 cores, once) ...")
        shown.set()

    slow = threading.Timer(SLOW_SECONDS, announce)
    slow.daemon = True
    slow.start()
    try:
        asyncio.run(prepare())
    except Exception as error:
        reason = getattr(error, "orig", None) or error  # SQLAlchemy's wrapper says the driver's words and more
        raise RuntimeError(
            f"Prefect could not prepare its database at {where}: {type(reason).__name__}: {reason}. Set PREFECT_HOME "
            "to a writable folder (the database is PREFECT_HOME/prefect.db), PREFECT_API_DATABASE_CONNECTION_URL "
            "to another database, or PREFECT_API_URL to a running Prefect server") from error
    finally:
        slow.cancel()
        slow.join()  # a line being printed is finished first
    seconds = time.monotonic() - started
    if shown.is_set():
        echo(f"Prefect's database is ready ({seconds:.0f} s)")
    return seconds


def ensure_server(echo: Callable[[str], None] = _stderr) -> None:
    """Without `PREFECT_API_URL` (and Prefect allowed to start one), Prefect's temporary server
    started now, on a prepared database: every client of this process then talks to it."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url or not settings.server.ephemeral.enabled:
        return  # a server of the user's, or none allowed: Prefect's client says what to set
    prepare_database(echo)
    try:
        SubprocessASGIServer().start()  # the instance Prefect's clients in this process use
    except RuntimeError as error:
        wait = settings.server.ephemeral.startup_timeout_seconds
        if "exited with code" in str(error):  # its own lines above say why
            advice = "the server stopped as it started: fix what its lines above name"
        else:
            advice = (f"the server did not answer within {wait} s: on a slow machine set "
                      "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS higher")
        raise RuntimeError(f"{error} Its database was ready; {advice}, or start a server (infra/local-stack.sh up, "
                           "or `prefect server start`) and set PREFECT_API_URL to it") from error


def require_server(what: str) -> None:
    """Refuses a command that needs a lasting server (`what` it does there) where none is set: a
    temporary one ends with the command, and no worker polls it."""
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url:
        raise RuntimeError(f"{what} on a Prefect server that workers poll, and none is set: set PREFECT_API_URL "
                           "(and PREFECT_API_AUTH_STRING) to it; infra/local-stack.sh up starts one on this machine")


if __name__ == "__main__":  # infra/local-stack.sh: its server's database, made before the server starts
    try:
        prepare_database()
    except RuntimeError as error:
        _stderr(str(error))
        sys.exit(1)

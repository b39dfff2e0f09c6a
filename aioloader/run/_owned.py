"""What a run owns that must be stopped: its session, its standbys and its portal.

Apart from the run so that the loader's garbage-collector backstop holds only these
(docs/architecture.md, "The run": the rest of a run can hold the loader).
"""

from __future__ import annotations

import asyncio
import os
import threading

from .._loops import running_loop
from ..workers._standby import StandbyPool
from ._portal import Portal
from ._session import GRACE, Session


class Owned:
    """A run's processes and loops, and every way to stop them. ``lock`` is the run's: the
    session slot is written under it."""

    def __init__(self, portal: Portal, standby: StandbyPool | None,
                 lock: threading.Lock) -> None:
        self.portal = portal
        self.standby = standby
        self.session: Session | None = None
        self.owner_pid = os.getpid()
        self._lock = lock

    def kill(self) -> None:
        """Stop everything, at once, without a loop; nothing in a forked child that
        inherited the loader."""
        if os.getpid() != self.owner_pid:
            return
        session, self.session = self.session, None
        if session is not None:
            session.close(0.0)
        if self.standby is not None:
            self.standby.close(0.0)
        self.portal.close()

    def adopt(self) -> None:
        """In a forked child that inherited the loader (a user's ``Process`` given it): forget
        the parent's session and standbys, never touching them, so that the child's next
        epoch starts workers of its own, as torch's loader does there."""
        if os.getpid() != self.owner_pid:
            self.owner_pid, self.session, self.standby = os.getpid(), None, None

    async def aclose(self) -> None:
        """Stop the workers, on the loop they are attached to, without blocking this one."""
        if self.standby is not None:
            await asyncio.to_thread(self.standby.close)
        session = self.take()
        if session is None:
            return
        if session.loop is None or session.loop is running_loop():
            await session.aclose()
        else:
            await asyncio.to_thread(self.stop, session)

    def close(self) -> None:
        """Blocking :meth:`aclose`, from any thread; also ends the portal's loops."""
        if self.standby is not None:
            self.standby.close()
        session = self.take()
        if session is not None:
            self.stop(session)
        self.portal.close()

    async def drop(self, session: Session, grace: float = GRACE) -> None:
        """Close ``session``, no longer the run's."""
        with self._lock:
            if self.session is session:
                self.session = None
        await session.aclose(grace)

    def hold(self, session: Session) -> None:
        """Make ``session`` the run's if it has none (a pass read outside an epoch: a close
        must reach it)."""
        with self._lock:
            if self.session is None:
                self.session = session

    def take(self) -> Session | None:
        """The session, which is no longer the run's."""
        with self._lock:
            session, self.session = self.session, None
        return session

    def stop(self, session: Session) -> None:
        """Close ``session`` from this thread, on the loop it is attached to."""
        loop, here = session.loop, running_loop()
        if loop is None and here is None:  # between epochs: an async reader's pass
            self.portal.call(session.aclose())  # closes on a loop
        elif loop is None or loop is here:
            session.close()  # from async code on its own loop: blocks it while reaping
        elif loop is self.portal.loop:  # the sync adapter's, driven in bursts
            self.portal.call(session.aclose())
        elif loop.is_running():  # a user's loop, or the portal's own thread
            asyncio.run_coroutine_threadsafe(session.aclose(), loop).result()
        else:
            session.close()

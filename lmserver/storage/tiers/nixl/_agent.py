"""The one module that imports nixl: load the API, check GDS prerequisites, drive an agent.

Strategy: everything else in the package is importable (and type-checked) without nixl.
Facts behind the choices here are in the probe notes summarised in docs/tiers.md ("The NIXL tier"):

* ``nixl_cu12._api`` is imported directly: ``import nixl`` picks the cu13 build when torch
  is a CPU build, imports torch (1.2 s), and its OBJ plugin needs a CUDA library.
* The agent is created with no default backends (the default is UCX, network only) and
  ``NIXL_THREAD_SYNC_STRICT``, because a lane's thread and a Store worker reading a victim
  may both use it.
* A transfer is polled until a deadline; past it the caller gets ``TransferTimeout`` at
  once (NIXL on its own fails a dead S3 endpoint only after about 25 s), but the request
  itself goes on: the S3 SDK keeps sending (and on each retry re-reads) a PUT's body from
  the lane's staging buffer. So the handle is not released while the request runs (we do
  not rely on a plugin's cancel); it is kept (``unfinished``) and released once it has
  ended, checked before each new transfer and at close. An agent closed with one still
  running lives on, with the staging buffer (``close(keep_alive=...)``).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import time
from types import ModuleType
from typing import Any

from .... import hardexit
from ..errors import ConfigError, TierError

_APIS = ("nixl_cu12._api", "nixl_cu13._api")
GDS_LIBRARIES = (
    ("libcufile.so.0", "NVIDIA cuFile (GPUDirect Storage)"),
    ("libcudart.so.12", "the CUDA 12 runtime"),
    ("libcuda.so.1", "the NVIDIA driver (a GPU)"),
)


class TransferTimeout(TierError):
    """A transfer did not finish before its deadline; it was given up (see ``unfinished``)."""


def load_api() -> ModuleType:
    """The nixl Python API, or ConfigError naming the extra to install."""
    # NIXL logs INFO lines to stdout (its C++ core and its Python "nixl" logger, which has
    # its own stdout handler): keep stdout for the operator, warnings still show.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    logging.getLogger("nixl").setLevel(logging.WARNING)
    errors = []
    for name in _APIS:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ConfigError(
        "tier kind 'nixl' needs the nixl package (" + "; ".join(errors) + "); "
        "install it with: pip install 'lmserver[nixl]'"
    )


def check_gds(backend: str) -> None:
    """ConfigError naming what is missing for GDS/GDS_MT, before NIXL fails obscurely.

    The GDS plugin loads only when these libraries can be found; preloading them globally
    (what this does) is also what lets the plugin resolve its symbols.
    """
    missing = []
    for lib, what in GDS_LIBRARIES:
        try:
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            missing.append(f"{lib} ({what})")
    if missing:
        raise ConfigError(
            f"NIXL backend {backend} needs GPUDirect Storage, and this machine lacks: "
            + ", ".join(missing)
            + "; use backend=POSIX here"
        )


class Agent:
    """One nixl agent with one backend. Used by one lane thread (plus victim reads)."""

    def __init__(self, api: ModuleType, name: str, backend: str, params: dict[str, str]) -> None:
        config = api.nixl_agent_config(backends=[], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self._agent: Any = api.nixl_agent(name, config)
        try:
            self._agent.create_backend(backend, params)
        except Exception as exc:  # nixl raises its own error classes for every failure
            raise ConfigError(f"NIXL backend {backend} could not be created: {exc}") from None
        self.backend = backend
        # Handles of transfers given up at their deadline and still running (see above).
        # Only the lane's thread transfers, so only it (and close, after the lane stopped)
        # touches this list.
        self._unfinished: list[Any] = []
        self.storage_mem = "OBJ" if backend == "OBJ" else "FILE"

    # -- registrations (each call is one registration; keep the handle to deregister) ------

    def register_dram(self, addr: int, length: int) -> Any:
        return self._call(self._agent.register_memory, [(addr, length, 0, "")], "DRAM")

    def register_file(self, fd: int) -> Any:
        # Length 0: the whole file, whatever it grows to.
        return self._call(self._agent.register_memory, [(0, 0, fd, "")], "FILE")

    def register_object(self, dev: int, key: str) -> Any:
        return self._call(self._agent.register_memory, [(0, 0, dev, key)], "OBJ")

    def deregister(self, reg: Any) -> None:
        self._call(self._agent.deregister_memory, reg)

    # -- transfers -------------------------------------------------------------------------

    def transfer(
        self,
        op: str,
        local: list[tuple[int, int]],
        remote: list[tuple[int, int, int]],
        deadline: float,
    ) -> None:
        """READ (storage -> memory) or WRITE (memory -> storage) the descriptor pairs;
        raises TransferTimeout past ``deadline`` (time.monotonic) or TierError."""
        self._release_ended()
        agent = self._agent
        handle = self._call(
            agent.initialize_xfer,
            op,
            agent.get_xfer_descs([(addr, n, 0) for addr, n in local], "DRAM"),
            agent.get_xfer_descs(remote, self.storage_mem),
            agent.name,
        )
        state = "ERR"
        try:
            state = self._call(agent.transfer, handle)
            pause = 0.0001
            while state == "PROC":
                if time.monotonic() >= deadline:
                    raise TransferTimeout(f"{op} did not finish in time; given up")
                # POSIX buffered I/O completes inside transfer(); OBJ and O_DIRECT run in
                # the background: back off so polling does not burn a shared CPU.
                time.sleep(pause)
                pause = min(pause * 2, 0.002)
                state = self._call(agent.check_xfer_state, handle)
            if state != "DONE":
                raise TierError(f"NIXL {op} ended in state {state}")
        finally:
            if state == "PROC":
                self._unfinished.append(handle)
            else:
                self._release(handle)

    @property
    def unfinished(self) -> int:
        """Transfers given up at their deadline that are still running (checked now).
        Ask from the lane's thread, or from any thread while the lane is idle or stopped."""
        self._release_ended()
        return len(self._unfinished)

    def _release_ended(self) -> None:
        if self._agent is None:  # closed: whatever still runs is kept alive with it
            return
        still = []
        for handle in self._unfinished:
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception:  # an ended request that failed: nixl raises its own classes
                state = "ERR"
            if state == "PROC":
                still.append(handle)
            else:
                self._release(handle)
        self._unfinished = still

    def _release(self, handle: Any) -> None:
        # The transfer's own outcome is what matters; a failed release leaks one handle.
        with contextlib.suppress(Exception):
            self._agent.release_xfer_handle(handle)

    def close(self, keep_alive: object = None) -> None:
        """Destroy the agent, unless a transfer given up at its deadline still runs: then
        the agent, its running handles and ``keep_alive`` (the memory those transfers may
        still read or write) live until the process ends."""
        if self.unfinished:
            # Destroying an agent whose backend still runs a request waits for that request
            # to die, holding the GIL (measured: 135 s against an endpoint that never
            # answers, the whole process frozen). Leak it instead, past interpreter exit too
            # (the OS reclaims it with the process), with the running handles (nixl releases
            # a dropped handle from its finalizer, at any time, on whichever thread collects
            # it) and the buffer the request reads: the S3 SDK reads a PUT's body from it
            # again on every retry (a freed buffer crashed a test run in a curl thread).
            # NIXL's OBJ plugin would then wait forever at process exit for this agent's S3
            # client (its C atexit handler): have the process skip native cleanup.
            ctypes.pythonapi.Py_IncRef(ctypes.py_object((self._agent, self._unfinished, keep_alive)))
            hardexit.require("a NIXL agent with an abandoned transfer is still alive")
        self._agent = None

    @staticmethod
    def _call(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except TierError:
            raise
        except Exception as exc:  # nixlBackendError, nixlNotFoundError, ...
            raise TierError(f"NIXL: {type(exc).__name__}: {exc}") from None

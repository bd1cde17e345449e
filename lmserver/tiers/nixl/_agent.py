"""The one module that imports nixl: load the API, check GDS prerequisites, drive an agent.

Strategy: everything else in the package is importable (and type-checked) without nixl.
Facts behind the choices here are in the probe notes summarised in README.md ("NIXL tier"):

* ``nixl_cu12._api`` is imported directly: ``import nixl`` picks the cu13 build when torch
  is a CPU build, imports torch (1.2 s), and its OBJ plugin needs a CUDA library.
* The agent is created with no default backends (the default is UCX, network only) and
  ``NIXL_THREAD_SYNC_STRICT``, because a lane's thread and a Store worker reading a victim
  may both use it.
* A transfer is polled until a deadline, then its handle is released, which cancels it
  (measured: a PROC handle on a dead S3 endpoint releases in microseconds, where NIXL on
  its own fails only after about 25 s).
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

from ... import hardexit
from ..base import ConfigError, TierError

_APIS = ("nixl_cu12._api", "nixl_cu13._api")
GDS_LIBRARIES = (
    ("libcufile.so.0", "NVIDIA cuFile (GPUDirect Storage)"),
    ("libcudart.so.12", "the CUDA 12 runtime"),
    ("libcuda.so.1", "the NVIDIA driver (a GPU)"),
)


class TransferTimeout(TierError):
    """A transfer did not finish before its deadline; it was cancelled."""


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
        self.cancelled = False  # a transfer was cancelled at its deadline
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
        agent = self._agent
        handle = self._call(
            agent.initialize_xfer,
            op,
            agent.get_xfer_descs([(addr, n, 0) for addr, n in local], "DRAM"),
            agent.get_xfer_descs(remote, self.storage_mem),
            agent.name,
        )
        try:
            state = self._call(agent.transfer, handle)
            pause = 0.0001
            while state == "PROC":
                if time.monotonic() >= deadline:
                    self.cancelled = True
                    raise TransferTimeout(f"{op} did not finish in time; cancelled")
                # POSIX buffered I/O completes inside transfer(); OBJ and O_DIRECT run in
                # the background: back off so polling does not burn a shared CPU.
                time.sleep(pause)
                pause = min(pause * 2, 0.002)
                state = self._call(agent.check_xfer_state, handle)
            if state != "DONE":
                raise TierError(f"NIXL {op} ended in state {state}")
        finally:
            # Cancels it if still in progress; the transfer's own outcome is what matters.
            with contextlib.suppress(Exception):
                agent.release_xfer_handle(handle)

    def close(self) -> None:
        agent, self._agent = self._agent, None
        if self.cancelled:
            # Destroying an agent whose backend still holds a request that a timeout
            # cancelled waits for that request to die, holding the GIL (measured: 135 s
            # against an endpoint that never answers, the whole process frozen). Leak it
            # instead, past interpreter exit too (the OS reclaims it with the process),
            # with its lane's staging buffer, which the request may still be using.
            # NIXL's OBJ plugin would then wait forever at process exit for this agent's
            # S3 client (its C atexit handler): have the process skip native cleanup.
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(agent))
            hardexit.require("a NIXL agent with a cancelled transfer is still alive")

    @staticmethod
    def _call(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except TierError:
            raise
        except Exception as exc:  # nixlBackendError, nixlNotFoundError, ...
            raise TierError(f"NIXL: {type(exc).__name__}: {exc}") from None

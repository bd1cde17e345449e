"""The only module that imports ``huggingface_hub`` and ``hf_xet``: a small synchronous,
thread-safe facade over the Buckets API calls the tier makes, with errors mapped to ``HubError``.

Every call blocks (HTTP, Xet transfers): the tier runs them on its worker threads only.
``CALLS`` lists each ``HfApi`` method and the keywords passed to it, so a test can check them
against the installed ``huggingface_hub`` (the API is young and has changed between releases).

Reads: a file's bytes are streamed by hf_xet straight into the caller's buffer
(``XetSession.new_download_stream_group``, any byte range), with no temp file. Where the
installed hf_xet lacks streaming, ``download_bucket_files`` writes a temp file in
``cache_dir`` that is then read into the buffer (``read_mode="file"`` forces this path).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import hf_xet
import huggingface_hub
from huggingface_hub import BucketFile, HfApi
from huggingface_hub.errors import BucketNotFoundError, HfHubHTTPError
from huggingface_hub.utils import (  # type: ignore[attr-defined]
    build_hf_headers,
    disable_progress_bars,
    set_client_factory,
)

from .errors import BatchFailed, HubError, Kind
from .options import ReadMode

try:  # huggingface_hub >= 1.33 raises it for rejected batch operations
    from huggingface_hub.errors import BucketBatchError
except ImportError:  # pragma: no cover - older versions ignore a partial failure silently
    BucketBatchError = None  # type: ignore[assignment,misc]


CALLS: dict[str, tuple[str, ...]] = {
    # HfApi method: keywords this module passes (bucket_id and token on every one)
    "create_bucket": ("bucket_id", "private", "exist_ok", "token"),
    "bucket_info": ("bucket_id", "token"),
    "list_bucket_tree": ("bucket_id", "prefix", "recursive", "token"),
    "get_bucket_paths_info": ("bucket_id", "paths", "token"),
    "batch_bucket_files": ("bucket_id", "add", "delete", "token"),
    "get_bucket_file_metadata": ("bucket_id", "remote_path", "token"),
    "download_bucket_files": ("bucket_id", "files", "raise_on_missing_files", "token"),
}
CAUGHT: tuple[str, ...] = ("HfHubHTTPError", "BucketNotFoundError", "BucketBatchError")
STREAMING = hasattr(getattr(hf_xet, "XetSession", None), "new_download_stream_group")
STREAM_PIECE = 1 << 20


class FileInfo:
    """A bucket file as the tier indexes it."""

    __slots__ = ("mtime", "path", "size", "xet_hash")

    def __init__(self, path: str, size: int, xet_hash: str, mtime: float) -> None:
        self.path = path
        self.size = size
        self.xet_hash = xet_hash
        self.mtime = mtime


def classify(exc: BaseException) -> HubError:
    """Map anything the client stack raises to a HubError (the stack raises HfHubHTTPError
    for HTTP statuses, httpx's errors for the network, and builtins for hf_xet failures)."""
    if isinstance(exc, HubError):
        return exc
    name = type(exc).__name__
    if isinstance(exc, HfHubHTTPError):
        response = exc.response
        status = response.status_code if response is not None else None
        kind: Kind
        retry_after = None
        if isinstance(exc, BucketNotFoundError) or status == 404:
            kind = "not_found"
        elif status in (401, 403):
            kind = "unauthorized"
        elif status == 429:
            kind = "rate_limited"
            value = response.headers.get("Retry-After") if response is not None else None
            if value is not None and value.strip().isdigit():
                retry_after = float(value)
        elif status is not None and status >= 500:
            kind = "server"
        else:
            kind = "client"
        # The first line only: later lines may quote request details.
        first_line = str(exc).splitlines()[0] if str(exc) else name
        return HubError(kind, f"{name}: {first_line}", status=status, retry_after=retry_after)
    text = str(exc)
    if isinstance(exc, (ConnectionError, OSError, TimeoutError)) or "Connect" in name or "Timeout" in name:
        # hf_xet reports HTTP statuses only in the text of a ConnectionError
        for status in (401, 403):
            if f"{status}" in text and ("Unauthorized" in text or "Forbidden" in text):
                return HubError("unauthorized", f"{name}: {text[:200]}", status=status)
        return HubError("unreachable", f"{name}: {text[:200]}")
    return HubError("error", f"{name}: {text[:200]}")


def bound_xet_retries(timeout_s: float) -> None:
    """hf_xet retries a failing CAS or token request for up to 6 minutes by default, which
    would stall every batch while the Hub is away: bound it by the tier's ``timeout``.
    These are defaults for hf_xet's environment configuration (read when its session is
    created), so an operator's own ``HF_XET_CLIENT_*`` settings win."""
    seconds = max(1, round(timeout_s))
    os.environ.setdefault("HF_XET_CLIENT_RETRY_MAX_DURATION", f"{seconds}s")
    os.environ.setdefault("HF_XET_CLIENT_CONNECT_TIMEOUT", f"{min(seconds, 10)}s")
    os.environ.setdefault("HF_XET_CLIENT_READ_TIMEOUT", f"{seconds}s")


_http_timeout_s: float | None = None


def bound_http_timeout(timeout_s: float) -> None:
    """huggingface_hub's HTTP client has no timeout: a Hub that accepts a connection and
    never answers would hold a worker forever. Give its default client one (the last tier
    opened sets it; the client is shared by the whole process). A client factory the
    embedding application installed itself is left alone."""
    global _http_timeout_s
    from huggingface_hub.utils import _http

    default = getattr(_http, "default_client_factory", None)
    current = getattr(_http, "_GLOBAL_CLIENT_FACTORY", None)
    if default is None or current not in (default, _timeout_client):
        return  # an unknown version, or an application's own factory
    _http_timeout_s = timeout_s
    set_client_factory(_timeout_client)  # also closes the current client


def _timeout_client() -> Any:
    from huggingface_hub.utils import _http

    client = _http.default_client_factory()
    client.timeout = _http_timeout_s
    inner = getattr(client, "_transport", None)  # httpx's (httpx2's) default transport
    if inner is not None and hasattr(inner, "handle_request"):
        client._transport = _ReportingTransport(inner)  # type: ignore[assignment]  # duck-typed
    return client


class _ReportingTransport:
    """huggingface_hub's HTTP transport, telling the tiers of each unreachable attempt at once.

    huggingface_hub retries a refused connection or a timeout five times over ~23 s before it
    raises: a tier that learned of it only then kept saying it was healthy, and took writes
    it could not make, all that time. Each attempt that fails to reach the host is reported
    here to the ``HubClient``s of that host while the retries go on. An HTTP error status
    (429, 5xx) is an answer: it is left to the call's outcome, as before.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def handle_request(self, request: Any) -> Any:
        try:
            response = self._inner.handle_request(request)
        except Exception as exc:  # the network: refused, reset, timed out
            _report(request.url.netloc, classify(exc))
            raise
        return response

    def close(self) -> None:
        self._inner.close()


_watchers: dict[bytes, set[HubClient]] = {}
_watchers_lock = threading.Lock()


def _report(netloc: bytes, error: HubError) -> None:
    with _watchers_lock:
        clients = list(_watchers.get(netloc, ()))
    for client in clients:
        callback = client.on_failed_attempt
        if callback is not None:
            callback(error)


class HubClient:
    def __init__(
        self,
        bucket_id: str,
        *,
        token: str | None,
        endpoint: str | None,
        cache_dir: str,
        read_mode: ReadMode = "auto",
        timeout_s: float = 60.0,
        read_piece: int = STREAM_PIECE,
    ) -> None:
        disable_progress_bars()  # a server's stderr is for logs, not progress bars
        bound_xet_retries(timeout_s)
        bound_http_timeout(timeout_s)
        self.bucket_id = bucket_id
        self._token: str | bool = token if token else False
        self.api = HfApi(endpoint=endpoint, token=self._token)
        self.cache_dir = cache_dir
        self.streaming = read_mode == "stream" or (read_mode == "auto" and STREAMING)
        if read_mode == "stream" and not STREAMING:
            raise HubError("error", "this hf_xet cannot stream downloads; use read=file")
        self._piece = read_piece
        self._lock = threading.Lock()
        self._group: Any = None
        self._session: Any = None
        # Told of each attempt that could not reach the Hub, while huggingface_hub retries it.
        self.on_failed_attempt: Callable[[HubError], None] | None = None
        self._netloc = urllib.parse.urlsplit(self.api.endpoint).netloc.encode()
        with _watchers_lock:
            _watchers.setdefault(self._netloc, set()).add(self)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self.api, method)(*args, token=self._token, **kwargs)
        except Exception as exc:
            raise classify(exc) from exc

    # -- bucket ----------------------------------------------------------------------------

    def ensure_bucket(self, *, create: bool, private: bool) -> None:
        if create:
            self._call("create_bucket", bucket_id=self.bucket_id, private=private, exist_ok=True)
        else:
            self._call("bucket_info", bucket_id=self.bucket_id)

    def probe(self) -> None:
        self._call("bucket_info", bucket_id=self.bucket_id)

    def listing(self, prefix: str) -> Iterator[FileInfo]:
        """Every file under ``prefix`` (recursive), paginated by the client."""
        try:
            for item in self.api.list_bucket_tree(
                bucket_id=self.bucket_id, prefix=prefix or None, recursive=True, token=self._token
            ):
                if isinstance(item, BucketFile):
                    mtime = item.mtime.timestamp() if item.mtime is not None else 0.0
                    yield FileInfo(item.path, item.size, item.xet_hash, mtime)
        except Exception as exc:
            raise classify(exc) from exc

    def paths_info(self, paths: list[str]) -> dict[str, FileInfo]:
        """What the bucket holds at ``paths``; missing paths are absent from the result."""
        if not paths:
            return {}
        try:
            infos = self.api.get_bucket_paths_info(bucket_id=self.bucket_id, paths=paths, token=self._token)
            return {i.path: FileInfo(i.path, i.size, i.xet_hash, 0.0) for i in infos}
        except Exception as exc:
            raise classify(exc) from exc

    # -- writes ----------------------------------------------------------------------------

    def batch(self, adds: list[tuple[str, str]], deletes: list[str]) -> None:
        """One commit: upload ``(local file, bucket path)`` pairs and delete paths.

        Raises BatchFailed listing rejected paths (the rest was applied) where the installed
        version reports them, HubError otherwise. Not transactional either way: callers
        reconcile with ``paths_info``.
        """
        try:
            self.api.batch_bucket_files(
                bucket_id=self.bucket_id,
                add=list(adds) or None,
                delete=list(deletes) or None,
                token=self._token,
            )
        except Exception as exc:
            if BucketBatchError is not None and isinstance(exc, BucketBatchError):
                failed = {f.get("path", ""): f.get("error", "") for f in exc.failures}
                status = exc.response.status_code if exc.response is not None else None
                raise BatchFailed(failed, f"{len(failed)} operation(s) rejected", status=status) from exc
            raise classify(exc) from exc

    # -- reads -----------------------------------------------------------------------------

    def read_into(self, info: FileInfo, start: int, buf: memoryview) -> int:
        """Read ``len(buf)`` bytes of the file from offset ``start`` into ``buf``; returns the
        bytes received (the caller checks the count and the checksum)."""
        if not len(buf):
            return 0
        try:
            if self.streaming:
                return self._stream_into(info, start, buf)
            return self._file_into(info, start, buf)
        except Exception as exc:
            raise classify(exc) from exc

    def _stream_group(self, path: str) -> Any:
        with self._lock:
            if self._group is None:
                meta = self.api.get_bucket_file_metadata(
                    bucket_id=self.bucket_id, remote_path=path, token=self._token
                )
                headers = build_hf_headers(token=self._token, library_name="lmserver")
                if self._session is None:
                    self._session = hf_xet.XetSession()
                self._group = self._session.new_download_stream_group(
                    token_refresh_url=meta.xet_file_data.refresh_route, token_refresh_headers=headers
                )
            return self._group

    def _stream_into(self, info: FileInfo, start: int, buf: memoryview) -> int:
        group = self._stream_group(info.path)
        file_info = hf_xet.XetFileInfo(info.xet_hash, info.size)
        got = 0
        try:
            # Range by range: hf_xet hands a range over as one bytes object, built while it
            # holds the GIL, so a whole 32 MiB object stalls the event loop for ~80 ms;
            # 1 MiB pieces keep each stall under ~10 ms and measured no slower here.
            # Over a real network each piece is a round trip: ``read_piece`` trades them.
            step = self._piece
            for first in range(0, len(buf), step):
                piece = buf[first : first + step]
                stream = group.download_unordered_stream(file_info, start + first, start + first + len(piece))
                for offset, chunk in stream:
                    n = len(chunk)
                    if offset < 0 or offset + n > len(piece):
                        raise HubError("error", "hf_xet returned a chunk outside the requested range")
                    piece[offset : offset + n] = chunk
                    got += n
        except Exception:
            with self._lock:  # a broken group (expired token refresh, CAS down) is rebuilt
                self._group = None
            raise
        return got

    def _file_into(self, info: FileInfo, start: int, buf: memoryview) -> int:
        tmp = os.path.join(self.cache_dir, f"dl-{uuid.uuid4().hex}")
        remote = BucketFile(  # type: ignore[no-untyped-call]
            type="file", path=info.path, size=info.size, xetHash=info.xet_hash
        )
        try:
            self.api.download_bucket_files(
                bucket_id=self.bucket_id,
                files=[(remote, tmp)],
                raise_on_missing_files=True,
                token=self._token,
            )
            with open(tmp, "rb", buffering=0) as f:
                f.seek(start)
                got = 0
                while got < len(buf):
                    n = f.readinto(buf[got:])
                    if not n:
                        break
                    got += n
            return got
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def close(self) -> None:
        with _watchers_lock:
            _watchers.get(self._netloc, set()).discard(self)
        with self._lock:
            group, self._group = self._group, None
        if group is not None:
            with contextlib.suppress(Exception):
                group.finish()


def default_cache_dir() -> str:
    return tempfile.mkdtemp(prefix="lmserver-hf-")


VERSION = huggingface_hub.__version__

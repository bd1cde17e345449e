"""A local fake of the Hugging Face Hub's Buckets API and of its Xet storage service, for
driving the real ``HfApi`` and ``hf_xet`` offline (test infrastructure, not product code).

The Hub's JSON routes are served here from a stdlib ``http.server``; its storage service (the
Xet CAS protocol: xorbs, shards, reconstructions, token refresh) is served on the same port
under ``/cas`` by ``fakehub.cas``, over HTTP as the real Hub's is, so any number of processes
share one bucket. ``addFile`` carries no size: the size of an added file comes from the shard
hf_xet uploaded for it. Faults are injected per route (status, headers, count), batch ops can
be rejected (listed as failed, as the Hub does) or silently dropped (what huggingface_hub
1.5-1.32 let through unnoticed), and every request is recorded so a test can check the routes
the real client sends are the ones served here.
"""

from __future__ import annotations

import contextlib
import datetime
import http.server
import json
import pathlib
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import cas

TOKEN = "hf_fake_test_token"
EMPTY_HASH = "0" * 64

# route name -> (method, regex over the URL path); the names are what faults refer to.
ROUTES: dict[str, tuple[str, re.Pattern[str]]] = {
    "create": ("POST", re.compile(r"^/api/buckets/(?P<id>[^/]+/[^/]+)$")),
    "info": ("GET", re.compile(r"^/api/buckets/(?P<id>[^/]+/[^/]+)$")),
    "paths-info": ("POST", re.compile(r"^/api/buckets/(?P<id>[^/]+/[^/]+)/paths-info$")),
    "tree": ("GET", re.compile(r"^/api/buckets/(?P<id>[^/]+/[^/]+)/tree(?:/(?P<prefix>.+))?$")),
    "batch": ("POST", re.compile(r"^/api/buckets/(?P<id>[^/]+/[^/]+)/batch$")),
    "xet-token": ("GET", re.compile(r"^/api/buckets/(?P<id>[^/]+/[^/]+)/xet-(?P<kind>read|write)-token$")),
    "resolve": ("HEAD", re.compile(r"^/buckets/(?P<id>[^/]+/[^/]+)/resolve/(?P<path>.+)$")),
}
PAGE_SIZE = 1000
CAS_PREFIX = "/cas"  # the storage service's routes (``fakehub.cas``) live under it
PRESIGNED = ("cas-fetch", "cas-grant-upload")


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat().replace("+00:00", "Z")


@dataclass
class FileRec:
    size: int
    xet_hash: str
    mtime: float
    uploaded_at: float = field(default_factory=time.time)

    def as_json(self, path: str) -> dict[str, Any]:
        return {
            "type": "file",
            "path": path,
            "size": self.size,
            "xetHash": self.xet_hash,
            "mtime": _iso(self.mtime),
            "uploadedAt": _iso(self.uploaded_at),
        }


@dataclass
class Fault:
    route: str
    status: int
    times: int
    headers: dict[str, str]


class FakeHub:
    """Start with ``hub.start()`` (or as a context manager); ``hub.endpoint`` is the URL."""

    def __init__(
        self,
        root: pathlib.Path,
        *,
        token: str | None = TOKEN,
        host: str = "127.0.0.1",
        xet_token_ttl_s: float = 3600.0,
    ) -> None:
        """``host``: the address to listen on (the storage URL handed to clients is the
        address they reached the Hub at). ``xet_token_ttl_s``: lifetime of the storage
        tokens the Hub hands out; hf_xet fetches a new one from 30 s before expiry, so a
        value a little over 30 makes every client refresh its token within seconds."""
        self.root = root
        self.cas = cas.CasStore(root / "cas", token_ttl_s=xet_token_ttl_s)
        self.token = token
        self.host = host
        self.lock = threading.Lock()
        self.buckets: dict[str, dict[str, FileRec]] = {}
        self.faults: list[Fault] = []
        self.reject: Callable[[str], str | None] = lambda path: None  # path -> error text
        self.silently_drop: Callable[[str], bool] = lambda path: False
        self.requests: list[tuple[str, str]] = []  # (route name or "?", raw path)
        self.delays: dict[str, float] = {}  # route name -> seconds before answering
        self.fail_after_batch = 0  # apply the next N batches, then answer 500 anyway
        # A storage service of the previous generation: no upload grants, no /v2 routes
        # (404), so hf_xet takes its documented fallbacks (/v1/xorbs, /v1/shards, /v1 reads).
        self.legacy_storage = False
        self._conns: set[socket.socket] = set()
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            owner = hub

        self._server = http.server.ThreadingHTTPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="fakehub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and drop open connections, as a Hub going away would (the port is
        kept, so ``start()`` again resumes on the same URL)."""
        if self._server is not None:
            self._server.shutdown()
            with self.lock:
                conns, self._conns = set(self._conns), set()
            for conn in conns:  # keep-alive connections would otherwise go on being served
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            self._server.server_close()
            assert self._thread is not None
            self._thread.join()
            self._server = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- test knobs ------------------------------------------------------------------------

    def create(self, bucket_id: str) -> None:
        with self.lock:
            self.buckets.setdefault(bucket_id, {})

    def fail(self, route: str, status: int, times: int = 1, headers: dict[str, str] | None = None) -> None:
        assert route in ROUTES or route in cas.CAS_ROUTES, route
        with self.lock:
            self.faults.append(Fault(route, status, times, headers or {}))

    def clear_faults(self) -> None:
        with self.lock:
            self.faults.clear()

    def files(self, bucket_id: str) -> dict[str, FileRec]:
        with self.lock:
            return dict(self.buckets.get(bucket_id, {}))

    def routes_seen(self) -> set[str]:
        with self.lock:
            return {name for name, _ in self.requests}

    def _take_fault(self, route: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.route == route and fault.times > 0:
                    fault.times -= 1
                    return fault
        return None


class _Handler(http.server.BaseHTTPRequestHandler):
    owner: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        with self.owner.lock:
            self.owner._conns.add(self.connection)

    def finish(self) -> None:
        with self.owner.lock:
            self.owner._conns.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    # -- plumbing --------------------------------------------------------------------------

    def _reply(self, status: int, body: Any = None, headers: dict[str, str] | None = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _not_found(self, what: str) -> None:
        self._reply(404, {"error": f"{what} not found"}, {"X-Error-Code": "RepoNotFound"})

    def _route(self, path: str) -> tuple[str, re.Match[str]] | None:
        if path.startswith(CAS_PREFIX + "/"):
            table, path = cas.CAS_ROUTES, path[len(CAS_PREFIX) :]
        else:
            table = ROUTES
        for name, (method, pattern) in table.items():
            match = pattern.match(path)
            if match and method == self.command:
                return name, match
        return None

    def _dispatch(self) -> None:
        hub = self.owner
        # Read the body before replying, whatever the reply: an unread body breaks keep-alive.
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        url = urllib.parse.urlsplit(self.path)
        path = url.path
        found = self._route(path)
        if found is None:
            with hub.lock:
                hub.requests.append(("?", f"{self.command} {path}"))
            self._reply(404, {"error": f"no route for {self.command} {path}"})
            return
        name, match = found
        with hub.lock:
            hub.requests.append((name, f"{self.command} {path}"))
        delay = hub.delays.get(name, 0.0)
        if delay:
            time.sleep(delay)
        fault = hub._take_fault(name)
        if fault is not None:
            self._reply(fault.status, {"error": f"injected {fault.status}"}, fault.headers)
            return
        groups = match.groupdict()
        handler = getattr(self, "_r_" + name.replace("-", "_"))
        if name in cas.CAS_ROUTES:
            if hub.legacy_storage and (name in cas.GRANT_ROUTES or groups.get("version") == "2"):
                self._reply(404, {"error": "not offered by this storage service"})
                return
            # Storage requests carry the xet token the Hub handed out; fetch and grant upload
            # URLs stand for presigned ones (the client sends them no credentials).
            if name not in PRESIGNED and not hub.cas.token_valid(self.headers.get("Authorization")):
                self._reply(401, {"error": "invalid or expired xet token"})
                return
            try:
                handler(groups, body)
            except KeyError as exc:
                self._reply(404, {"error": f"not found: {exc}"})
            except cas.RangeNotSatisfiable as exc:
                self._reply(416, {"error": str(exc)})
            except ValueError as exc:  # cas.FormatError, or a request body that is not JSON
                self._reply(400, {"error": str(exc)})
            return
        if hub.token is not None and self.headers.get("Authorization") != f"Bearer {hub.token}":
            self._reply(401, {"error": "Invalid credentials"})
            return
        query = urllib.parse.parse_qs(url.query)
        handler(groups["id"], groups, body, query)

    def _serve(self) -> None:
        try:
            self._dispatch()
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout)
            self.close_connection = True

    do_GET = do_POST = do_HEAD = do_PUT = _serve

    # -- routes ----------------------------------------------------------------------------

    def _bucket(self, bucket_id: str) -> dict[str, FileRec] | None:
        files = self.owner.buckets.get(bucket_id)
        if files is None:
            self._not_found(f"bucket {bucket_id}")
        return files

    def _r_create(self, bucket_id: str, groups: dict[str, str], body: bytes, query: Any) -> None:
        url = f"{self.owner.endpoint}/buckets/{bucket_id}"
        with self.owner.lock:
            if bucket_id in self.owner.buckets:
                self._reply(409, {"error": "already exists", "url": url})
                return
            self.owner.buckets[bucket_id] = {}
        self._reply(200, {"url": url, "name": bucket_id, "id": bucket_id})

    def _r_info(self, bucket_id: str, groups: dict[str, str], body: bytes, query: Any) -> None:
        with self.owner.lock:
            files = self._bucket(bucket_id)
            if files is None:
                return
            info = {
                "id": bucket_id,
                "private": True,
                "createdAt": _iso(0),
                "size": sum(f.size for f in files.values()),
                "totalFiles": len(files),
            }
        self._reply(200, info)

    def _r_paths_info(self, bucket_id: str, groups: dict[str, str], body: bytes, query: Any) -> None:
        paths = json.loads(body)["paths"]
        with self.owner.lock:
            files = self._bucket(bucket_id)
            if files is None:
                return
            found = [files[p].as_json(p) for p in paths if p in files]
        self._reply(200, found)

    def _r_tree(self, bucket_id: str, groups: dict[str, str], body: bytes, query: dict[str, Any]) -> None:
        prefix = urllib.parse.unquote(groups.get("prefix") or "")
        recursive = query.get("recursive", ["False"])[0].lower() == "true"
        start = int(query.get("cursor", ["0"])[0])
        with self.owner.lock:
            files = self._bucket(bucket_id)
            if files is None:
                return
            entries: list[dict[str, Any]] = []
            dirs: set[str] = set()
            base = prefix.rstrip("/") + "/" if prefix else ""
            for p in sorted(files):
                if not p.startswith(base):
                    continue
                rest = p[len(base) :]
                if not recursive and "/" in rest:
                    d = base + rest.split("/", 1)[0]
                    if d not in dirs:
                        dirs.add(d)
                        entries.append({"type": "directory", "path": d, "uploadedAt": _iso(0)})
                    continue
                entries.append(files[p].as_json(p))
        page = entries[start : start + PAGE_SIZE]
        headers = {}
        if start + PAGE_SIZE < len(entries):
            q = urllib.parse.urlencode({"recursive": str(recursive), "cursor": start + PAGE_SIZE})
            here = urllib.parse.urlsplit(self.path).path
            headers["Link"] = f'<{self.owner.endpoint}{here}?{q}>; rel="next"'
        self._reply(200, page, headers)

    def _r_batch(self, bucket_id: str, groups: dict[str, str], body: bytes, query: Any) -> None:
        hub = self.owner
        ops = [json.loads(line) for line in body.splitlines() if line.strip()]
        failed: list[dict[str, str]] = []
        with hub.lock:
            files = self._bucket(bucket_id)
            if files is None:
                return
            for op in ops:
                path = op["path"]
                error = hub.reject(path)
                if error is not None:
                    failed.append({"path": path, "error": error})
                    continue
                if hub.silently_drop(path):
                    continue
                if op["type"] == "deleteFile":
                    files.pop(path, None)
                elif op["type"] == "addFile":
                    xet_hash = op["xetHash"]
                    size = 0 if xet_hash == EMPTY_HASH else hub.cas.file_size(xet_hash)
                    if size is None:
                        failed.append({"path": path, "error": "unknown xet hash"})
                        continue
                    files[path] = FileRec(size, xet_hash, op["mtime"] / 1000)
                else:
                    failed.append({"path": path, "error": f"unsupported op {op['type']}"})
        with hub.lock:
            lost_reply = hub.fail_after_batch > 0
            hub.fail_after_batch -= lost_reply
        if lost_reply:
            self._reply(500, {"error": "injected 500 after applying the batch"})
            return
        status = 422 if failed and len(failed) == len(ops) else 200
        self._reply(status, {"failed": failed} if failed else {"success": True})

    def _r_xet_token(self, bucket_id: str, groups: dict[str, str], body: bytes, query: Any) -> None:
        with self.owner.lock:
            if self._bucket(bucket_id) is None:
                return
        token, exp = self.owner.cas.issue_token()
        # The storage URL is the address this client reached the Hub at: it works from
        # wherever the client is (loopback, or another network namespace).
        cas_url = f"http://{self.headers.get('Host') or f'{self.owner.host}:{self.owner.port}'}{CAS_PREFIX}"
        headers = {
            "X-Xet-Cas-Url": cas_url,
            "X-Xet-Access-Token": token,
            "X-Xet-Token-Expiration": str(exp),
        }
        self._reply(200, {"accessToken": token, "exp": exp, "casUrl": cas_url}, headers)

    # -- the storage service (fakehub.cas) ---------------------------------------------------

    def _reply_bytes(self, status: int, data: bytes, content_type: str = "application/octet-stream") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _cas_base(self) -> str:
        return f"http://{self.headers.get('Host')}{CAS_PREFIX}"

    # Handlers raise what the store raises; _dispatch answers it: KeyError 404 (no such
    # file, xorb or grant), RangeNotSatisfiable 416, FormatError (and a bad body) 400.

    def _r_cas_xorb_grant(self, groups: dict[str, str], body: bytes) -> None:
        # The real service hands out a presigned upload URL; 200 says the xorb exists.
        grant = self.owner.cas.grant(groups["hash"], int(json.loads(body)["length"]))
        if grant is None:
            self._reply(200, {})
            return
        url = f"{self._cas_base()}/grant-uploads/{grant}"
        self._reply(201, {"id": grant, "method": "PUT", "url": url, "headers": {}})

    def _r_cas_grant_upload(self, groups: dict[str, str], body: bytes) -> None:
        status = self.owner.cas.upload_to_grant(groups["grant"], body)
        self._reply(status, {} if status == 200 else {"error": f"grant upload refused ({status})"})

    def _r_cas_xorb_commit(self, groups: dict[str, str], body: bytes) -> None:
        if not self.owner.cas.commit_grant(groups["hash"], groups["grant"]):
            raise KeyError("no data was uploaded for this grant")
        self._reply(200, {"was_inserted": True})

    def _r_cas_xorb(self, groups: dict[str, str], body: bytes) -> None:
        self._reply(200, {"was_inserted": self.owner.cas.put_xorb(groups["hash"], body)})

    def _r_cas_shard(self, groups: dict[str, str], body: bytes) -> None:
        self.owner.cas.put_shard(body)
        if groups["version"] == "2":
            self._reply_bytes(200, cas.SHARD_V2_EVENTS, "application/x-ndjson")
        else:
            self._reply(200, {"result": 1})  # SyncPerformed

    def _r_cas_dedup(self, groups: dict[str, str], body: bytes) -> None:
        raise KeyError("no global dedup shard")

    def _r_cas_reconstruction(self, groups: dict[str, str], body: bytes) -> None:
        first, last = cas.parse_range(self.headers.get("Range")) or (None, None)
        v1 = self.owner.cas.reconstruction(groups["hash"], first, last, self._cas_base())
        self._reply(200, cas.as_v2(v1) if groups["version"] == "2" else v1)

    def _r_cas_fetch(self, groups: dict[str, str], body: bytes) -> None:
        first, last = cas.parse_range(self.headers.get("Range")) or (0, None)
        if last is None:
            raise cas.RangeNotSatisfiable("a fetch names its byte range")
        self._reply_bytes(206, self.owner.cas.read_xorb(groups["hash"], first, last))

    def _r_resolve(self, bucket_id: str, groups: dict[str, str], body: bytes, query: Any) -> None:
        path = urllib.parse.unquote(groups["path"])
        with self.owner.lock:
            files = self._bucket(bucket_id)
            if files is None:
                return
            rec = files.get(path)
        if rec is None:
            self._reply(404, {"error": "entry not found"}, {"X-Error-Code": "EntryNotFound"})
            return
        refresh = f"{self.owner.endpoint}/api/buckets/{bucket_id}/xet-read-token"
        self._reply(
            200,
            None,
            {
                "X-Xet-Hash": rec.xet_hash,
                "X-Linked-Size": str(rec.size),
                "Link": f'<{refresh}>; rel="xet-auth"',
                "ETag": f'"{rec.xet_hash}"',
            },
        )

"""A Hugging Face hub on loopback for download tests: a real HTTP server that answers what huggingface_hub
asks (model info, file metadata, files with range requests), counts what it serves, and can hold a file's
transfer at a given byte until told to go on, or until the client hangs up.

The hub cannot be reached from the tests; this one can be pointed at with ``HF_ENDPOINT`` (a process) or
``HubSettings(endpoint=hub.url)`` (a ModelDownloader).
"""

import hashlib
import json
import re
import select
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

SHA = "0123456789abcdef0123456789abcdef01234567"
#: How much of a file the hub sends between two looks at whether to hold it.
PIECE = 64 * 1024


@dataclass
class Served:
    """One GET of a file: where its range started, and how many bytes the hub sent."""

    name: str
    revision: str
    start: int
    sent: int = 0


@dataclass
class Hold:
    """A file's transfer held once it has sent ``at`` bytes (of the file, not of the response)."""

    at: int
    reached: threading.Event = field(default_factory=threading.Event)
    go_on: threading.Event = field(default_factory=threading.Event)
    #: Set when the client hung up while the transfer was held.
    hung_up: threading.Event = field(default_factory=threading.Event)


class FakeHub:
    """Repos by id, each file's content given as bytes or a path; ``hold()`` a file's first transfer.

    ``cards`` adds fields to a repo's info and search result (downloads, likes, tags, pipeline_tag, gguf …);
    ``GET /api/models?search=…`` lists the repos whose id holds the search (ignoring case), as the hub does.
    ``answers`` replaces the answer to a path (without its query) with a status and body, for broken hubs.
    """

    def __init__(self) -> None:
        self.url = ""
        self.repos: dict[str, dict[str, bytes | Path]] = {}
        self.cards: dict[str, dict[str, object]] = {}
        self.answers: dict[str, tuple[int, bytes]] = {}
        #: The query strings of the searches asked.
        self.searches: list[str] = []
        self.served: list[Served] = []
        self._holds: dict[str, Hold] = {}
        self._closing = threading.Event()
        self._lock = threading.Lock()

    def hold(self, name: str, at: int) -> Hold:
        """Hold the next transfer of file ``name`` once ``at`` bytes of it are sent (a multiple of PIECE)."""
        hold = self._holds[name] = Hold(at)
        return hold

    def bytes_served(self, name: str) -> int:
        with self._lock:
            return sum(each.sent for each in self.served if each.name == name)

    def gets(self, name: str) -> list[Served]:
        with self._lock:
            return [each for each in self.served if each.name == name]

    # -- what the handler reads -----------------------------------------------------------------

    def size(self, content: bytes | Path) -> int:
        return len(content) if isinstance(content, bytes) else content.stat().st_size

    @staticmethod
    def etag(name: str) -> str:
        return hashlib.sha256(name.encode()).hexdigest()


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _send(self, status: int, body: bytes, headers: dict[str, str], *, head: bool) -> None:
            self.send_response(status)
            for name, value in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(name, value)
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _answer(self, head: bool) -> None:
            path, _, query = self.path.partition("?")
            json_type = {"Content-Type": "application/json"}
            if path in hub.answers:
                status, body = hub.answers[path]
                self._send(status, body, json_type, head=head)
                return
            if path == "/api/models":
                self._search(query, head=head)
                return
            api = path.startswith("/api/models/")
            parts = path.removeprefix("/api/models/").lstrip("/").split("/")
            repo = "/".join(parts[:2])
            files = hub.repos.get(repo)
            if files is None:
                self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, head=head)
                return
            if api and "tree" in parts:  # /api/models/{repo}/tree/{revision}
                tree = [{"type": "file", "path": n, "size": hub.size(c), "oid": hub.etag(n)} for n, c in files.items()]
                self._send(200, json.dumps(tree).encode(), json_type, head=head)
            elif api:  # /api/models/{repo}[/revision/{revision}]
                siblings = [{"rfilename": name, "size": hub.size(content)} for name, content in files.items()]
                info = {"id": repo, "sha": SHA, "siblings": siblings, **hub.cards.get(repo, {})}
                self._send(200, json.dumps(info).encode(), json_type, head=head)
            elif parts[2:3] == ["resolve"] and "/".join(parts[4:]) in files:  # /{repo}/resolve/{rev}/{file}
                name = "/".join(parts[4:])
                self._file(name, parts[3], files[name], head=head)
            else:
                self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"}, head=head)

        def _search(self, query: str, *, head: bool) -> None:
            hub.searches.append(query)
            params = parse_qs(query)
            wanted = params.get("search", [""])[0].lower()
            limit = int(params.get("limit", ["1000"])[0])
            found = [
                {"id": repo, "siblings": [{"rfilename": name} for name in files], **hub.cards.get(repo, {})}
                for repo, files in hub.repos.items()
                if wanted in repo.lower()
            ]
            self._send(200, json.dumps(found[:limit]).encode(), {"Content-Type": "application/json"}, head=head)

        def _file(self, name: str, revision: str, content: bytes | Path, *, head: bool) -> None:
            size = hub.size(content)
            headers = {"X-Repo-Commit": SHA, "ETag": f'"{hub.etag(name)}"', "Accept-Ranges": "bytes"}
            start = 0
            if (wanted := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))) is not None:
                start = int(wanted.group(1))
                headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
            self.send_response(206 if "Content-Range" in headers else 200)
            for header, value in {"Content-Length": str(size - start), **headers}.items():
                self.send_header(header, value)
            self.end_headers()
            if head:
                return
            served = Served(name, revision, start)
            with hub._lock:
                hub.served.append(served)
            hold = hub._holds.pop(name, None)
            with _opened(content) as source:
                source.seek(start)
                position = start
                while position < size:
                    if hold is not None and position >= hold.at:
                        if not self._held(hold):
                            self.close_connection = True
                            return
                        hold = None
                    piece = source.read(PIECE)
                    self.wfile.write(piece)
                    position += len(piece)
                    with hub._lock:
                        served.sent += len(piece)

        def _held(self, hold: Hold) -> bool:
            """Wait until the hold is lifted (True), or the client hangs up or the hub closes (False)."""
            self.wfile.flush()
            hold.reached.set()
            while not hold.go_on.wait(0.02):
                if hub._closing.is_set():
                    return False
                if _hung_up(self.connection):
                    hold.hung_up.set()
                    return False
            return True

        def do_GET(self) -> None:
            self._answer(head=False)

        def do_HEAD(self) -> None:
            self._answer(head=True)

    return Handler


def _hung_up(connection: socket.socket) -> bool:
    readable, _, _ = select.select([connection], [], [], 0)
    if not readable:
        return False
    try:
        return connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


@contextmanager
def _opened(content: bytes | Path) -> Iterator["_Reader"]:
    if isinstance(content, bytes):
        yield _Reader(content)
    else:
        with content.open("rb") as file:
            yield file  # type: ignore[misc]  # a file reads and seeks as _Reader does


class _Reader:
    def __init__(self, content: bytes) -> None:
        self._content = content
        self._position = 0

    def seek(self, position: int) -> None:
        self._position = position

    def read(self, size: int) -> bytes:
        piece = self._content[self._position : self._position + size]
        self._position += len(piece)
        return piece


@contextmanager
def running_hub() -> Iterator[FakeHub]:
    """A FakeHub served on a free loopback port until the block ends (transfers still held are dropped)."""
    hub = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield hub
    finally:
        hub._closing.set()
        server.shutdown()
        server.server_close()
        thread.join()

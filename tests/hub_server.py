"""A loopback Hugging Face Hub for dataset repos (127.0.0.1 only), for tests that load a Hub
dataset id through ``datasets.load_dataset`` unchanged: point ``HF_ENDPOINT`` at ``url`` (in a
fresh process: huggingface_hub reads it at import) with ``HF_HUB_OFFLINE=0`` and an empty
``HF_HOME``.

It answers the few endpoints ``datasets`` / ``huggingface_hub`` call for a plain data-file
repo (parquet, jsonl, csv, no loading script):

  GET  /api/datasets/<repo>[/revision/<rev>]      repo info (sha, siblings)
  GET  /api/datasets/<repo>/tree/<rev>[/<dir>]    file listing (``recursive`` honoured)
  POST /api/datasets/<repo>/paths-info/<rev>      the same entries for the given paths
  HEAD|GET /datasets/<repo>/resolve/<rev>/<file>  the file, with the ETag / X-Repo-Commit headers

An unknown repo answers 404 ``RepositoryNotFound``, an unknown file 404 ``EntryNotFound``
(the ``X-Error-Code`` headers huggingface_hub maps to its exceptions). Every request is kept
in ``requests`` as ``(method, path)``; nothing else is implemented.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import urllib.parse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class LoopbackHub:
    def __init__(self, repos: dict[str, dict[str, bytes]]):
        """``repos``: repo id (``user/name``) -> {path in the repo: file bytes}."""
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub._handle(self, head=True)

            def do_GET(self):
                hub._handle(self, head=False)

            def do_POST(self):
                hub._handle(self, head=False)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="loopback-hub", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ answers

    def _entry(self, path: str, data: bytes | None) -> dict:
        if data is None:
            return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "path": path}
        return {"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": path}

    def _tree(self, files: dict[str, bytes], under: str, recursive: bool) -> list[dict]:
        prefix = under.strip("/") + "/" if under.strip("/") else ""
        out, dirs = [], set()
        for path in sorted(files):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix):].split("/")
            for depth in range(1, len(rest)):  # the directories on the way
                if recursive or depth == 1:
                    dirs.add(prefix + "/".join(rest[:depth]))
            if recursive or len(rest) == 1:
                out.append(self._entry(path, files[path]))
        return [self._entry(d, None) for d in sorted(dirs)] + out

    def _handle(self, req, head: bool) -> None:
        url = urllib.parse.urlsplit(req.path)
        path, query = urllib.parse.unquote(url.path), urllib.parse.parse_qs(url.query)
        body = req.rfile.read(int(req.headers.get("content-length") or 0))
        self.requests.append((req.command, req.path))
        status, headers, payload = 404, {"X-Error-Code": "RepositoryNotFound"}, b'{"error": "not found"}'
        for repo, files in self.repos.items():
            api, resolve = f"/api/datasets/{repo}", f"/datasets/{repo}/resolve/"
            if path in (api, f"{api}/revision/main", f"{api}/revision/{COMMIT}"):
                info = {"id": repo, "sha": COMMIT, "private": False, "disabled": False, "gated": False,
                        "downloads": 0, "likes": 0, "tags": [], "cardData": {}, "lastModified": "2025-01-01T00:00:00.000Z",
                        "siblings": [{"rfilename": f} for f in sorted(files)]}
                status, headers, payload = 200, {}, json.dumps(info).encode()
            elif path.startswith(f"{api}/tree/"):
                rev_and_dir = path[len(f"{api}/tree/"):].split("/", 1)
                recursive = query.get("recursive", ["false"])[0].lower() == "true"
                listing = self._tree(files, rev_and_dir[1] if len(rev_and_dir) > 1 else "", recursive)
                status, headers, payload = 200, {}, json.dumps(listing).encode()
            elif path.startswith(f"{api}/paths-info/"):
                form = urllib.parse.parse_qs(body.decode())
                asked = form.get("paths") or json.loads(body or b"{}").get("paths", [])
                found = [self._entry(p, files[p]) for p in asked if p in files]
                found += [self._entry(p, None) for p in asked if any(f.startswith(p.rstrip("/") + "/") for f in files)]
                status, headers, payload = 200, {}, json.dumps(found).encode()
            elif path.startswith(resolve):
                name = path[len(resolve):].split("/", 1)[1]
                if name in files:
                    data = files[name]
                    status, payload = 200, data
                    headers = {"ETag": f'"{hashlib.sha1(data).hexdigest()}"', "X-Repo-Commit": COMMIT}
                else:
                    status, headers, payload = 404, {"X-Error-Code": "EntryNotFound"}, b'{"error": "no such file"}'
            else:
                continue
            break
        req.send_response(status)
        for key, value in {"Content-Type": "application/json", **headers}.items():
            req.send_header(key, value)
        req.send_header("Content-Length", str(len(payload)))
        req.end_headers()
        if not head:
            req.wfile.write(payload)

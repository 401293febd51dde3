"""A local HTTP server speaking the part of the Hub API that `HfApi.upload_folder` uses.

It answers the real client's requests (repo creation, preupload, the Git LFS batch API with basic
PUT uploads and verify, the ndjson commit endpoint), checks what it receives (auth header, LFS
content against its sha256 oid, every committed LFS file uploaded first) and writes each commit
as a snapshot in the Hub cache layout, so a fresh process can `from_pretrained(repo_id)` it with
`HF_HUB_OFFLINE=1`. Anything else gets a 404 and is recorded in `unexpected`.
"""

import base64
import hashlib
import json
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

ROUTES = [
    ("POST", re.compile(r"/api/repos/create"), "create_repo"),
    ("POST", re.compile(r"/api/validate-yaml"), "validate_yaml"),
    ("GET", re.compile(r"/api/agent-harnesses"), "agent_harnesses"),
    ("POST", re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>[^/?]+)"), "preupload"),
    ("POST", re.compile(r"/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch"), "lfs_batch"),
    ("PUT", re.compile(r"/lfs-upload/(?P<oid>[0-9a-f]{64})"), "lfs_upload"),
    ("POST", re.compile(r"/lfs-verify"), "lfs_verify"),
    ("POST", re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>[^/?]+)"), "commit"),
    ("GET", re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/?]+)"), "tree"),
    ("GET", re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)(/revision/(?P<rev>[^/?]+))?"), "repo_info"),
]


class FakeHub:
    """Server state: created repos, uploaded LFS objects, commits, and the cache it writes."""

    def __init__(self, cache: Path):
        self.cache = Path(cache)
        self.repos, self.objects, self.commits, self.unexpected, self.calls = {}, {}, [], [], []   # repos: private
        self.card_metadata = None
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    # -- endpoints: each returns (status, json body) --------------------------------------------
    def create_repo(self, body, **_):
        """As the Hub: 409 for a repo that exists (its visibility unchanged), else created public or private."""
        repo_id = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
        if repo_id in self.repos:
            return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}
        self.repos[repo_id] = body.get("private") is True or body.get("visibility") == "private"
        return 200, {"url": f"{self.url}/{repo_id}", "name": repo_id}

    def repo_info(self, repo, rev=None, **_):
        if repo not in self.repos:
            return 404, {"error": f"Repository {repo} not found"}
        return 200, {"id": repo, "modelId": repo, "private": self.repos[repo], "sha": self._ref(repo, rev or "main")}

    def tree(self, repo, rev, **_):
        """The files of a revision (one page; a new repo's `main` is empty here)."""
        if repo not in self.repos:
            return 404, {"error": f"Repository {repo} not found"}
        snapshot = self._snapshot(repo, rev)
        files = sorted(p for p in snapshot.rglob("*") if p.is_file()) if snapshot else []
        return 200, [{"type": "file", "path": str(p.relative_to(snapshot)), "size": p.stat().st_size,
                      "oid": hashlib.sha1(p.read_bytes()).hexdigest()} for p in files]

    def agent_harnesses(self, **_):
        """A best-effort registry huggingface_hub fetches for its user agent; empty here."""
        return 200, {"standardEnvVars": [], "harnesses": {}}

    def validate_yaml(self, body, **_):
        """The model card's metadata must be a YAML mapping between `---` lines, as on the Hub."""
        parts = body["content"].split("---\n")
        try:
            meta = yaml.safe_load(parts[1]) if body["content"].startswith("---\n") and len(parts) > 2 else None
        except yaml.YAMLError as err:
            meta = err
        if not isinstance(meta, dict):
            return 400, {"errors": [{"message": f"README.md metadata is not a YAML mapping: {meta!r}"}]}
        self.card_metadata = meta
        return 200, {"errors": [], "warnings": []}

    def preupload(self, body, repo, **_):
        if repo not in self.repos:
            return 404, {"error": f"Repository {repo} not found"}
        modes = [{"path": f["path"], "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                  "shouldIgnore": False, "oid": None} for f in body["files"]]
        return 200, {"files": modes}

    def lfs_batch(self, body, repo, **_):
        objects = [{"oid": o["oid"], "size": o["size"], "authenticated": True,
                    "actions": {"upload": {"href": f"{self.url}/lfs-upload/{o['oid']}"},
                                "verify": {"href": f"{self.url}/lfs-verify"}}} for o in body["objects"]]
        return 200, {"transfer": "basic", "objects": objects}

    def lfs_upload(self, raw, oid, **_):
        if hashlib.sha256(raw).hexdigest() != oid:
            return 400, {"error": "content does not match its sha256 oid"}
        self.objects[oid] = raw
        return 200, {}

    def lfs_verify(self, body, **_):
        ok = self.objects.get(body["oid"]) is not None and len(self.objects[body["oid"]]) == body["size"]
        return (200, {}) if ok else (404, {"error": "object not uploaded"})

    def commit(self, raw, repo, rev, **_):
        lines = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
        files, deleted = {}, []
        for item in lines[1:]:
            value = item["value"]
            if item["key"] == "deletedFile":
                deleted.append(value["path"])
            elif item["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif item["key"] == "lfsFile":
                if value["oid"] not in self.objects:
                    return 400, {"error": f"LFS object of {value['path']} was never uploaded"}
                files[value["path"]] = self.objects[value["oid"]]
            else:
                return 400, {"error": f"unsupported commit operation {item['key']}"}
        sha = self._write_snapshot(repo, rev, files, deleted)
        self.commits.append({"repo": repo, "header": lines[0]["value"], "files": sorted(files), "sha": sha,
                             "deleted": sorted(deleted)})
        return 200, {"commitUrl": f"{self.url}/{repo}/commit/{sha}", "commitOid": sha, "pullRequestUrl": None}

    def _ref(self, repo: str, rev: str) -> str | None:
        refs = self.cache / f"models--{repo.replace('/', '--')}" / "refs" / rev
        return refs.read_text() if refs.exists() else None

    def _snapshot(self, repo: str, rev: str) -> Path | None:
        sha = self._ref(repo, rev)
        return self.cache / f"models--{repo.replace('/', '--')}" / "snapshots" / sha if sha else None

    def _write_snapshot(self, repo: str, rev: str, files: dict[str, bytes], deleted: list[str]) -> str:
        """A new snapshot: the parent's files, less `deleted`, plus `files`; `rev` then points at it."""
        root = self.cache / f"models--{repo.replace('/', '--')}"
        refs = root / "refs" / rev
        parent = self._snapshot(repo, rev)
        digest = hashlib.sha1(str(len(self.commits)).encode())
        for path in sorted(files):
            digest.update(path.encode() + files[path])
        sha = digest.hexdigest()
        snapshot = root / "snapshots" / sha
        if parent is not None:
            shutil.copytree(parent, snapshot)
        for path in deleted:
            (snapshot / path).unlink()
        for path, data in files.items():
            (snapshot / path).parent.mkdir(parents=True, exist_ok=True)
            (snapshot / path).write_bytes(data)
        refs.parent.mkdir(parents=True, exist_ok=True)
        refs.write_text(sha)
        return sha


def _read_body(handler: BaseHTTPRequestHandler) -> bytes:
    """The request body, with or without chunked transfer encoding (httpx streams file uploads)."""
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        out = b""
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                handler.rfile.readline()
                return out
            out += handler.rfile.read(size)
            handler.rfile.readline()
    return handler.rfile.read(int(handler.headers.get("Content-Length", 0)))


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        def _dispatch(self):
            raw = _read_body(self)
            path = self.path.split("?", 1)[0]
            hub.calls.append(f"{self.command} {path}")
            for method, pattern, name in ROUTES:
                match = pattern.fullmatch(path)
                if method == self.command and match:
                    break
            else:
                hub.unexpected.append(f"{self.command} {path}")
                return self._reply(404, {"error": f"fake hub: no route for {self.command} {path}"})
            authorized = self.headers.get("authorization", "").startswith("Bearer hf_")
            if name not in ("lfs_upload", "agent_harnesses") and not authorized:
                return self._reply(401, {"error": "missing token"})
            body = json.loads(raw) if raw and name not in ("commit", "lfs_upload") else {}
            status, payload = getattr(hub, name)(body=body, raw=raw, **match.groupdict())
            self._reply(status, payload)

        def _reply(self, status, payload):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_POST = do_PUT = do_GET = do_HEAD = _dispatch

        def log_message(self, *args):  # keep pytest output clean
            pass

    return Handler

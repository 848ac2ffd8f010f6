"""``conveyor batch INPUT.jsonl -o OUTPUT.jsonl``: offline jobs in the OpenAI Batch API's line format.

Each input line is ``{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
"body": {...}}``; each output line is ``{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}`` as the Batch API writes them (a request the server refused keeps its status and
error body; a line that is not a request gets ``error`` with ``response`` null). The server is the
running stack's HTTP API. ``--concurrency`` requests are in flight at once, enough to keep the
scheduler's batch full; a progress line shows lines done, output tokens/s and the time left.

A transient failure (429, 502, 503, 504, a connection refused or broken: the server restarting or busy) is
retried with a doubling delay for ``--retry-for`` seconds before the line records it.

Output is appended a line at a time (flushed), so a run stopped by a crash or Ctrl-C resumes where it
was: run the same command again and it skips every ``custom_id`` already in the output with a final result
(a line cut off mid-write, and lines that recorded a transient failure, are dropped first and run again).
Every input line gets exactly one output line.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from conveyor.config import ConfigError, require, setting

ENV_PREFIX = "CONVEYOR_BATCH_"
URLS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class BatchConfig:
    """The server and the pace (the files are the command's arguments)."""

    target: str = setting("http://127.0.0.1:8000", "the base URL of the stack's OpenAI HTTP API")
    api_key: str = setting("", "API key of the server (prefer the environment variable)", secret=True)
    concurrency: int = setting(32, "requests in flight at once")
    timeout: float = setting(600.0, "deadline of each request, in seconds")
    retry_for: float = setting(600.0, "seconds a line retries a transient failure (429, 502-504, no connection) "
                                      "before its result records it")

    def __post_init__(self):
        require(self.concurrency >= 1, "concurrency", "must be >= 1")
        require(self.timeout > 0, "timeout", "must be > 0")
        require(self.retry_for >= 0, "retry_for", "must be >= 0")


TRANSIENT = (429, 502, 503, 504)  # statuses worth trying again later
MAX_DELAY = 30.0  # seconds between two tries at most


def transient(result: dict) -> bool:
    """Whether an output line recorded a failure that a later try may not meet (a resumed run retries it)."""
    response, error = result.get("response"), result.get("error") or {}
    if response is None:
        return error.get("code") == "request_failed"
    return response.get("status_code") in TRANSIENT


def done_ids(output: Path) -> set[str]:
    """The ``custom_id`` of every line of ``output`` with a final result. A last line cut off mid-write and the
    lines that recorded a transient failure are removed from the file (they run again)."""
    if not output.exists():
        return set()
    raw = output.read_bytes()
    ids, keep = set(), []
    for line in raw.splitlines(keepends=True):
        try:
            result = json.loads(line)
            final = line.endswith(b"\n") and not transient(result)
            custom_id = result["custom_id"]
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if final:
            ids.add(custom_id)
            keep.append(line)
    if b"".join(keep) != raw:
        output.write_bytes(b"".join(keep))
    return ids


class Runner:
    """One ``conveyor batch`` job: the input's request lines sent to the HTTP API, a result line each appended to
    the output (lines already there are skipped: a run resumes)."""

    def __init__(self, cfg: BatchConfig, input_path: str, output_path: str):
        self.cfg = cfg
        self.input, self.output = Path(input_path), Path(output_path)
        url = urlsplit(cfg.target if "://" in cfg.target else f"http://{cfg.target}")
        self.host, self.port, self.scheme = url.hostname, url.port, url.scheme
        self.lock = threading.Lock()
        self.tokens = 0
        self.finished = 0

    def _post(self, path: str, body: dict) -> tuple[int, dict]:
        kind = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = kind(self.host, self.port, timeout=self.cfg.timeout)
        headers = {"Content-Type": "application/json"}
        if self.cfg.api_key:
            headers["Authorization"] = f"Bearer {self.cfg.api_key}"
        try:
            conn.request("POST", path, json.dumps({**body, "stream": False}), headers)
            response = conn.getresponse()
            return response.status, json.loads(response.read() or b"{}")
        finally:
            conn.close()

    def result(self, custom_id: str, line: str) -> dict:
        """One output line for one input line (never raises)."""
        try:
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ValueError("a line must be a JSON object")
            url, body = request.get("url"), request.get("body")
            if request.get("method", "POST") != "POST" or url not in URLS or not isinstance(body, dict):
                raise ValueError(f"a request needs method POST, url one of {', '.join(URLS)} and an object body")
        except ValueError as exc:
            return {"id": _id(), "custom_id": custom_id, "response": None,
                    "error": {"code": "invalid_request", "message": str(exc)}}
        deadline, delay = time.monotonic() + self.cfg.retry_for, 0.5
        while True:  # the server restarting or busy: try again, with a doubling delay, until --retry-for
            try:
                status, reply = self._post(url, body)
            except (OSError, http.client.HTTPException, ValueError) as exc:
                if time.monotonic() + delay > deadline:
                    return {"id": _id(), "custom_id": custom_id, "response": None,
                            "error": {"code": "request_failed", "message": f"{type(exc).__name__}: {exc}"}}
            else:
                if status not in TRANSIENT or time.monotonic() + delay > deadline:
                    break
            time.sleep(delay)
            delay = min(delay * 2, MAX_DELAY)
        with self.lock:
            self.tokens += (reply.get("usage") or {}).get("completion_tokens", 0)
        return {"id": _id(), "custom_id": custom_id,
                "response": {"status_code": status, "request_id": reply.get("id", ""), "body": reply}, "error": None}

    def run(self) -> int:
        """Run the job; returns the exit status (0 when every line got a result)."""
        output = self.output
        skip = done_ids(output)
        try:
            lines = [(i, line) for i, line in enumerate(self.input.read_text().splitlines(), 1) if line.strip()]
        except OSError as exc:
            raise ConfigError(f"batch input: {exc}") from exc
        named = [(_custom_id(line, i), line) for i, line in lines]
        todo = [(custom_id, line) for custom_id, line in named if custom_id not in skip]
        total, started = len(todo), time.monotonic()
        print(f"{len(lines)} requests, {len(lines) - total} already in {output}", file=sys.stderr, flush=True)
        with output.open("a") as out, ThreadPoolExecutor(self.cfg.concurrency) as pool:
            for record in pool.map(lambda item: self.result(*item), todo):
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                out.flush()
                self.finished += 1
                self._progress(total, started)
        print(file=sys.stderr)
        return 0

    def _progress(self, total: int, started: float) -> None:
        elapsed = max(1e-9, time.monotonic() - started)
        left = (total - self.finished) * elapsed / self.finished
        print(f"\r  {self.finished}/{total} lines, {self.tokens / elapsed:.1f} output tok/s, ETA {left:.0f} s   ",
              end="", file=sys.stderr, flush=True)


def _custom_id(line: str, number: int) -> str:
    try:
        request = json.loads(line)
        return str(request.get("custom_id") or f"line-{number}") if isinstance(request, dict) else f"line-{number}"
    except ValueError:
        return f"line-{number}"


def _id() -> str:
    return "batch_req_" + uuid.uuid4().hex


def run(cfg: BatchConfig, input_path: str, output_path: str) -> int:
    """``conveyor batch``: run one job; returns the exit status."""
    return Runner(cfg, input_path, output_path).run()

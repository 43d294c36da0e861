"""`sluice run-batch`: an OpenAI batch file through a deployment started for it, as vLLM's
`vllm run-batch`.

    sluice run-batch -i requests.jsonl -o results.jsonl --model DIR [sluice serve's flags]

Starts `sluice serve` (every flag but `-i`/`-o` goes to it; its own Redis unless
`--redis-url`) on a free loopback port, runs the file's lines through the Batch API
(services/batches.py: one batch per `url` the lines name), writes every line's result (answers
and errors alike, vLLM's single file) to the output file in input order, and stops the
deployment. Exit status 0 once every batch has ended `completed` (some lines may have failed:
see their `error` / `response.status_code`), 1 when a batch failed validation (its errors are
printed) or the deployment did not start, 2 for an unreadable input file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

from services.batch_lines import ENDPOINTS
from services.serve import service_command, spawn, stop_processes
from shared.redis_server import free_port

READY_TIMEOUT_S = 900.0


def _request(url: str, data: bytes | None = None, content_type: str | None = None) -> Any:
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    if content_type:
        req.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{url}: {exc.code} {exc.read().decode(errors='replace')}") from None
    return raw if url.endswith("/content") else json.loads(raw)


def _upload(base: str, content: bytes) -> str:
    boundary = uuid.uuid4().hex
    body = b"".join([
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'.encode(),
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="input.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n".encode(), content,
        f"\r\n--{boundary}--\r\n".encode(),
    ])  # fmt: skip
    return _request(base + "/v1/files", body, f"multipart/form-data; boundary={boundary}")["id"]


def read_groups(path: str) -> tuple[list[str], dict[str, list[str]]]:
    """The custom ids in input order and the lines by their `url`; ValueError naming a line
    that is not a JSON object with a known `url` (the server checks the rest)."""
    order, groups = [], {}
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                item = json.loads(raw)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not JSON: {exc}") from None
            url = item.get("url") if isinstance(item, dict) else None
            if url not in ENDPOINTS:
                raise ValueError(f"{path}:{number}: url must be one of {', '.join(ENDPOINTS)}")
            order.append(item.get("custom_id"))
            groups.setdefault(url, []).append(raw.rstrip("\n"))
    if not order:
        raise ValueError(f"{path}: no requests")
    return order, groups


def _start(serve_args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = service_command("serve", *serve_args, "--host", "127.0.0.1", "--port", str(port))
    proc = spawn(cmd, stdout=subprocess.PIPE, text=True)
    ready = threading.Event()

    def forward() -> None:  # serve's stdout to our stderr (stdout may be a pipe of results)
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("sluice ready"):
                ready.set()
            sys.stderr.write(line)

    threading.Thread(target=forward, daemon=True).start()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready.wait(0.25):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_processes([proc])
            raise RuntimeError(f"sluice serve did not start (exit {proc.poll()})")
    return proc, f"http://127.0.0.1:{port}"


def run_group(base: str, url: str, lines: list[str], poll_s: float) -> dict[str, Any]:
    """Run one batch; its batch object and its result lines by custom id."""
    file_id = _upload(base, ("\n".join(lines) + "\n").encode())
    body = {"input_file_id": file_id, "endpoint": url, "completion_window": "24h"}
    batch = _request(base + "/v1/batches", json.dumps(body).encode(), "application/json")
    while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(poll_s)
        batch = _request(f"{base}/v1/batches/{batch['id']}")
    results = {}
    for key in ("output_file_id", "error_file_id"):
        if batch[key]:
            for raw in _request(f"{base}/v1/files/{batch[key]}/content").splitlines():
                results[json.loads(raw)["custom_id"]] = raw.decode()
    return {"batch": batch, "results": results}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sluice run-batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-i", "--input-file", required=True, help="the requests (JSONL)")
    parser.add_argument("-o", "--output-file", required=True, help="where results go (JSONL)")
    parser.add_argument("--poll-s", type=float, default=0.5, help="how often to look")
    ns, serve_args = parser.parse_known_args(argv)
    try:
        order, groups = read_groups(ns.input_file)
    except (OSError, ValueError) as exc:
        print(f"sluice run-batch: {exc}", file=sys.stderr)
        return 2
    try:
        proc, base = _start(serve_args)
    except RuntimeError as exc:
        print(f"sluice run-batch: {exc}", file=sys.stderr)
        return 1
    try:
        runs = {url: run_group(base, url, lines, ns.poll_s) for url, lines in groups.items()}
    finally:
        stop_processes([proc])
    status = 0
    for url, run in runs.items():
        batch = run["batch"]
        counts = batch["request_counts"]
        print(f"sluice run-batch: {url}: {batch['status']}, {counts['completed']} completed, "
              f"{counts['failed']} failed", file=sys.stderr)  # fmt: skip
        if batch["status"] != "completed":
            status = 1
            for error in (batch.get("errors") or {}).get("data", []):
                print(f"  line {error['line']}: {error['message']}", file=sys.stderr)
    results = {k: v for run in runs.values() for k, v in run["results"].items()}
    tmp = ns.output_file + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for custom_id in order:
            if custom_id in results:
                f.write(results[custom_id] + "\n")
    os.replace(tmp, ns.output_file)
    return status

"""A real HTTP server speaking the OpenAI chat API that replays a script of turns.

Tests of the agent loop, the CLI and the benchmark point a real client at it. Each POST to
/v1/chat/completions consumes the next turn of the script; every request body is recorded
so tests can assert on the messages the harness sent.

Turn keys (all optional):

    content          assistant text (raw `<tool_call>` text or plain text both go here)
    bash             shortcut for one native `bash` tool call with this command
    tool_calls       [{"name": ..., "arguments": dict | str, "id": ...}]  native calls
    reasoning_content  returned next to content, as a reasoning parser would
    finish_reason    default "tool_calls" when there are calls, else "stop"
    usage            {"prompt_tokens": ..., "completion_tokens": ..., "total_tokens": ...}
    delay            seconds to wait before answering (client timeouts)
    status           answer with this HTTP error status instead (with "message")
    raw              answer 200 with exactly this body instead (a proxy's HTML page, a cut-off reply)
    content_type     the Content-Type of a `raw` body (default application/json)
    error            "context_length" | "max_tokens_too_large" | "auth" | "not_found" | "server": canned vLLM-style errors
    max_model_len    (a server option, not a turn key) the context window: reported per model by
                     GET /v1/models as vLLM does, and enforced on every request as vLLM 0.32 does
                     (a prompt over it gets vLLM's 400 "maximum context length"; max_tokens is
                     clamped to what the window leaves). Server options beside it:
                     publish_window=False (the window is enforced but not listed: the 400 is the
                     only sign of it) and report_usage=False (no usage in the answers)

Token counts are a deterministic stand-in, ~4 characters a token: the request's messages and
tools as JSON (a real server renders the tools into the prompt too); or, in-process, what
`count(request) -> int` says (a real tokenizer over the chat template, as vLLM counts).

`script` may also be a callable `request body -> turn` (in-process only): a responder that
picks its answer from the request, for clients that send requests concurrently.

When the script is used up the server answers 400 "script exhausted" (not retried by the
harness), so a test that makes too many calls fails loudly.

Use in tests::

    with ScriptedServer([{"bash": "ls"}, {"bash": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}]) as srv:
        policy = ChatPolicy(model=srv.model, base_url=srv.base_url)
        ...
        srv.requests   # list of request bodies

`ScriptedServer(..., process=True)` runs the same server as a separate process
(`python tests/scripted_server.py script.json --port N`), for tests that want the model
server outside the test process; `requests` is then fetched over HTTP (GET /_requests).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

CANNED_ERRORS: dict[str, tuple[int, str, str]] = {
    "context_length": (
        400,
        "BadRequestError",
        "This model's maximum context length is 65536 tokens. However, you requested 86384 tokens "
        "(70000 in the messages, 16384 in the completion). Please reduce the length of the messages or completion.",
    ),
    # vLLM's answer when max_tokens alone exceeds the window (a small --max-model-len).
    "max_tokens_too_large": (
        400,
        "BadRequestError",
        "max_tokens=16384 cannot be greater than max_model_len=4096. Please request fewer output tokens.",
    ),
    "auth": (401, "AuthenticationError", "Incorrect API key provided."),
    "not_found": (404, "NotFoundError", "The model `missing` does not exist."),
    "permission": (403, "PermissionDeniedError", "You do not have access to this model."),
    "bad_request": (400, "BadRequestError", "Unsupported parameter: 'top_p'."),
    "server": (500, "InternalServerError", "Scripted internal server error."),
    "unavailable": (503, "ServiceUnavailableError", "Scripted: the server is overloaded."),
}


def _tool_calls(turn: dict[str, Any]) -> list[dict[str, Any]]:
    specs = list(turn.get("tool_calls") or [])
    if "bash" in turn:
        specs.insert(0, {"name": "bash", "arguments": {"command": turn["bash"]}})
    calls = []
    for spec in specs:
        args = spec.get("arguments", {})
        calls.append(
            {
                "id": spec.get("id") or f"chatcmpl-tool-{uuid.uuid4().hex[:16]}",
                "type": "function",
                "function": {"name": spec["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
        )
    return calls


def prompt_length(request: dict[str, Any]) -> int:
    """The stand-in token count of a request's prompt: ~4 characters of its messages and tools a token."""
    tools = request.get("tools")
    return (len(json.dumps(request.get("messages", []))) + (len(json.dumps(tools)) if tools else 0)) // 4


def window_error(window: int, prompt: int) -> str:
    """vLLM's (0.32) answer to a prompt longer than the window."""
    return (f"This model's maximum context length is {window} tokens. However, your prompt contains {prompt} input "
            "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
            "prompt.")


def completion_body(turn: dict[str, Any], model: str, request: dict[str, Any], index: int,
                    prompt_tokens: int | None = None) -> dict[str, Any]:
    calls = _tool_calls(turn)
    message: dict[str, Any] = {"role": "assistant", "content": turn.get("content", "" if calls else None)}
    if calls:
        message["tool_calls"] = calls
    if "reasoning_content" in turn:
        message["reasoning_content"] = turn["reasoning_content"]
    prompt_tokens = prompt_length(request) if prompt_tokens is None else prompt_tokens
    completion_tokens = (len(message.get("content") or "") + len(json.dumps(calls))) // 4 + 1
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}
    usage.update(turn.get("usage") or {})
    return {
        "id": f"chatcmpl-scripted-{index}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": turn.get("finish_reason", "tool_calls" if calls else "stop"),
                "logprobs": None,
            }
        ],
        "usage": usage,
    }


class _State:
    def __init__(self, script: Any, model: str, api_key: str | None, max_model_len: int | None = None,
                 publish_window: bool = True, report_usage: bool = True, count: Any = prompt_length) -> None:
        self.script = script if callable(script) else list(script)
        self.model = model
        self.api_key = api_key
        self.max_model_len = max_model_len
        self.publish_window = publish_window
        self.report_usage = report_usage
        self.count = count
        self.requests: list[dict[str, Any]] = []
        self.refused: list[int] = []  # indices in `requests` of those refused as over the window
        self.next = 0
        self.lock = threading.Lock()

    def refuse(self, body: dict[str, Any]) -> None:
        with self.lock:
            self.refused.append(len(self.requests))
            self.requests.append(body)

    def take(self, body: dict[str, Any]) -> tuple[int, dict[str, Any] | None]:
        with self.lock:
            self.requests.append(body)
            index = self.next
            self.next += 1
        if callable(self.script):
            return index, self.script(body)
        return index, (self.script[index] if index < len(self.script) else None)


def _handler(state: _State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
            pass

        def _send(self, status: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (a timeout test); nothing to do

        def _send_raw(self, data: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, kind: str, message: str) -> None:
            self._send(status, {"error": {"message": message, "type": kind, "param": None, "code": status}, "object": "error"})

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/v1/models":
                entry = {"id": state.model, "object": "model", "owned_by": "tmax-tests"}
                if state.max_model_len is not None and state.publish_window:
                    entry["max_model_len"] = state.max_model_len
                self._send(200, {"object": "list", "data": [entry]})
            elif self.path == "/_requests":
                with state.lock:
                    self._send(200, list(state.requests))
            elif self.path == "/health":
                self._send(200, {"ok": True})
            else:
                self._error(404, "NotFoundError", f"no route {self.path}")

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._error(404, "NotFoundError", f"no route {self.path}")
                return
            if state.api_key is not None and self.headers.get("Authorization") != f"Bearer {state.api_key}":
                self._error(401, "AuthenticationError", "Incorrect API key provided.")
                return
            try:
                body = json.loads(raw)
            except json.JSONDecodeError:
                self._error(400, "BadRequestError", "request body is not JSON")
                return
            if body.get("stream"):
                self._error(400, "BadRequestError", "the scripted server does not stream")
                return
            prompt = state.count(body)
            if state.max_model_len is not None and prompt > state.max_model_len:
                state.refuse(body)
                self._error(400, "BadRequestError", window_error(state.max_model_len, prompt))
                return
            index, turn = state.take(body)
            if turn is None:
                self._error(400, "BadRequestError", f"scripted server: script exhausted after {index} turns")
                return
            if turn.get("delay"):
                time.sleep(float(turn["delay"]))
            if "raw" in turn:
                self._send_raw(turn["raw"].encode(), turn.get("content_type", "application/json"))
            elif "error" in turn:
                status, kind, message = CANNED_ERRORS[turn["error"]]
                self._error(status, kind, turn.get("message", message))
            elif "status" in turn:
                self._error(int(turn["status"]), "ScriptedError", turn.get("message", f"scripted error {turn['status']}"))
            else:
                answer = completion_body(turn, state.model, body, index, prompt)
                if not state.report_usage:
                    answer.pop("usage")
                self._send(200, answer)

    return Handler


class ScriptedServer:
    """Context manager; in-process thread by default, a separate process with process=True."""

    def __init__(
        self,
        script: Any,
        model: str = "scripted-model",
        api_key: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        process: bool = False,
        max_model_len: int | None = None,
        publish_window: bool = True,
        report_usage: bool = True,
        count: Any = prompt_length,
    ) -> None:
        if callable(script) and process:
            raise ValueError("a callable script runs in-process only")
        self.script = script if callable(script) else list(script)
        self.max_model_len = max_model_len
        self.publish_window = publish_window
        self.report_usage = report_usage
        self.count = count
        self.model = model
        self.api_key = api_key
        self.host = host
        self.port = port
        self.process = process
        self._state: _State | None = None
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._script_file: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def refused(self) -> list[int]:
        """Which requests (indices in `requests`) were refused as over the window (in-process only)."""
        assert self._state is not None
        with self._state.lock:
            return list(self._state.refused)

    @property
    def requests(self) -> list[dict[str, Any]]:
        if self._state is not None:
            with self._state.lock:
                return list(self._state.requests)
        return httpx.get(f"http://{self.host}:{self.port}/_requests", timeout=10).json()

    def start(self) -> "ScriptedServer":
        if self.process:
            self._start_process()
        else:
            self._state = _State(self.script, self.model, self.api_key, self.max_model_len, self.publish_window,
                                 self.report_usage, self.count)
            self._httpd = ThreadingHTTPServer((self.host, self.port), _handler(self._state))
            self._httpd.daemon_threads = True
            self.port = self._httpd.server_address[1]
            self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="scripted-server", daemon=True)
            self._thread.start()
        return self

    def _start_process(self) -> None:
        fd, self._script_file = tempfile.mkstemp(prefix="tmax-script-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"turns": self.script, "model": self.model, "api_key": self.api_key}, f)
        self._proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), self._script_file, "--host", self.host, "--port", str(self.port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line.startswith("READY "):
            self.close()
            raise RuntimeError(f"scripted server did not start: {line!r}")
        self.port = int(line.split()[1].rsplit(":", 1)[1].split("/")[0])

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._proc = None
        if self._script_file is not None:
            os.unlink(self._script_file)
            self._script_file = None

    def __enter__(self) -> "ScriptedServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_script(path: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A script file is a list of turns, or {"turns": [...], "model": ..., "api_key": ...}."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, list):
        return data, {}
    if isinstance(data, dict) and isinstance(data.get("turns"), list):
        return data["turns"], {k: v for k, v in data.items() if k in ("model", "api_key") and v is not None}
    raise SystemExit(f"{path}: expected a list of turns or an object with a 'turns' list")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Replay scripted assistant turns over the OpenAI chat API.")
    ap.add_argument("script", help="JSON file: a list of turns or {'turns': [...]}")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port")
    args = ap.parse_args(argv)
    turns, opts = load_script(args.script)
    state = _State(turns, opts.get("model", "scripted-model"), opts.get("api_key"))
    httpd = ThreadingHTTPServer((args.host, args.port), _handler(state))
    httpd.daemon_threads = True
    print(f"READY http://{args.host}:{httpd.server_address[1]}/v1", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    main()

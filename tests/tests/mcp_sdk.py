"""The official MCP Python SDK (PyPI `mcp`) against the proxy's sandbox tools server.

Run by tests/tests/mcp.rs with the MCP URLs of two live trial keys (A and B), the proxy's
base URL and key A. Each check prints one line; any failure raises (exit 1). After the
checks on live keys it prints `revoke A` and waits for a line on stdin: the test revokes
trial A's key (the trial ended), and the script then checks that A's session is over.
"""

import asyncio
import json
import sys

import httpx2
from mcp import Client
from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client
from mcp.shared.exceptions import MCPError

url_a, url_b, base, key_a = sys.argv[1:5]


def text(result):
    return "".join(block.text for block in result.content if block.type == "text")


def check(what, ok, detail=""):
    if not ok:
        raise AssertionError(f"{what}: {detail}")
    print(f"ok  {what}", flush=True)


async def main():
    async with Client(url_a) as a, Client(url_b) as b:
        listed = await a.list_tools()
        names = sorted(tool.name for tool in listed.tools)
        check("tools listed", names == ["read_file", "run_code", "run_shell", "write_file"], names)
        run_code = next(t for t in listed.tools if t.name == "run_code")
        check(
            "run_code has a JSON Schema",
            run_code.input_schema["type"] == "object" and run_code.input_schema["required"] == ["code"],
            run_code.input_schema,
        )

        result = await a.call_tool("run_code", {"code": "print(6*7)"})
        check("print(6*7) gives 42", text(result).strip() == "42" and not result.is_error, result)
        check("structured output", result.structured_content["exit_code"] == 0, result.structured_content)

        result = await a.call_tool("run_code", {"code": "import time\ntime.sleep(30)", "timeout_s": 1})
        check("a timeout is a tool error", result.is_error and "timed out" in text(result), result)

        result = await a.call_tool("run_code", {"code": "import os\nos.abort()"})
        check("a crash is a tool error", result.is_error and "exit code 134" in text(result), result)

        result = await a.call_tool("run_code", {"code": "x = bytearray(4 << 30)"})
        # Under cgroups the kernel kills it (137); under rlimits Python raises MemoryError.
        limited = "MemoryError" in text(result) or "exit code 137" in text(result)
        check("memory is limited", result.is_error and limited, text(result))

        result = await a.call_tool("run_code", {})
        check("a missing argument is a tool error", result.is_error and "code" in text(result), result)

        result = await a.call_tool("run_shell", {"command": "echo hi >&2; exit 3"})
        check("run_shell", result.is_error and "exit code 3" in text(result) and "hi" in text(result), result)

        result = await a.call_tool("write_file", {"path": "notes/secret.txt", "content": "A's secret"})
        check("write_file", not result.is_error, result)
        result = await a.call_tool("read_file", {"path": "notes/secret.txt"})
        check("read_file reads it back", text(result) == "A's secret", result)

        result = await b.call_tool("read_file", {"path": "notes/secret.txt"})
        check("B cannot see A's file", result.is_error, result)
        result = await b.call_tool("run_code", {"code": "import os\nprint(os.path.exists('notes/secret.txt'))"})
        check("B's sandbox is its own", text(result).strip() == "False", result)

        try:
            await a.call_tool("no_such_tool", {})
            check("an unknown tool is refused", False, "no error")
        except MCPError as e:
            check("an unknown tool is refused", "unknown tool" in str(e), e)

        # The key as a bearer token on /mcp, through the SDK's own HTTP client.
        http = create_mcp_http_client(headers={"Authorization": f"Bearer {key_a}"})
        async with Client(streamable_http_client(f"{base}/mcp", http_client=http)) as bearer:
            result = await bearer.call_tool("run_code", {"code": "print('bearer')"})
            check("the key as a bearer token", text(result).strip() == "bearer", result)

        # A wrong key is refused before any session exists.
        try:
            async with Client(f"{base}/tk-not-a-key/mcp") as wrong:
                await wrong.list_tools()
            check("a wrong key is refused", False, "connected")
        except Exception as e:  # the SDK raises from its task group
            check("a wrong key is refused", "401" in repr(e) or "unknown or revoked" in repr(e), repr(e))

        # The trial ends: the test revokes A's key.
        print("revoke A", flush=True)
        sys.stdin.readline()
        try:
            await a.call_tool("run_code", {"code": "print(1)"})
            check("a call after the trial ended is an error", False, "answered")
        except Exception as e:
            check("a call after the trial ended is an error", True)
        result = await b.call_tool("run_code", {"code": "print('still here')"})
        check("B goes on", text(result).strip() == "still here", result)

    # A session deleted by its client is gone too (raw HTTP, as any client would).
    async with httpx2.AsyncClient() as http:
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"}}}
        response = await http.post(url_b, json=init, headers={"Accept": "application/json, text/event-stream"})
        session = response.headers["mcp-session-id"]
        headers = {"mcp-session-id": session, "mcp-protocol-version": "2025-06-18",
                   "Accept": "application/json, text/event-stream"}
        gone = await http.delete(url_b, headers=headers)
        check("DELETE ends a session", gone.status_code == 204, gone.status_code)
        call = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
        after = await http.post(url_b, json=call, headers=headers)
        check("a deleted session answers 404", after.status_code == 404, after.text)
        batch = await http.post(url_b, json=[call], headers=headers)
        check("a batch is refused", batch.status_code == 400, batch.text)
        probe = await http.get(url_b, headers=headers)
        check("no server-initiated stream (405)", probe.status_code == 405, probe.status_code)
    print(json.dumps({"passed": True}), flush=True)


asyncio.run(main())

"""The upstream behind Coffer for the conformance suite's server scenarios: a stdlib MCP server on stdio that
behaves as the suite expects of the server under test (its tools, resources, prompts and their results), so that
what the suite sees through Coffer is Coffer's relaying of it.

    upstream_server.py [--era handshake|modern]

handshake (default): the initialize handshake; a tool that needs the client (sampling, elicitation, roots) asks it
with a real server->client request.  modern: MCP 2026-07-28 only -- server/discover, the per-request envelope,
results with resultType, and a tool that needs the client answers ``input_required`` with named inputRequests and
a requestState of its own, reading the answers from the retry (basic/patterns/mrtr).

Written for this repository from the conformance suite's scenario descriptions; stdlib only.
"""

from __future__ import annotations

import argparse
import base64
import json
import secrets
import sys
import threading
import time

MODERN = "2026-07-28"
# A 1x1 PNG and a tiny WAV: real files, so a client that decodes them can.
PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")
WAV = base64.b64encode(b"RIFF$\x00\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00\x01\x00D\xac\x00\x00\x88X\x01\x00\x02\x00"
                       b"\x10\x00data\x00\x00\x00\x00").decode()
NAME_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


EMPTY = {"type": "object", "properties": {}}
TOOLS = {
    "test_simple_text": "Tests simple text content response",
    "test_image_content": "Tests image content response",
    "test_audio_content": "Tests audio content response",
    "test_embedded_resource": "Tests embedded resource content response",
    "test_multiple_content_types": "Tests response with multiple content types (text, image, resource)",
    "test_tool_with_logging": "Tests tool that emits log messages during execution",
    "test_tool_with_progress": "Tests tool that reports progress notifications",
    "test_error_handling": "Tests error response handling",
    "test_sampling": "Tests server-initiated sampling (LLM completion request)",
    "test_elicitation": "Tests server-initiated elicitation (user input request)",
    "test_elicitation_sep1034_defaults": "Tests elicitation with default values per SEP-1034",
    "test_elicitation_sep1330_enums": "Tests elicitation with enum schema improvements per SEP-1330",
    "json_schema_2020_12_tool": "Tool with JSON Schema 2020-12 features (SEP-1613)",
    "test_input_required_result_elicitation": "Needs the user's name (elicitation)",
    "test_input_required_result_sampling": "Needs the client's model (sampling)",
    "test_input_required_result_list_roots": "Needs the client's roots",
    "test_input_required_result_request_state": "Needs a confirmation, carrying state across the round",
    "test_input_required_result_multiple_inputs": "Needs a name, a greeting and the roots at once",
    "test_input_required_result_multi_round": "Needs two answers, one round each",
    "test_input_required_result_tampered_state": "Needs a confirmation; its state must come back unchanged",
    "test_input_required_result_capabilities": "Asks only for what the client declared",
    "test_missing_capability": "Needs the client's sampling capability, declared on the request",
    "test_streaming_elicitation": "Sends a notification before its answer",
    "test_logging_tool": "Logs only when the request asked for logs",
    "test_trigger_tool_change": "Adds a tool, so the tool list changes",
    "test_trigger_prompt_change": "Adds a prompt, so the prompt list changes",
}
SCHEMAS = {
    "test_sampling": {"type": "object", "properties": {"prompt": {"type": "string"}}, "required": ["prompt"]},
    "test_elicitation": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]},
    # The JSON Schema 2020-12 vocabulary SEP-1613 and SEP-2106 ask a server to keep: $schema, $defs with an
    # $anchor, composition, conditionals, additionalProperties.
    "json_schema_2020_12_tool": {
        "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
        "$defs": {"address": {"$anchor": "addressDef", "type": "object",
                              "properties": {"street": {"type": "string"}, "city": {"type": "string"}}}},
        "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/address"},
                       "contactMethod": {"type": "string", "enum": ["phone", "email"]},
                       "phone": {"type": "string"}, "email": {"type": "string"}},
        "allOf": [{"anyOf": [{"required": ["phone"]}, {"required": ["email"]}]}],
        "if": {"properties": {"contactMethod": {"const": "phone"}}, "required": ["contactMethod"]},
        "then": {"required": ["phone"]}, "else": {"required": ["email"]},
        "additionalProperties": False},
}
SEP1034_SCHEMA = {"type": "object", "required": [], "properties": {
    "name": {"type": "string", "description": "User name", "default": "John Doe"},
    "age": {"type": "integer", "description": "User age", "default": 30},
    "score": {"type": "number", "description": "User score", "default": 95.5},
    "status": {"type": "string", "description": "User status", "enum": ["active", "inactive", "pending"],
               "default": "active"},
    "verified": {"type": "boolean", "description": "Verification status", "default": True}}}
SEP1330_SCHEMA = {"type": "object", "required": [], "properties": {
    "untitledSingle": {"type": "string", "description": "Select one option", "enum": ["option1", "option2", "option3"]},
    "titledSingle": {"type": "string", "description": "Select one option with titles", "oneOf": [
        {"const": "value1", "title": "First Option"}, {"const": "value2", "title": "Second Option"},
        {"const": "value3", "title": "Third Option"}]},
    "legacyEnum": {"type": "string", "description": "Select one option (legacy)", "enum": ["opt1", "opt2", "opt3"],
                   "enumNames": ["Option One", "Option Two", "Option Three"]},
    "untitledMulti": {"type": "array", "description": "Select multiple options", "minItems": 1, "maxItems": 3,
                      "items": {"type": "string", "enum": ["option1", "option2", "option3"]}},
    "titledMulti": {"type": "array", "description": "Select multiple options with titles", "minItems": 1,
                    "maxItems": 3, "items": {"anyOf": [
                        {"const": "value1", "title": "First Choice"}, {"const": "value2", "title": "Second Choice"},
                        {"const": "value3", "title": "Third Choice"}]}}}}
RESOURCES = [
    {"uri": "test://static-text", "name": "static-text", "title": "Static Text Resource",
     "description": "A static text resource for testing", "mimeType": "text/plain"},
    {"uri": "test://static-binary", "name": "static-binary", "title": "Static Binary Resource",
     "description": "A static binary resource (image) for testing", "mimeType": "image/png"},
    {"uri": "test://watched-resource", "name": "watched-resource", "title": "Watched Resource",
     "description": "A resource clients may subscribe to", "mimeType": "text/plain"},
]
TEMPLATES = [{"uriTemplate": "test://template/{id}/data", "name": "template", "title": "Resource Template",
              "description": "A resource template with parameter substitution", "mimeType": "application/json"}]
PROMPTS = [
    {"name": "test_simple_prompt", "title": "Simple Test Prompt", "description": "A simple prompt without arguments"},
    {"name": "test_prompt_with_arguments", "title": "Prompt With Arguments",
     "description": "A prompt with required arguments",
     "arguments": [{"name": "arg1", "description": "First test argument", "required": True},
                   {"name": "arg2", "description": "Second test argument", "required": True}]},
    {"name": "test_prompt_with_embedded_resource", "title": "Prompt With Embedded Resource",
     "description": "A prompt that includes an embedded resource",
     "arguments": [{"name": "resourceUri", "description": "URI of the resource to embed", "required": True}]},
    {"name": "test_prompt_with_image", "title": "Prompt With Image",
     "description": "A prompt that includes image content"},
    {"name": "test_input_required_result_prompt", "description": "A prompt that needs the user's name first"},
]


class Failure(Exception):
    def __init__(self, code: int, message: str, data=None):
        super().__init__(message)
        self.code, self.message, self.data = code, message, data


class Server:
    """One stdio connection.  Requests run on threads of their own (a tool may wait for the client); ``_lock``
    guards stdout and the table of this server's own requests to the client."""

    def __init__(self, modern: bool):
        self.modern = modern
        self._lock = threading.Lock()
        self._asked: dict[str, dict] = {}
        self._ids = iter(range(1, 1 << 30))
        self.log_level = "debug"
        self.listeners: dict = {}       # 2026-07-28 subscriptions/listen requests: id -> notifications wanted
        self.added_tools: list[str] = []
        self.added_prompts: list[str] = []

    # -- the wire --------------------------------------------------------------------------------------------------
    def write(self, message: dict) -> None:
        with self._lock:
            sys.stdout.write(json.dumps(message) + "\n")
            sys.stdout.flush()

    def notify(self, method: str, params: dict) -> None:
        self.write({"jsonrpc": "2.0", "method": method, "params": params})

    def ask(self, method: str, params: dict, timeout: float = 60.0) -> dict:
        """A server->client request (handshake era), answered through Coffer by the client."""
        box: dict = {"done": threading.Event()}
        with self._lock:
            ours = f"up-{next(self._ids)}"
            self._asked[ours] = box
        self.write({"jsonrpc": "2.0", "id": ours, "method": method, "params": params})
        if not box["done"].wait(timeout):
            raise Failure(-32603, f"the client did not answer {method}")
        reply = box["reply"]
        if "error" in reply:
            raise Failure(-32603, f"{method} failed: {reply['error'].get('message')}")
        return reply.get("result") or {}

    def serve(self) -> None:
        for line in sys.stdin:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if not isinstance(message, dict):
                continue
            if "method" not in message:
                with self._lock:
                    box = self._asked.pop(message.get("id"), None)
                if box is not None:
                    box["reply"] = message
                    box["done"].set()
                continue
            if "id" in message:
                threading.Thread(target=self.handle, args=(message,), daemon=True).start()
            elif message.get("method") == "notifications/cancelled":  # a listen stream ends this way
                self.listeners.pop((message.get("params") or {}).get("requestId"), None)

    def handle(self, message: dict) -> None:
        method, params = message["method"], message.get("params") or {}
        if method == "subscriptions/listen" and self.modern:  # open until cancelled: no answer now
            self.listeners[message["id"]] = params.get("notifications") or {}
            self.notify("notifications/subscriptions/acknowledged",
                        {"_meta": {"io.modelcontextprotocol/subscriptionId": message["id"]}})
            return
        try:
            result = self.dispatch(method, params)
            if self.modern:
                result = {"resultType": "complete", **result}
                if method in ("server/discover", "tools/list", "prompts/list", "resources/list",
                              "resources/templates/list", "resources/read"):
                    result.setdefault("ttlMs", 0)
                    result.setdefault("cacheScope", "private")
            self.write({"jsonrpc": "2.0", "id": message["id"], "result": result})
        except Failure as exc:
            error = {"code": exc.code, "message": exc.message, **({"data": exc.data} if exc.data is not None else {})}
            self.write({"jsonrpc": "2.0", "id": message["id"], "error": error})

    # -- requests --------------------------------------------------------------------------------------------------
    def dispatch(self, method: str, params: dict) -> dict:
        if method == "initialize":
            if self.modern:
                raise Failure(-32022, "Unsupported protocol version", {"supported": [MODERN],
                                                                        "requested": params.get("protocolVersion")})
            return {"protocolVersion": params.get("protocolVersion") or "2025-11-25",
                    "capabilities": self.capabilities(), "serverInfo": {"name": "conformance-upstream",
                                                                        "version": "1.0.0"}}
        if method == "server/discover":
            if not self.modern:
                raise Failure(-32601, "Method not found: server/discover")
            return {"supportedVersions": [MODERN], "capabilities": self.capabilities(),
                    "_meta": {"io.modelcontextprotocol/serverInfo": {"name": "conformance-upstream",
                                                                     "version": "1.0.0"}}}
        if method == "ping":
            return {}
        if method == "logging/setLevel":
            self.log_level = params.get("level", "debug")
            return {}
        if method == "tools/list":
            return {"tools": [{"name": name, "description": description,
                               "inputSchema": SCHEMAS.get(name, EMPTY)} for name, description in TOOLS.items()]
                    + [{"name": name, "description": "Added at run time", "inputSchema": EMPTY}
                       for name in self.added_tools]}
        if method == "tools/call":
            return self.call(params.get("name"), params)
        if method == "resources/list":
            return {"resources": RESOURCES}
        if method == "resources/templates/list":
            return {"resourceTemplates": TEMPLATES}
        if method == "resources/read":
            return self.read(params.get("uri"))
        if method in ("resources/subscribe", "resources/unsubscribe"):
            return {}
        if method == "prompts/list":
            return {"prompts": PROMPTS + [{"name": name, "description": "Added at run time"}
                                          for name in self.added_prompts]}
        if method == "prompts/get":
            return self.prompt(params.get("name"), params)
        if method == "completion/complete":
            return {"completion": {"values": [], "total": 0, "hasMore": False}}
        raise Failure(-32601, f"Method not found: {method}")

    def capabilities(self) -> dict:
        capabilities = {"tools": {"listChanged": True}, "resources": {"subscribe": True},
                        "prompts": {"listChanged": True}, "completions": {}}
        if not self.modern:
            capabilities["logging"] = {}
        return capabilities

    def read(self, uri) -> dict:
        if uri == "test://static-text":
            return {"contents": [{"uri": uri, "mimeType": "text/plain",
                                  "text": "This is the content of the static text resource."}]}
        if uri == "test://static-binary":
            return {"contents": [{"uri": uri, "mimeType": "image/png", "blob": PNG}]}
        if uri == "test://watched-resource":
            return {"contents": [{"uri": uri, "mimeType": "text/plain", "text": "Watched resource content"}]}
        if isinstance(uri, str) and uri.startswith("test://template/") and uri.endswith("/data"):
            ident = uri[len("test://template/"):-len("/data")]
            return {"contents": [{"uri": uri, "mimeType": "application/json", "text": json.dumps(
                {"id": ident, "templateTest": True, "data": f"Data for ID: {ident}"})}]}
        raise Failure(-32602, "Resource not found", {"uri": uri})

    def prompt(self, name, params: dict) -> dict:
        arguments = params.get("arguments") or {}
        if name == "test_simple_prompt":
            return {"messages": [{"role": "user", "content": text("This is a simple prompt for testing.")}]}
        if name == "test_prompt_with_arguments":
            return {"messages": [{"role": "user", "content": text(
                f"Prompt with arguments: arg1='{arguments.get('arg1')}', arg2='{arguments.get('arg2')}'")}]}
        if name == "test_prompt_with_embedded_resource":
            return {"messages": [
                {"role": "user", "content": {"type": "resource", "resource": {
                    "uri": arguments.get("resourceUri"), "mimeType": "text/plain",
                    "text": "Embedded resource content for testing."}}},
                {"role": "user", "content": text("Please process the embedded resource above.")}]}
        if name == "test_prompt_with_image":
            return {"messages": [{"role": "user", "content": {"type": "image", "data": PNG, "mimeType": "image/png"}},
                                 {"role": "user", "content": text("Please analyze the image above.")}]}
        if name == "test_input_required_result_prompt":
            answers = self.inputs(params, {"user_name": ("elicitation/create", {
                "message": "What is your name?", "requestedSchema": NAME_SCHEMA})})
            if answers is None:
                return self.input_required({"user_name": ("elicitation/create", {
                    "message": "What is your name?", "requestedSchema": NAME_SCHEMA})})
            return {"messages": [{"role": "user", "content": text(
                f"Hello, {self.answer_text(answers['user_name'], 'name')}!")}]}
        raise Failure(-32602, f"Unknown prompt: {name}")

    # -- 2026-07-28 input rounds, or real requests in the handshake era ------------------------------------------------
    def input_required(self, requests: dict, state: dict | None = None) -> dict:
        result = {"resultType": "input_required", "inputRequests": {
            key: {"method": method, "params": request} for key, (method, request) in requests.items()}}
        if state is not None:
            result["requestState"] = json.dumps(state)
        return result

    def inputs(self, params: dict, requests: dict) -> dict | None:
        """The answers to ``requests`` (key -> (method, params)): asked of the client now in the handshake era; in
        2026-07-28 read from the retry's inputResponses, None when a key is missing (the caller asks again)."""
        if not self.modern:
            return {key: self.ask(method, request) for key, (method, request) in requests.items()}
        responses = params.get("inputResponses") or {}
        if not all(isinstance(responses.get(key), dict) for key in requests):
            return None
        return responses

    @staticmethod
    def answer_text(answer: dict, field: str) -> str:
        content = answer.get("content") if isinstance(answer, dict) else None
        if isinstance(content, dict):
            value = content.get(field, content.get("text"))
            return str(value) if value is not None else "friend"
        return "friend"

    def call(self, name, params: dict) -> dict:
        arguments = params.get("arguments") or {}
        meta = params.get("_meta") or {}
        if name == "test_simple_text":
            return {"content": [text("This is a simple text response for testing.")]}
        if name == "test_image_content":
            return {"content": [{"type": "image", "data": PNG, "mimeType": "image/png"}]}
        if name == "test_audio_content":
            return {"content": [{"type": "audio", "data": WAV, "mimeType": "audio/wav"}]}
        if name == "test_embedded_resource":
            return {"content": [{"type": "resource", "resource": {
                "uri": "test://embedded-resource", "mimeType": "text/plain",
                "text": "This is an embedded resource content."}}]}
        if name == "test_multiple_content_types":
            return {"content": [text("Multiple content types test:"),
                                {"type": "image", "data": PNG, "mimeType": "image/png"},
                                {"type": "resource", "resource": {"uri": "test://mixed-content-resource",
                                                                  "mimeType": "application/json",
                                                                  "text": json.dumps({"test": "data", "value": 123})}}]}
        if name == "test_tool_with_logging":
            for line in ("Tool execution started", "Tool processing data", "Tool execution completed"):
                self.notify("notifications/message", {"level": "info", "logger": "conformance-upstream",
                                                      "data": line})
                time.sleep(0.05)
            return {"content": [text("Tool with logging executed successfully")]}
        if name == "test_tool_with_progress":
            token = meta.get("progressToken", 0)
            for step in (0, 50, 100):
                self.notify("notifications/progress", {"progressToken": token, "progress": step, "total": 100,
                                                       "message": f"Completed step {step} of 100"})
                time.sleep(0.05)
            return {"content": [text(str(token))]}
        if name == "test_error_handling":
            return {"isError": True, "content": [text("This tool intentionally returns an error for testing")]}
        if name == "test_missing_capability":
            if "sampling" not in (meta.get("io.modelcontextprotocol/clientCapabilities") or {}):
                raise Failure(-32021, "MissingRequiredClientCapabilityError",
                              {"requiredCapabilities": {"sampling": {}}})
            return {"content": [text("Success")]}
        if name == "test_streaming_elicitation":
            self.notify("notifications/progress", {"progressToken": "token-abc", "progress": 50, "total": 100})
            return {"content": [text("Streaming complete")]}
        if name == "test_logging_tool":
            if meta.get("io.modelcontextprotocol/logLevel") or not self.modern:
                self.notify("notifications/message", {"level": "info", "logger": "conformance-upstream",
                                                      "data": "Diagnostic trace logging activated"})
            return {"content": [text("Logging evaluated")]}
        if name in ("test_trigger_tool_change", "test_trigger_prompt_change"):
            kind = "tools" if name == "test_trigger_tool_change" else "prompts"
            (self.added_tools if kind == "tools" else self.added_prompts).append(
                f"dynamic_{kind[:-1]}_{secrets.token_hex(3)}")
            self.list_changed(kind)
            return {"content": [text("Mutation triggered")]}
        if name == "json_schema_2020_12_tool":
            return {"content": [text(f"JSON Schema 2020-12 tool called with: {json.dumps(arguments)}")]}
        if name in ("test_sampling", "test_input_required_result_sampling"):
            prompt = arguments.get("prompt") or "What is the capital of France?"
            request = {"messages": [{"role": "user", "content": text(prompt)}], "maxTokens": 100}
            answers = self.inputs(params, {"sample_request": ("sampling/createMessage", request)})
            if answers is None:
                return self.input_required({"sample_request": ("sampling/createMessage", request)})
            content = answers["sample_request"].get("content") or {}
            said = content.get("text") if isinstance(content, dict) else None
            prefix = "LLM response" if name == "test_sampling" else "Sampling result"
            return {"content": [text(f"{prefix}: {said or 'no response'}")]}
        if name in ("test_elicitation", "test_elicitation_sep1034_defaults", "test_elicitation_sep1330_enums"):
            schema = {"test_elicitation": {"type": "object", "required": ["response"], "properties": {
                "response": {"type": "string", "description": "User's response"}}},
                "test_elicitation_sep1034_defaults": SEP1034_SCHEMA,
                "test_elicitation_sep1330_enums": SEP1330_SCHEMA}[name]
            message = arguments.get("message") or ("Please review and update the form fields with defaults"
                                                   if name.endswith("defaults") else "Please select options")
            answers = self.inputs(params, {"form": ("elicitation/create", {"message": message,
                                                                           "requestedSchema": schema})})
            if answers is None:
                return self.input_required({"form": ("elicitation/create", {"message": message,
                                                                            "requestedSchema": schema})})
            answer = answers["form"]
            return {"content": [text(f"Elicitation completed: action={answer.get('action')}, "
                                     f"content={json.dumps(answer.get('content') or {})}")]}
        return self.call_needing_input(name, params, meta)

    def call_needing_input(self, name, params: dict, meta: dict) -> dict:
        """The 2026-07-28 input_required tools (in the handshake era they ask with real requests)."""
        state = self.state_of(params)
        if name == "test_input_required_result_elicitation":
            wanted = {"user_name": ("elicitation/create", {"message": "What is your name?",
                                                           "requestedSchema": NAME_SCHEMA})}
            answers = self.inputs(params, wanted)
            if answers is None:
                return self.input_required(wanted)
            return {"content": [text(f"Hello, {self.answer_text(answers['user_name'], 'name')}!")]}
        if name == "test_input_required_result_list_roots":
            wanted = {"roots_request": ("roots/list", {})}
            answers = self.inputs(params, wanted)
            if answers is None:
                return self.input_required(wanted)
            roots = answers["roots_request"].get("roots")
            return {"content": [text(f"Found {len(roots) if isinstance(roots, list) else 0} root(s)")]}
        if name in ("test_input_required_result_request_state", "test_input_required_result_tampered_state"):
            kind = "request-state" if name.endswith("request_state") else "tampered-state"
            wanted = {"confirm": ("elicitation/create", {"message": "Please confirm", "requestedSchema": {
                "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}})}
            answers = self.inputs(params, wanted)
            if answers is not None and (not self.modern or (state or {}).get("kind") == kind):
                return {"content": [text("state-ok: requestState validated")]}
            if self.modern and state is not None and state.get("kind") != kind:
                raise Failure(-32602, "requestState failed its integrity check")
            return self.input_required(wanted, {"kind": kind, "nonce": secrets.token_hex(8)})
        if name == "test_input_required_result_multiple_inputs":
            wanted = {"user_name": ("elicitation/create", {"message": "What is your name?",
                                                           "requestedSchema": NAME_SCHEMA}),
                      "greeting": ("sampling/createMessage", {"messages": [
                          {"role": "user", "content": text("Generate a greeting")}], "maxTokens": 50}),
                      "client_roots": ("roots/list", {})}
            answers = self.inputs(params, wanted)
            if answers is None or (self.modern and (state or {}).get("kind") != "multiple-inputs"):
                return self.input_required(wanted, {"kind": "multiple-inputs", "nonce": secrets.token_hex(8)})
            greeting = (answers["greeting"].get("content") or {}).get("text", "Hello there!")
            roots = answers["client_roots"].get("roots")
            return {"content": [text(f"Name: {self.answer_text(answers['user_name'], 'name')}; Greeting: "
                                     f"{greeting}; Roots: {len(roots) if isinstance(roots, list) else 0}")]}
        if name == "test_input_required_result_multi_round":
            return self.multi_round(params, state)
        if name == "test_input_required_result_capabilities":
            capabilities = meta.get("io.modelcontextprotocol/clientCapabilities") or {}
            wanted = {}
            if "elicitation" in capabilities:
                wanted["elicitation_input"] = ("elicitation/create", {
                    "message": "Elicitation input", "requestedSchema": {
                        "type": "object", "properties": {"value": {"type": "string"}}, "required": ["value"]}})
            if "sampling" in capabilities:
                wanted["sample_input"] = ("sampling/createMessage", {"messages": [
                    {"role": "user", "content": text("Sample request")}], "maxTokens": 50})
            responses = params.get("inputResponses") or {}
            if responses:
                return {"content": [text(f"capabilities-ok: received {','.join(responses)}")]}
            if not wanted:
                return {"content": [text("No supported capabilities declared")]}
            if not self.modern:
                answers = self.inputs(params, wanted)
                return {"content": [text(f"capabilities-ok: received {','.join(answers)}")]}
            return self.input_required(wanted, {"kind": "capabilities-test", "nonce": secrets.token_hex(8)})
        raise Failure(-32602, f"Unknown tool: {name}")

    def multi_round(self, params: dict, state: dict | None) -> dict:
        step1 = {"step1": ("elicitation/create", {"message": "Step 1: What is your name?",
                                                  "requestedSchema": NAME_SCHEMA})}
        step2 = {"step2": ("elicitation/create", {"message": "Step 2: What is your favorite color?",
                                                  "requestedSchema": {"type": "object", "properties": {
                                                      "color": {"type": "string"}}, "required": ["color"]}})}
        if not self.modern:
            name = self.answer_text(self.inputs(params, step1)["step1"], "name")
            color = self.answer_text(self.inputs(params, step2)["step2"], "color")
            return {"content": [text(f"Multi-round complete for {name} who likes {color}")]}
        responses = params.get("inputResponses") or {}
        if state and state.get("round") == 1 and isinstance(responses.get("step1"), dict):
            name = self.answer_text(responses["step1"], "name")
            return self.input_required(step2, {"round": 2, "name": name, "nonce": secrets.token_hex(8)})
        if state and state.get("round") == 2 and isinstance(responses.get("step2"), dict):
            color = self.answer_text(responses["step2"], "color")
            return {"content": [text(f"Multi-round complete for {state.get('name', 'friend')} who likes {color}")]}
        return self.input_required(step1, {"round": 1, "nonce": secrets.token_hex(8)})

    def list_changed(self, kind: str) -> None:
        """Announce a changed list: on each listen stream that asked for it (2026-07-28), else bare."""
        method = f"notifications/{kind}/list_changed"
        if not self.modern:
            self.notify(method, {})
            return
        flag = f"{kind}ListChanged"
        for listen_id, wanted in list(self.listeners.items()):
            if wanted.get(flag):
                self.notify(method, {"_meta": {"io.modelcontextprotocol/subscriptionId": listen_id}})

    @staticmethod
    def state_of(params: dict) -> dict | None:
        raw = params.get("requestState")
        if not isinstance(raw, str):
            return None
        try:
            state = json.loads(raw)
        except ValueError:
            raise Failure(-32602, "requestState failed its integrity check") from None
        return state if isinstance(state, dict) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--era", choices=("handshake", "modern"), default="handshake")
    Server(parser.parse_args().era == "modern").serve()


if __name__ == "__main__":
    main()

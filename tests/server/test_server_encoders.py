"""The server's encoder endpoints, driven by the openai client and httpx over the app:
POST /v1/embeddings in OpenAI's shape (a string, a list, token ids; float and base64;
dimensions; usage) equal to sentence-transformers' encode; POST /v1/rerank equal to
CrossEncoder.predict; a chat request to an encoder is a 400 that says so, and the
encoder endpoints on a decoder's server are too."""

import base64

import numpy as np
import pytest

from fixtures.encoder_models import bert_with_tokenizer, sentence_transformer_folder
from fixtures.openai_spec import check_response

TEXTS = ["the cat sat on the mat", "paris is the capital of france", "the sea is blue"]


def client_for(folder):
    from starlette.testclient import TestClient

    from mlx_tfm.server.app import ServerState, build_app
    from mlx_tfm.server.settings import ServerSettings

    state = ServerState(ServerSettings(model=str(folder)))
    client = TestClient(build_app(state))
    client.event_hooks["response"].append(check_response)  # every JSON answer against OpenAI's spec
    client.__enter__()
    state.loaded.wait(60)
    assert state.load_error is None, state.load_error
    return client


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    bert_with_tokenizer(root / "bert")
    st = sentence_transformer_folder(root / "st", root / "bert", "mean", 16, True)
    bert_with_tokenizer(root / "ce", head="classification", seed=2, num_labels=1)
    clients = {"st": client_for(root / "st"), "ce": client_for(root / "ce")}
    yield root, st, clients
    for client in clients.values():
        client.__exit__(None, None, None)


def test_embeddings_in_openai_shape(encoders):
    from openai import OpenAI

    root, st, clients = encoders
    api = OpenAI(base_url="http://testserver/v1", api_key="none", http_client=clients["st"])
    result = api.embeddings.create(model="st", input=TEXTS, encoding_format="float")
    assert [d.index for d in result.data] == [0, 1, 2] and result.model == "st"
    assert np.abs(np.array([d.embedding for d in result.data]) - st.encode(TEXTS)).max() < 1e-5
    ids = [root_tokenizer_ids(root, t) for t in TEXTS]
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(len(i) for i in ids)
    # base64 (what the client asks for by default and decodes itself), dimensions, one string
    short = api.embeddings.create(model="st", input=TEXTS[0], dimensions=4)
    expected = st.encode(TEXTS[:1], truncate_dim=4, normalize_embeddings=True)[0]
    assert np.abs(np.array(short.data[0].embedding) - expected).max() < 1e-5
    # token ids, one list or several, read as given
    by_ids = api.embeddings.create(model="st", input=ids, encoding_format="float")
    assert np.abs(np.array([d.embedding for d in by_ids.data]) - st.encode(TEXTS)).max() < 1e-5
    raw = clients["st"].post("/v1/embeddings", json={"input": ids[1], "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.abs(vector - st.encode(TEXTS[1])).max() < 1e-5


def root_tokenizer_ids(root, text):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(root / "st"))(text)["input_ids"]


def test_rerank(encoders):
    from sentence_transformers import CrossEncoder

    root, _, clients = encoders
    query, documents = "capital of france", ["paris is the capital of france", "the cat sat", "rome is in italy"]
    expected = CrossEncoder(str(root / "ce"), device="cpu").predict([(query, d) for d in documents])
    answer = clients["ce"].post("/v1/rerank", json={"model": "ce", "query": query, "documents": documents,
                                                     "top_n": 2, "return_documents": True}).json()
    order = list(np.argsort(-expected))[:2]
    assert [r["index"] for r in answer["results"]] == order
    assert np.allclose([r["relevance_score"] for r in answer["results"]], expected[order], atol=1e-5)
    assert answer["results"][0]["document"] == {"text": documents[order[0]]}
    assert answer["usage"]["total_tokens"] > 0


@pytest.mark.parametrize("path,body,message", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
     "the model 'st' is an encoder (bert): it embeds and ranks text but does not generate; use POST /v1/embeddings "
     "or /v1/rerank"),
    ("/v1/completions", {"prompt": "hi"}, "the model 'st' is an encoder (bert)"),
    ("/v1/embeddings", {"input": []}, "input must not be empty"),
    ("/v1/embeddings", {"input": ["a", ""]}, "input must not contain empty strings"),
    ("/v1/embeddings", {"input": [[1, 2, 99999]]}, "token ids must be non-empty lists of ids in [0, 79)"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format must be 'float' or 'base64'"),
    ("/v1/embeddings", {"input": "a", "dimensions": 0}, "dimensions: Input should be greater than or equal to 1"),
    ("/v1/embeddings", {"input": "a", "model": "other"}, "the model 'other' does not exist: this server serves 'st'"),
    ("/v1/rerank", {"query": "q", "documents": ["d"]}, "reranking needs a cross-encoder"),
])
def test_bad_requests_are_400_that_say_why(encoders, path, body, message):
    _, _, clients = encoders
    response = clients["st"].post(path, json=body)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["message"].startswith(message), response.json()


def test_more_dimensions_than_the_model_has_is_a_400_on_dimensions(encoders):
    _, st, clients = encoders
    width = st.encode(TEXTS[:1]).shape[1]
    response = clients["st"].post("/v1/embeddings", json={"input": "a", "dimensions": width + 1})
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {
        "message": f"dimensions must be at most {width} (this model's embedding size), got {width + 1}",
        "type": "invalid_request_error", "param": "dimensions", "code": "invalid_value"}
    full = clients["st"].post("/v1/embeddings", json={"input": "a", "dimensions": width, "encoding_format": "float"})
    assert np.abs(np.array(full.json()["data"][0]["embedding"]) - st.encode("a", truncate_dim=width)).max() < 1e-5


def test_a_decoders_server_refuses_the_encoder_endpoints(stories_hf):
    client = client_for(stories_hf)
    try:
        response = client.post("/v1/embeddings", json={"input": "hi"})
        assert response.status_code == 400
        assert response.json()["error"]["message"].startswith("POST /v1/embeddings needs an encoder model")
        assert client.post("/v1/rerank", json={"query": "q", "documents": ["d"]}).status_code == 400
    finally:
        client.__exit__(None, None, None)


def test_an_encoder_may_be_named_by_its_model_argument(encoders):
    """The server was started with the folder's path; a request may name the model so."""
    root, _, clients = encoders
    body = {"input": TEXTS[0], "model": str(root / "st"), "encoding_format": "float"}
    assert clients["st"].post("/v1/embeddings", json=body).status_code == 200
    assert clients["st"].post("/v1/embeddings", json={**body, "model": str(root / "ce")}).status_code == 404

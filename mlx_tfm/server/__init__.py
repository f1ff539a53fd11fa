"""`mlx-tfm server`: an OpenAI-compatible HTTP API over the batching engine (and Ollama's
and Anthropic's APIs beside it).

Layer 6 (an interface): it imports everything below it and nothing imports it. The HTTP
side (Starlette, pydantic, uvicorn, imported only by `mlx-tfm server`) never touches MLX:
one engine thread (``mlx_tfm.engine.loop.Engine``) owns the model, and each HTTP request talks
to it through ``Engine.submit`` / ``Engine.cancel`` and events handed back to the event loop
(``engine_client``).

Modules, by job:
    settings      the server's configuration (from the command line)
    errors        OpenAI-shaped error bodies and the exception that carries them
    protocol      pydantic models of the request bodies (chat, legacy completions)
    prompts       messages -> token ids through the chat template (tools, template kwargs)
    constrained   response_format and forced tool calls as llguidance logits processors
    output        the generated text -> content, reasoning_content and tool_calls
    responses     OpenAI response objects, stream chunks, usage and logprobs
    engine_client the asyncio side of the engine: submit, events, cancel on disconnect
    completions   the two completion endpoints, streaming and not
    ollama_api    Ollama's API (/api/chat, /api/generate, tags, show, embed...) on the same machinery
    anthropic_api Anthropic's Messages API (/v1/messages, count_tokens) on the same machinery
    responses_api OpenAI's Responses API (/v1/responses, kept responses by id) on the same machinery
    response_items a kept response's input items as the spec's item resources, in pages
    metrics       Prometheus text for /metrics
    page_route    the chat page for browsers at / (its files in page/), and /props for it
    app           the Starlette app: routes, API key, CORS, body limit, model loading
    model_swap    --model-dir: the local models /v1/models lists, one loaded at a time, swapped on request
                  by any API's request
    serve         uvicorn with a clean Ctrl-C / SIGTERM
"""

"""An OpenAI-compatible HTTP server over ``PagedGenerator``: ``python -m models.llama.serve``
(docs/serving.md#the-http-server). Needs the serve extra (``pip install "ms_rope_attention[serve]"``).

One concept per module: ``__main__`` (command line, model loading), ``server`` (uvicorn with a
drain on SIGTERM), ``app`` (the routes, auth, body limits), ``protocol`` (OpenAI's request and
response bodies), ``errors`` (OpenAI's error shape), ``completion`` (one request's limits and text),
``responses`` (JSON and SSE responses that abort on disconnect), ``scheduler`` (the engine thread),
``detokenizer`` (incremental text and stop strings), ``chat_template`` (the checkpoint's template in
a jinja2 sandbox), ``metrics`` (Prometheus, vLLM's names).
"""

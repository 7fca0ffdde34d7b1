"""`hybridserve serve`: an OpenAI-compatible HTTP server over one `LLMEngine`, and
`hybridserve proxy` in front of prefill and decode instances.

Server modules: `async_engine` (the engine loop in one background thread, asyncio streams) and
`engine_commands` (what that thread and the event loop pass each other), `protocol`
(request/response bodies), `body` (strict JSON bodies under size and time limits), `chat` (chat
templates), `serving` (the endpoints' logic), `formatting` (response bodies and stream chunks),
`metrics` (Prometheus), `errors` (the OpenAI error shape), `auth` (the API key), `app` (FastAPI
routes), `listener` (uvicorn settings and connection deadlines), `launch` (start-up, signals,
draining), `flags` (command-line flags shared by `serve` and `proxy`). Proxy modules: `proxy`
(the app), `proxy_state` (instances, health, counters), `proxy_routes` (the two legs of a
request and the release of a failed one). The server imports the engine; nothing in the engine
imports the server, and the proxy imports neither.
"""

"""The OpenAI-compatible HTTP server; the engine core runs in its own process.

Request path: app (routes) -> chat | completions (one endpoint each) -> decoding (body ->
protocol models, errors) -> chat_template / request_params -> generation (engine client,
detokenizer, stop strings) -> tool_calls / streaming (SSE). state holds what handlers share
(admission, health); supervisor replaces a dead or hung engine; commands is `kamado serve`,
chat_client is `kamado chat`.
"""

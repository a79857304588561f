-- wrk request script: POST a small chat completion; BENCH_STREAM=1 asks for SSE.
-- BENCH_HEADERS=sdk adds the thirteen further headers an SDK client sends (its user agent,
-- credential, accepted encodings and the x-stainless-* platform fields): the cost of a
-- head grows with its fields, and the bench's default sends three. Its Authorization is
-- forwarded to no one (Sluice sets the connection's own); it passes because the bench's
-- config names no clients: one that did would answer each of these requests 401.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
if os.getenv("BENCH_HEADERS") == "sdk" then
  wrk.headers["Accept"] = "application/json"
  wrk.headers["User-Agent"] = "OpenAI/Python 1.99.9"
  wrk.headers["Authorization"] = "Bearer client-token-1"
  wrk.headers["Accept-Encoding"] = "gzip, deflate"
  wrk.headers["Connection"] = "keep-alive"
  wrk.headers["X-Stainless-Lang"] = "python"
  wrk.headers["X-Stainless-Package-Version"] = "1.99.9"
  wrk.headers["X-Stainless-OS"] = "Linux"
  wrk.headers["X-Stainless-Arch"] = "x64"
  wrk.headers["X-Stainless-Runtime"] = "CPython"
  wrk.headers["X-Stainless-Runtime-Version"] = "3.12.3"
  wrk.headers["X-Stainless-Retry-Count"] = "0"
  wrk.headers["X-Stainless-Read-Timeout"] = "600"
end
local stream = os.getenv("BENCH_STREAM") == "1"
wrk.body = '{"model":"bench","stream":' .. (stream and "true" or "false") ..
  ',"messages":[{"role":"user","content":"Say hello in five words."}]}'

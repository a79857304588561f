-- wrk request script: POST a small chat completion; BENCH_STREAM=1 asks for SSE.
-- BENCH_HEADERS=sdk adds the thirteen further headers an SDK client sends (its user agent,
-- credential, accepted encodings and the x-stainless-* platform fields): the cost of a
-- head grows with its fields, and the bench's default sends three. Its Authorization is
-- forwarded to no one (Sluice sets the connection's own); it passes because the bench's
-- config names no clients: one that did would answer each of these requests 401.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
-- The SDK's fields, as they go on the wire.
local SDK = [[
Accept: application/json
User-Agent: OpenAI/Python 1.99.9
Authorization: Bearer client-token-1
Accept-Encoding: gzip, deflate
Connection: keep-alive
X-Stainless-Lang: python
X-Stainless-Package-Version: 1.99.9
X-Stainless-OS: Linux
X-Stainless-Arch: x64
X-Stainless-Runtime: CPython
X-Stainless-Runtime-Version: 3.12.3
X-Stainless-Retry-Count: 0
X-Stainless-Read-Timeout: 600
]]
if os.getenv("BENCH_HEADERS") == "sdk" then
  for name, value in SDK:gmatch("([^:\n]+): ([^\n]+)") do
    wrk.headers[name] = value
  end
end
local stream = os.getenv("BENCH_STREAM") == "1"
wrk.body = '{"model":"bench","stream":' .. (stream and "true" or "false") ..
  ',"messages":[{"role":"user","content":"Say hello in five words."}]}'

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
local messages = '[{"role":"user","content":"Say hello in five words."}]'
-- BENCH_BODY_KB=N: a coding agent's request instead, of at least N KiB: a tool
-- definition, then turns that quote a source file (escaped newlines, quotes and tabs, as
-- an agent's JSON carries them), whole turns of ~2.3 KiB until the body is that long
-- (64 gives 67,216 bytes). Its content, like the default's, is the same on every request.
local kb = tonumber(os.getenv("BENCH_BODY_KB") or "")
if kb then
  local FILE = [[use std::collections::HashMap;\n\n/// Counts the words of \"text\".\n]] ..
    [[pub fn count(text: &str) -> HashMap<&str, usize> {\n\tlet mut seen = HashMap::new();\n]] ..
    [[\tfor word in text.split_whitespace() {\n\t\t*seen.entry(word).or_insert(0) += 1;\n]] ..
    [[\t}\n\tseen\n}\n\n]]
  local turns = {
    '{"role":"system","content":"You are a coding agent. Read files before you edit them."}',
  }
  local size = 0
  local n = 0
  while size < kb * 1024 do
    n = n + 1
    local turn = '{"role":"user","content":"Here is src/words' .. n .. '.rs:\\n' ..
      FILE:rep(8) .. 'Add a test for it."},' ..
      '{"role":"assistant","content":[{"type":"text","text":"I will read the tests first."},' ..
      '{"type":"tool_use","id":"call_' .. n .. '","name":"read_file","input":{"path":"tests/words.rs","limit":200}}]}'
    turns[#turns + 1] = turn
    size = size + #turn
  end
  messages = '[' .. table.concat(turns, ',') .. '],"max_tokens":1024,' ..
    '"tools":[{"name":"read_file","description":"Reads a file.","input_schema":' ..
    '{"type":"object","properties":{"path":{"type":"string"},"limit":{"type":"integer"}},' ..
    '"required":["path"]}}]'
end
wrk.body = '{"model":"bench","stream":' .. (stream and "true" or "false") ..
  ',"messages":' .. messages .. '}'

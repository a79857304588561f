-- wrk request script: POST a small chat completion; BENCH_STREAM=1 asks for SSE.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local stream = os.getenv("BENCH_STREAM") == "1"
wrk.body = '{"model":"bench","stream":' .. (stream and "true" or "false") ..
  ',"messages":[{"role":"user","content":"Say hello in five words."}]}'

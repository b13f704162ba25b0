"""`loraplex bench serve`: an HTTP load client for any OpenAI-compatible server.

workload.py builds the requests (exact-length random token-id prompts or a JSONL
dataset, a shared prefix, a mix of adapters, Poisson arrivals); client.py sends them
over aiohttp and times every streamed chunk; report.py turns the records into
throughput and latency percentiles, JSON and a PNG; server.py starts and stops a
`serve run` app; offline.py runs the same workload through the engine in a separate
process for the served/offline ratio; cli.py wires the command line.
"""
